"""The per-token scores every scoring engine returns (torch: `memaudit.probes.scoring`, JAX:
`memaudit.probes.jax_scoring`); imports neither framework."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class TokenScores:
    """Per sequence of n tokens, arrays of n-1 entries for positions 1..n-1.

    logp: log p(x_t | x_<t). mu, sigma: mean and std of log p(v | x_<t) under v ~ p(. | x_<t)
    (present when requested; Min-K%++ needs them).
    """

    logp: list[np.ndarray]
    mu: list[np.ndarray] | None = None
    sigma: list[np.ndarray] | None = None


__all__ = ["TokenScores"]
