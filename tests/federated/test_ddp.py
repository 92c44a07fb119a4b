"""Distributed DP: rotation, rounding, the discrete Gaussian sampler, end to end, accounting."""

import math
import random
from fractions import Fraction

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats

from memaudit.federated import ddp


def test_hadamard_is_orthogonal_and_rotation_invertible():
    H = ddp.hadamard(np.eye(8))
    np.testing.assert_allclose(H @ H.T, np.eye(8), atol=1e-12)
    x = np.random.default_rng(0).normal(size=(3, 37))
    y = ddp.rotate(x, seed=5)
    assert y.shape == (3, 64)
    np.testing.assert_allclose(np.linalg.norm(y, axis=1), np.linalg.norm(x, axis=1), rtol=1e-12)
    np.testing.assert_allclose(ddp.unrotate(y, seed=5, dim=37), x, atol=1e-12)
    # against the dense Sylvester construction
    S = np.array([[1.0]])
    for _ in range(3):
        S = np.block([[S, S], [S, -S]])
    np.testing.assert_allclose(H, S / math.sqrt(8), atol=1e-12)


def test_conditional_rounding_respects_bound_and_is_unbiased():
    rng = np.random.default_rng(1)
    x = rng.normal(size=64) * 3
    bound = ddp.rounded_l2_bound(float(np.linalg.norm(x)), 64, math.exp(-0.5))
    draws = np.stack([ddp.conditional_round(x, bound, rng) for _ in range(2000)])
    assert (np.linalg.norm(draws, axis=1) <= bound + 1e-9).all()
    assert np.abs(draws.mean(0) - x).max() < 0.06  # rounding noise std <= 0.5, 2000 draws


def _chi2_against_pmf(samples, sigma):
    k = int(4 * sigma) + 1
    support = np.arange(-k, k + 1)
    pmf = ddp.discrete_gaussian_pmf(support, sigma)
    counts = np.array([(samples == v).sum() for v in support] + [(np.abs(samples) > k).sum()])
    expected = np.append(pmf, 1 - pmf.sum()) * len(samples)
    return stats.chisquare(counts, expected).pvalue


@pytest.mark.parametrize("sigma", [0.8, 3.0, 12.5])
def test_vectorised_sampler_matches_exact_pmf(sigma):
    x = ddp.sample_discrete_gaussian(sigma, 200_000, np.random.default_rng(int(sigma * 10)))
    assert _chi2_against_pmf(x, sigma) > 1e-3


def test_exact_sampler_matches_exact_pmf():
    rng = random.Random(0)
    sigma2 = Fraction(9, 4)
    x = np.array([ddp.sample_discrete_gaussian_exact(sigma2, rng) for _ in range(6000)])
    assert _chi2_against_pmf(x, 1.5) > 1e-3


def test_chi2_detects_a_wrong_sigma():  # the test above has power
    x = ddp.sample_discrete_gaussian(3.3, 200_000, np.random.default_rng(0))
    assert _chi2_against_pmf(x, 3.0) < 1e-6


def test_tau_and_rdp_against_hand_computation():
    tau = ddp.ddg_tau(1.0, 3)
    assert tau == pytest.approx(10 * (math.exp(-math.pi ** 2) + math.exp(-2 * math.pi ** 2 * 2 / 3)))
    orders = [2.0, 8.0]
    r = ddp.ddg_rdp(orders, l2=4.0, l1=10.0, local_std=2.0, n=4, dim=16)
    s2 = 4.0 / (2 * 2.0)
    t = ddp.ddg_tau(2.0, 4)
    want = [min(a / 2 * s2 ** 2 + t * 16, a / 2 * (s2 ** 2 + 2 * 10 / 4 * t + t ** 2 * 16), a / 2 * (s2 + 4 * t) ** 2)
            for a in orders]
    np.testing.assert_allclose(r, want)
    # large noise: tau -> 0 and the curve is the Gaussian one, alpha Δ²/(2 n σ²)
    r = ddp.ddg_rdp(orders, l2=4.0, l1=10.0, local_std=5.0, n=4, dim=16)
    np.testing.assert_allclose(r, np.array(orders) * 16 / (2 * 4 * 25), rtol=1e-9)
    # fewer survivors -> less noise -> larger RDP
    assert (ddp.ddg_rdp(orders, l2=4.0, l1=10.0, local_std=5.0, n=2, dim=16) > r).all()


