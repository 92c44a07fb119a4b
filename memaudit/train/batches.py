"""Deterministic batch selection: the batch of step t depends only on (seed, t).

The training sequences are read as one endless stream of per-epoch permutations;
epoch e is `numpy.random.default_rng([seed, e]).permutation(n)`, and step t takes the
positions [t*B, (t+1)*B) of that stream. A resumed run therefore sees exactly the batches
of an uninterrupted run, with no data-loader state to save.

>>> sel = EpochBatches(num_examples=5, batch_size=2, seed=0)
>>> allidx = np.concatenate([sel.indices(t) for t in range(5)])
>>> sorted(allidx[:5].tolist()) == list(range(5))  # the first epoch covers every example
True
>>> bool((sel.indices(3) == EpochBatches(5, 2, 0).indices(3)).all())
True
"""

from __future__ import annotations

from functools import lru_cache

import numpy as np


class EpochBatches:
    """Fixed-size batches drawn without replacement from per-epoch permutations."""

    def __init__(self, num_examples: int, batch_size: int, seed: int) -> None:
        if num_examples < 1:
            raise ValueError("the training set is empty; add documents or lower data.holdout_fraction")
        self.num_examples = num_examples
        self.batch_size = batch_size
        self.seed = seed
        self._perm = lru_cache(maxsize=4)(self._permutation)

    def _permutation(self, epoch: int) -> np.ndarray:
        return np.random.default_rng([self.seed, epoch]).permutation(self.num_examples)

    def indices(self, step: int) -> np.ndarray:
        """Example indices of step `step` (0-based), shape (batch_size,)."""
        start = step * self.batch_size
        pos = np.arange(start, start + self.batch_size)
        epochs, offsets = np.divmod(pos, self.num_examples)
        out = np.empty(self.batch_size, dtype=np.int64)
        for e in np.unique(epochs):
            sel = epochs == e
            out[sel] = self._perm(int(e))[offsets[sel]]
        return out

    def epoch_of(self, step: int) -> float:
        return step * self.batch_size / self.num_examples
