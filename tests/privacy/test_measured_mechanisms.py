"""Measured, not restated: each mechanism's ε from what its code really does.

For every mechanism the test measures the noise std on zero updates and the sensitivity from
neighbouring inputs run with the *same* key (so the noise cancels in the difference), derives
the multiplier from those numbers alone, computes ε with dp_accounting, and checks it is at
most the ledger's ε (+1e-3). The noise std is taken at a one-sided 4-sigma upper bound of
its estimate, so sampling error cannot make a correct ledger fail.
"""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from dp_accounting import dp_event
from dp_accounting.privacy_accountant import NeighboringRelation
from dp_accounting.rdp import RdpAccountant

from memaudit.config import AdaptiveClipConfig
from memaudit.federated.aggregators import mean_aggregator
from memaudit.federated.dp import dp_fedavg
from memaudit.privacy import federated as fed
from memaudit.privacy.accounting import RDP_ORDERS
from memaudit.privacy.ledger import PrivacyLedger

POP, COHORT, Z, CLIP, ROUNDS, DELTA = 400, 8, 1.2, 0.7, 60, 1e-5


def _std_upper(x: np.ndarray) -> float:
    x = np.asarray(x, np.float64).ravel()
    return float(np.std(x)) * (1 + 4 / math.sqrt(2 * x.size))


def _ledger_eps(sampling: str, z: float = Z) -> float:
    led = PrivacyLedger(unit="user", delta=DELTA)
    for _ in range(ROUNDS):
        fed.record_dpfedavg_round(led, cohort=COHORT, population=POP, noise_multiplier=z, sampling=sampling)
    return led.epsilon("rdp")


def _sum_of(agg, deltas, key):
    res = jax.jit(agg.aggregate)(deltas, jnp.ones(deltas["w"].shape[0]), agg.init(None), key)
    return np.asarray(res.update["w"], np.float64) * COHORT, res  # back from the fixed denominator


def _measure(adaptive=None, d=2000):
    """(noise std on the clipped sum, sensitivity of the sum: +C -> -C and present -> absent)."""
    agg = dp_fedavg(mean_aggregator(), clip=CLIP, noise_multiplier=Z, expected_cohort=COHORT, adaptive=adaptive)
    c = adaptive.initial_clip if adaptive is not None else CLIP
    noise = np.concatenate([_sum_of(agg, {"w": jnp.zeros((COHORT, d))}, jax.random.key(k))[0] for k in range(30)])
    rng = np.random.default_rng(0)
    others = rng.normal(size=(COHORT - 1, d)) * 0.01
    u = np.zeros(d)
    u[0] = 10.0  # clipped to norm C
    key = jax.random.key(99)
    plus, _ = _sum_of(agg, {"w": jnp.asarray(np.vstack([others, u]), jnp.float32)}, key)
    minus, _ = _sum_of(agg, {"w": jnp.asarray(np.vstack([others, -u]), jnp.float32)}, key)
    absent, _ = _sum_of(agg, {"w": jnp.asarray(np.vstack([others, np.zeros(d)]), jnp.float32)}, key)
    return _std_upper(noise) / c, np.linalg.norm(plus - minus) / c, np.linalg.norm(plus - absent) / c


def test_dp_accounting_replace_one_convention_is_pinned():
    """Fails loudly if dp_accounting changes how sampling without replacement reads σ.

    Today its RDP takes σ relative to the L2 sensitivity: at sample = population it is the
    Gaussian's α/(2σ²), and at α = 2 it is WBK19 Thm. 27's closed form in σ. memaudit passes
    z/2 for replace-one; if upstream starts doubling the sensitivity itself (its open fix for
    google/differential-privacy issue 378), memaudit would halve z twice.
    """
    from importlib.metadata import version

    assert version("dp-accounting") == "0.6.0", "re-check the replace-one convention, then re-pin"
    for sigma in (0.5, 1.3):
        acc = RdpAccountant([2.0, 5.0], neighboring_relation=NeighboringRelation.REPLACE_ONE)
        acc.compose(dp_event.SampledWithoutReplacementDpEvent(10, 10, dp_event.GaussianDpEvent(sigma)))
        np.testing.assert_allclose(acc._rdp, np.array([2.0, 5.0]) / (2 * sigma ** 2), rtol=1e-12)
        q = 0.1
        acc = RdpAccountant([2.0], neighboring_relation=NeighboringRelation.REPLACE_ONE)
        acc.compose(dp_event.SampledWithoutReplacementDpEvent(100, 10, dp_event.GaussianDpEvent(sigma)))
        e2 = 1 / sigma ** 2  # Gaussian RDP at α = 2, sensitivity 1
        want = math.log1p(q ** 2 * min(4 * math.expm1(e2), 2 * math.exp(e2)))
        assert acc._rdp[0] == pytest.approx(want, rel=1e-9)