@pytest.fixture(scope="module")
def client_deltas():
    rng = np.random.default_rng(2)
    return jnp.asarray(rng.normal(size=(12, 50)) * 0.05, jnp.float32)  # norms ~0.35 < clip


def test_end_to_end_mean_within_noise(client_deltas):
    z, clip, n = 0.5, 1.0, 12
    agg = ddp.distributed_dp(clip=clip, noise_multiplier=z, expected_cohort=n, bits=20, seed=0)
    res = agg.aggregate(client_deltas, jnp.ones(n), agg.init(None), jax.random.key(0))
    err = np.asarray(res.update) - np.asarray(client_deltas).mean(0)
    std = z * clip / n
    assert np.abs(err).max() < 5 * std
    assert float(res.metrics["survivors"]) == n and float(res.metrics["ddp_effective_noise"]) == pytest.approx(z)


def test_noise_std_distributed_matches_configuration():
    # zero updates, plain modular sum (same arithmetic as the secure one): the noise on the
    # average has std z C / n (plus rounding noise, <= 0.5 gamma per client per coordinate)
    z, clip, n, d = 1.0, 1.0, 8, 4000
    agg = ddp.distributed_dp(clip=clip, noise_multiplier=z, expected_cohort=n, secure=False, seed=1)
    res = agg.aggregate(jnp.zeros((n, d)), jnp.ones(n), agg.init(None), jax.random.key(0))
    got = float(np.std(np.asarray(res.update)))
    want = z * clip / n
    assert got == pytest.approx(want, rel=0.05)  # 4000 draws: relative std error 1.1%


def replay_client_secrets(monkeypatch):
    """Make the clients' own noise secrets (fresh OS entropy) replay one sequence from each call
    on, so two runs of one round draw the same noise shares (for comparing code paths)."""
    import hashlib
    import itertools

    from memaudit.federated import client_ops

    def restart():
        counter = itertools.count()
        monkeypatch.setattr(client_ops, "fresh_secret",
                            lambda: hashlib.sha256(str(next(counter)).encode()).digest())
    return restart


def noise_by_slot(monkeypatch):
    """Key each client's noise share by its slot seed, in the in-process and the node path alike
    (`encode_rows` of both modules), so that runs on different runtimes can be compared bit for
    bit. Only for such comparisons: in memaudit the share comes from the client's own secret."""
    import hashlib

    from memaudit.federated import client_ops, updates
    from memaudit.federated.secagg import remote

    def encode_rows(encoding, rows, seeds):
        rngs = [client_ops.slot_rng(s) for s in seeds]
        if isinstance(encoding, client_ops.DDGEncoding):
            noise = [client_ops.secret_rng(hashlib.sha256(b"noise" + s.encode()).digest()) for s in seeds]
            return encoding.encode(rows, rngs, noise_rngs=noise)
        return encoding.encode(rows, rngs)

    monkeypatch.setattr(updates, "encode_rows", encode_rows)
    monkeypatch.setattr(remote, "encode_rows", encode_rows)


def test_secure_and_plain_sum_agree_and_dropouts_lose_noise(client_deltas, monkeypatch):
    n = 12
    kw = {"clip": 1.0, "noise_multiplier": 0.5, "expected_cohort": n, "seed": 3}
    a = ddp.distributed_dp(secure=True, **kw)
    b = ddp.distributed_dp(secure=False, **kw)
    restart = replay_client_secrets(monkeypatch)
    restart()
    ra = a.aggregate(client_deltas, jnp.ones(n), a.init(None), jax.random.key(4))
    restart()
    rb = b.aggregate(client_deltas, jnp.ones(n), b.init(None), jax.random.key(4))
    np.testing.assert_array_equal(np.asarray(ra.update), np.asarray(rb.update))
    c = ddp.distributed_dp(secure=False, dropout_rate=0.4, **kw)
    rc = c.aggregate(client_deltas, jnp.ones(n), c.init(None), jax.random.key(4))
    m = float(rc.metrics["survivors"])
    assert m < n
    assert float(rc.metrics["ddp_effective_noise"]) == pytest.approx(0.5 * math.sqrt(m / n))


