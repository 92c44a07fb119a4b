"""The document record shared by every data stage, and its JSONL form.

One `Document` is one line of `RUN_DIR/data/documents.jsonl` (see DEVELOPERS.md,
"Prepared data"). A corpus document starts with kind "doc" and role "member"; the split
assigns the role, canary insertion adds kind "canary" / "audit_canary" documents.

>>> d = Document(id="d0", user="u0", text="call 555-0100", pii=(Pii("phone", "555-0100", 5),))
>>> d.pii[0].check(d.text)
True
>>> Document.from_json(d.to_json()) == d
True
"""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass, field, replace
from typing import Any, Literal

Kind = Literal["doc", "canary", "audit_canary"]
Role = Literal["member", "holdout", "heldout_user", "audit_out"]


@dataclass(frozen=True)
class Pii:
    """A PII span: `text[start:start + len(value)] == value`."""

    type: str
    value: str
    start: int

    def check(self, text: str) -> bool:
        return text[self.start : self.start + len(self.value)] == self.value


@dataclass(frozen=True)
class Document:
    id: str
    user: str
    text: str = field(repr=False)  # raw text and PII stay out of reprs and messages
    pii: tuple[Pii, ...] = field(default=(), repr=False)
    kind: Kind = "doc"
    canary_id: str | None = None
    repeats: int = 1
    role: Role = "member"

    def with_(self, **changes: Any) -> Document:
        return replace(self, **changes)

    def to_json(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "user": self.user,
            "text": self.text,
            "pii": [{"type": p.type, "value": p.value, "start": p.start} for p in self.pii],
            "kind": self.kind,
            "canary_id": self.canary_id,
            "repeats": self.repeats,
            "role": self.role,
        }

    def to_corpus_json(self) -> dict[str, Any]:
        """The corpus form written by `memaudit data synth`: {id, user, text, pii}."""
        d = self.to_json()
        return {k: d[k] for k in ("id", "user", "text", "pii")}

    @classmethod
    def from_json(cls, obj: dict[str, Any]) -> Document:
        return cls(
            id=str(obj["id"]),
            user=str(obj["user"]),
            text=obj["text"],
            pii=tuple(Pii(str(p["type"]), str(p["value"]), int(p["start"])) for p in obj.get("pii") or ()),
            kind=obj.get("kind", "doc"),
            canary_id=obj.get("canary_id"),
            repeats=int(obj.get("repeats", 1)),
            role=obj.get("role", "member"),
        )


def dumps_jsonl(docs: list[Document] | tuple[Document, ...]) -> bytes:
    return "".join(json.dumps(d.to_json(), ensure_ascii=False) + "\n" for d in docs).encode("utf-8")


def loads_jsonl(data: bytes) -> list[Document]:
    return [Document.from_json(json.loads(line)) for line in data.decode("utf-8").splitlines() if line]


def count_repeats(docs: list[Document], *, by_role: bool = False) -> list[Document]:
    """Set `repeats` of each document to the number of documents with identical text.

    With `by_role`, count only documents of the same role: for a member document that is
    the number of times its text is trained on (what extraction buckets by).
    """
    key = (lambda d: (d.role, d.text)) if by_role else (lambda d: d.text)
    counts = Counter(key(d) for d in docs)
    return [d if d.repeats == counts[key(d)] else d.with_(repeats=counts[key(d)]) for d in docs]


@dataclass
class DocumentBuilder:
    """Builds a text piece by piece, recording the offset of every PII value."""

    parts: list[str] = field(default_factory=list)
    pii: list[Pii] = field(default_factory=list)
    length: int = 0

    def add(self, s: str, pii_type: str | None = None) -> None:
        if pii_type is not None:
            self.pii.append(Pii(pii_type, s, self.length))
        self.parts.append(s)
        self.length += len(s)

    def build(self) -> tuple[str, tuple[Pii, ...]]:
        return "".join(self.parts), tuple(self.pii)
