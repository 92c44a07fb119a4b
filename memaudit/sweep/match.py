"""Matched-utility points: where to train one backend so that its utility meets the other's.

Equal nominal epsilons rarely give equal utility (an example is a smaller unit than a user), and
the report compares centralized and federated training only between real runs whose holdout
perplexities lie within a tolerance (`memaudit.reports.frontier`). A fixed grid meets that by luck:
DP noise is drawn fresh in every run, and a run's perplexity moves by several percent between
repeats. With `match_utility` the sweep places the pair itself. After the grid, for each target
run (the target backend at a listed epsilon) that no run of the other backend already matches, it
reads the other backend's DP runs of the same model and seed as points (log epsilon, log
perplexity), interpolates linearly between the two levels that bracket the target's perplexity (or
extrapolates from the two nearest, at most `max_factor` beyond the measured epsilons), and trains
and probes one more run there. The interpolation only decides where to train; the report compares
the run it gets, and says so when it lands outside the tolerance.

The epsilon is chosen from other runs' utilities on the same private data. Choosing a
hyperparameter on private data has a privacy cost of its own that no run's ledger counts (Papernot
and Steinke 2022); that is the design of a comparison study, not of a model to release.

References:
  Thakkar, Ramaswamy, Mathews, Beaufays. Understanding unintended memorization in federated
  learning. 2020 (centralized and federated training compared at a given utility).
  Papernot, Steinke. Hyperparameter tuning with Renyi differential privacy. ICLR 2022.

>>> round(interpolate_epsilon([(2.0, 2000.0), (8.0, 1000.0)], 1414.2), 3)
4.0
>>> round(interpolate_epsilon([(2.0, 2000.0), (8.0, 1000.0)], 2500.0), 3)
1.28
>>> interpolate_epsilon([(2.0, 2000.0), (8.0, 1000.0)], 9000.0) is None  # beyond max_factor
True
"""

from __future__ import annotations

import math
from dataclasses import replace
from pathlib import Path
from typing import Any

from memaudit.sweep.config import SweepConfig, SweepPoint, point_name


def interpolate_epsilon(levels: list[tuple[float, float]], target_ppl: float,
                        max_factor: float = 4.0) -> float | None:
    """The epsilon at which log perplexity, piecewise linear in log epsilon through the measured
    `levels` [(epsilon, perplexity)], meets `target_ppl`; None when the levels cannot say (fewer
    than two, no decrease of perplexity with epsilon at the end used, or an epsilon more than
    `max_factor` beyond the measured ones)."""
    pts = sorted((math.log(e), math.log(p)) for e, p in levels
                 if math.isfinite(e) and e > 0 and p is not None and math.isfinite(p) and p > 0)
    if len(pts) < 2 or not (target_ppl > 0 and math.isfinite(target_ppl)):
        return None
    y = math.log(target_ppl)
    for (x0, y0), (x1, y1) in zip(pts, pts[1:], strict=False):
        if y0 != y1 and min(y0, y1) <= y <= max(y0, y1):
            return math.exp(x0 + (y - y0) * (x1 - x0) / (y1 - y0))
    # outside the measured range: extend the end segment on the target's side
    (x0, y0), (x1, y1) = pts[:2] if y > max(p[1] for p in pts) else pts[-2:]
    slope = (y1 - y0) / (x1 - x0)
    if not slope < 0:  # perplexity does not fall with epsilon there: no line to follow
        return None
    x = x0 + (y - y0) / slope
    lo, hi = pts[0][0] - math.log(max_factor), pts[-1][0] + math.log(max_factor)
    return math.exp(x) if lo <= x <= hi else None


def _perplexity(run_dir: Path) -> float | None:
    """A complete run's final holdout perplexity from its manifest, or None."""
    from memaudit.rundir import RunDir

    rd = RunDir(run_dir)
    if not rd.is_run() or rd.status() != "complete":
        return None
    p = (rd.read_manifest().get("result") or {}).get("final_holdout_perplexity")
    return float(p) if isinstance(p, int | float) and math.isfinite(p) and p > 0 else None


