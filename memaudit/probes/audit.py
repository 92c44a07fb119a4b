"""One-run ε audit (Steinke, Nasr, Jagielski 2023).

m audit canaries are each included in training with probability 1/2. After training, each is
scored (here: its log-likelihood under the model), and the auditor guesses "in" for the r/2 most
confident and "out" for the r/2 least confident canaries. If the training algorithm is (ε, δ)-DP,
the number of correct guesses is stochastically dominated by Binomial(r, e^ε / (1 + e^ε)) up to a
δ term; the largest ε whose p-value stays below p is a one-sided lower bound on the true ε at
confidence 1 - p. The most any audit of m canaries can certify at the run's δ is the maximum over
r of the bound with every guess right (v = r): `audit_ceiling(m, delta, p)`. With δ = 0 and a
fixed r that is logit(p^(1/r)) (`ceiling`).

Beside that bound, from the same canary scores (`canary_estimators`):

- the all-thresholds bound: an (ε, δ)-DP algorithm bounds every threshold test of "in" against
  "out" by TPR <= e^ε FPR + δ and TNR <= e^ε FNR + δ; Clopper-Pearson bounds on the rates at every
  threshold of the scores, Bonferroni over all of them, give a one-sided lower bound on ε at
  confidence 1 - p (Jagielski et al. 2020's bound, over every threshold instead of one chosen);
- the Gaussian-DP estimate: if the scores of included and excluded canaries are Gaussian with
  one variance (the trade-off curve of μ-GDP), μ = √2 Φ⁻¹(AUC), and the ε of μ-GDP at the run's δ
  (dp_accounting) is an *estimate*, not a bound; it is 0 when the AUC is not above chance at 95%
  (one-sided DeLong), and its interval maps the AUC's.

References:
  Steinke, Nasr, Jagielski. Privacy Auditing with One (1) Training Run. NeurIPS 2023
  (Algorithm 2 / Theorem 5.2: the p-value with the δ term).
  Jagielski, Ullman, Oprea. Auditing Differentially Private Machine Learning: How Private is
  Private SGD? NeurIPS 2020.
  Dong, Roth, Su. Gaussian Differential Privacy. JRSS B 2022.

>>> round(eps_lower_bound(m=1000, r=100, v=90, delta=1e-5, p=0.05), 3)
1.626
>>> round(ceiling(r=100, p=0.05), 2)
3.49
>>> round(audit_ceiling(m=200, delta=1e-3, p=0.05)["eps"], 2)  # below logit(p^(1/200)) = 4.19
3.57
"""

from __future__ import annotations

import math

import numpy as np

from memaudit.probes.stats import auc_interval, auc_placements


def p_value(m: int, r: int, v: int, eps: float, delta: float) -> float:
    """P[>= v of r guesses correct] for an (ε, δ)-DP algorithm on m canaries (the paper's bound)."""
    # lazy: scipy.stats (~0.3 s) only when called; this module imports without it
    from scipy.stats import binom

    if not 0 <= v <= r <= m:
        raise ValueError(f"need 0 <= v <= r <= m, got v={v}, r={r}, m={m}")
    q = 1.0 / (1.0 + math.exp(-eps))
    beta = float(binom.sf(v - 1, r, q))  # P[Binomial(r, q) >= v]
    # alpha = max_i P[v - i <= Binomial(r, q) < v] / i, the δ term's worst-case spread
    pmf = binom.pmf(np.arange(v - 1, -1, -1), r, q)  # v-1, v-2, ..., 0
    alpha = float(np.max(np.cumsum(pmf) / np.arange(1, v + 1))) if v > 0 else 0.0
    return min(beta + alpha * delta * 2 * m, 1.0)


def eps_lower_bound(
    *, m: int, r: int, v: int, delta: float, p: float = 0.05, iters: int = 40
) -> float:
    """The largest ε with p_value(m, r, v, ε, δ) < p (0 when even ε = 0 is not rejected)."""
    if not 0 < p < 1:
        raise ValueError(f"p must be in (0, 1), got {p}")
    if p_value(m, r, v, 0.0, delta) >= p:
        return 0.0
    lo, hi = 0.0, 1.0
    while p_value(m, r, v, hi, delta) < p:
        lo, hi = hi, hi + 1.0
        if hi > 100:
            return math.inf
    for _ in range(iters):
        mid = (lo + hi) / 2
        if p_value(m, r, v, mid, delta) < p:
            lo = mid
        else:
            hi = mid
    return lo


