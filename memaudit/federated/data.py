"""Per-user client datasets for the federated backend, built from `PackedSequences`.

Each training user is one client. Its packed sequences are stacked into a padded array
(num_users, max_seqs, L) with an example mask (num_users, max_seqs), so clients with
different amounts of data live in one array and masking keeps the padding out of every loss
and aggregate. The trainer gathers a round's cohort from it into a
`memaudit.federated.cohorts.ClientData` (examples + example mask), and each client draws its
local batches from its own sequences only (`memaudit.federated.algorithms`).

>>> import numpy as np
>>> from memaudit.data.packing import pack
>>> p = pack({"a": [[1, 2, 3, 4, 5]], "b": [[6]]}, seq_len=3, eos_id=0, pad_id=0, seed=0)
>>> cd = build_client_data(p)
>>> cd.input_ids.shape, cd.num_examples.tolist()
((2, 2, 3), [2, 1])
>>> cd.example_mask.tolist()
[[True, True], [True, False]]
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from memaudit.errors import DataError


class ClientData(NamedTuple):
    """Clients-placed training data (host numpy arrays)."""

    input_ids: np.ndarray  # (num_users, max_seqs, L) int32
    attention_mask: np.ndarray  # (num_users, max_seqs, L) int8
    example_mask: np.ndarray  # (num_users, max_seqs) bool: real sequence rows
    num_examples: np.ndarray  # (num_users,) int64
    users: tuple[str, ...]

    @property
    def num_users(self) -> int:
        return len(self.users)

    @property
    def seq_len(self) -> int:
        return int(self.input_ids.shape[-1])


def build_client_data(packed, *, min_users: int = 1) -> ClientData:
    """Group `packed` sequences by `user_index` into one padded block per user.

    Users without sequences are dropped. Raises `DataError` when fewer than `min_users`
    users have data.
    """
    idx = np.asarray(packed.user_index)
    present = np.unique(idx)
    if len(present) < min_users:
        raise DataError(
            f"the training data has {len(present)} users with sequences, but the federated backend "
            f"needs at least {min_users}; add users (data.synth.users) or lower federated.cohort"
        )
    counts = np.array([(idx == u).sum() for u in present], dtype=np.int64)
    s_max, length = int(counts.max()), int(packed.input_ids.shape[1])
    ids = np.zeros((len(present), s_max, length), np.int32)
    am = np.zeros((len(present), s_max, length), np.int8)
    em = np.zeros((len(present), s_max), bool)
    for k, u in enumerate(present):
        rows = np.flatnonzero(idx == u)
        ids[k, : len(rows)] = packed.input_ids[rows]
        am[k, : len(rows)] = packed.attention_mask[rows]
        em[k, : len(rows)] = True
    users = tuple(packed.users[int(u)] for u in present)
    return ClientData(ids, am, em, counts, users)
