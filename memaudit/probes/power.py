"""What a comparison without a finding could have seen: the minimum detectable effect.

"No difference shown" is not "no difference": a test on few units misses large effects. For each
test `memaudit.probes.stats.compare_units` makes, `minimum_detectable_effect` gives the smallest
true difference, in the metric's own units, that the same test on the same number of units would
find with probability `power` (80% by default) at level `alpha` (the report passes the strictest
Holm step, alpha / m over its m tests, so the effect would pass the correction whatever the other
tests say). The variance comes from the units themselves:

- means (exposure in bits), paired sign-flip permutation: simulated through the test itself.
  The paired differences are drawn Normal with their observed standard deviation around a true
  difference d, the sign-flip test is run on each draw as the report runs it (every sign pattern
  for up to `EXACT_UNITS` units, else Monte-Carlo sign patterns as many as the test would draw),
  and d is found by bisection (common random numbers) where its power reaches `power` (above
  `SIM_UNITS` units, the limit where the test is a t-test with a critical value of its own). A
  sign-flip p-value is at least 2^-n (one-sided; 2^(1-n) two-sided): where that floor, or the
  Monte-Carlo floor 1 / (B + 1) of a test that would not draw more, lies above `alpha`, no
  difference is detectable and the value is inf. The Normal approximation (z_{1-a} + z_{power})
  * SE, which ignores the floor and the resolution of the permutation distribution, stated
  effects the test found a third of the time at 16 canaries (issue 68);
- means of independent units, label permutation: the Normal approximation above, with the
  floor 1 / C(n_a + n_b, n_a) of a label shuffle;
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
  Efron. Student's t-test under symmetry conditions. JASA 1969.

>>> import numpy as np
>>> rng = np.random.default_rng(0)
>>> a = {"kind": "mean", "unit": "canaries", "ids": list(range(40)), "values": rng.normal(0, 1, 40)}
>>> b = {**a, "values": a["values"] + rng.normal(0, 1, 40)}
>>> round(minimum_detectable_effect(a, b, alternative="greater", alpha=0.05)["value"], 2)
0.43
>>> few = {**a, "ids": list(range(10)), "values": a["values"][:10]}
>>> minimum_detectable_effect(few, {**few, "values": b["values"][:10]}, alternative="greater",
...                           alpha=0.05 / 66)["value"]  # 2^-10 > alpha: no difference reachable
inf
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from memaudit.probes.stats import ALTERNATIVES, PERMUTATIONS, aligned, auc_placements

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


EXACT_UNITS = 13
"""Up to this many paired units the simulated sign-flip test enumerates every sign pattern."""
SIM_UNITS = 64  # above: the self-normalized statistic's Normal limit (`_mde_selfnormalized`)
SIM_DATASETS = 400  # simulated data sets per power evaluation of the sign-flip test
SIM_PATTERNS = 2**15  # at most this many Monte-Carlo sign patterns per simulated test
FLOOR_MARGIN = 10
"""A permutation test whose floor would decide is re-run with FLOOR_MARGIN / alpha permutations
(`memaudit.reports.findings._refine_floors`; alpha there is the family's alpha / family)."""


def signflip_floor(n: int, alternative: str) -> float:
    """The smallest p-value the paired sign-flip test can return on n units: one sign pattern of
    2^n (the observed one) for a one-sided test, two (it and its mirror) for a two-sided one."""
    return (2.0 if alternative == "two-sided" else 1.0) * 2.0 ** -n


def permutations_at(alpha: float, n_perm: int | None) -> int:
    """The Monte-Carlo permutations the test would draw at level `alpha`: `n_perm` (default
    `PERMUTATIONS["mean"]`), raised to FLOOR_MARGIN / alpha where its floor 1 / (n_perm + 1) would
    keep it from reaching `alpha` -- as the report re-runs such a test
    (`memaudit.reports.findings._refine_floors`). An explicit `n_perm` is taken as it is."""
    if n_perm is not None:
        return n_perm
    b = PERMUTATIONS["mean"]
    return b if 1.0 / (b + 1) < alpha else math.ceil(FLOOR_MARGIN / alpha)


def _signflip_power(d: float, sd: float, z: np.ndarray, signs: np.ndarray | None, exact: bool,
                    alpha: float, two_sided: bool) -> float:
    """Power of the sign-flip test of mean > 0 (|mean| for two-sided) on data sets d + sd * z
    (rows of z), with the null from `signs` (rows of +-1: every pattern, or Monte-Carlo ones)."""
    x = d + sd * z  # (datasets, n)
    obs = x.sum(axis=1)
    null = x @ signs.T  # (datasets, patterns)
    eps = 1e-12 * np.maximum(1.0, np.abs(obs))[:, None]
    if two_sided:
        k = (np.abs(null) >= np.abs(obs)[:, None] - eps).sum(axis=1)
    else:
        k = (null >= obs[:, None] - eps).sum(axis=1)
    p = k / signs.shape[0] if exact else (k + 1) / (signs.shape[0] + 1)
    return float(np.mean(p <= alpha * (1 + 1e-9)))


def _mde_signflip(diff: np.ndarray, alpha: float, alternative: str, power: float,
                  n_perm: int | None) -> float:
    """The sign-flip test's minimum detectable effect, simulated (module docstring)."""
    n = len(diff)
    b = permutations_at(alpha, n_perm)
    exact = 2**n <= max(b, 2**EXACT_UNITS) if n_perm is None else 2**n <= b  # as the test decides
    floor = signflip_floor(n, alternative) if exact else max(signflip_floor(n, alternative), 1.0 / (b + 1))
    if n < 2 or floor > alpha * (1 + 1e-9):
        return math.inf
    sd = float(np.std(diff, ddof=1))
    if sd == 0.0:  # every unit moved alike: any difference gives the floor, which reaches alpha
        return 0.0
    if n > SIM_UNITS:
        return _mde_selfnormalized(n, sd, alpha, alternative, power)
    rng = np.random.default_rng(0)
    z = rng.standard_normal((SIM_DATASETS, n))
    if exact:
        signs = 1.0 - 2 * ((np.arange(2**n)[:, None] >> np.arange(n)) & 1)
    else:
        signs = rng.choice(np.array([-1.0, 1.0]), (min(b, SIM_PATTERNS), n))
        if b > SIM_PATTERNS:  # fewer patterns than the test: keep its level's resolution
            alpha = max(alpha, 1.0 / (SIM_PATTERNS + 1))
    two = alternative == "two-sided"

    def pw(d: float) -> float:
        return _signflip_power(d, sd, z, signs, exact, alpha, two)

    hi = _z(alpha, alternative, power) * sd / math.sqrt(n)  # the Normal approximation's answer
    while pw(hi) < power:
        hi *= 2
        if hi > 1e3 * sd:  # power stays below the target: the floor sits at the level's edge
            return math.inf
    lo = 0.0
    for _ in range(10):  # hi / 1024
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if pw(mid) < power else (lo, mid)
    return hi


def _mde_selfnormalized(n: int, sd: float, alpha: float, alternative: str, power: float) -> float:
    """Many units: the sign-flip test rejects where sum(d) / sqrt(sum(d^2)) exceeds the Normal
    quantile c, i.e. where the t statistic exceeds c sqrt((n - 1) / (n - c^2)); its power on
    Normal differences is the noncentral t's (Efron 1969: the self-normalized sum and t)."""
    # lazy: scipy (~0.3 s) only when a report is built; this module imports without it
    from scipy.optimize import brentq
    from scipy.stats import nct, norm

    c = float(norm.ppf(1 - (alpha / 2 if alternative == "two-sided" else alpha)))
    if c * c >= n:
        return math.inf
    t_c = c * math.sqrt((n - 1) / (n - c * c))
    nc = brentq(lambda x: float(nct.sf(t_c, n - 1, x)) - power, 0.0, t_c + 40.0)
    return nc * sd / math.sqrt(n)


def _mde_two_means(va: np.ndarray, vb: np.ndarray, alpha: float, alternative: str, power: float,
                   n_perm: int | None) -> float:
    """Independent units: the Normal approximation, inf below the label shuffle's floor."""
    na, nb = len(va), len(vb)
    log_shuffles = math.lgamma(na + nb + 1) - math.lgamma(na + 1) - math.lgamma(nb + 1)
    floor = math.exp(-log_shuffles) * (2 if alternative == "two-sided" else 1)
    if n_perm is not None:
        floor = max(floor, 1.0 / (n_perm + 1))
    if floor > alpha * (1 + 1e-9):
        return math.inf
    return _z(alpha, alternative, power) * _se_means(va, vb, paired=False)


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
                              power: float = POWER, n_perm: int | None = None) -> dict[str, Any]:
    """The smallest difference between runs `a` and `b` (per-unit scores as `compare_units`
    takes them) that their test would find with probability `power` at level `alpha`:
    {"value", "unit" (None: the metric's), "power", "alpha", "method"}; value inf when no
    difference within the metric's range would be found, as where the test's smallest p-value
    lies above `alpha`. `n_perm`: the Monte-Carlo permutations of the test; None, as many as the
    report would draw at this level (`test_permutations`)."""
    if alternative not in ALTERNATIVES:
        raise ValueError(f"alternative '{alternative}' is not one of {', '.join(ALTERNATIVES)}")
    if not 0 < alpha < 1 or not 0 < power < 1:
        raise ValueError(f"alpha {alpha} and power {power} must lie in (0, 1)")
    kind = a["kind"]
    z = _z(alpha, alternative, power)
    va, vb, al = _paired(a, b)
    paired = al is not None
    if kind == "mean" and paired:
        value = _mde_signflip(va - vb, alpha, alternative, power, n_perm)
        method = "simulated sign-flip test"
    elif kind == "mean":
        value, method = _mde_two_means(va, vb, alpha, alternative, power, n_perm), "normal approximation"
    elif kind == "auc":
        value = _mde_auc(a, b, (va, vb, al), alpha, alternative, power)
        if paired and signflip_floor(len(va), alternative) > alpha * (1 + 1e-9):
            value = math.inf  # the paired AUC permutation swaps units: its floor is a sign flip's
        method = "simulated from DeLong's moments"
    elif kind == "binary" and paired:
        value, method = _mde_mcnemar(va, vb, alpha, alternative, power), "exact McNemar power"
    elif kind == "binary":
        value, method = _mde_two_rates(va, vb, z), "arcsine normal approximation"
    else:
        raise ValueError(f"no minimum detectable effect for units of kind {kind}")
    return {"value": float(value), "unit": EFFECT_UNITS.get(kind), "power": power, "alpha": alpha,
            "method": method}
