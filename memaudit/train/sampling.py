"""Poisson sampling of each step's batch: the sampling that DP-SGD's accounting assumes.

Every example joins a step's batch independently with probability q, so the batch size is
Binomial(N, q) and may be empty. Step t's draw comes from a Philox generator keyed by the
run's secret randomness at (purpose "poisson", t) (:mod:`memaudit.privacy.randomness`), so
the realised batches cannot be recomputed from anything public (amplification by sampling
assumes they are hidden), while a resumed run, holding the same secret, samples exactly the
batches the interrupted run would have.

References:
  Abadi et al., "Deep Learning with Differential Privacy", CCS 2016.
  Mironov, Talwar, Zhang, "Rényi Differential Privacy of the Sampled Gaussian Mechanism", 2019.

>>> from memaudit.privacy.randomness import DPRandomness
>>> s = PoissonSampler(1000, 0.05, DPRandomness.fresh())
>>> s.expected_batch_size
50.0
>>> bool((s.indices(7) == s.indices(7)).all())
True
"""

from __future__ import annotations

from typing import Any

import numpy as np

from memaudit.privacy.randomness import DPRandomness

PURPOSE = "poisson"


class PoissonSampler:
    """Per-step Poisson sampler over `num_examples` indices, keyed by a `DPRandomness`."""

    def __init__(self, num_examples: int, sampling_rate: float, randomness: Any) -> None:
        if num_examples < 1:
            raise ValueError(f"num_examples must be >= 1, got {num_examples}")
        if not 0 < sampling_rate <= 1:
            raise ValueError(
                f"sampling rate must be in (0, 1], got {sampling_rate}; use batch_size / num_examples"
            )
        if not isinstance(randomness, DPRandomness):
            raise TypeError("PoissonSampler needs a DPRandomness (DPRandomness.fresh() or .from_seed(seed)), "
                            f"got {type(randomness).__name__}")
        self.num_examples = int(num_examples)
        self.sampling_rate = float(sampling_rate)
        self.randomness = randomness

    @property
    def expected_batch_size(self) -> float:
        return self.num_examples * self.sampling_rate

    def indices(self, step: int) -> np.ndarray:
        """Sorted int64 indices of the examples in step `step`'s batch (possibly empty)."""
        if step < 0:
            raise ValueError(f"step must be >= 0, got {step}")
        rng = self.randomness.numpy_rng(PURPOSE, int(step))
        keep = rng.random(self.num_examples) < self.sampling_rate
        return np.flatnonzero(keep).astype(np.int64)


USER_PURPOSE = "poisson-users"


def cap_per_user(user_index: np.ndarray, k: int, seed: int) -> np.ndarray:
    """Sorted rows that keep at most `k` sequences of each user (the contribution bound).

    Which k of a user's sequences are kept is drawn once from `seed` (public, independent of
    the data's content), so every step of a run and its resume see the same capped set.

    >>> cap_per_user(np.array([0, 0, 0, 1, 2, 2]), 2, seed=0).size
    5
    """
    user_index = np.asarray(user_index)
    rng = np.random.default_rng([int(seed), 0x5EC])
    keys = rng.random(user_index.size)  # a random order inside each user
    order = np.lexsort((keys, user_index))
    users = user_index[order]
    first = np.searchsorted(users, users, side="left")  # each row's user's first position
    rank = np.arange(users.size) - first
    return np.sort(order[rank < k]).astype(np.int64)


class SubsetSampler:
    """Poisson sampling over a subset of the rows (ELS: the capped rows), in row numbers."""

    def __init__(self, rows: np.ndarray, sampling_rate: float, randomness: Any) -> None:
        self.rows = np.asarray(rows, dtype=np.int64)
        self.base = PoissonSampler(self.rows.size, sampling_rate, randomness)

    @property
    def expected_batch_size(self) -> float:
        return self.base.expected_batch_size

    def indices(self, step: int) -> np.ndarray:
        return self.rows[self.base.indices(step)]


class UserPoissonSampler:
    """ULS: each user joins a step independently with probability q; a sampled user brings its
    (capped) sequences as one group of `group_size` rows, padded with -1 (no sequence).

    Step t's draw comes from the run's secret randomness at ("poisson-users", t), like
    `PoissonSampler`'s, so the sampled users are hidden and a resume draws them again.

    >>> from memaudit.privacy.randomness import DPRandomness
    >>> s = UserPoissonSampler(np.array([0, 0, 1, 2, 2, 2]), np.arange(6), 1.0, DPRandomness.fresh())
    >>> s.group_size, s.indices(0).tolist()
    (3, [0, 1, -1, 2, -1, -1, 3, 4, 5])
    """

    def __init__(self, user_index: np.ndarray, rows: np.ndarray, sampling_rate: float, randomness: Any) -> None:
        rows = np.asarray(rows, dtype=np.int64)
        users = np.asarray(user_index)[rows]
        order = np.argsort(users, kind="stable")
        ids, starts = np.unique(users[order], return_index=True)
        self.groups = np.split(rows[order], starts[1:]) if ids.size else []
        self.group_size = max((g.size for g in self.groups), default=1)
        self.users = PoissonSampler(max(len(self.groups), 1), sampling_rate, randomness)
        self._purpose = USER_PURPOSE

    @property
    def num_users(self) -> int:
        return len(self.groups)

    @property
    def expected_batch_size(self) -> float:
        """Expected users per step."""
        return self.users.expected_batch_size

    def sampled_users(self, step: int) -> np.ndarray:
        if step < 0:
            raise ValueError(f"step must be >= 0, got {step}")
        rng = self.users.randomness.numpy_rng(self._purpose, int(step))
        return np.flatnonzero(rng.random(self.num_users) < self.users.sampling_rate).astype(np.int64)

    def indices(self, step: int) -> np.ndarray:
        """Rows of step `step`'s users, `group_size` per user, -1 where a user has fewer."""
        out = np.full((0, self.group_size), -1, dtype=np.int64)
        picked = self.sampled_users(step)
        if picked.size:
            out = np.full((picked.size, self.group_size), -1, dtype=np.int64)
            for i, u in enumerate(picked):
                g = self.groups[u]
                out[i, :g.size] = g
        return out.reshape(-1)
