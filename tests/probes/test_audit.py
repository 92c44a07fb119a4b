"""One-run audit bound (Steinke, Nasr, Jagielski 2023) against the paper's numbers."""

import itertools
import math

import numpy as np
import pytest

from memaudit.probes.audit import ceiling, eps_lower_bound, guesses, p_value, run_audit


def test_paper_example():
    assert eps_lower_bound(m=1000, r=100, v=90, delta=1e-5, p=0.05) == pytest.approx(
        1.626, abs=1e-3
    )


def test_ceiling_never_exceeded():
    c = ceiling(r=100, p=0.05)
    assert c == pytest.approx(math.log(0.05**0.01 / (1 - 0.05**0.01)))
    assert c == pytest.approx(3.49, abs=5e-3)
    for m in (100, 1000, 10**6):
        for delta in (0.0, 1e-10, 1e-5):
            assert eps_lower_bound(m=m, r=100, v=100, delta=delta, p=0.05) <= c + 1e-9
    assert eps_lower_bound(m=1000, r=100, v=100, delta=0.0, p=0.05) == pytest.approx(c, abs=1e-6)


def test_monotone_and_null():
    bounds = [eps_lower_bound(m=1000, r=100, v=v, delta=1e-5) for v in (50, 60, 70, 80, 90, 100)]
    assert bounds[0] == 0.0  # chance accuracy proves nothing
    assert all(a <= b for a, b in itertools.pairwise(bounds))
    # the p-value is exactly the binomial tail when delta = 0
    from scipy.stats import binom

    q = 1 / (1 + math.exp(-1.0))
    assert p_value(1000, 100, 80, 1.0, 0.0) == pytest.approx(binom.sf(79, 100, q))


def test_guesses_and_bonferroni():
    scores = np.array([5.0, 4.0, 3.0, 2.0, 1.0, 0.0])
    inc = np.array([True, True, False, True, False, False])
    assert guesses(scores, inc, 4) == (4, 4)  # in: 5, 4 ; out: 1, 0
    assert guesses(scores, inc, 6) == (6, 4)
    res = run_audit(scores, inc, [f"a{i}" for i in range(6)], r_grid=(2, 4), delta=1e-5)
    s = res["summary"]
    assert s["bonferroni"] == 2 and s["ceiling_at_r"] == pytest.approx(eps_lower_bound(m=6, r=s["r"], v=s["r"], delta=1e-5, p=0.025))
    with pytest.raises(ValueError):
        guesses(scores, inc, 7)


@pytest.mark.parametrize("m, delta", [(40, 1e-5), (200, 1e-3), (200, 0.0), (500, 1e-5)])
def test_ceiling_is_the_brute_force_max_over_r(m, delta):
    """Defect 10: the ceiling is the most m canaries allow at the run's δ, max over every r."""
    from memaudit.probes.audit import audit_ceiling

    brute = max(eps_lower_bound(m=m, r=r, v=r, delta=delta, p=0.05) for r in range(1, m + 1))
    got = audit_ceiling(m=m, delta=delta, p=0.05)
    assert got["eps"] == pytest.approx(brute, abs=1e-6)
    if delta >= 1e-3:
        # the old ceiling logit(p^(1/r)) at r = m overstates what the δ term allows
        assert ceiling(r=m, p=0.05) > got["eps"] + 0.1


def test_run_audit_ceiling_bounds_every_grid_bound():
    rng = np.random.default_rng(0)
    inc = rng.random(200) < 0.5
    scores = inc + rng.normal(0, 0.3, 200)
    s = run_audit(scores, inc, [f"a{i}" for i in range(200)], r_grid=(10, 20, 50), delta=1e-5)["summary"]
    assert s["kind"] == "one-sided lower bound" and s["confidence"] == pytest.approx(0.95)
    assert all(row["eps_lower_bound"] <= s["ceiling"] + 1e-9 for row in s["grid"])
