"""Privacy-utility-leakage frontiers and the centralized-vs-federated comparison at matched utility.

Every run is one point: its utility (holdout perplexity) and, per headline metric, its leakage.
Each backend's points, ordered by epsilon, form its frontier; the public base model (run.json
``"role": "public-base"``), when present, is the origin every fine-tune starts from. Equal
nominal epsilons are not equal guarantees (one sequence vs one user) and equal epsilons rarely
give equal utility, so the backends are compared between *real runs* whose utilities lie within
a stated tolerance, ``|log(ppl_a / ppl_b)| <= tolerance``. Lines between points are only a visual
guide; no verdict is read off an interpolation. Where no pair is within the tolerance the report
says so and gives no verdict (Thakkar et al. 2020 compare both settings at a given utility).

References:
  Thakkar, Ramaswamy, Mathews, Beaufays. Understanding unintended memorization in federated
  learning. 2020.
  Li, Tramer, Liang, Hashimoto. Large language models can be strong differentially private
  learners. ICLR 2022.

>>> log_ratio(100.0, 110.0) < 0.1
True
"""

from __future__ import annotations

import math
from typing import Any

from memaudit.backends import CENTRALIZED
from memaudit.reports.blocks import (
    Frontier,
    FrontierMetric,
    FrontierOrigin,
    FrontierPoint,
    FrontierSeries,
    MatchedPair,
    MatchedUtility,
    compared,
)
from memaudit.reports.cells import METRICS, TESTABLE, Cell
from memaudit.reports.compare import compare_groups, nominal_epsilon, pool
from memaudit.reports.entries import RunEntry, entries

DEFAULT_TOLERANCE = 0.1
"""Default |log ppl ratio| for a matched-utility pair (about 10% in perplexity)."""

FRONTIER_METRICS = ("exposure_top", "mia_auc", "user_mia_auc", "extraction_exact", "pii_extraction",
                    "canary_completion")
"""Headline metrics drawn on the frontier, in order of preference."""

PUBLIC_BASE = "public-base"


def log_ratio(a: float, b: float) -> float:
    """|log(a / b)|: the utility distance of two runs' perplexities."""
    return abs(math.log(a) - math.log(b))


def check_tolerance(tolerance: float) -> float:
    """The tolerance itself, or a one-line ValueError naming it and the fix."""
    if not (tolerance > 0 and math.isfinite(tolerance)):
        raise ValueError(f"utility tolerance {tolerance} must be a positive |log perplexity ratio|, e.g. 0.1")
    return tolerance


def _ppl(run: RunEntry) -> float | None:
    p = run.utility.holdout_perplexity
    return float(p) if p is not None and math.isfinite(p) and p > 0 else None


def is_base(run: dict[str, Any] | RunEntry) -> bool:
    return RunEntry.of(run).role == PUBLIC_BASE


def series_label(run: dict[str, Any] | RunEntry) -> str:
    """A frontier series: the backend and what changes the curve. ELS runs are their own series
    (ULS, the default per-user algorithm, continues the non-DP run's)."""
    run = RunEntry.of(run)
    lbl = run.backend + (" (ELS)" if run.privacy.user_sampling == "els" else "")
    return lbl + (" + Goldfish" if run.mitigation.goldfish else "") + (
        " + LoRA" if (run.model.trained or "full") != "full" else "")


def _point(run: RunEntry, key: str) -> FrontierPoint:
    c = run.cell(key) or Cell(value=None)
    return FrontierPoint(run=run.id, epsilon=run.privacy.epsilon, unit=run.privacy.unit, perplexity=_ppl(run),
                         value=c.value, ci_low=c.ci_low, ci_high=c.ci_high, n=c.n, n_unit=c.unit, note=c.note,
                         lower_bound=c.lower_bound)


def frontier(runs: list[dict[str, Any] | RunEntry]) -> Frontier:
    """The `Frontier`: the public base's points as its origin (None without a base) and per metric
    its series (`FrontierMetric`: the series, whether every value is 0, how many points).

    A metric appears when at least one real run measured it; `all_zero` marks a metric that is 0
    in every run (plots say "none extracted" instead of a flat panel).
    """
    runs = entries(runs)
    real = [r for r in runs if not r.audit and not is_base(r) and _ppl(r) is not None]
    base = next((r for r in runs if is_base(r) and _ppl(r) is not None), None)
    origin = None
    if base is not None:
        origin = FrontierOrigin(run=base.id, perplexity=_ppl(base),
                                leakage={k: _point(base, k) for k in FRONTIER_METRICS if base.cell(k)})
    metrics = {}
    for key in FRONTIER_METRICS:
        with_value = [r for r in real if r.measured(key)]
        if not with_value:
            continue
        labels = sorted({series_label(r) for r in with_value})
        series = []
        for lbl in labels:
            rs = sorted((r for r in with_value if series_label(r) == lbl),
                        key=lambda r: (r.privacy.epsilon, r.id))  # from the strongest guarantee to no DP
            series.append(FrontierSeries(label=lbl, points=[_point(r, key) for r in rs]))
        metrics[key] = FrontierMetric(label=METRICS[key][0], unit=METRICS[key][1], series=series,
                                      n_points=len(with_value),
                                      all_zero=all(r.cell(key).value == 0 for r in with_value))
    return Frontier(utility="holdout perplexity", origin=origin, metrics=metrics)


