"""Statistical validity in one place: metrics with their n, intervals, tests and corrections.

Every number a probe or the report states is a *cell* ``{value, n, unit, ci_low, ci_high, note}``:
``n`` counts the independent units behind it (canaries, documents, users) and ``unit`` names them.
An interval is given only when ``n >= MIN_N`` (a mean of real values: ``n >= MEAN_MIN_N``); below
that the cell says "n too small" and carries no interval. Rates of 0/1 outcomes get the exact
Clopper-Pearson interval (so 0/49 is [0, 0.073], not the collapsed bootstrap [0, 0]); AUCs get
DeLong's interval on the logit scale, fractional rates a seeded studentized bootstrap, means the
hull of its equal-tailed and symmetric forms (`bootstrap_t`), TPRs a stratified percentile
bootstrap (Efron 1979). Each interval type's coverage at its smallest n is simulated in
tests/probes/test_interval_coverage.py (>= 93% of a nominal 95%). TPR at FPR f is stated only with at least ``ceil(10 / f)`` negatives of
the attack's unit, else the cell says how many are needed.

Differences are claimed only from a test: permutation tests (paired sign-flip where two runs share
units, label shuffles otherwise), exact McNemar / Fisher tests for 0/1 outcomes, one-sided where
the question is one-sided; and across all findings of a report, Holm (1979) or Benjamini-Hochberg
(1995) control of the family.

References:
  Clopper, Pearson. The use of confidence or fiducial limits illustrated in the case of the
  binomial. Biometrika 1934.
  Holm. A simple sequentially rejective multiple test procedure. Scand. J. Statist. 1979.
  Benjamini, Hochberg. Controlling the false discovery rate. JRSS B 1995.
  Good. Permutation, Parametric and Bootstrap Tests of Hypotheses. Springer 2005.
  DeLong, DeLong, Clarke-Pearson. Comparing the areas under two or more correlated ROC curves.
  Biometrics 1988.
  Efron, Tibshirani. An Introduction to the Bootstrap (ch. 12, bootstrap-t). Chapman & Hall 1993.

>>> import numpy as np
>>> tpr_at_fpr(np.array([3.0, 2.0, 1.5]), np.array([2.5, 1.0, 0.5, 0.0]), 0.0)
0.3333333333333333
>>> holm([0.01, 0.04, 0.03])
[0.03, 0.06, 0.06]
>>> rate_summary(np.zeros(49), unit="documents").ci_high > 0.07
True
"""

from __future__ import annotations

import math

import numpy as np

from memaudit.probes.records import AttackSummary, Cell, Test

DEFAULT_FPRS = (0.01, 0.001)
MIN_N = 10
"""Units a metric needs before an interval is shown (below: "n too small")."""
MEAN_MIN_N = 40
"""Units a mean of real values (exposures in bits) needs before its interval is shown. Canary
exposures are skewed: where 10% of canaries are memorised, 10 canaries hold none of them 35% of
the time, and no interval from the sample reaches the mean then. Simulated (issue 68, 2,000
draws a point), `mean_summary`'s interval covered 10%-memorised exposures 86% at 16, 95% at 30
and 98% at 40, and lognormal scores 91% at 16, 93% at 30 and 94% at 40."""
N_TOO_SMALL = "n too small"
LEVEL = 0.95
ALTERNATIVES = ("greater", "less", "two-sided")


def needed_negatives(fpr: float) -> int:
    """Negatives that make TPR at FPR `fpr` mean something: ceil(10 / fpr)."""
    return math.ceil(10 / fpr - 1e-9) if fpr > 0 else math.inf


PROBE_KEYS = ("value", "n", "unit", "ci_low", "ci_high", "level", "note")
"""The keys of a probe's cell in probes.json, in their order (its extra keys follow)."""


def cell(
    value: float | None,
    *,
    n: int,
    unit: str,
    ci: tuple[float, float] | None = None,
    note: str | None = None,
    min_n: int = MIN_N,
    **extra,
) -> Cell:
    """A metric cell; the interval is dropped (note "n too small") when n < `min_n`. `extra`:
    both classes of an AUC (`n_pos`, `n_neg`) or what else the cell's JSON carries."""
    if n < min_n:
        ci, note = None, note or N_TOO_SMALL
    known = {k: extra.pop(k) for k in ("n_pos", "n_neg") if k in extra}
    return Cell(value=None if value is None else float(value), interval=ci, n=int(n), unit=unit, note=note,
                level=LEVEL if ci is not None else None, extra=extra, keys=PROBE_KEYS + tuple(known) + tuple(extra),
                **known)


