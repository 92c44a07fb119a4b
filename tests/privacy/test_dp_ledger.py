"""Privacy ledger: coalescing, JSON round trip, resume without double counting, RDP curves."""

import json
import math

import pytest
from dp_accounting import dp_event

from memaudit.privacy.accounting import dpsgd_event, epsilon, group_epsilon
from memaudit.privacy.ledger import PrivacyLedger, RdpCurveEvent, event_from_dict, event_to_dict


def test_coalesces_consecutive_identical_steps():
    led = PrivacyLedger(unit="example", delta=1e-5)
    for _ in range(30):
        led.record_steps(0.04, 1.5, 1)
    led.record_steps(0.04, 1.5, 20)
    assert led.events == [dpsgd_event(0.04, 1.5, 50)]
    led.record_steps(0.05, 1.5, 10)  # a different step starts a new event
    led.record_steps(0.04, 1.5, 5)
    assert len(led.events) == 3 and led.steps == 65
    want = epsilon(dp_event.ComposedDpEvent(
        [dpsgd_event(0.04, 1.5, 50), dpsgd_event(0.05, 1.5, 10), dpsgd_event(0.04, 1.5, 5)]), 1e-5)
    assert led.epsilon("rdp") == pytest.approx(want)


def test_json_round_trip(tmp_path):
    led = PrivacyLedger(unit="example", delta=1e-6, max_sequences_per_user=4,
                        calibration={"target_epsilon": 8.0, "accountant": "rdp", "noise_multiplier": 1.1})
    led.record_steps(0.01, 1.1, 300)
    led.record(dp_event.ComposedDpEvent([dp_event.GaussianDpEvent(3.0), dp_event.LaplaceDpEvent(2.0)]))
    path = tmp_path / "privacy.json"
    led.save(path)
    raw = json.loads(path.read_text())
    assert raw["schema"] == 1 and raw["unit"] == "example" and raw["steps"] == 301
    assert raw["noise_multiplier"] == 1.1 and raw["sampling_rate"] == 0.01
    assert raw["epsilon"]["rdp"] == pytest.approx(led.epsilon("rdp"))
    assert raw["epsilon"]["pld"] < raw["epsilon"]["rdp"]
    assert raw["per_user"]["k"] == 4 and raw["per_user"]["epsilon"] == pytest.approx(4 * raw["epsilon"]["pld"])
    back = PrivacyLedger.load(path)
    assert back.events == led.events and back.delta == 1e-6 and back.calibration == led.calibration
    assert back.epsilon("pld") == pytest.approx(led.epsilon("pld"))
    assert not list(tmp_path.glob(".*tmp"))  # atomic write left no temporary behind
    for ev in led.events:
        assert event_from_dict(json.loads(json.dumps(event_to_dict(ev)))) == ev


def test_resume_does_not_double_count(tmp_path):
    """A run checkpointed at step 20, killed at step 27, resumed to step 40."""
    path = tmp_path / "privacy.json"
    led = PrivacyLedger(unit="example", delta=1e-5)
    for step in range(1, 28):
        led.record_steps(0.02, 1.0, 1)
        led.save(path) if step in (10, 20, 27) else None
    resumed = PrivacyLedger.load(path)
    assert resumed.steps == 27
    resumed.truncate_steps(20)  # the checkpoint's step: steps 21..27 are redone
    for _ in range(20, 40):
        resumed.record_steps(0.02, 1.0, 1)
    fresh = PrivacyLedger(unit="example", delta=1e-5)
    fresh.record_steps(0.02, 1.0, 40)
    assert resumed.steps == 40 and resumed.events == fresh.events
    assert resumed.epsilon() == pytest.approx(epsilon(dpsgd_event(0.02, 1.0, 40), 1e-5))
    with pytest.raises(ValueError, match="truncate"):
        resumed.truncate_steps(41)


