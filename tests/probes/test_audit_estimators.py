"""The audit's other estimators beside the one-run bound: the all-thresholds lower bound and the
Gaussian-DP estimate (`memaudit.probes.audit`), on scores of a Gaussian mechanism whose ε is known
and on null scores."""

from __future__ import annotations

import math

import numpy as np
import pytest
from scipy.stats import norm

from memaudit.probes.audit import all_thresholds_bound, gdp_epsilon, gdp_estimate, run_audit

DELTA = 1e-5


def _gdp_delta(eps: float, mu: float) -> float:
    """Dong, Roth, Su (Cor. 2.13): the δ(ε) of μ-GDP, written out here as the oracle."""
    return norm.cdf(-eps / mu + mu / 2) - math.exp(eps) * norm.cdf(-eps / mu - mu / 2)


@pytest.mark.parametrize("mu", [0.3, 1.0, 2.5])
def test_gdp_epsilon_matches_the_trade_off_formula(mu):
    eps = gdp_epsilon(mu, DELTA)
    assert _gdp_delta(eps, mu) == pytest.approx(DELTA, rel=1e-3)
    assert gdp_epsilon(0.0, DELTA) == 0.0


def test_null_scores_give_epsilon_zero():
    """Included and excluded canaries scored alike: the bound is 0 in every draw, the estimate in
    all but the draws whose AUC is above chance at 95% by luck."""
    rng = np.random.default_rng(0)
    bounds, estimates = [], []
    for _ in range(60):
        s_in, s_out = rng.normal(0, 1, 200), rng.normal(0, 1, 200)
        bounds.append(all_thresholds_bound(s_in, s_out, delta=DELTA)["eps"])
        estimates.append(gdp_estimate(s_in, s_out, delta=DELTA)["eps"])
    assert bounds == [0.0] * 60
    assert sum(e == 0.0 for e in estimates) >= 54


def test_a_known_mechanism_is_bounded_below_and_estimated():
    """Scores of a mu-GDP test (in ~ N(mu, 1), out ~ N(0, 1)): the bound never exceeds the true
    epsilon, the estimate's interval covers it, and both grow with mu."""
    rng = np.random.default_rng(1)
    prev_bound = prev_est = -1.0
    for mu in (0.5, 1.5, 3.0):
        truth = gdp_epsilon(mu, DELTA)
        covered, bounds, est = 0, [], []
        for _ in range(20):
            s_in, s_out = rng.normal(mu, 1, 400), rng.normal(0, 1, 400)
            b = all_thresholds_bound(s_in, s_out, delta=DELTA)
            g = gdp_estimate(s_in, s_out, delta=DELTA)
            assert b["kind"] == "one-sided lower bound" and g["kind"] == "estimate"
            bounds.append(b["eps"])
            est.append(g["eps"])
            covered += g["ci_low"] <= truth <= g["ci_high"]
        assert max(bounds) <= truth
        assert covered >= 16, (mu, covered)
        assert np.median(est) == pytest.approx(truth, rel=0.2)
        assert np.median(bounds) > prev_bound and np.median(est) > prev_est
        prev_bound, prev_est = np.median(bounds), np.median(est)


def test_run_audit_states_each_estimator_for_what_it_is():
    rng = np.random.default_rng(2)
    included = rng.random(300) < 0.5
    scores = rng.normal(0, 1, 300) + 2.0 * included
    s = run_audit(scores, included, [f"a{i}" for i in range(300)], r_grid=(50, 100), delta=DELTA)["summary"]
    assert s["kind"] == "one-sided lower bound"
    assert s["all_thresholds"]["kind"] == "one-sided lower bound" and s["all_thresholds"]["eps"] > 0
    assert s["gdp_estimate"]["kind"] == "estimate" and "GDP" in s["gdp_estimate"]["assumes"]
    assert s["gdp_estimate"]["eps"] > s["all_thresholds"]["eps"]