def _eps(p: SweepPoint) -> float:
    return math.inf if p.level is None else float(p.level)


def _comparable(p: SweepPoint) -> bool:
    return p.level_kind == "epsilon" and not p.audit and not p.goldfish and p.matches is None


def plan_matches(cfg: SweepConfig, points: list[SweepPoint], out: Path
                 ) -> tuple[list[SweepPoint], list[dict[str, Any]]]:
    """The matched-utility points to train after `points` (complete under `out/runs/`), and one
    record per target: the epsilon chosen from which runs, or why no point was planned."""
    m = cfg.match_utility
    other = "parallel" if m.target_backend == "federated" else "federated"
    runs = out / "runs"
    comp = [p for p in points if _comparable(p)]
    ppl = {p.name: _perplexity(runs / p.name) for p in comp}
    finite = list(dict.fromkeys(_eps(p) for p in comp  # the grid's order
                                if p.backend == m.target_backend and math.isfinite(_eps(p))))
    levels = finite if m.levels is None else [float(v) for v in m.levels]
    taken = {p.name for p in points}
    extra: list[SweepPoint] = []
    records: list[dict[str, Any]] = []
    for lvl in levels:
        targets = [p for p in comp if p.backend == m.target_backend and _eps(p) == lvl]
        if not targets:
            records.append({"target": f"{m.target_backend} at epsilon {lvl:g}", "point": None,
                            "reason": "no such grid point (the grid lacks this level or backend)"})
        for t in targets:
            rec: dict[str, Any] = {"target": t.name, "target_perplexity": ppl[t.name], "point": None}
            records.append(rec)
            side = [p for p in comp if p.backend == other and p.model == t.model and p.seed == t.seed]
            if ppl[t.name] is None or not side:
                rec["reason"] = ("the target run is not complete" if ppl[t.name] is None
                                 else f"no {other} run of the same model and seed")
                continue
            near = [(abs(math.log(ppl[p.name]) - math.log(ppl[t.name])), p.name) for p in side
                    if ppl[p.name] is not None]
            if near and min(near)[0] <= m.tolerance:
                rec["reason"] = f"already matched by {min(near)[1]} (|log ratio| {min(near)[0]:.3g})"
                continue
            dp = [p for p in side if math.isfinite(_eps(p)) and ppl[p.name] is not None]
            rec["from"] = {p.name: [_eps(p), ppl[p.name]] for p in dp}
            eps = interpolate_epsilon([(_eps(p), ppl[p.name]) for p in dp], ppl[t.name], m.max_factor)
            if eps is None:
                rec["reason"] = (f"the {other} DP runs do not reach this perplexity within a factor "
                                 f"{m.max_factor:g} of their epsilons")
                continue
            eps = float(f"{eps:.3g}")
            template = min(dp, key=lambda p: abs(math.log(_eps(p)) - math.log(eps)))
            name = point_name(other, t.model, eps, "epsilon", t.seed)
            rec.update(epsilon=eps, point=name)
            if name in taken:
                rec["reason"] = "the interpolated epsilon is already a point"
                continue
            taken.add(name)
            extra.append(replace(template, name=name, level=eps, matches=t.name,
                                 overrides={**template.overrides, "privacy.target_epsilon": eps}))
    return extra, records


def match_line(rec: dict[str, Any]) -> str:
    """One line for the terminal: the point a target got, or why it got none."""
    ppl = rec.get("target_perplexity")
    head = f"matched utility: {rec['target']}" + (f" (holdout perplexity {ppl:.4g})" if ppl else "")
    if rec.get("point") and not rec.get("reason"):
        return f"{head}: {rec['point']} trained at epsilon {rec['epsilon']:g}, interpolated from " \
               f"{', '.join(rec.get('from') or {})}"
    return f"{head}: no point ({rec.get('reason')})"