def test_fixed_cohort_measured_sensitivity_is_2C_and_ledger_covers_it():
    std, s_flip, _ = _measure()
    assert std == pytest.approx(Z, rel=0.02)
    assert s_flip == pytest.approx(2.0, rel=1e-4)  # +C -> -C moves the sum by 2C
    acc = RdpAccountant(list(fed.FIXED_COHORT_ORDERS), neighboring_relation=NeighboringRelation.REPLACE_ONE)
    acc.compose(dp_event.SampledWithoutReplacementDpEvent(POP, COHORT, dp_event.GaussianDpEvent(std / s_flip)),
                ROUNDS)
    assert acc.get_epsilon(DELTA) <= _ledger_eps("fixed") + 1e-3


def test_poisson_measured_sensitivity_is_C_and_ledger_covers_it():
    std, _, s_abs = _measure()
    assert s_abs == pytest.approx(1.0, rel=1e-4)
    acc = RdpAccountant(list(RDP_ORDERS))
    acc.compose(dp_event.PoissonSampledDpEvent(COHORT / POP, dp_event.GaussianDpEvent(std / s_abs)), ROUNDS)
    assert acc.get_epsilon(DELTA) <= _ledger_eps("poisson") + 1e-3


def test_adaptive_count_measured_sensitivity_and_ledger_covers_it():
    sb = 1.0
    cfg = AdaptiveClipConfig(enabled=True, initial_clip=CLIP, count_noise=sb)
    std_delta, _, s_sum = _measure(cfg)
    agg = dp_fedavg(mean_aggregator(), clip=CLIP, noise_multiplier=Z, expected_cohort=COHORT, adaptive=cfg)
    step = jax.jit(agg.aggregate)

    def count(rows, key):  # the released count, back in count units (times the expected cohort)
        res = step({"w": jnp.asarray(rows, jnp.float32)}, jnp.ones(len(rows)), agg.init(None), key)
        return float(res.metrics["unclipped_fraction"]) * COHORT

    counts = [count(np.zeros((COHORT, 4)), jax.random.key(k)) for k in range(3000)]
    std_count = _std_upper(np.asarray(counts))
    assert std_count == pytest.approx(sb, rel=0.08)
    rng = np.random.default_rng(1)
    others = rng.normal(size=(COHORT - 1, 4)) * 0.01
    small, big = np.array([[0.01, 0, 0, 0]]), np.array([[10.0, 0, 0, 0]])
    key = jax.random.key(7)
    # the padded slot is absent (weight 0): present-vs-absent with the same key
    def count_w(rows, weights):
        res = step({"w": jnp.asarray(rows, jnp.float32)}, jnp.asarray(weights, jnp.float32), agg.init(None), key)
        return float(res.metrics["unclipped_fraction"]) * COHORT

    w_in, w_out = np.ones(COHORT), np.r_[np.ones(COHORT - 1), 0.0]
    s_count = max(abs(count_w(np.vstack([others, x]), w_in) - count_w(np.vstack([others, x]), w_out))
                  for x in (small, big))  # present vs absent, unclipped and clipped
    assert s_count == pytest.approx(0.5, abs=1e-4)
    # the pair (sum, count) is one Gaussian with 1/z^2 = (s_sum/std_sum)^2 + (s_count/std_count)^2
    z_meas = ((s_sum / std_delta) ** 2 + (s_count / std_count) ** 2) ** -0.5
    acc = RdpAccountant(list(RDP_ORDERS))
    acc.compose(dp_event.PoissonSampledDpEvent(COHORT / POP, dp_event.GaussianDpEvent(z_meas)), ROUNDS)
    assert acc.get_epsilon(DELTA) <= _ledger_eps("poisson") + 1e-3


@pytest.mark.parametrize("sampling", ["poisson", "fixed"])
def test_calibration_reaches_target_from_above(sampling):
    target = 4.0
    z = fed.calibrate_dpfedavg_noise(target, cohort=COHORT, population=POP, rounds=ROUNDS, delta=DELTA,
                                     sampling=sampling)
    eps = _ledger_eps(sampling, z)
    assert target - 1e-3 <= eps <= target


