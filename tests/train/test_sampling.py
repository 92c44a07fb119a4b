"""Poisson sampler: deterministic per (secret, step), inclusion probability q."""

import numpy as np
import pytest

from memaudit.privacy.randomness import DPRandomness
from memaudit.train.sampling import PoissonSampler


def test_deterministic_and_resumable():
    s = PoissonSampler(500, 0.1, DPRandomness.from_seed(7))
    first = [s.indices(t) for t in range(20)]
    again = PoissonSampler(500, 0.1, DPRandomness.from_seed(7))
    assert all(np.array_equal(again.indices(t), first[t]) for t in reversed(range(20)))
    assert not np.array_equal(PoissonSampler(500, 0.1, DPRandomness.from_seed(8)).indices(3), first[3])
    assert not all(np.array_equal(first[0], f) for f in first[1:])
    assert all(np.all(np.diff(f) > 0) and (f.size == 0 or (f[0] >= 0 and f[-1] < 500)) for f in first)


def test_inclusion_rate_and_batch_size_distribution():
    n, q, steps = 400, 0.05, 400
    s = PoissonSampler(n, q, DPRandomness.from_seed(0))
    counts = np.zeros(n)
    sizes = []
    for t in range(steps):
        idx = s.indices(t)
        counts[idx] += 1
        sizes.append(idx.size)
    assert s.expected_batch_size == pytest.approx(20.0)
    # mean batch size: sd sqrt(n q (1-q) / steps) ≈ 0.22
    assert np.mean(sizes) == pytest.approx(n * q, abs=1.0)
    assert np.var(sizes) == pytest.approx(n * q * (1 - q), rel=0.25)  # binomial, not fixed
    assert counts.mean() / steps == pytest.approx(q, rel=0.05)


def test_bad_arguments():
    with pytest.raises(ValueError, match="sampling rate"):
        PoissonSampler(10, 0.0, DPRandomness.from_seed(0))
    with pytest.raises(ValueError, match="sampling rate"):
        PoissonSampler(10, 1.5, DPRandomness.from_seed(0))
    with pytest.raises(ValueError):
        PoissonSampler(0, 0.5, DPRandomness.from_seed(0))
    assert PoissonSampler(10, 1.0, DPRandomness.from_seed(0)).indices(0).tolist() == list(range(10))


def test_secret_by_default_and_never_the_seed():
    """Two fresh secrets draw different batches; a seed-derived one is reproducible."""
    a, b = PoissonSampler(500, 0.1, DPRandomness.fresh()), PoissonSampler(500, 0.1, DPRandomness.fresh())
    assert not all(np.array_equal(a.indices(t), b.indices(t)) for t in range(5))
    with pytest.raises(TypeError, match="DPRandomness"):
        PoissonSampler(10, 0.5, 3)  # a bare seed is refused: it would make the sample public
