"""ROC statistics against direct computations on known score arrays."""

import itertools

import numpy as np
import pytest

from memaudit.probes.stats import (
    _split_aucs,
    _tpr_rows,
    attack_summary,
    auc_difference_test,
    benjamini_hochberg,
    holm,
    paired_permutation_test,
    permutation_test,
    rate_summary,
    roc_auc,
    tpr_at_fpr,
)
from tests.probes.ranked_auc import ranked_auc_difference_test


def direct_tpr(pos, neg, fpr):
    """Try every threshold: the best TPR whose FPR (score >= t) stays <= fpr."""
    best = 0.0
    for t in np.r_[pos, neg, np.inf]:
        if np.mean(neg >= t) <= fpr + 1e-12:
            best = max(best, float(np.mean(pos >= t)))
    return best


def direct_auc(pos, neg):
    p, n = pos[:, None], neg[None, :]
    return float(np.mean((p > n) + 0.5 * (p == n)))


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("fpr", [0.0, 0.001, 0.01, 0.1, 0.3])
def test_tpr_at_fpr_equals_direct(seed, fpr):
    rng = np.random.default_rng(seed)
    pos = np.round(rng.normal(1.0, 1.0, 80), 1)  # rounded: ties between and within classes
    neg = np.round(rng.normal(0.0, 1.0, 120), 1)
    assert tpr_at_fpr(pos, neg, fpr) == pytest.approx(direct_tpr(pos, neg, fpr))
    # the vectorised bootstrap statistic agrees on the un-resampled arrays
    assert _tpr_rows(pos[None], neg[None], fpr)[0] == pytest.approx(direct_tpr(pos, neg, fpr))
    assert roc_auc(pos, neg) == pytest.approx(direct_auc(pos, neg))
    # the permutation tests' statistic: every member and non-member on side x, then a split
    pos_x, neg_x = np.ones((1, 80), bool), np.ones((1, 120), bool)
    neg_x[0, 0] = False  # side y needs one of each for its own AUC
    pos_x[0, 0] = False
    ax, ay = _split_aucs(pos, neg, pos_x, neg_x)
    assert ax[0] == pytest.approx(direct_auc(pos[1:], neg[1:]))
    assert ay[0] == pytest.approx(direct_auc(pos[:1], neg[:1]))


def test_known_arrays():
    pos = np.array([0.9, 0.8, 0.7, 0.2])
    neg = np.array([0.85, 0.3, 0.1, 0.05])
    assert roc_auc(pos, neg) == pytest.approx(12 / 16)
    assert tpr_at_fpr(pos, neg, 0.0) == 0.25  # only 0.9 beats every non-member
    assert tpr_at_fpr(pos, neg, 0.25) == 0.75  # one non-member (0.85) may be passed


def test_summary_cis_bracket_and_seeded():
    rng = np.random.default_rng(0)
    pos, neg = rng.normal(1, 1, 300), rng.normal(0, 1, 300)
    a = attack_summary(pos, neg, n_boot=300, seed=1)
    b = attack_summary(pos, neg, n_boot=300, seed=1)
    assert a == b
    assert a.auc.ci_low < a.auc.value < a.auc.ci_high
    assert set(a.tpr_at_fpr) == {"0.01", "0.001"}
    # bootstrap sd of AUC near the Hanley-McNeil normal approximation
    width = a.auc.ci_high - a.auc.ci_low
    assert 0.04 < width < 0.12
    r = rate_summary(np.r_[np.ones(30), np.zeros(70)], n_boot=500, seed=0)
    assert r.value == 0.3 and r.ci_low < 0.3 < r.ci_high and r.n == 100
    with pytest.raises(ValueError):
        attack_summary(pos, np.array([]))


