"""Proof that a public pretraining corpus holds nothing of the private one.

A public base model is only a zero-fine-tuning reference point if it never saw the private
data: a private document, canary secret or PII value in the public corpus would make the base
"know" what the probes count as memorised by fine-tuning, and would leak it without any
privacy accounting. `check_disjoint` refuses, with one line naming counts and never the text,
a public corpus that

- holds a document whose text hash (sha256 of the whitespace-normalised text) equals a
  private document's (corpus documents and canary documents),
- contains a canary secret (inserted, reference or audit canaries) anywhere in its text, or
- contains a private PII value (as a whole word sequence, case-sensitive; values shorter than
  `min_pii_chars` are skipped: a 2-letter first name is not evidence of a leak).

References:
    Carlini et al., "The Secret Sharer", USENIX Security 2019 (canaries);
    Tramèr et al., "Considerations for Differentially Private Learning with Large-Scale Public
    Pretraining", 2022 (public data that overlaps the private data voids the comparison).

>>> from memaudit.data.documents import Document, Pii
>>> priv = [Document(id="a", user="u", text="call Ann Lee now", pii=(Pii("name", "Ann Lee", 5),))]
>>> check_disjoint([Document(id="p", user="p", text="a public notice")], priv, secrets=["123456"]).ok
True
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from memaudit.data.documents import Document
from memaudit.errors import DataError


@dataclass(frozen=True)
class Overlap:
    """Counts of what the public corpus shares with the private one (no text)."""

    documents: int
    secrets: int
    pii_values: int
    public_documents: int
    private_documents: int

    @property
    def ok(self) -> bool:
        return not (self.documents or self.secrets or self.pii_values)

    def to_json(self) -> dict[str, int | bool]:
        return {"shared_documents": self.documents, "shared_canary_secrets": self.secrets,
                "shared_pii_values": self.pii_values, "public_documents": self.public_documents,
                "private_documents": self.private_documents, "disjoint": self.ok}


def text_hash(text: str) -> str:
    """sha256 of the text with runs of whitespace collapsed (so re-wrapped copies match)."""
    return hashlib.sha256(" ".join(text.split()).encode("utf-8")).hexdigest()


def _literal_matcher(values: Iterable[str], *, word: bool) -> re.Pattern[str] | None:
    vals = sorted({v for v in values if v}, key=len, reverse=True)
    if not vals:
        return None
    body = "|".join(map(re.escape, vals))
    return re.compile(rf"(?<!\w)(?:{body})(?!\w)" if word else body)


def check_disjoint(public: Sequence[Document], private: Sequence[Document], *,
                   secrets: Iterable[str] = (), min_pii_chars: int = 4) -> Overlap:
    """Count what `public` shares with `private` (documents, canary `secrets`, PII values).

    Canary secrets are matched anywhere (digits inside a longer number still reveal them);
    PII values as whole words. Returns the counts; `require_disjoint` raises on any.
    """
    private_hashes = {text_hash(d.text) for d in private}
    shared_docs = sum(text_hash(d.text) in private_hashes for d in public)
    secret_re = _literal_matcher(secrets, word=False)
    pii_values = {p.value for d in private for p in d.pii if len(p.value) >= min_pii_chars}
    pii_re = _literal_matcher(pii_values, word=True)
    found_secrets: set[str] = set()
    found_pii: set[str] = set()
    for d in public:
        if secret_re is not None:
            found_secrets.update(secret_re.findall(d.text))
        if pii_re is not None:
            found_pii.update(pii_re.findall(d.text))
    return Overlap(shared_docs, len(found_secrets), len(found_pii), len(public), len(private))


def require_disjoint(public: Sequence[Document], private: Sequence[Document], *,
                     secrets: Iterable[str] = (), what: str = "the public corpus") -> Overlap:
    """`check_disjoint`, raising a one-line DataError (counts only) when anything is shared."""
    o = check_disjoint(public, private, secrets=secrets)
    if not o.ok:
        raise DataError(
            f"{what} overlaps the private training data ({o.documents} shared document(s), "
            f"{o.secrets} canary secret(s), {o.pii_values} PII value(s)); remove them from the "
            "public corpus or use another one (pretrain.path / pretrain.seed)")
    return o
