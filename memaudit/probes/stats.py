"""Attack statistics: ROC AUC, TPR at a fixed low FPR, and seeded, vectorised bootstrap CIs.

Every rate and AUC memaudit reports carries a percentile bootstrap interval (Efron 1979); members
and non-members are resampled separately (stratified), so each resample has both classes.

>>> import numpy as np
>>> tpr_at_fpr(np.array([3.0, 2.0, 1.5]), np.array([2.5, 1.0, 0.5, 0.0]), 0.0)
0.3333333333333333
"""

from __future__ import annotations

import numpy as np

DEFAULT_FPRS = (0.01, 0.001)


def roc_auc(pos: np.ndarray, neg: np.ndarray) -> float:
    """ROC AUC of 'higher score = member' (scikit-learn), ties counted as 1/2."""
    from sklearn.metrics import roc_auc_score

    y = np.r_[np.ones(len(pos)), np.zeros(len(neg))]
    return float(roc_auc_score(y, np.r_[pos, neg]))


def tpr_at_fpr(pos: np.ndarray, neg: np.ndarray, fpr: float) -> float:
    """The largest TPR over ROC points (scikit-learn `roc_curve`) whose FPR is <= `fpr`."""
    from sklearn.metrics import roc_curve

    y = np.r_[np.ones(len(pos)), np.zeros(len(neg))]
    f, t, _ = roc_curve(y, np.r_[pos, neg], drop_intermediate=False)
    ok = f <= fpr + 1e-12
    return float(t[ok].max()) if ok.any() else 0.0


def _auc_rows(pos: np.ndarray, neg: np.ndarray) -> np.ndarray:
    """Mann-Whitney AUC of each row pair: pos (B, n1), neg (B, n0) -> (B,)."""
    from scipy.stats import rankdata

    n1, n0 = pos.shape[1], neg.shape[1]
    ranks = rankdata(np.concatenate([pos, neg], axis=1), axis=1)
    return (ranks[:, :n1].sum(axis=1) - n1 * (n1 + 1) / 2) / (n1 * n0)


def _tpr_rows(pos: np.ndarray, neg: np.ndarray, fpr: float) -> np.ndarray:
    """TPR at FPR <= fpr per row: members strictly above the (k+1)-th largest non-member."""
    n0 = neg.shape[1]
    k = int(np.floor(fpr * n0 + 1e-9))
    if k >= n0:
        return np.ones(pos.shape[0])
    thr = -np.sort(-neg, axis=1)[:, k]  # (B,) the (k+1)-th largest
    return (pos > thr[:, None]).mean(axis=1)


def _ci(samples: np.ndarray, level: float) -> tuple[float, float]:
    a = (1 - level) / 2
    lo, hi = np.quantile(samples, [a, 1 - a])
    return float(lo), float(hi)


def attack_summary(
    pos: np.ndarray,
    neg: np.ndarray,
    *,
    fprs: tuple[float, ...] = DEFAULT_FPRS,
    n_boot: int = 1000,
    seed: int = 0,
    level: float = 0.95,
) -> dict:
    """AUC and TPR at each FPR, each as {value, ci_low, ci_high} (stratified bootstrap).

    Args:
      pos: scores of members (higher = more likely a member).
      neg: scores of non-members.
    Returns:
      {"auc": {...}, "tpr_at_fpr": {"0.01": {...}, ...}, "n_pos", "n_neg"}.
    """
    pos = np.asarray(pos, dtype=np.float64)
    neg = np.asarray(neg, dtype=np.float64)
    if len(pos) == 0 or len(neg) == 0:
        raise ValueError(f"an attack needs members and non-members, got {len(pos)} and {len(neg)}")
    rng = np.random.default_rng(seed)
    bp = pos[rng.integers(0, len(pos), (n_boot, len(pos)))]
    bn = neg[rng.integers(0, len(neg), (n_boot, len(neg)))]
    auc_lo, auc_hi = _ci(_auc_rows(bp, bn), level)
    out = {
        "auc": {"value": roc_auc(pos, neg), "ci_low": auc_lo, "ci_high": auc_hi},
        "tpr_at_fpr": {},
        "n_pos": len(pos),
        "n_neg": len(neg),
    }
    for f in fprs:
        lo, hi = _ci(_tpr_rows(bp, bn, f), level)
        out["tpr_at_fpr"][repr(f)] = {"value": tpr_at_fpr(pos, neg, f), "ci_low": lo, "ci_high": hi}
    return out


def rate_summary(
    hits: np.ndarray, *, n_boot: int = 1000, seed: int = 0, level: float = 0.95
) -> dict:
    """Mean of a 0/1 (or [0, 1]) array with its bootstrap CI: {value, ci_low, ci_high, n}."""
    x = np.asarray(hits, dtype=np.float64)
    if len(x) == 0:
        return {"value": None, "ci_low": None, "ci_high": None, "n": 0}
    rng = np.random.default_rng(seed)
    lo, hi = _ci(x[rng.integers(0, len(x), (n_boot, len(x)))].mean(axis=1), level)
    return {"value": float(x.mean()), "ci_low": lo, "ci_high": hi, "n": len(x)}
