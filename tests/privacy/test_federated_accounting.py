"""User-level accounting of federated training against direct dp_accounting computations."""

import math

import numpy as np
import pytest
from dp_accounting import dp_event
from dp_accounting.pld import PLDAccountant
from dp_accounting.privacy_accountant import NeighboringRelation
from dp_accounting.rdp import RdpAccountant

from memaudit.privacy import federated as fed
from memaudit.privacy.accounting import PLD_DISCRETIZATION, RDP_ORDERS
from memaudit.privacy.ledger import PrivacyLedger, RdpCurveEvent, event_from_dict, event_to_dict

COHORT, POP, Z, ROUNDS, DELTA = 20, 2000, 1.1, 150, 1e-5


def _direct(accountant):
    accountant.compose(dp_event.PoissonSampledDpEvent(COHORT / POP, dp_event.GaussianDpEvent(Z)), ROUNDS)
    return accountant.get_epsilon(DELTA)


def test_poisson_run_matches_dp_accounting():
    led = PrivacyLedger(unit="user", delta=DELTA)
    for _ in range(ROUNDS):
        fed.record_dpfedavg_round(led, cohort=COHORT, population=POP, noise_multiplier=Z)
    assert len(led.events) == 1 and led.steps == ROUNDS  # rounds coalesce
    assert led.epsilon("rdp") == pytest.approx(_direct(RdpAccountant(list(RDP_ORDERS))), rel=1e-9)
    assert led.epsilon("pld") == pytest.approx(_direct(PLDAccountant(value_discretization_interval=PLD_DISCRETIZATION)), rel=1e-6)


def test_fixed_cohort_is_replace_one_rdp_only():
    ev = fed.dpfedavg_event(cohort=COHORT, population=POP, noise_multiplier=Z, rounds=ROUNDS, sampling="fixed")
    assert isinstance(ev, RdpCurveEvent) and "replace-one" in ev.label
    acc = RdpAccountant(list(fed.FIXED_COHORT_ORDERS), neighboring_relation=NeighboringRelation.REPLACE_ONE)
    # replace-one moves the clipped sum by 2C: dp_accounting's multiplier is std / (2C) = Z / 2
    acc.compose(dp_event.SampledWithoutReplacementDpEvent(POP, COHORT, dp_event.GaussianDpEvent(Z / 2)), ROUNDS)
    led = PrivacyLedger(unit="user", delta=DELTA, events=[ev])
    assert led.epsilon("rdp") == pytest.approx(acc.get_epsilon(DELTA), rel=1e-9)
    assert led.epsilons()["pld"] is None
    with pytest.raises(ValueError, match="rdp"):
        led.epsilon("pld")
    assert event_from_dict(event_to_dict(ev)) == ev


def test_calibration_hits_target():
    # Poisson cohorts delegate to privacy.calibrate.calibrate_noise (tested there)
    for sampling in ("fixed",):
        z = fed.calibrate_dpfedavg_noise(3.0, cohort=COHORT, population=POP, rounds=ROUNDS, delta=DELTA,
                                         sampling=sampling)
        eps = PrivacyLedger(unit="user", delta=DELTA, events=[
            fed.dpfedavg_event(cohort=COHORT, population=POP, noise_multiplier=z, rounds=ROUNDS, sampling=sampling)
        ]).epsilon("rdp")
        assert 2.95 < eps <= 3.0 + 1e-9


def test_ddp_round_event_composes_with_dp_accounting_events():
    from memaudit.federated.ddp import ddg_rdp

    metrics = {"survivors": 9.0, "ddp_l2": 300.0, "ddp_l1": 3000.0, "ddp_local_std": 250.0, "ddp_dim": 1024}
    ev = fed.ddp_round_event(metrics)
    np.testing.assert_allclose(ev.rdp, ddg_rdp(RDP_ORDERS, l2=300.0, l1=3000.0, local_std=250.0, n=9, dim=1024))
    gauss = dp_event.GaussianDpEvent(2.0)
    led = PrivacyLedger(unit="user", delta=DELTA, events=[ev, ev, gauss])
    want_rdp = 2 * np.asarray(ev.rdp) + np.asarray(RDP_ORDERS) / (2 * 2.0 ** 2)
    from dp_accounting.rdp.rdp_privacy_accountant import compute_epsilon
    assert led.epsilon("rdp") == pytest.approx(compute_epsilon(np.asarray(RDP_ORDERS), want_rdp, DELTA)[0], rel=1e-6)
    # losing clients loses noise: fewer survivors, larger epsilon
    fewer = fed.ddp_round_event({**metrics, "survivors": 5.0})
    assert PrivacyLedger(unit="user", delta=DELTA, events=[fewer]).epsilon("rdp") > \
        PrivacyLedger(unit="user", delta=DELTA, events=[ev]).epsilon("rdp")


def test_user_level_ledger_required_and_bad_cohort():
    with pytest.raises(ValueError, match="user-level"):
        fed.record_dpfedavg_round(PrivacyLedger(unit="example", delta=DELTA), cohort=5, population=10,
                                  noise_multiplier=1.0)
    with pytest.raises(ValueError, match="cohort"):
        fed.poisson_round_event(cohort=20, population=10, noise_multiplier=1.0)
    assert math.isinf(fed.fixed_cohort_rdp(cohort=5, population=10, noise_multiplier=0.0)[0])
