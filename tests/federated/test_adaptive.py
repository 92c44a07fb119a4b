"""Adaptive clipping (Andrew et al. 2021): quantile tracking and the noise split."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from memaudit.config import AdaptiveClipConfig
from memaudit.federated.aggregators import mean_aggregator
from memaudit.federated.dp import adaptive_noise_split, dp_fedavg, effective_noise_multiplier


def test_noise_split_keeps_total_multiplier():
    z, sb = 1.1, 2.5
    zd = adaptive_noise_split(z, sb)
    assert zd > z
    # the two releases (sum: sensitivity C, noise zd C; count: sensitivity 1/2, noise sb)
    # compose (RDP of Gaussians adds 1/(2 z_i^2)) to one Gaussian with multiplier z
    assert zd ** -2 + (2 * sb) ** -2 == pytest.approx(z ** -2)
    assert effective_noise_multiplier(zd, sb) == pytest.approx(z)


def test_impossible_split_raises_with_fix():
    with pytest.raises(ValueError, match="count_noise"):
        adaptive_noise_split(3.0, 1.5)
    with pytest.raises(ValueError, match="need z < 2σ_b"):
        dp_fedavg(clip=1.0, noise_multiplier=2.0, expected_cohort=20,
                  adaptive=AdaptiveClipConfig(enabled=True))  # σ_b = 20/20 = 1


@pytest.mark.parametrize("gamma", [0.5, 0.8])
def test_clip_converges_to_quantile(gamma):
    n = 50
    norms = np.linspace(0.5, 3.0, n)  # known update norms; the γ-quantile is known
    deltas = {"w": jnp.asarray(np.stack([[r, 0.0] for r in norms]), jnp.float32)}
    cfg = AdaptiveClipConfig(enabled=True, target_quantile=gamma, lr=0.2, initial_clip=0.1, count_noise=0.5)
    agg = dp_fedavg(mean_aggregator(), clip=1.0, noise_multiplier=0.0, expected_cohort=n, adaptive=cfg)
    step = jax.jit(agg.aggregate)
    state = agg.init(None)
    clips = []
    for r in range(300):
        res = step(deltas, jnp.ones(n), state, jax.random.key(r))
        state = res.state
        clips.append(float(res.metrics["clip"]))
    tail = np.asarray(clips[-100:])
    lo, hi = np.quantile(norms, [gamma - 0.06, gamma + 0.06])
    assert lo <= np.median(tail) <= hi
    assert clips[0] == pytest.approx(0.1)


def test_adaptive_metrics_and_noise_std():
    cfg = AdaptiveClipConfig(enabled=True, initial_clip=0.5, count_noise=None)
    z, m = 0.8, 40
    agg = dp_fedavg(mean_aggregator(), clip=1.0, noise_multiplier=z, expected_cohort=m, adaptive=cfg)
    res = jax.jit(agg.aggregate)({"w": jnp.zeros((3, 20000))}, jnp.ones(3), agg.init(None), jax.random.key(0))
    zd = adaptive_noise_split(z, m / 20)
    assert float(np.std(np.asarray(res.update["w"]))) == pytest.approx(zd * 0.5 / m, rel=0.03)
    assert float(res.metrics["effective_noise"]) == pytest.approx(z)
    assert "next_clip" in res.metrics and "unclipped_fraction" in res.metrics
