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
    assert s["bonferroni"] == 2 and s["ceiling"] == pytest.approx(ceiling(r=s["r"], p=0.025))
    with pytest.raises(ValueError):
        guesses(scores, inc, 7)