def test_too_few_bits_raises():
    with pytest.raises(ValueError, match="bits"):
        ddp.ddp_params(clip=1.0, noise_multiplier=1.0, expected_cohort=10, cohort=10, dim=8, bits=3,
                       beta=0.5, k_stddevs=4)


def test_from_config_builds_and_rejects_infinite_clip():
    from memaudit.config import Config
    from memaudit.errors import ConfigError

    cfg = Config.model_validate({"backend": "federated", "privacy": {"noise_multiplier": 1.0, "clip": 0.5,
                                                                      "mechanism": "distributed"}})
    agg = ddp.distributed_dp_from_config(None, cfg, noise_multiplier=1.0)
    assert agg.jittable is False
    bad = Config.model_validate({"backend": "federated", "privacy": {"noise_multiplier": 1.0, "clip": "inf"}})
    with pytest.raises(ConfigError, match="finite privacy.clip"):
        ddp.distributed_dp_from_config(None, bad, noise_multiplier=1.0)


def test_calibration_bisects_over_the_event_the_ledger_records():
    """Distributed DP's target epsilon: calibrated on the KLS curve without amplification (the
    ledger's own round event), not on the Poisson-amplified central event."""
    from memaudit.privacy.ledger import PrivacyLedger
    from memaudit.privacy.mechanisms import DistributedDiscreteGaussian, calibrate

    clip, n, d, rounds, delta = 1.0, 8, 64, 5, 1e-5
    make = lambda z: ddp.planned_round_event(clip=clip, noise_multiplier=z, expected_cohort=n, dim=d)
    z = calibrate(6.0, make, steps=rounds, delta=delta, unit="user")
    agg = ddp.distributed_dp(clip=clip, noise_multiplier=z, expected_cohort=n, secure=False, seed=0)
    res = agg.aggregate(jnp.zeros((n, d)), jnp.ones(n), agg.init(None), jax.random.key(0))
    led = PrivacyLedger(unit="user", delta=delta)
    for _ in range(rounds):
        led.record_mechanism(DistributedDiscreteGaussian(), {k: float(v) for k, v in res.metrics.items()
                                                            if k.startswith("ddp_") or k == "survivors"})
    assert 6.0 - 1e-3 <= led.epsilon("rdp") <= 6.0


def test_metrics_that_depend_on_the_realized_cohort_are_sensitive(client_deltas):
    """Every metric a private aggregator reports that changes with how many clients took part
    (here 12 vs 7, same expected cohort) is a sensitive key, so it never reaches metrics.jsonl.
    Distributed DP's noise is the survivors' shares: its effective noise and noise std are such
    metrics (they used to be public names that the trainer renamed for this one aggregator)."""
    from memaudit.federated.dp import dp_fedavg
    from memaudit.run.lifecycle import SENSITIVE_KEYS

    n = 12
    aggs = {
        "distributed": ddp.distributed_dp(clip=1.0, noise_multiplier=0.5, expected_cohort=n, secure=False, seed=3),
        "central": dp_fedavg(clip=1.0, noise_multiplier=0.5, expected_cohort=n),
    }
    for name, agg in aggs.items():
        full = agg.aggregate(client_deltas, jnp.ones(n), agg.init(None), jax.random.key(4)).metrics
        part = agg.aggregate(client_deltas[:7], jnp.ones(7), agg.init(None), jax.random.key(4)).metrics
        assert set(full) == set(part), name
        varying = {k for k in full if not np.allclose(np.asarray(full[k]), np.asarray(part[k]))}
        assert varying, name  # the cohort changed something (at least the survivor count)
        assert varying <= SENSITIVE_KEYS, (name, sorted(varying - SENSITIVE_KEYS))
