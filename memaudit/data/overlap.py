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
  `min_pii_chars` are skipped: a 2-letter first name is not evidence of a leak, and neither is
  a first name alone: Bill, Glen and Dale are ordinary words of any English corpus, so a name
  counts only in full, as two or more words).

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

from memaudit.data.documents import Document, Pii
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


_WORD = re.compile(r"\w")
_RUN = re.compile(r"\w+")


class _WholeWordIndex:
    """Every occurrence of a set of literal strings as whole word sequences (not preceded and
    not followed by a word character, `\\w` as Python's `re` reads it), found from an index of the
    strings' first words rather than one regular expression of thousands of alternatives (which
    tries every alternative at every position: a quarter of an hour on a 5,000-author corpus).

    A value that starts with a word character can only start where one of the text's word runs
    starts, and that run must equal the value's own first run; the other values are looked up
    at each occurrence of their first character. Unlike `re.findall`, overlapping and nested
    occurrences all count: a value inside a longer one that also occurs is still found.
    """

    def __init__(self, values: Iterable[str]) -> None:
        # first word (or first character) -> length -> the values: one slice and one set lookup
        # a length at each candidate position, however many values share a first name
        self.by_head: dict[str, dict[int, set[str]]] = {}
        for v in {v for v in values if v}:
            head = _RUN.match(v)
            key = head.group() if head else v[0]
            self.by_head.setdefault(key, {}).setdefault(len(v), set()).add(v)
        chars = sorted(k for k in self.by_head if not _WORD.match(k))
        self.scan = re.compile("|".join([r"\w+", *([f"[{re.escape(''.join(chars))}]"] if chars else [])]))

    def __bool__(self) -> bool:
        return bool(self.by_head)

    def find(self, text: str) -> set[str]:
        found: set[str] = set()
        for m in self.scan.finditer(text):
            s, key = m.start(), m.group()
            vals = self.by_head.get(key)
            if not vals or (s > 0 and not _WORD.match(key) and _WORD.match(text, s - 1)):
                continue
            for n, same_length in vals.items():
                v = text[s:s + n]
                if v in same_length and not _WORD.match(text, s + n):
                    found.add(v)
        return found


class _AnywhereIndex:
    """Occurrences anywhere (inside longer words or numbers too): the candidate positions are
    those of each value's first character, found with `str.find` per distinct first character."""

    def __init__(self, values: Iterable[str]) -> None:
        self.by_first: dict[str, dict[int, set[str]]] = {}
        for v in {v for v in values if v}:
            self.by_first.setdefault(v[0], {}).setdefault(len(v), set()).add(v)

    def __bool__(self) -> bool:
        return bool(self.by_first)

    def find(self, text: str) -> set[str]:
        found: set[str] = set()
        for first, vals in self.by_first.items():
            i = text.find(first)
            while i >= 0:
                for n, same_length in vals.items():
                    if text[i:i + n] in same_length:
                        found.add(text[i:i + n])
                i = text.find(first, i + 1)
        return found


def _evidence(p: Pii, min_chars: int) -> bool:
    """Whether a PII value in a public text would show a leak (see the module's docstring)."""
    return len(p.value) >= min_chars and not (p.type == "name" and len(p.value.split()) < 2)


def check_disjoint(public: Sequence[Document], private: Sequence[Document], *,
                   secrets: Iterable[str] = (), min_pii_chars: int = 4) -> Overlap:
    """Count what `public` shares with `private` (documents, canary `secrets`, PII values).

    Canary secrets are matched anywhere (digits inside a longer number still reveal them);
    PII values as whole words. Returns the counts; `require_disjoint` raises on any.
    """
    private_hashes = {text_hash(d.text) for d in private}
    shared_docs = sum(text_hash(d.text) in private_hashes for d in public)
    secret_index = _AnywhereIndex(secrets)
    pii_index = _WholeWordIndex(p.value for d in private for p in d.pii if _evidence(p, min_pii_chars))
    found_secrets: set[str] = set()
    found_pii: set[str] = set()
    for d in public:
        if secret_index:
            found_secrets |= secret_index.find(d.text)
        if pii_index:
            found_pii |= pii_index.find(d.text)
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
