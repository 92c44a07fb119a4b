"""Views of the prepared documents that the probes need.

>>> # idx = document_index(load_prepared(RunDir("runs/tiny")))
>>> # idx.member[0].text, idx.token_ids(idx.member[:2])
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from memaudit.data.documents import Document
from memaudit.models.tokenizer import encode

if TYPE_CHECKING:
    from memaudit.data.prepare import PreparedData


@dataclass(frozen=True)
class DocumentIndex:
    """Natural documents by role, canary copies and audit canaries, and tokenization.

    `member`, `holdout` and `heldout` hold only corpus documents (kind "doc"): the member
    and holdout lists are an IID split of the training users' documents, so they are the
    two populations of membership inference; `heldout` are the never-trained users' documents.
    """

    prepared: PreparedData
    member: tuple[Document, ...]
    holdout: tuple[Document, ...]
    heldout: tuple[Document, ...]
    canary_copies: tuple[Document, ...]
    audit: tuple[Document, ...]

    @property
    def by_id(self) -> dict[str, Document]:
        return {d.id: d for d in self.prepared.documents}

    def by_user(self, docs: tuple[Document, ...] | list[Document]) -> dict[str, list[Document]]:
        out: dict[str, list[Document]] = {}
        for d in docs:
            out.setdefault(d.user, []).append(d)
        return out

    def token_ids(self, docs: list[Document] | tuple[Document, ...], *, eos: bool = False) -> list[list[int]]:
        """Token ids of each document exactly as in training (training appends EOS: `eos=True`)."""
        ids = encode(self.prepared.tokenizer(), [d.text for d in docs])
        return [[*t, self.prepared.eos_id] for t in ids] if eos else ids


def document_index(prepared: PreparedData) -> DocumentIndex:
    docs = prepared.documents

    def pick(kind: str, role: str | None = None) -> tuple[Document, ...]:
        return tuple(d for d in docs if d.kind == kind and (role is None or d.role == role))

    return DocumentIndex(
        prepared=prepared,
        member=pick("doc", "member"),
        holdout=pick("doc", "holdout"),
        heldout=pick("doc", "heldout_user"),
        canary_copies=pick("canary"),
        audit=pick("audit_canary"),
    )


def token_ids(prepared: PreparedData, texts: list[str]) -> list[list[int]]:
    """Token ids of arbitrary texts (e.g. canary prefixes) with the run's tokenizer, no specials."""
    return encode(prepared.tokenizer(), list(texts))
