"""DP-SGD accounting against dp_accounting and published values; calibration; group privacy."""

import math

import pytest
from dp_accounting import dp_event
from dp_accounting.rdp import RdpAccountant

from memaudit.privacy.accounting import (
    default_delta,
    dpsgd_event,
    epsilon,
    epsilon_from_rdp,
    group_epsilon,
    rdp_curve,
)
from memaudit.privacy.calibrate import calibrate_noise


@pytest.mark.parametrize("q,sigma,steps,want", [(0.04, 1.5, 2250, 7.329), (0.01, 4.0, 10_000, 1.035)])
def test_rdp_reference_values_and_pld_below(q, sigma, steps, want):
    event = dpsgd_event(q, sigma, steps)
    assert event == dp_event.SelfComposedDpEvent(
        dp_event.PoissonSampledDpEvent(q, dp_event.GaussianDpEvent(sigma)), steps)
    rdp = epsilon(event, 1e-5, "rdp")
    assert rdp == pytest.approx(want, abs=1e-3)
    # independent oracle: dp_accounting's own accountant with its default orders
    ref = RdpAccountant()
    ref.compose(event)
    assert rdp <= ref.get_epsilon(1e-5) + 1e-9  # a finer grid can only help
    assert rdp == pytest.approx(ref.get_epsilon(1e-5), abs=2e-3)
    pld = epsilon(event, 1e-5, "pld")
    assert pld < rdp and pld > 0.8 * rdp


def test_zero_noise_is_infinite_and_zero_steps_free():
    assert epsilon(dpsgd_event(0.1, 0.0, 10), 1e-5) == math.inf
    assert epsilon(dpsgd_event(0.1, 0.0, 10), 1e-5, "pld") == math.inf
    assert epsilon(dpsgd_event(0.1, 1.0, 0), 1e-5) == pytest.approx(0.0, abs=1e-9)


def test_rdp_curve_round_trip():
    """A curve exported at our orders gives back the accountant's ε."""
    event = dpsgd_event(0.02, 1.1, 500)
    from memaudit.privacy.accounting import RDP_ORDERS

    assert epsilon_from_rdp(RDP_ORDERS, rdp_curve(event), 1e-6) == pytest.approx(epsilon(event, 1e-6))
    # Gaussian mechanism: RDP is α / (2σ²) exactly (Mironov 2017, Prop. 7)
    curve = rdp_curve(dp_event.GaussianDpEvent(2.0), (2.0, 8.0))
    assert curve.tolist() == pytest.approx([2 / 8, 8 / 8])


def test_bad_inputs():
    with pytest.raises(ValueError, match="sampling rate"):
        dpsgd_event(0.0, 1.0, 10)
    with pytest.raises(ValueError, match="sampling rate"):
        dpsgd_event(1.5, 1.0, 10)
    with pytest.raises(ValueError, match="noise multiplier"):
        dpsgd_event(0.1, -1.0, 10)
    with pytest.raises(ValueError, match="delta"):
        epsilon(dpsgd_event(0.1, 1.0, 10), 1.0)
    with pytest.raises(ValueError, match="delta"):
        epsilon(dpsgd_event(0.1, 1.0, 10), 0.0)


def test_default_delta():
    assert default_delta(1) == 0.1
    assert default_delta(10) == 0.01
    assert default_delta(60_000) == 1e-6  # 1/600000 = 1.67e-6 -> 1e-6
    assert default_delta(99_999) == 1e-6
    assert default_delta(100_000) == 1e-6
    assert default_delta(100_001) == 1e-7
    with pytest.raises(ValueError):
        default_delta(0)


def test_group_epsilon_hand_computed():
    g = group_epsilon(1.0, 1e-5, 3)
    assert g["epsilon"] == 3.0
    assert g["delta"] == pytest.approx(1e-5 * (1 + math.e + math.e**2))
    assert g["delta"] <= 3 * math.exp(2.0) * 1e-5  # the k e^{(k-1)ε} δ form
    assert not g["vacuous"]
    assert group_epsilon(0.5, 1e-6, 1) == {**group_epsilon(0.5, 1e-6, 1), "epsilon": 0.5, "delta": 1e-6}
    big = group_epsilon(8.0, 1e-5, 16)
    assert big["delta"] == 1.0 and big["vacuous"]
    assert group_epsilon(5.0, 1e-9, 2)["vacuous"]  # ε' = 10: no test at FPR 1e-3 is ruled out
    assert group_epsilon(math.inf, 1e-5, 2)["vacuous"]


def test_calibration_round_trip():
    q, steps, delta = 0.04, 2250, 1e-5
    sigma = calibrate_noise(7.329, q=q, steps=steps, delta=delta)
    assert sigma == pytest.approx(1.5, rel=2e-3)
    assert epsilon(dpsgd_event(q, sigma, steps), delta) <= 7.329
    assert epsilon(dpsgd_event(q, sigma * (1 - 2e-3), steps), delta) > 7.329
    s_pld = calibrate_noise(2.0, q=0.01, steps=1000, delta=delta, accountant="pld")
    e_pld = epsilon(dpsgd_event(0.01, s_pld, 1000), delta, "pld")
    assert 1.95 < e_pld <= 2.0
    assert epsilon(dpsgd_event(0.01, s_pld, 1000), delta, "rdp") > 2.0  # PLD needs less noise


def test_calibration_unreachable_target():
    with pytest.raises(ValueError, match="reduce the steps"):
        calibrate_noise(1e-4, q=1.0, steps=10_000, delta=1e-5)
    with pytest.raises(ValueError, match="target epsilon"):
        calibrate_noise(-1.0, q=0.1, steps=10, delta=1e-5)
