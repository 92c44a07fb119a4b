"""Poisson sampling of each step's batch: the sampling that DP-SGD's accounting assumes.

Every example joins a step's batch independently with probability q, so the batch size is
Binomial(N, q) and may be empty. The draw depends only on (seed, step), so a resumed run
samples exactly the batches the interrupted run would have.

References:
  Abadi et al., "Deep Learning with Differential Privacy", CCS 2016.
  Mironov, Talwar, Zhang, "Rényi Differential Privacy of the Sampled Gaussian Mechanism", 2019.

>>> s = PoissonSampler(1000, 0.05, seed=3)
>>> s.expected_batch_size
50.0
>>> bool((s.indices(7) == s.indices(7)).all())
True
"""

from __future__ import annotations

import numpy as np


class PoissonSampler:
    """Deterministic per-step Poisson sampler over `num_examples` indices."""

    def __init__(self, num_examples: int, sampling_rate: float, seed: int) -> None:
        if num_examples < 1:
            raise ValueError(f"num_examples must be >= 1, got {num_examples}")
        if not 0 < sampling_rate <= 1:
            raise ValueError(
                f"sampling rate must be in (0, 1], got {sampling_rate}; use batch_size / num_examples"
            )
        self.num_examples = int(num_examples)
        self.sampling_rate = float(sampling_rate)
        self.seed = int(seed)

    @property
    def expected_batch_size(self) -> float:
        return self.num_examples * self.sampling_rate

    def indices(self, step: int) -> np.ndarray:
        """Sorted int64 indices of the examples in step `step`'s batch (possibly empty)."""
        if step < 0:
            raise ValueError(f"step must be >= 0, got {step}")
        # A generator keyed by (seed, step) alone: no state to carry across a resume.
        rng = np.random.default_rng([self.seed, int(step), 0x5A4D])
        keep = rng.random(self.num_examples) < self.sampling_rate
        return np.flatnonzero(keep).astype(np.int64)
