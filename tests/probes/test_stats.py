"""ROC statistics against direct computations on known score arrays."""

import numpy as np
import pytest

from memaudit.probes.stats import (
    _auc_rows,
    _tpr_rows,
    attack_summary,
    rate_summary,
    roc_auc,
    tpr_at_fpr,
)


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
    assert _auc_rows(pos[None], neg[None])[0] == pytest.approx(direct_auc(pos, neg))


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
    assert a["auc"]["ci_low"] < a["auc"]["value"] < a["auc"]["ci_high"]
    assert set(a["tpr_at_fpr"]) == {"0.01", "0.001"}
    # bootstrap sd of AUC near the Hanley-McNeil normal approximation
    width = a["auc"]["ci_high"] - a["auc"]["ci_low"]
    assert 0.04 < width < 0.12
    r = rate_summary(np.r_[np.ones(30), np.zeros(70)], n_boot=500, seed=0)
    assert r["value"] == 0.3 and r["ci_low"] < 0.3 < r["ci_high"] and r["n"] == 100
    with pytest.raises(ValueError):
        attack_summary(pos, np.array([]))