def roc_auc(pos: np.ndarray, neg: np.ndarray) -> float:
    """ROC AUC of 'higher score = member' (scikit-learn), ties counted as 1/2."""
    # lazy: scikit-learn (~4 s) only when called; this module imports without it
    from sklearn.metrics import roc_auc_score

    y = np.r_[np.ones(len(pos)), np.zeros(len(neg))]
    return float(roc_auc_score(y, np.r_[pos, neg]))


def tpr_at_fpr(pos: np.ndarray, neg: np.ndarray, fpr: float) -> float:
    """The largest TPR over ROC points (scikit-learn `roc_curve`) whose FPR is <= `fpr`."""
    # lazy: scikit-learn (~4 s) only when called; this module imports without it
    from sklearn.metrics import roc_curve

    y = np.r_[np.ones(len(pos)), np.zeros(len(neg))]
    f, t, _ = roc_curve(y, np.r_[pos, neg], drop_intermediate=False)
    ok = f <= fpr + 1e-12
    return float(t[ok].max()) if ok.any() else 0.0


def _split_aucs(pos_pool: np.ndarray, neg_pool: np.ndarray, pos_x: np.ndarray,
                neg_x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """AUCs of the two sides of each split of two score pools: row r puts the positives
    `pos_x[r]` and the negatives `neg_x[r]` (boolean masks over the pools) on side x and the rest
    on side y; returns (AUC of x, AUC of y), each (B,), ties counted as 1/2 (Mann-Whitney).

    The negatives are sorted once; a row then costs one cumulative count over them and one look-up
    per positive, O(B (M0 + M1)), where ranking every row costs O(B N log N). The counts are
    integers, so the AUCs equal the ranking's exactly.
    """
    order = np.argsort(neg_pool, kind="stable")
    ranked = neg_pool[order]
    lo = np.searchsorted(ranked, pos_pool, side="left")  # pool negatives strictly below each positive
    hi = np.searchsorted(ranked, pos_pool, side="right")  # ... and at most equal to it
    rows, m0 = neg_x.shape
    below = np.zeros((rows, m0 + 1), np.int32)  # below[r, j]: x-side negatives among the j lowest
    np.cumsum(neg_x[:, order], axis=1, dtype=np.int32, out=below[:, 1:])
    lo_x, hi_x = np.take(below, lo, axis=1), np.take(below, hi, axis=1)
    # twice a positive's wins: (strictly below) + (below or equal) = 2 (below + ties / 2)
    twice_x = lo_x.astype(np.int64) + hi_x
    twice_y = (lo + hi) - twice_x
    n1x, n0x = pos_x.sum(axis=1), neg_x.sum(axis=1)
    n1y, n0y = pos_x.shape[1] - n1x, m0 - n0x
    wins_x = np.where(pos_x, twice_x, 0).sum(axis=1)
    wins_y = np.where(pos_x, 0, twice_y).sum(axis=1)
    return wins_x / (2 * n1x * n0x), wins_y / (2 * n1y * n0y)


def _tpr_rows(pos: np.ndarray, neg: np.ndarray, fpr: float) -> np.ndarray:
    """TPR at FPR <= fpr per row: members strictly above the (k+1)-th largest non-member."""
    n0 = neg.shape[1]
    k = int(np.floor(fpr * n0 + 1e-9))
    if k >= n0:
        return np.ones(pos.shape[0])
    thr = -np.sort(-neg, axis=1)[:, k]  # (B,) the (k+1)-th largest
    return (pos > thr[:, None]).mean(axis=1)


def auc_placements(pos: np.ndarray, neg: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """DeLong's placements: each member's share of non-members it beats (ties 1/2), and each
    non-member's share of members that beat it. Both average to the AUC; no n_pos x n_neg matrix.
    """
    pos, neg = np.asarray(pos, float), np.asarray(neg, float)
    sn, sp = np.sort(neg), np.sort(pos)
    v10 = (np.searchsorted(sn, pos, "left") + np.searchsorted(sn, pos, "right")) / (2 * len(neg))
    above = 2 * len(pos) - np.searchsorted(sp, neg, "left") - np.searchsorted(sp, neg, "right")
    return v10, above / (2 * len(pos))


def auc_interval(v10: np.ndarray, v01: np.ndarray, level: float = LEVEL) -> tuple[float, float]:
    """Interval of an AUC from its placements (`auc_placements`), values in [0, 1].

    DeLong's variance, floored by Hanley and McNeil's at the observed AUC so that a perfectly
    separated small sample still has a width; the interval is built on the logit scale with
    Student's t on min(n_pos, n_neg) - 1 degrees of freedom and mapped back, so it stays in
    (0, 1). The placements may be averages over draws of the units' data (user inference averages
    them over draws of documents): the AUC stays a two-sample U-statistic of the units. Simulated
    at 10 units a side (tests/probes/test_interval_coverage.py) it covers 95-99% for AUC 0.5 to
    0.97, where the percentile bootstrap covered 67-91%.

    References:
      DeLong, DeLong, Clarke-Pearson. Comparing the areas under two or more correlated receiver
      operating characteristic curves. Biometrics 1988.
      Hanley, McNeil. The meaning and use of the area under a ROC curve. Radiology 1982.
      Qin, Hotilovac. Comparison of non-parametric confidence intervals for the area under the
      ROC curve of a continuous-scale diagnostic test. Stat. Methods Med. Res. 2008.
    """
    # lazy: scipy.stats (~0.3 s) only when called; this module imports without it
    from scipy.stats import t as student

    n1, n0 = len(v10), len(v01)
    auc = float(np.mean(v10))
    var = (np.var(v10, ddof=1) / n1 if n1 > 1 else 0.0) + (np.var(v01, ddof=1) / n0 if n0 > 1 else 0.0)
    # an AUC of 0 or 1 has no logit: pull it in by half a unit of the smaller side (a pull of
    # half a pair, 1 / (2 n1 n0), made the logit's standard error explode: [0.001, 1] at 1.0)
    eps = 0.5 / min(n1, n0)
    a = min(max(auc, eps), 1 - eps)
    q1, q2 = a / (2 - a), 2 * a * a / (1 + a)
    hm = (a * (1 - a) + (n1 - 1) * (q1 - a * a) + (n0 - 1) * (q2 - a * a)) / (n1 * n0)
    se = math.sqrt(max(var, hm)) / (a * (1 - a))
    q = float(student.ppf(1 - (1 - level) / 2, max(1, min(n1, n0) - 1)))
    logit = math.log(a / (1 - a))
    lo, hi = 1 / (1 + math.exp(-(logit - q * se))), 1 / (1 + math.exp(-(logit + q * se)))
    return min(lo, auc), max(hi, auc)


def percentile_interval(samples: np.ndarray, level: float) -> tuple[float, float]:
    a = (1 - level) / 2
    lo, hi = np.quantile(samples, [a, 1 - a])
    return float(lo), float(hi)


def attack_summary(
    pos: np.ndarray,
    neg: np.ndarray,
    *,
    unit: str = "documents",
    fprs: tuple[float, ...] = DEFAULT_FPRS,
    n_boot: int = 1000,
    seed: int = 0,
    level: float = LEVEL,
    placements: tuple[np.ndarray, np.ndarray] | None = None,
) -> AttackSummary:
    """AUC (DeLong, logit scale) and TPR at each FPR (stratified bootstrap, widened to hold the
    Clopper-Pearson interval of the members above the threshold) as cells with n.

    Args:
      pos: scores of members (higher = more likely a member).
      neg: scores of non-members.
      unit: what one score is ("documents", "users").
      placements: the AUC's placements when they are not those of `pos` and `neg` (averaged
        over draws, `auc_interval`); default `auc_placements(pos, neg)`.
    Returns:
      an `AttackSummary`: the AUC's cell and a TPR cell per FPR (`repr(f)`: "0.01"); a TPR cell
      has value None and a note "needs >= N non-member <unit>" when len(neg) < ceil(10 / f).
    """
    pos = np.asarray(pos, dtype=np.float64)
    neg = np.asarray(neg, dtype=np.float64)
    if len(pos) == 0 or len(neg) == 0:
        raise ValueError(f"an attack needs members and non-members, got {len(pos)} and {len(neg)}")
    rng = np.random.default_rng(seed)
    n = min(len(pos), len(neg))
    v10, v01 = auc_placements(pos, neg) if placements is None else placements
    auc = cell(float(np.mean(v10)), n=n, unit=unit, ci=auc_interval(v10, v01, level),
               n_pos=len(pos), n_neg=len(neg))
    rates: dict[str, Cell] = {}
    bp = bn = None  # bootstrap resamples, drawn once when a TPR cell needs them
    for f in fprs:
        need = needed_negatives(f)
        if len(neg) < need:
            rates[repr(f)] = cell(
                None, n=len(neg), unit=unit, note=f"needs >= {need} non-member {unit}",
                needed=need,
            )
            continue
        if bp is None:
            bp = pos[rng.integers(0, len(pos), (n_boot, len(pos)))]
            bn = neg[rng.integers(0, len(neg), (n_boot, len(neg)))]
        tpr = tpr_at_fpr(pos, neg, f)
        # the bootstrap carries the threshold's variance; at a TPR near 0 or 1 most resamples
        # agree and it collapses ([0, 0] for no member above the threshold), so the interval also
        # holds the exact binomial interval of the members above the observed threshold
        boot = percentile_interval(_tpr_rows(bp, bn, f), level)
        exact = clopper_pearson(round(tpr * len(pos)), len(pos), level)
        ci = (min(boot[0], exact[0]), max(boot[1], exact[1]))
        rates[repr(f)] = cell(tpr, n=len(pos), unit=unit, ci=ci, n_neg=len(neg))
    return AttackSummary(auc=auc, tpr_at_fpr=rates, n_pos=len(pos), n_neg=len(neg), unit=unit)


def clopper_pearson(k: int, n: int, level: float = LEVEL) -> tuple[float, float]:
    """Exact two-sided binomial interval for k successes of n."""
    # lazy: scipy.stats (~0.3 s) only when called; this module imports without it
    from scipy.stats import beta

    a = (1 - level) / 2
    lo = 0.0 if k == 0 else float(beta.ppf(a, k, n - k + 1))
    hi = 1.0 if k == n else float(beta.ppf(1 - a, k + 1, n - k))
    return lo, hi


def rate_summary(
    hits: np.ndarray,
    *,
    unit: str = "units",
    n_boot: int = 1000,
    seed: int = 0,
    level: float = LEVEL,
) -> Cell:
    """Mean of a 0/1 array (exact Clopper-Pearson CI) or of values in [0, 1] (bootstrap-t CI)."""
    x = np.asarray(hits, dtype=np.float64)
    if len(x) == 0:
        return cell(None, n=0, unit=unit, note="no units")
    if np.isin(x, (0.0, 1.0)).all():
        ci = clopper_pearson(int(x.sum()), len(x), level)
    else:
        lo, hi = bootstrap_t(x, n_boot=n_boot, seed=seed, level=level)
        ci = (max(0.0, lo), min(1.0, hi)) if ((x >= 0) & (x <= 1)).all() else (lo, hi)
    return cell(x.mean(), n=len(x), unit=unit, ci=ci)


def clustered_rate_summary(
    hits: np.ndarray, clusters, *, unit: str = "units", cluster_unit: str = "users",
    level: float = LEVEL,
) -> Cell:
    """Rate of 0/1 outcomes that come in clusters (a user's PII items): the items' rate with
    Korn and Graubard's interval, Clopper-Pearson at the effective sample size.

    The rate's variance is the cluster-robust (linearised) one over the G clusters; the effective
    n is r(1 - r) / var (at most n), scaled by (t_{n-1} / t_{G-1})^2 for the G - 1 degrees of
    freedom, and the exact binomial interval is taken at r x n_eff successes of n_eff. With no
    spread between clusters (a rate of 0 or 1) only the degrees-of-freedom factor applies. With as
    many clusters as items this is Clopper-Pearson's interval of independent items (to the df
    factor). Simulated on 13 users of 10-20 items (tests/probes/test_interval_coverage.py), where
    users leak or not, it covers >= 93% where the items' own interval covered 46-63%.

    References:
      Korn, Graubard. Confidence intervals for proportions with small expected number of positive
      counts estimated from survey data. Survey Methodology 1998.
    """
    # lazy: scipy.stats (~0.3 s) only when called; this module imports without it
    from scipy.stats import beta
    from scipy.stats import t as student

    x = np.asarray(hits, dtype=np.float64)
    ids = np.asarray([str(c) for c in clusters])
    n = len(x)
    if n == 0:
        return cell(None, n=0, unit=unit, note="no units")
    _u, inv = np.unique(ids, return_inverse=True)
    g = int(inv.max()) + 1
    r = float(x.mean())
    a = (1 - level) / 2
    n_eff = float(n)
    if g > 1:
        y, m = np.bincount(inv, weights=x), np.bincount(inv)
        var = g / (g - 1) * float(((y - r * m) ** 2).sum()) / n**2
        if var > 0 and 0 < r < 1:
            n_eff = min(n_eff, r * (1 - r) / var)
        if g < n:
            n_eff *= (float(student.ppf(1 - a, n - 1)) / float(student.ppf(1 - a, g - 1))) ** 2
        n_eff = min(n_eff, float(n))
    k = r * n_eff
    lo = 0.0 if k <= 0 else float(beta.ppf(a, k, n_eff - k + 1))
    hi = 1.0 if k >= n_eff else float(beta.ppf(1 - a, k + 1, n_eff - k))
    return cell(r, n=n, unit=unit, ci=(lo, hi) if g > 1 else None,
                note=None if g > 1 else f"one {cluster_unit[:-1]}: no interval",
                **{cluster_unit: g})


def mean_summary(
    x: np.ndarray, *, unit: str, n_boot: int = 1000, seed: int = 0, level: float = LEVEL
) -> Cell:
    """Mean of a real-valued array with the hull of its equal-tailed and symmetric bootstrap-t
    intervals (`bootstrap_t`); no interval below `MEAN_MIN_N` units."""
    x = np.asarray(x, dtype=np.float64)
    if len(x) == 0:
        return cell(None, n=0, unit=unit, note="no units")
    ci = bootstrap_t(x, n_boot=n_boot, seed=seed, level=level, hull=True) if len(x) >= MEAN_MIN_N else None
    return cell(x.mean(), n=len(x), unit=unit, ci=ci, min_n=MEAN_MIN_N)


def bootstrap_t(x: np.ndarray, *, n_boot: int = 1000, seed: int = 0,
                level: float = LEVEL, hull: bool = False) -> tuple[float, float]:
    """Studentized bootstrap interval of a mean (Efron & Tibshirani 1993, ch. 12; Hall 1988).

    Each resample gives t* = (mean* - mean) / se*; the interval is mean - t*_(1-a/2) se to
    mean - t*_(a/2) se. Second-order accurate, yet on the skew of canary exposures it falls short
    at small n: simulated (tests/probes/test_interval_coverage.py), a mean of exponential
    exposures is covered ~94% at n = 10 (percentile bootstrap 86%, t-interval 89%), but lognormal
    scores only 90% at 10 and 92% at 40, and exposures of which 10% are memorised 80% at 10. With
    `hull`, the interval also holds the symmetric bootstrap-t interval, mean -+ |t*|_(1-a) se,
    whose upper end reaches further into a long right tail: 94% and 98% on those two at n = 40
    (`MEAN_MIN_N`), 95% on normal and exponential exposures.
    Resamples with no spread carry no t* and are left out; a sample with none is [mean, mean].

    References:
      Hall. Theoretical comparison of bootstrap confidence intervals. Ann. Statist. 1988.
    """
    n = len(x)
    m, se = float(x.mean()), float(x.std(ddof=1)) / math.sqrt(n) if n > 1 else 0.0
    if se == 0.0:
        return m, m
    rng = np.random.default_rng(seed)
    xb = x[rng.integers(0, n, (n_boot, n))]  # (n_boot, n)
    sb = xb.std(axis=1, ddof=1) / math.sqrt(n)
    ok = sb > 0
    t = (xb.mean(axis=1)[ok] - m) / sb[ok]
    if not len(t):
        return m, m
    a = (1 - level) / 2
    hi_t, lo_t = np.quantile(t, [1 - a, a])
    lo, hi = m - hi_t * se, m - lo_t * se
    if hull:
        sym = float(np.quantile(np.abs(t), level))
        lo, hi = min(lo, m - sym * se), max(hi, m + sym * se)
    return float(lo), float(hi)


# ----------------------------------------------------------------------------- tests
def _check_alt(alternative: str) -> None:
    if alternative not in ALTERNATIVES:
        raise ValueError(f"alternative '{alternative}' is not one of {', '.join(ALTERNATIVES)}")


def _p_from_null(observed: float, null: np.ndarray, alternative: str) -> float:
    """Monte-Carlo permutation p-value (k + 1) / (B + 1), never 0 (Phipson & Smyth 2010)."""
    eps = 1e-12 * max(1.0, abs(observed))
    if alternative == "greater":
        k = int((null >= observed - eps).sum())
    elif alternative == "less":
        k = int((null <= observed + eps).sum())
    else:
        k = int((np.abs(null) >= abs(observed) - eps).sum())
    return (k + 1) / (len(null) + 1)


def permutation_test(
    a: np.ndarray,
    b: np.ndarray,
    *,
    alternative: str = "greater",
    n_perm: int = 9999,
    seed: int = 0,
) -> float:
    """p-value of mean(a) - mean(b) under shuffles of the group labels (independent units)."""
    _check_alt(alternative)
    a, b = np.asarray(a, float), np.asarray(b, float)
    if not len(a) or not len(b):
        raise ValueError(f"a permutation test needs units on both sides, got {len(a)} and {len(b)}")
    pooled = np.r_[a, b]
    rng = np.random.default_rng(seed)
    perm = rng.permuted(np.broadcast_to(pooled, (n_perm, len(pooled))), axis=1)
    null = perm[:, : len(a)].mean(axis=1) - perm[:, len(a) :].mean(axis=1)
    return _p_from_null(a.mean() - b.mean(), null, alternative)


def paired_permutation_test(
    a: np.ndarray,
    b: np.ndarray,
    *,
    alternative: str = "greater",
    n_perm: int = 9999,
    seed: int = 0,
) -> float:
    """Sign-flip test of mean(a - b) for units measured in both runs (exact when 2^n <= n_perm)."""
    _check_alt(alternative)
    d = np.asarray(a, float) - np.asarray(b, float)
    if d.ndim != 1 or not len(d):
        raise ValueError("a paired test needs the same non-empty set of units in both runs")
    n = len(d)
    if 2**n <= n_perm:  # every sign pattern
        signs = 1 - 2 * ((np.arange(2**n)[:, None] >> np.arange(n)) & 1)
        null = (signs * d).mean(axis=1)
        obs = d.mean()
        eps = 1e-12 * max(1.0, abs(obs))
        if alternative == "greater":
            return float((null >= obs - eps).mean())
        if alternative == "less":
            return float((null <= obs + eps).mean())
        return float((np.abs(null) >= abs(obs) - eps).mean())
    rng = np.random.default_rng(seed)
    signs = rng.choice(np.array([-1.0, 1.0]), (n_perm, n))
    return _p_from_null(d.mean(), (signs * d).mean(axis=1), alternative)


def mann_whitney(x: np.ndarray, y: np.ndarray, *, alternative: str = "greater") -> float:
    """Mann-Whitney U p-value (exact for small samples without ties, scipy's choice)."""
    # lazy: scipy.stats (~0.3 s) only when called; this module imports without it
    from scipy.stats import mannwhitneyu

    _check_alt(alternative)
    return float(mannwhitneyu(np.asarray(x, float), np.asarray(y, float),
                              alternative=alternative).pvalue)


def mcnemar_exact(a: np.ndarray, b: np.ndarray, *, alternative: str = "greater") -> float:
    """Exact McNemar test of paired 0/1 outcomes: is a's rate above (below) b's?"""
    # lazy: scipy.stats (~0.3 s) only when called; this module imports without it
    from scipy.stats import binomtest

    _check_alt(alternative)
    a, b = np.asarray(a, bool), np.asarray(b, bool)
    n10, n01 = int((a & ~b).sum()), int((~a & b).sum())
    if n10 + n01 == 0:
        return 1.0
    return float(binomtest(n10, n10 + n01, 0.5, alternative=alternative).pvalue)


def fisher_exact(a: np.ndarray, b: np.ndarray, *, alternative: str = "greater") -> float:
    """Fisher's exact test of two independent 0/1 samples: is a's rate above (below) b's?"""
    # lazy: scipy.stats (~0.3 s) only when called; this module imports without it
    from scipy.stats import fisher_exact as fe

    _check_alt(alternative)
    a, b = np.asarray(a, bool), np.asarray(b, bool)
    table = [[int(a.sum()), int((~a).sum())], [int(b.sum()), int((~b).sum())]]
    return float(fe(table, alternative=alternative).pvalue)


def _first_of_shuffle(rng: np.random.Generator, rows: int, n_a: int, n_b: int) -> np.ndarray:
    """(rows, n_a + n_b) masks: in each row, the positions a shuffle puts first n_a."""
    idx = rng.permuted(np.broadcast_to(np.arange(n_a + n_b), (rows, n_a + n_b)), axis=1)
    mask = np.zeros((rows, n_a + n_b), bool)
    np.put_along_axis(mask, idx[:, :n_a], True, axis=1)
    return mask


AUC_PERM_CHUNK = 2000  # permutations per block of auc_difference_test (1999, the default, is one)


def auc_difference_test(
    a: tuple[np.ndarray, np.ndarray],
    b: tuple[np.ndarray, np.ndarray],
    *,
    paired: bool,
    alternative: str = "greater",
    n_perm: int = 1999,
    seed: int = 0,
    advantage: bool = False,
) -> float:
    """Permutation test of AUC(a) - AUC(b); a and b are (member scores, non-member scores).

    Scores become within-run ranks first, so two models' scales never meet. Paired (the same
    units in the same order in both runs): each unit's pair of ranks is swapped between runs with
    probability 1/2. Unpaired: members of both runs are shuffled between runs, and so are
    non-members. With `advantage` the statistic is |AUC(a) - 1/2| - |AUC(b) - 1/2| instead: the
    attack's distance from chance, which is what leaks (`chance_advantage`).
    """
    # lazy: scipy.stats (~0.3 s) only when called; this module imports without it
    from scipy.stats import rankdata

    _check_alt(alternative)

    def pct(pos, neg):
        r = rankdata(np.r_[pos, neg]) / (len(pos) + len(neg))
        return r[: len(pos)], r[len(pos) :]

    (ap, an), (bp, bn) = pct(*a), pct(*b)
    if paired and (len(ap) != len(bp) or len(an) != len(bn)):
        raise ValueError("a paired AUC test needs the same units in both runs")
    f = chance_advantage if advantage else (lambda x: x)
    pos_pool, neg_pool = np.r_[ap, bp], np.r_[an, bn]

    def statistic(pos_x, neg_x):  # side x against side y of each split
        auc_x, auc_y = _split_aucs(pos_pool, neg_pool, pos_x, neg_x)
        return f(auc_x) - f(auc_y)

    def run_a(n_a, n_b):  # the observed split: run a's units on side x
        return np.r_[np.ones(n_a, bool), np.zeros(n_b, bool)][None]

    obs = float(statistic(run_a(len(ap), len(bp)), run_a(len(an), len(bn)))[0])
    rng = np.random.default_rng(seed)
    nulls = []
    for start in range(0, n_perm, AUC_PERM_CHUNK):  # chunks bound the memory of many permutations
        k = min(AUC_PERM_CHUNK, n_perm - start)
        if paired:  # each unit's two scores swap sides with probability 1/2
            sp, sn = rng.random((k, len(ap))) < 0.5, rng.random((k, len(an))) < 0.5
            pos_x, neg_x = np.c_[~sp, sp], np.c_[~sn, sn]
        else:  # side x takes the first len(a) of a shuffle of both runs' members (non-members)
            pos_x = _first_of_shuffle(rng, k, len(ap), len(bp))
            neg_x = _first_of_shuffle(rng, k, len(an), len(bn))
        nulls.append(statistic(pos_x, neg_x))
    return _p_from_null(obs, np.concatenate(nulls), alternative)


ADVANTAGE = "|AUC - 0.5|"  # what a comparison of two runs' AUCs compares


def chance_advantage(auc):
    """|AUC - 1/2|: how far a membership score is from chance, in either direction.

    An AUC below 1/2 is not less leakage than 1/2: the attacker who reverses the score gets
    1 - AUC. Comparisons of how much two runs leak by an AUC therefore compare this.

    >>> round(chance_advantage(0.3), 6), round(chance_advantage(0.7), 6)
    (0.2, 0.2)
    """
    d = np.abs(np.asarray(auc, dtype=float) - 0.5)
    return d if d.ndim else float(d)


def holm(pvalues) -> list[float]:
    """Holm step-down adjusted p-values (family-wise error control), in the input order."""
    p = np.asarray(list(pvalues), float)
    m = len(p)
    if not m:
        return []
    order = np.argsort(p, kind="stable")
    adj = np.maximum.accumulate((m - np.arange(m)) * p[order])
    out = np.empty(m)
    out[order] = np.minimum(adj, 1.0)
    return [round(float(v), 12) for v in out]


def benjamini_hochberg(pvalues) -> list[float]:
    """Benjamini-Hochberg adjusted p-values (false-discovery-rate control), in the input order."""
    p = np.asarray(list(pvalues), float)
    m = len(p)
    if not m:
        return []
    order = np.argsort(p, kind="stable")
    scaled = p[order] * m / np.arange(1, m + 1)
    adj = np.minimum.accumulate(scaled[::-1])[::-1]
    out = np.empty(m)
    out[order] = np.minimum(adj, 1.0)
    return [round(float(v), 12) for v in out]


CORRECTIONS = {"holm": holm, "benjamini-hochberg": benjamini_hochberg}


# ----------------------------------------------------------------------------- runs vs runs
UNIT_KINDS = ("mean", "binary", "auc")


def aligned(a: dict, b: dict) -> tuple[list[int], list[int]] | None:
    """Indices that put b's units in a's order when both runs hold exactly the same units."""
    ia, ib = [str(x) for x in a["ids"]], [str(x) for x in b["ids"]]
    if len(set(ia)) != len(ia) or set(ia) != set(ib) or len(ia) != len(ib):
        return None
    pos = {u: i for i, u in enumerate(ib)}
    return list(range(len(ia))), [pos[u] for u in ia]


PERMUTATIONS = {"mean": 9999, "auc": 1999}  # compare_units' defaults per kind of unit scores


def compare_units(a: dict, b: dict, *, alternative: str, seed: int = 0, n_perm: int | None = None) -> Test:
    """The test of "run a leaks more (greater) / less / differently than run b" on their units.

    `a` and `b` are per-unit scores of one metric: {"kind": mean | binary | auc, "unit", "ids",
    "values"} (plus "member" flags for auc). Runs sharing all their units get paired tests
    (sign-flip permutation, exact McNemar, paired AUC permutation); otherwise unpaired ones
    (label permutation, Fisher exact, unpaired AUC permutation). `n_perm` overrides the
    permutation count (`PERMUTATIONS`); `p_floor` in the result is the smallest p-value the test
    can return, 1 / (n_perm + 1) for a Monte-Carlo permutation test, None for an exact one.
    """
    _check_alt(alternative)
    k = n_perm or PERMUTATIONS.get(a["kind"], 9999)
    floor: float | None = 1.0 / (k + 1)
    if a["kind"] != b["kind"] or a["kind"] not in UNIT_KINDS:
        raise ValueError(f"cannot compare units of kind {a['kind']} with {b['kind']}")
    kind, al = a["kind"], aligned(a, b)
    va, vb = np.asarray(a["values"], float), np.asarray(b["values"], float)
    if al is not None:
        va, vb = va[al[0]], vb[al[1]]
    if kind == "mean":
        est = float(va.mean() - vb.mean())
        name = "paired sign-flip permutation" if al else "permutation"
        p = (paired_permutation_test(va, vb, alternative=alternative, seed=seed, n_perm=k) if al
             else permutation_test(va, vb, alternative=alternative, seed=seed, n_perm=k))
        if al and 2 ** len(va) <= k:
            floor = None  # every sign pattern: exact
    elif kind == "binary":
        est = float(va.mean() - vb.mean())
        name = "exact McNemar" if al else "Fisher exact"
        p = (mcnemar_exact(va, vb, alternative=alternative) if al
             else fisher_exact(va, vb, alternative=alternative))
        floor = None
    else:
        ma, mb = np.asarray(a["member"], bool), np.asarray(b["member"], bool)
        if al is not None:
            ma, mb = ma[al[0]], mb[al[1]]
            if not (ma == mb).all():
                al = None
        # leakage by an AUC is its distance from chance (an AUC below 1/2 is not "less")
        est = chance_advantage(roc_auc(va[ma], va[~ma])) - chance_advantage(roc_auc(vb[mb], vb[~mb]))
        name = "paired AUC permutation" if al else "AUC permutation"
        p = auc_difference_test((va[ma], va[~ma]), (vb[mb], vb[~mb]), paired=al is not None,
                                alternative=alternative, seed=seed, advantage=True, n_perm=k)
    keys = ("test", "alternative", "paired", "p_value", "estimate", "n_a", "n_b", "unit", "p_floor")
    return Test(name=name, alternative=alternative, paired=al is not None, p_value=float(p),
                estimate=float(est), n_a=len(va), n_b=len(vb), unit=a["unit"], p_floor=floor,
                statistic=ADVANTAGE if kind == "auc" else None,
                keys=keys + (("statistic",) if kind == "auc" else ()))


def compare_seeds(a: list[float], b: list[float], *, alternative: str, seed: int = 0,
                  kind: str = "mean") -> Test:
    """Configurations with several seeds each: a permutation test over the per-seed values
    (per-seed AUCs, `kind` "auc", as their distance from chance)."""
    statistic = None
    if kind == "auc":
        a, b = [chance_advantage(x) for x in a], [chance_advantage(x) for x in b]
        statistic = ADVANTAGE
    keys = ("test", "alternative", "paired", "p_value", "estimate", "n_a", "n_b", "unit")
    return Test(name="permutation over seeds", alternative=alternative, paired=False,
                p_value=permutation_test(a, b, alternative=alternative, seed=seed),
                estimate=float(np.mean(a) - np.mean(b)), n_a=len(a), n_b=len(b), unit="seeds",
                statistic=statistic, keys=(("statistic",) if statistic else ()) + keys)
