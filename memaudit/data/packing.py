"""Pack each user's documents into fixed-length sequences of their own.

A user's documents are shuffled (seeded, so the r copies of a canary do not all sit in one
sequence) and each is followed by EOS. They fill rows of `seq_len` tokens in that order; a
document that does not fit in the rest of the current row starts a new one, so a document
(a canary in particular) never straddles two sequences unless it is longer than `seq_len`,
in which case it fills the current row and continues in the next. Row ends are padded
(`pad_id`, `attention_mask` 0; real tokens are always a prefix of the row). A sequence
therefore belongs to exactly one user: the unit of example-level DP. A document longer than a
row spans several sequences; `doc_spans` counts them (`span_summary`), so the ledger can state
the document-level guarantee (`memaudit.privacy.ledger.PrivacyLedger.document`).

>>> p = pack({"a": [[1, 2], [3]], "b": [[4, 5, 6, 7]]}, seq_len=3, eos_id=0, pad_id=9, seed=0)
>>> p.input_ids.tolist(), p.user_index.tolist(), p.users
([[1, 2, 0], [3, 0, 9], [4, 5, 6], [7, 0, 9]], [0, 0, 1, 1], ('a', 'b'))
>>> p.attention_mask.tolist()
[[1, 1, 1], [1, 1, 0], [1, 1, 1], [1, 1, 0]]
>>> p.doc_spans.tolist(), span_summary(p.doc_spans)["max_sequences_per_document"]
([1, 1, 2], 2)
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np


@dataclass(frozen=True)
class PackedSequences:
    """input_ids int32 (N, L), attention_mask int8 (N, L), user_index int32 (N,) into `users`.

    `doc_spans` int32 (D,): how many sequences each packed document (with its EOS) touches, user
    by user in `users` order and each user's documents in input order; known when packed, None
    when read back from disk (the prepared data's meta.json keeps its `span_summary`).
    """

    input_ids: np.ndarray
    attention_mask: np.ndarray
    user_index: np.ndarray
    users: tuple[str, ...]
    doc_spans: np.ndarray | None = field(default=None, compare=False, repr=False)

    def __len__(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def seq_len(self) -> int:
        return int(self.input_ids.shape[1])

    def user_of(self, i: int) -> str:
        return self.users[int(self.user_index[i])]

    def rows_of(self, user: str) -> np.ndarray:
        """Indices of the sequences that belong to `user` (empty when it has none)."""
        if user not in self.users:
            return np.zeros(0, dtype=np.int64)
        return np.flatnonzero(self.user_index == self.users.index(user))

    def n_tokens(self) -> int:
        return int(self.attention_mask.sum())

    def arrays(self) -> dict[str, np.ndarray]:
        return {"input_ids": self.input_ids, "attention_mask": self.attention_mask,
                "user_index": self.user_index}


def empty(seq_len: int) -> PackedSequences:
    return PackedSequences(np.zeros((0, seq_len), np.int32), np.zeros((0, seq_len), np.int8),
                           np.zeros(0, np.int32), (), np.zeros(0, np.int32))


def span_summary(doc_spans: np.ndarray) -> dict[str, Any]:
    """How many packed sequences the documents span: the largest number m (what document-level
    accounting composes for) and how many documents span 1, 2 and 3 or more.

    >>> span_summary(np.array([1, 1, 2, 4]))
    {'max_sequences_per_document': 4, 'documents': 4, 'spanning': {'1': 2, '2': 1, '3+': 1}}
    """
    s = np.asarray(doc_spans, dtype=np.int64)
    return {"max_sequences_per_document": int(s.max()) if s.size else None, "documents": int(s.size),
            "spanning": {"1": int((s == 1).sum()), "2": int((s == 2).sum()), "3+": int((s >= 3).sum())}}


def _user_rows(docs: list[list[int]], order, seq_len: int, eos_id: int) -> tuple[list[list[int]], list[int]]:
    """Rows of one user, and how many rows each document touches (by document index): a
    document (with its EOS) that fits in a row never straddles two."""
    rows: list[list[int]] = [[]]
    spans = [0] * len(docs)
    for j in order:
        doc = [*docs[j], eos_id]
        room = seq_len - len(rows[-1])
        if len(doc) > room and len(doc) <= seq_len:
            rows.append([])
            room = seq_len
        while doc:  # longer than a row: fill this one, continue in the next
            rows[-1].extend(doc[:room])
            spans[j] += room > 0  # a full row (room 0) gets none of it
            doc = doc[room:]
            if doc:
                rows.append([])
                room = seq_len
    return [r for r in rows if r], spans


def pack(
    by_user: dict[str, list[list[int]]], *, seq_len: int, eos_id: int, pad_id: int, seed: int
) -> PackedSequences:
    """Pack `{user: [token ids of each document]}`; users keep their sorted order."""
    users = tuple(sorted(u for u, docs in by_user.items() if docs))
    rows, index, spans = [], [], []
    for ui, user in enumerate(users):
        docs = by_user[user]
        order = np.random.default_rng([seed, 4, ui]).permutation(len(docs))
        user_rows, user_spans = _user_rows(docs, order, seq_len, eos_id)
        rows.extend(user_rows)
        index.extend([ui] * len(user_rows))
        spans.extend(user_spans)
    if not users:
        return empty(seq_len)
    ids = np.full((len(rows), seq_len), pad_id, dtype=np.int32)  # (N, L)
    mask = np.zeros((len(rows), seq_len), dtype=np.int8)
    for i, r in enumerate(rows):
        ids[i, : len(r)] = r
        mask[i, : len(r)] = 1
    return PackedSequences(ids, mask, np.asarray(index, dtype=np.int32), users,
                           np.asarray(spans, dtype=np.int32))