def ceiling(*, r: int, p: float = 0.05) -> float:
    """logit(p^(1/r)): the most any audit with r guesses (all correct, δ = 0) can show."""
    q = p ** (1.0 / r)
    return math.log(q / (1 - q))


def audit_ceiling(*, m: int, delta: float, p: float = 0.05) -> dict:
    """{"eps", "r"}: the largest lower bound that m canaries can give, max over r of v = r.

    With δ > 0 the δ term (which grows with m) lowers the bound below logit(p^(1/r)), and the
    best r need not be m. A geometric grid of r is scanned, then every r between the best grid
    point's neighbours (checked against a brute-force maximum in the tests).
    """
    if m < 1:
        raise ValueError(f"an audit needs m >= 1 canaries, got m={m}")
    grid = sorted({round(float(x)) for x in np.geomspace(1, m, min(m, 48))} | {1, m})
    vals = {r: eps_lower_bound(m=m, r=r, v=r, delta=delta, p=p) for r in grid}
    best = max(grid, key=lambda r: (vals[r], -r))
    i = grid.index(best)
    lo, hi = grid[max(0, i - 1)], grid[min(len(grid) - 1, i + 1)]
    for r in range(lo, hi + 1):
        if r not in vals:
            vals[r] = eps_lower_bound(m=m, r=r, v=r, delta=delta, p=p)
    best = max(vals, key=lambda r: (vals[r], -r))
    return {"eps": vals[best], "r": best}