def _guarantee(r: RunEntry) -> tuple[float, str | None]:
    """A run's guarantee, for pairing: its nominal epsilon (the level the report groups it at)
    and unit; no DP: inf and no unit."""
    eps = nominal_epsilon(r)
    return (eps, None) if math.isinf(eps) else (eps, r.privacy.unit)


def _pairs(par: list[RunEntry], fed: list[RunEntry], tol: float) -> list[tuple[float, RunEntry, RunEntry]]:
    """One-to-one pairs within `tol`: pairs at equal guarantees (epsilon and unit) first, then the
    rest, each closest first (greedy on the utility distance). A pair at equal guarantees and
    matched utility answers the question; a closer pair at unequal guarantees only stands in
    where no equal one is within `tol`."""
    cand = sorted(((_guarantee(a) != _guarantee(b), log_ratio(_ppl(a), _ppl(b)), a.id, b.id, a, b)
                   for a in par for b in fed), key=lambda t: t[:4])
    used: set[str] = set()
    out = []
    for _, d, ia, ib, a, b in cand:
        if d <= tol and ia not in used and ib not in used:
            used |= {ia, ib}
            out.append((d, a, b))
    return out


def _range_text(rs: list[RunEntry]) -> str:
    ps = sorted(_ppl(r) for r in rs)
    return f"{ps[0]:.4g}" if len(ps) == 1 else f"{ps[0]:.4g}-{ps[-1]:.4g}"


def matched_utility(runs: list[dict[str, Any] | RunEntry], tolerance: float = DEFAULT_TOLERANCE) -> MatchedUtility:
    """Centralized vs federated between real runs whose perplexities lie within `tolerance`.

    Returns its `MatchedUtility` (tolerance, pairs, closest, status, message): status 'pairs' (each pair with
    a two-sided test per metric, adjusted with every other test of the report), 'no pair' (the
    utility ranges overlap but no two runs are within the tolerance), 'disjoint' (the ranges lie
    further apart than the tolerance) or 'no runs' (a backend has no run with a utility).
    """
    check_tolerance(tolerance)
    real = [r for r in entries(runs) if not r.audit and not is_base(r) and not r.mitigation.goldfish
            and _ppl(r) is not None]
    par = [r for r in real if r.backend == CENTRALIZED]
    fed = [r for r in real if r.backend == "federated"]
    if not par or not fed:
        missing = "centralized" if not par else "federated"
        return MatchedUtility(tolerance=tolerance, pairs=[], closest=None, status="no runs",
                              message=f"no {missing} run with a holdout perplexity; no matched-utility comparison")
    d, a, b = min(((log_ratio(_ppl(a), _ppl(b)), a, b) for a in par for b in fed), key=lambda t: t[0])
    pairs = []
    metrics = [k for k in METRICS if TESTABLE.get(k, True)]
    for dist, pa_run, pf_run in _pairs(par, fed, tolerance):
        cells = {}
        for key in metrics:
            pa, pf = pool([pa_run.cell(key)]), pool([pf_run.cell(key)])
            if pa and pf:
                cells[key] = compared((CENTRALIZED, pa), ("federated", pf),
                                      compare_groups([pf_run], [pa_run], key, "two-sided"))
        pairs.append(MatchedPair(runs=[pa_run.id, pf_run.id], log_ratio=dist,
                                 perplexity=[_ppl(pa_run), _ppl(pf_run)],
                                 epsilon=[pa_run.privacy.epsilon, pf_run.privacy.epsilon],
                                 units=[pa_run.privacy.unit, pf_run.privacy.unit], metrics=cells))
    out = MatchedUtility(tolerance=tolerance, pairs=pairs,
                         closest={"runs": [a.id, b.id], "log_ratio": d, "perplexity": [_ppl(a), _ppl(b)]})
    if pairs:
        n = len(pairs)
        return out.replace(status="pairs",
                           message=f"{n} run pair{'s' if n > 1 else ''} within |log perplexity ratio| <= {tolerance:g}")
    lo_p, hi_p = min(map(_ppl, par)), max(map(_ppl, par))
    lo_f, hi_f = min(map(_ppl, fed)), max(map(_ppl, fed))
    gap = max(math.log(lo_f) - math.log(hi_p), math.log(lo_p) - math.log(hi_f))
    closest = (f"closest: {a.id} vs {b.id}, perplexity {_ppl(a):.4g} vs {_ppl(b):.4g}, "
               f"|log ratio| = {d:.3g}")
    if gap > tolerance:
        return out.replace(status="disjoint",
                           message=(f"no run pair within |log perplexity ratio| <= {tolerance:g}; no verdict: the "
                            f"utilities lie too far apart (centralized perplexity {_range_text(par)}, "
                                    f"federated {_range_text(fed)}; {closest})"))
    return out.replace(status="no pair",
                       message=(f"no run pair within |log perplexity ratio| <= {tolerance:g}; no verdict "
                                f"({closest}; the frontier lines are a visual guide only)"))