# ----------------------------------------------------------------------------- defect 1 and 5
def test_tpr_at_low_fpr_needs_ten_over_f_negatives():
    """Defect 5: 96 non-members cannot give TPR at 1% or 0.1% FPR; the cell says what it needs."""
    rng = np.random.default_rng(0)
    a = attack_summary(rng.normal(1, 1, 96), rng.normal(0, 1, 96), n_boot=50, unit="users")
    for f, need in (("0.01", 1000), ("0.001", 10000)):
        c = a.tpr_at_fpr[f]
        assert c.value is None and c.ci_low is None
        assert c.note == f"needs >= {need} non-member users"
    b = attack_summary(rng.normal(1, 1, 50), rng.normal(0, 1, 1000), n_boot=50)
    assert b.tpr_at_fpr["0.01"].value is not None and b.tpr_at_fpr["0.001"].value is None
    assert a.auc.n == 96 and a.auc.unit == "users"


def test_small_n_has_no_interval_and_rates_are_exact():
    """Defect 1: n = 1 or 2 gives no interval; 0/49 gets the exact interval, not [0, 0]."""
    from scipy.stats import binomtest

    for x in (np.array([3.0]), np.array([1.0, 0.0])):
        c = rate_summary(x, unit="canaries")
        assert c.ci_low is None and c.note == "n too small" and c.n == len(x)
    c = rate_summary(np.zeros(49), unit="documents")
    ref = binomtest(0, 49).proportion_ci(0.95, method="exact")
    assert c.ci_low == pytest.approx(ref.low) and c.ci_high == pytest.approx(ref.high)
    assert c.ci_high > 0.07 and c.unit == "documents"
    k = rate_summary(np.r_[np.ones(7), np.zeros(13)])
    ref = binomtest(7, 20).proportion_ci(0.95, method="exact")
    assert (k.ci_low, k.ci_high) == pytest.approx((ref.low, ref.high))


def _brute_perm_p(a, b):
    """Every split of the pooled units: the share with a mean difference >= the observed one."""
    pooled, na = np.r_[a, b], len(a)
    obs = a.mean() - b.mean()
    hits = tot = 0
    for idx in itertools.combinations(range(len(pooled)), na):
        m = np.zeros(len(pooled), bool)
        m[list(idx)] = True
        tot += 1
        hits += pooled[m].mean() - pooled[~m].mean() >= obs - 1e-12
    return hits / tot


def test_permutation_tests_against_brute_force():
    rng = np.random.default_rng(1)
    a, b = rng.normal(0.8, 1, 6), rng.normal(0, 1, 6)
    assert permutation_test(a, b, n_perm=40000, seed=0) == pytest.approx(_brute_perm_p(a, b), abs=0.01)
    d = rng.normal(0.3, 1, 8)
    # exact sign-flip enumeration (2^8 patterns) against a direct loop
    pats = [np.array(s) for s in itertools.product([-1, 1], repeat=8)]
    direct = np.mean([np.mean(s * d) >= d.mean() - 1e-12 for s in pats])
    assert paired_permutation_test(d, np.zeros(8)) == pytest.approx(direct)


def test_no_signal_tests_are_uniform_enough():
    """Null check: 200 no-signal comparisons reject at 5% about 5% of the time (binomial 99.9%)."""
    rng = np.random.default_rng(2)
    ps = [permutation_test(rng.normal(size=20), rng.normal(size=20), n_perm=499, seed=i)
          for i in range(200)]
    assert sum(p < 0.05 for p in ps) <= 22
    assert all(p > 0.05 for p in holm(ps))


def test_holm_and_bh_against_a_loop():
    rng = np.random.default_rng(3)
    p = rng.uniform(0, 0.2, 12)
    m = len(p)
    order = np.argsort(p)
    h, run = np.empty(m), 0.0
    for i, j in enumerate(order):
        run = max(run, (m - i) * p[j])
        h[j] = min(1.0, run)
    assert holm(p) == pytest.approx(h)
    bh, run = np.empty(m), 1.0
    for i in range(m - 1, -1, -1):
        j = order[i]
        run = min(run, p[j] * m / (i + 1))
        bh[j] = min(1.0, run)
    assert benjamini_hochberg(p) == pytest.approx(bh)