def guesses(scores: np.ndarray, included: np.ndarray, r: int) -> tuple[int, int]:
    """(r, v): "in" for the r - r//2 highest scores, "out" for the r//2 lowest; v correct."""
    if not 0 < r <= len(scores):
        raise ValueError(f"audit needs 0 < r <= m, got r={r} with m={len(scores)} canaries")
    order = np.argsort(-scores, kind="stable")
    n_in = r - r // 2
    top, bottom = order[:n_in], order[len(order) - r // 2 :]
    v = int(included[top].sum() + (~included[bottom]).sum())
    return r, v


def all_thresholds_bound(in_scores: np.ndarray, out_scores: np.ndarray, *, delta: float,
                         p: float = 0.05) -> dict:
    """One-sided lower bound on ε at confidence 1 - p from every threshold of the scores (higher:
    "in"), both directions, Clopper-Pearson with Bonferroni over all the one-sided bounds."""
    # lazy: scipy.stats (~0.3 s) only when called; this module imports without it
    from scipy.stats import beta

    ins, outs = np.sort(np.asarray(in_scores, float)), np.sort(np.asarray(out_scores, float))
    n1, n0 = len(ins), len(outs)
    if not n1 or not n0:
        raise ValueError("the all-thresholds bound needs included and excluded canaries")
    thr = np.unique(np.r_[ins, outs])
    tp = n1 - np.searchsorted(ins, thr, "left")  # scores >= t called "in"
    fp = n0 - np.searchsorted(outs, thr, "left")
    tn, fn = n0 - fp, n1 - tp
    q = p / (4 * len(thr))  # two rates a direction, two directions, every threshold

    def lower(k, n):
        return np.where(k > 0, beta.ppf(q, np.maximum(k, 1), n - k + 1), 0.0)

    def upper(k, n):
        return np.where(k < n, beta.ppf(1 - q, k + 1, np.maximum(n - k, 1)), 1.0)

    with np.errstate(divide="ignore", invalid="ignore"):
        e1 = np.log(np.maximum(lower(tp, n1) - delta, 0)) - np.log(upper(fp, n0))
        e2 = np.log(np.maximum(lower(tn, n0) - delta, 0)) - np.log(upper(fn, n1))
    best = float(np.nanmax(np.r_[e1, e2, 0.0]))
    return {"eps": max(best, 0.0), "kind": "one-sided lower bound", "confidence": 1 - p,
            "thresholds": len(thr), "method": "all thresholds, Clopper-Pearson, Bonferroni"}


def gdp_epsilon(mu: float, delta: float) -> float:
    """ε of μ-GDP at δ: the Gaussian mechanism with noise 1/μ (dp_accounting); 0 at μ = 0."""
    # lazy: dp_accounting (~1.5 s) only when called; this module imports without it
    import dp_accounting

    if mu <= 0:
        return 0.0
    return float(dp_accounting.get_epsilon_gaussian(1.0 / mu, delta))


def gdp_estimate(in_scores: np.ndarray, out_scores: np.ndarray, *, delta: float,
                 level: float = 0.95) -> dict:
    """The ε estimate under μ-GDP from the canaries' AUC (see the module's text), with the
    interval the AUC's DeLong interval maps to."""
    # lazy: scipy.stats (~0.3 s) only when called; this module imports without it
    from scipy.stats import norm


    v10, v01 = auc_placements(in_scores, out_scores)
    auc = float(np.mean(v10))
    lo, hi = auc_interval(v10, v01, level=1 - 2 * (1 - level))  # its lower end: one-sided at `level`
    def mu(a: float) -> float:
        return max(0.0, math.sqrt(2) * float(norm.ppf(min(max(a, 1e-12), 1 - 1e-12))))

    above_chance = lo > 0.5
    return {"eps": gdp_epsilon(mu(auc), delta) if above_chance else 0.0,
            "ci_low": gdp_epsilon(mu(lo), delta), "ci_high": gdp_epsilon(mu(hi), delta),
            "mu": mu(auc) if above_chance else 0.0, "auc": auc, "kind": "estimate",
            "assumes": "mu-GDP: Gaussian scores of one variance", "ci_level": 1 - 2 * (1 - level)}


def run_audit(
    scores: np.ndarray,
    included: np.ndarray,
    ids: list[str],
    *,
    r_grid: tuple[int, ...],
    delta: float,
    p: float = 0.05,
    ledger_eps: float | None = None,
) -> dict:
    """Audit over a grid of r with a Bonferroni correction (p / len(grid)); the best bound wins.

    The summary's `eps_lower_bound` is a one-sided lower bound at `confidence` = 1 - p; `ceiling`
    is the most that m canaries can certify at this δ (and p / len(grid)), maximised over r, and
    `ceiling_at_r` the most at the chosen r.
    """
    m = len(scores)
    included = np.asarray(included, dtype=bool)
    grid = [r for r in r_grid if 0 < r <= m] or [m]
    p_each = p / len(grid)
    rows = []
    for r in grid:
        r, v = guesses(scores, included, r)
        rows.append(
            {
                "r": r,
                "v": v,
                "eps_lower_bound": eps_lower_bound(m=m, r=r, v=v, delta=delta, p=p_each),
                "ceiling_at_r": eps_lower_bound(m=m, r=r, v=r, delta=delta, p=p_each),
            }
        )
    best = max(rows, key=lambda row: (row["eps_lower_bound"], row["r"]))  # ties: the largest r
    summary = {
        "eps_lower_bound": best["eps_lower_bound"],
        "r": best["r"],
        "v": best["v"],
        "kind": "one-sided lower bound",
        "confidence": 1 - p,
        "ceiling": audit_ceiling(m=m, delta=delta, p=p_each)["eps"],
        "ceiling_r": audit_ceiling(m=m, delta=delta, p=p_each)["r"],
        "ceiling_at_r": best["ceiling_at_r"],
        "m": m,
        "delta": delta,
        "p": p,
        "bonferroni": len(grid),
        "grid": rows,
        "ledger_eps": ledger_eps,
        "n_included": int(included.sum()),
    }
    if included.any() and (~included).any():
        summary["all_thresholds"] = all_thresholds_bound(scores[included], scores[~included], delta=delta, p=p)
        summary["gdp_estimate"] = gdp_estimate(scores[included], scores[~included], delta=delta, level=1 - p)
    per = [
        {"id": i, "included": bool(inc), "score": float(s)}
        for i, inc, s in zip(ids, included, scores, strict=True)
    ]
    return {"summary": summary, "scores": per}