def test_ledger_states_unit_adjacency_mechanism_and_views(tmp_path):
    led = PrivacyLedger(unit="user", delta=DELTA)
    fed.record_dpfedavg_round(led, cohort=COHORT, population=POP, noise_multiplier=Z, sampling="fixed")
    obj = led.to_json()
    assert obj["adjacency"] == ["replace-one"] and obj["unit"] == "user"
    (decl,) = obj["mechanisms"]
    assert decl["mechanism"] == "DP-FedAvg" and decl["sensitivity"] == "2 C"
    assert "sampled" in decl["assumes_hidden"]
    assert math.isinf(obj["guarantees"]["server"]["epsilon"]["rdp"])  # central DP: none
    led.save(tmp_path / "p.json")
    back = PrivacyLedger.load(tmp_path / "p.json")
    assert back.mechanisms == led.mechanisms and back.epsilon() == led.epsilon()
    ddp = PrivacyLedger(unit="user", delta=DELTA)
    metrics = {"survivors": 9.0, "ddp_l2": 300.0, "ddp_l1": 3000.0, "ddp_local_std": 250.0, "ddp_dim": 1024}
    from memaudit.privacy.mechanisms import DistributedDiscreteGaussian

    ddp.record_mechanism(DistributedDiscreteGaussian(), metrics)
    g = ddp.to_json()
    assert g["adjacency"] == ["zero-out"]
    assert g["guarantees"]["server"]["epsilon"]["rdp"] == pytest.approx(ddp.epsilon())


def test_distributed_dp_measured_noise_and_quantised_sensitivity_within_ledger(monkeypatch):
    """Zero-out neighbours: the target (last row, so the others' rounding draws are the same)
    sends its clipped update or zeros; with the noise draws switched off (same grid gamma),
    the decoded sums differ by exactly its quantised update."""
    from dp_accounting.rdp.rdp_privacy_accountant import compute_epsilon

    from memaudit.federated.ddp import distributed_dp
    from memaudit.privacy.ddg import ddg_rdp
    from memaudit.privacy.mechanisms import DistributedDiscreteGaussian

    n, d, z, clip = 8, 1024, 1.0, 1.0
    # k_stddevs=8: no coordinate of the sum wraps around the modulus (a wrap is a +-M outlier)
    agg = distributed_dp(clip=clip, noise_multiplier=z, expected_cohort=n, secure=False, seed=0, k_stddevs=8)
    runs = [agg.aggregate(jnp.zeros((n, d)), jnp.ones(n), agg.init(None), jax.random.key(k)) for k in range(16)]
    zeros = runs[0]
    gamma = float(zeros.metrics["ddp_gamma"])
    # the integer noise sum (the rotation is orthonormal), 16 x 1024 draws
    noise = np.concatenate([np.asarray(r.update, np.float64) * n / gamma for r in runs])
    assert float(np.std(noise)) / math.sqrt(n) == pytest.approx(float(zeros.metrics["ddp_local_std"]), rel=0.03)
    local_std = _std_upper(noise) / math.sqrt(n)

    from memaudit.federated import client_ops as ddp_mod  # the noise share is a client op

    monkeypatch.setattr(ddp_mod, "sample_discrete_gaussian", lambda sigma, size, rng: np.zeros(size, np.int64))
    rng = np.random.default_rng(3)
    others = rng.normal(size=(n - 1, d)) * 0.01
    l2 = 0.0
    for trial in range(20):
        x = rng.normal(size=d)
        x *= 5 * clip / np.linalg.norm(x)  # clipped to C by the mechanism
        key = jax.random.key(trial)
        sums = [np.asarray(agg.aggregate(jnp.asarray(np.vstack([others, last]), jnp.float32), jnp.ones(n),
                                         agg.init(None), key).update, np.float64) * n / gamma
                for last in (x, np.zeros(d))]
        l2 = max(l2, float(np.linalg.norm(sums[0] - sums[1])))
    assert l2 > 0.5 * float(zeros.metrics["ddp_l2"])  # the measurement sees the update
    stated = zeros.metrics
    assert l2 <= float(stated["ddp_l2"]) * (1 + 1e-9)
    D = int(stated["ddp_dim"])
    orders = np.asarray(RDP_ORDERS)
    rdp = ddg_rdp(orders, l2=l2, l1=min(math.sqrt(D) * l2, l2 ** 2), local_std=local_std, n=n, dim=D)
    eps_meas = compute_epsilon(orders, rdp * ROUNDS, DELTA)[0]
    led = PrivacyLedger(unit="user", delta=DELTA)
    for _ in range(ROUNDS):
        led.record_mechanism(DistributedDiscreteGaussian(), {k: float(v) for k, v in stated.items()
                                                            if k.startswith("ddp_") or k == "survivors"})
    assert eps_meas <= led.epsilon("rdp") + 1e-3
    assert led.to_json()["guarantees"]["server"]["epsilon"]["rdp"] == pytest.approx(led.epsilon("rdp"))
