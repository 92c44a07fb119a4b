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

PURPOSE = "poisson"


class PoissonSampler:
    """Per-step Poisson sampler over `num_examples` indices, keyed by a `DPRandomness`."""

    def __init__(self, num_examples: int, sampling_rate: float, randomness: Any) -> None:
        from memaudit.privacy.randomness import DPRandomness

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