def test_rdp_curve_events_compose_with_dp_events():
    """A Gaussian mechanism given by its RDP curve α/(2σ²) counts like GaussianDpEvent(σ)."""
    from memaudit.privacy.accounting import RDP_ORDERS

    sigma = 3.0
    curve = RdpCurveEvent(orders=RDP_ORDERS, rdp=tuple(a / (2 * sigma**2) for a in RDP_ORDERS),
                          count=5, label="gaussian")
    led = PrivacyLedger(unit="user", delta=1e-5)
    led.record(curve)
    led.record(RdpCurveEvent(orders=curve.orders, rdp=curve.rdp, count=3, label="gaussian"))
    assert len(led.events) == 1 and led.steps == 8
    led.record_steps(0.1, 1.2, 50)
    want = epsilon(dp_event.ComposedDpEvent(
        [dp_event.SelfComposedDpEvent(dp_event.GaussianDpEvent(sigma), 8), dpsgd_event(0.1, 1.2, 50)]), 1e-5)
    assert led.epsilon("rdp") == pytest.approx(want, rel=1e-9)
    assert led.epsilons()["pld"] is None
    with pytest.raises(ValueError, match="rdp"):
        led.epsilon("pld")
    back = PrivacyLedger.from_json(json.loads(json.dumps(led.to_json())))
    assert back.events == led.events and back.epsilon() == pytest.approx(want, rel=1e-9)
    assert back.to_json()["per_user"] is None  # a user-level ledger needs no group bound
    # a coarser curve is an upper bound: values at missing orders come from the next order up
    coarse = PrivacyLedger(unit="user", delta=1e-5)
    coarse.record(RdpCurveEvent(orders=(2.0, 4.0, 8.0, 16.0, 32.0, 64.0),
                                rdp=tuple(8 * a / (2 * sigma**2) for a in (2, 4, 8, 16, 32, 64))))
    exact = epsilon(dp_event.SelfComposedDpEvent(dp_event.GaussianDpEvent(sigma), 8), 1e-5)
    assert exact <= coarse.epsilon() < 1.5 * exact


def test_per_user_block_and_bad_input():
    led = PrivacyLedger(unit="example", delta=1e-5, max_sequences_per_user=3)
    led.record_steps(0.01, 2.0, 100)
    block = led.per_user()
    eps = min(led.epsilon("rdp"), led.epsilon("pld"))
    assert block == group_epsilon(eps, 1e-5, 3)
    with pytest.raises(ValueError, match="unit"):
        PrivacyLedger(unit="token", delta=1e-5)
    with pytest.raises(ValueError, match="delta"):
        PrivacyLedger(unit="example", delta=1.0)
    with pytest.raises(ValueError, match="unknown privacy event"):
        event_from_dict({"type": "os.system"})
    assert PrivacyLedger(unit="example", delta=1e-5).epsilon() == 0.0
    zero = PrivacyLedger(unit="example", delta=1e-5)
    zero.record_steps(0.1, 0.0, 3)
    assert zero.to_json()["epsilon"] == {"rdp": math.inf, "pld": math.inf}


def test_summary_is_recomputed_from_events_never_the_stored_number():
    import math

    from memaudit.privacy.ledger import ledger_summary
    from memaudit.privacy.mechanisms import SampledGaussian

    led = PrivacyLedger(unit="user", delta=1e-5, reproducible_randomness=True)
    mech = SampledGaussian(name="DP-FedAvg", unit="user", noise_multiplier=1.0, population=1000, expected=10)
    led.record_mechanism(mech, steps=100)
    obj = led.to_json()
    obj["epsilon"] = {"rdp": 0.001, "pld": 0.001}  # a tampered stored number is ignored
    s = ledger_summary(obj)
    assert s["epsilon"] == pytest.approx(min(led.epsilon("rdp"), led.epsilon("pld")))
    assert s["adjacency"] == ["add/remove"] and s["unit"] == "user" and s["void_if_seed_known"]
    assert math.isinf(s["server_epsilon"])  # central DP: nothing against the server
    bad = {**obj, "events": [{"type": "NoSuchEvent"}]}
    with pytest.raises(ValueError, match="unknown privacy event"):
        ledger_summary(bad)  # no fallback to the stored epsilon
    assert math.isinf(ledger_summary(None)["epsilon"])


def test_a_remembered_epsilon_answers_only_for_the_same_events_delta_and_accountant():
    """ε is remembered per (events, δ, accountant): each ask, in any order and again, equals the
    accountant's own figure for those events (the oracle: `accounting.epsilon`, no memo)."""
    import numpy as np

    asks = [(0.04, 1.5, 50, 1e-5, "rdp"), (0.04, 1.5, 51, 1e-5, "rdp"), (0.04, 1.6, 50, 1e-5, "rdp"),
            (0.04, 1.5, 50, 1e-6, "rdp"), (0.04, 1.5, 50, 1e-5, "pld"), (0.05, 1.5, 50, 1e-5, "pld")]
    want = {a: epsilon(dpsgd_event(a[0], a[1], a[2]), a[3], a[4]) for a in asks}
    assert len(set(want.values())) == len(asks)  # every ask has its own figure
    for a in [*asks, *reversed(asks)]:
        led = PrivacyLedger(unit="example", delta=a[3])
        led.record_steps(a[0], a[1], a[2])
        assert led.epsilon(a[4]) == want[a], a
    # a numpy count (a key JSON cannot write) is still keyed by its value
    step = dp_event.PoissonSampledDpEvent(0.04, dp_event.GaussianDpEvent(1.5))
    led = PrivacyLedger(unit="example", delta=1e-5, events=[dp_event.SelfComposedDpEvent(step, np.int64(51))])
    assert led.epsilon("rdp") == want[asks[1]]
