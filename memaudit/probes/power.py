"""What a comparison without a finding could have seen: the minimum detectable effect.

"No difference shown" is not "no difference": a test on few units misses large effects. For each
test `memaudit.probes.stats.compare_units` makes, `minimum_detectable_effect` gives the smallest
true difference, in the metric's own units, that the same test on the same number of units would
find with probability `power` (80% by default) at level `alpha` (the report passes the strictest
Holm step, alpha / m over its m tests, so the effect would pass the correction whatever the other
tests say). The variance comes from the units themselves:

- means (exposure in bits), paired sign-flip or label permutation: the Normal approximation
  (z_{1-a} + z_{power}) * SE of the difference of means, SE from the paired differences or from
  both samples;
- AUCs (membership, user inference), paired or unpaired AUC permutation on |AUC - 1/2|: the
  test's statistic folds at chance, so its power is simulated from the two AUCs' joint Normal law
  with DeLong's variances and covariance (where the runs share units), in AUC points of distance
  from chance;
- 0/1 rates (extraction, canary completion, PII), exact McNemar: the power of the exact
  conditional test computed exactly (discordant pairs Binomial(n, 2r + d), those towards the
  alternative Binomial(D, (r + d) / (2r + d)), r the observed rate of discordance against it), so a
  rate of 0 in both runs, the usual case, gets the exact answer the Normal approximation misses;
  Fisher's exact test (runs without shared units): the arcsine Normal approximation.

Each formula is checked against a simulation of the test itself in tests/probes/test_power.py.

References:
  Cohen. Statistical Power Analysis for the Behavioral Sciences (2nd ed., ch. 6, arcsine h).
  Erlbaum 1988.
  DeLong, DeLong, Clarke-Pearson. Comparing the areas under two or more correlated ROC curves.
  Biometrics 1988.
  Connor. Sample size for testing differences in proportions for the paired-sample design.
  Biometrics 1987.

>>> import numpy as np
>>> rng = np.random.default_rng(0)
>>> a = {"kind": "mean", "unit": "canaries", "ids": list(range(40)), "values": rng.normal(0, 1, 40)}
>>> b = {**a, "values": a["values"] + rng.normal(0, 1, 40)}
>>> round(minimum_detectable_effect(a, b, alternative="greater", alpha=0.05)["value"], 2)
0.43
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from memaudit.probes.stats import ALTERNATIVES, aligned, auc_placements

POWER = 0.8
EFFECT_UNITS = {"mean": None, "auc": "AUC points", "binary": "rate"}
"""The unit a minimum detectable effect is stated in (None: the metric's own, e.g. bits)."""


def _z(alpha: float, alternative: str, power: float) -> float:
    from scipy.stats import norm  # lazy: scipy.stats (~0.3 s) only when a report is built

    side = alpha / 2 if alternative == "two-sided" else alpha
    return float(norm.ppf(1 - side) + norm.ppf(power))


def _paired(a: dict, b: dict) -> tuple[np.ndarray, np.ndarray, Any]:
    """Both runs' values, in one unit order when the runs share their units, and that
    alignment (`memaudit.probes.stats.aligned`; None: independent units)."""
    va, vb = np.asarray(a["values"], float), np.asarray(b["values"], float)
    al = aligned(a, b)
    if al is None:
        return va, vb, None
    return va[al[0]], vb[al[1]], al


def _se_means(va: np.ndarray, vb: np.ndarray, paired: bool) -> float:
    if paired:
        return float(np.std(va - vb, ddof=1) / math.sqrt(len(va))) if len(va) > 1 else math.inf
    if len(va) < 2 or len(vb) < 2:
        return math.inf
    return math.sqrt(np.var(va, ddof=1) / len(va) + np.var(vb, ddof=1) / len(vb))


def _auc_moments(a: dict, b: dict, va: np.ndarray, vb: np.ndarray,
                 al: Any) -> tuple[float, float, float, float]:
    """(AUC of b, var AUC(a), var AUC(b), their covariance) by DeLong's placements, from the
    values `_paired` aligned; the covariance is 0 unless the runs share their members and
    non-members."""
    ma, mb = np.asarray(a["member"], bool), np.asarray(b["member"], bool)
    paired = al is not None
    if paired:
        ma, mb = ma[al[0]], mb[al[1]]
        paired = bool((ma == mb).all())
    pa, pb = auc_placements(va[ma], va[~ma]), auc_placements(vb[mb], vb[~mb])
    if min(len(pa[0]), len(pa[1]), len(pb[0]), len(pb[1])) < 2:
        return float(np.mean(pb[0])) if len(pb[0]) else 0.5, math.inf, math.inf, 0.0

    def var(x: np.ndarray) -> float:
        return float(np.var(x, ddof=1) / len(x))

    cov = 0.0
    if paired:
        cov = float(np.cov(pa[0], pb[0])[0, 1] / len(pa[0]) + np.cov(pa[1], pb[1])[0, 1] / len(pa[1]))
    return float(np.mean(pb[0])), var(pa[0]) + var(pa[1]), var(pb[0]) + var(pb[1]), cov


def _mde_auc(a: dict, b: dict, paired: tuple, alpha: float, alternative: str, power: float) -> float:
    """The test compares the AUCs' distances from chance, |AUC - 1/2|, which folds near chance;
    its power is simulated from the two AUCs' joint Normal law (DeLong's moments): run b at its
    observed distance, run a `d` further from chance (greater, two-sided) or nearer (less), the
    critical value from the same law with both runs at their mean distance, as the permutation
    null puts them. Common random numbers over `d`."""
    auc_b, var_a, var_b, cov = _auc_moments(a, b, *paired)
    if not math.isfinite(var_a + var_b):
        return math.inf
    side = alpha / 2 if alternative == "two-sided" else alpha
    draws = int(min(max(100_000, 50 / side), 2_000_000))
    cov_m = np.array([[var_a, cov], [cov, var_b]]) + 1e-15 * np.eye(2)
    w, v = np.linalg.eigh(cov_m)
    err = (v * np.sqrt(np.clip(w, 0, None))) @ np.random.default_rng(0).standard_normal((2, draws))
    base = abs(auc_b - 0.5)

    def stat(adv_a: float, adv_b: float) -> np.ndarray:
        t = np.abs(adv_a + err[0]) - np.abs(adv_b + err[1])
        return -t if alternative == "less" else (np.abs(t) if alternative == "two-sided" else t)

    sign, top = (-1.0, base) if alternative == "less" else (1.0, 0.5 - base)

    def pw(d: float) -> float:
        # the permutation null exchanges the runs' units: both AUCs at their mean distance
        mid = base + sign * d / 2
        crit = float(np.quantile(stat(mid, mid), 1 - side))
        return float(np.mean(stat(base + sign * d, base) > crit))

    if top <= 0 or pw(top) < power:
        return math.inf
    lo, hi = 0.0, top
    for _ in range(30):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if pw(mid) < power else (lo, mid)
    return hi


def _mcnemar_power(n: int, r: float, d: float, alpha: float, alternative: str) -> float:
    """Exact power of the exact McNemar test: n pairs, discordance r against the alternative and
    r + d towards it."""
    # lazy: scipy.stats (~0.3 s) only when called; this module imports without it
    from scipy.stats import binom

    side = alpha / 2 if alternative == "two-sided" else alpha
    total = 2 * r + d
    if total <= 0:
        return 0.0
    dd = np.arange(n + 1)
    p_d = binom.pmf(dd, n, min(total, 1.0))
    # for each number D of discordant pairs, the smallest count k towards the alternative that
    # rejects: P(X >= k | D, 1/2) <= side, i.e. k - 1 = the (1 - side) quantile
    k = binom.ppf(1 - side, dd, 0.5) + 1
    return float(np.sum(p_d * binom.sf(k - 1, dd, (r + d) / total)))


def _mde_mcnemar(va: np.ndarray, vb: np.ndarray, alpha: float, alternative: str, power: float) -> float:
    n = len(va)
    a, b = va.astype(bool), vb.astype(bool)
    # discordance against the direction the test looks for stays at its observed rate
    against = (~a & b) if alternative != "less" else (a & ~b)
    r = float(against.mean())
    lo, hi = 0.0, 1.0 - 2 * r
    if hi <= 0 or _mcnemar_power(n, r, hi, alpha, alternative) < power:
        return math.inf
    for _ in range(40):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if _mcnemar_power(n, r, mid, alpha, alternative) < power else (lo, mid)
    return hi


def _mde_two_rates(va: np.ndarray, vb: np.ndarray, z: float) -> float:
    """Arcsine (Cohen's h) Normal approximation for two independent rates, from the pooled rate."""
    p0 = float(np.r_[va, vb].mean())
    h = z * math.sqrt(1 / len(va) + 1 / len(vb))
    phi = math.asin(math.sqrt(p0)) + h / 2
    if phi >= math.pi / 2:
        return math.inf
    return math.sin(phi) ** 2 - p0


def minimum_detectable_effect(a: dict, b: dict, *, alternative: str, alpha: float,
                              power: float = POWER) -> dict[str, Any]:
    """The smallest difference between runs `a` and `b` (per-unit scores as `compare_units`
    takes them) that their test would find with probability `power` at level `alpha`:
    {"value", "unit" (None: the metric's), "power", "alpha", "method"}; value inf when no
    difference within the metric's range would be found."""
    if alternative not in ALTERNATIVES:
        raise ValueError(f"alternative '{alternative}' is not one of {', '.join(ALTERNATIVES)}")
    if not 0 < alpha < 1 or not 0 < power < 1:
        raise ValueError(f"alpha {alpha} and power {power} must lie in (0, 1)")
    kind = a["kind"]
    z = _z(alpha, alternative, power)
    va, vb, al = _paired(a, b)
    paired = al is not None
    if kind == "mean":
        value, method = z * _se_means(va, vb, paired), "normal approximation"
    elif kind == "auc":
        value, method = _mde_auc(a, b, (va, vb, al), alpha, alternative, power), "simulated from DeLong's moments"
    elif kind == "binary" and paired:
        value, method = _mde_mcnemar(va, vb, alpha, alternative, power), "exact McNemar power"
    elif kind == "binary":
        value, method = _mde_two_rates(va, vb, z), "arcsine normal approximation"
    else:
        raise ValueError(f"no minimum detectable effect for units of kind {kind}")
    return {"value": float(value), "unit": EFFECT_UNITS.get(kind), "power": power, "alpha": alpha,
            "method": method}