@pytest.mark.parametrize("paired", [True, False])
def test_auc_difference_test_equals_ranking_every_permutation(paired):
    """The cumulative-count statistic gives the p-values of ranking each permuted row, exactly:
    ties within and between runs (rounded scores, and the equal rank grids of two runs of the
    same size), both alternatives, the advantage statistic, unequal run sizes unpaired."""
    rng = np.random.default_rng(7)
    for trial in range(6):
        n1b, n0b = (40, 25) if trial % 2 and not paired else (30, 50)
        a = (np.round(rng.normal(0.4, 1, 30), 1), np.round(rng.normal(0, 1, 50), 1))
        b = (np.round(rng.normal(0.2 * trial - 0.4, 1, n1b), 1), np.round(rng.normal(0, 1, n0b), 1))
        for alternative, advantage in (("greater", True), ("less", False), ("two-sided", True)):
            kw = {"paired": paired, "alternative": alternative, "n_perm": 499, "seed": trial,
                  "advantage": advantage}
            assert auc_difference_test(a, b, **kw) == ranked_auc_difference_test(a, b, **kw)


def test_auc_difference_test_null_and_signal():
    rng = np.random.default_rng(4)
    pos, neg = rng.normal(1.5, 1, 200), rng.normal(0, 1, 200)  # AUC 0.86 vs 0.63
    weak = (pos + rng.normal(0, 3, 200), neg + rng.normal(0, 3, 200))
    assert auc_difference_test((pos, neg), weak, paired=True, seed=0) < 0.01
    assert auc_difference_test((pos, neg), weak, paired=False, seed=0) < 0.05
    same = (rng.normal(0, 1, 60), rng.normal(0, 1, 60))
    other = (rng.normal(0, 1, 60), rng.normal(0, 1, 60))
    assert auc_difference_test(same, other, paired=False, alternative="two-sided", seed=0) > 0.01


def test_an_auc_below_chance_is_not_less_leakage():
    """A membership score whose AUC is below 1/2 leaks as much as its mirror image above 1/2 (the
    attacker reverses it), so "run a leaks less than run b" compares |AUC - 1/2|. The first
    version compared raw AUCs and found a DP run at AUC 0.45 leaking less than one at 0.55."""
    from memaudit.probes.stats import compare_seeds, compare_units, roc_auc

    rng = np.random.default_rng(7)
    n = 600
    member = np.r_[np.ones(n, bool), np.zeros(n, bool)]
    signal = np.where(member, 0.35, 0.0)
    base = rng.normal(0, 1, 2 * n)
    ids = [f"d{i}" for i in range(2 * n)]

    def units(values):
        return {"kind": "auc", "unit": "documents", "ids": ids, "values": values.tolist(), "member": member.tolist()}

    above, below = units(base + signal), units(base - signal)  # AUC about 0.6 and 0.4
    auc_above = roc_auc(np.asarray(above["values"])[member], np.asarray(above["values"])[~member])
    auc_below = roc_auc(np.asarray(below["values"])[member], np.asarray(below["values"])[~member])
    assert auc_above > 0.57 and auc_below < 0.43
    t = compare_units(below, above, alternative="less", seed=0)
    assert t.p_value > 0.2 and abs(t.estimate) < 0.1, t
    # a real drop towards chance is still found: AUC about 0.5 against about 0.6
    chance = units(rng.normal(0, 1, 2 * n))
    assert compare_units(chance, above, alternative="less", seed=0).p_value < 0.01
    # over seeds (configurations), the same rule
    assert compare_seeds([0.42, 0.43, 0.44], [0.56, 0.57, 0.58], alternative="less", kind="auc").p_value > 0.2
    assert compare_seeds([0.49, 0.50, 0.51], [0.56, 0.57, 0.58], alternative="less", kind="auc").p_value < 0.2
