"""Matched-utility points: where to train one backend so that its utility meets the other's.

Equal nominal epsilons rarely give equal utility (an example is a smaller unit than a user), and
the report compares centralized and federated training only between real runs whose holdout
perplexities lie within a tolerance (`memaudit.reports.frontier`). A fixed grid meets that by luck:
DP noise is drawn fresh in every run, and a run's perplexity moves by several percent between
repeats. With `match_utility` the sweep places the pair itself. After the grid, for each target
run (the target backend at a listed epsilon) that no DP run of the other backend already matches, it
reads the other backend's DP runs of the same model and seed as points (log noise multiplier, log
perplexity), interpolates linearly between the two that bracket the target's perplexity (or
extrapolates from the two nearest, at most `max_factor` beyond the measured noise multipliers),
and trains and probes one more run at that noise multiplier; its epsilon is what its ledger says.

The noise multiplier, not epsilon, is what sets a DP run's utility: on the quickstart's centralized
runs log perplexity rose with log sigma at slopes 0.70, 0.46 and 0.66 between neighbouring
levels, while its slope in log epsilon doubled below epsilon = 2 (0.26, 0.18, 0.38), where a
point extrapolated in epsilon landed at perplexity 3,388 for a target of 2,676 (measured). The
interpolation only decides where to train; the report compares the run it gets, and pairs it only
if it lands within the tolerance.

The noise level is chosen from other runs' utilities on the same private data. Choosing a
hyperparameter on private data has a privacy cost of its own that no run's ledger counts (Papernot
and Steinke 2022); that is the design of a comparison study, not of a model to release.

References:
  Thakkar, Ramaswamy, Mathews, Beaufays. Understanding unintended memorization in federated
  learning. 2020 (centralized and federated training compared at a given utility).
  Papernot, Steinke. Hyperparameter tuning with Renyi differential privacy. ICLR 2022.

>>> round(interpolate_noise([(0.5, 1000.0), (2.0, 2000.0)], 1414.2), 3)
1.0
>>> round(interpolate_noise([(0.5, 1000.0), (2.0, 2000.0)], 2500.0), 3)
3.125
>>> interpolate_noise([(0.5, 1000.0), (2.0, 2000.0)], 9000.0) is None  # beyond max_factor
True
"""

from __future__ import annotations

import itertools
import math
from dataclasses import replace
from pathlib import Path
from typing import Any

from memaudit.backends import CENTRALIZED, FEDERATED
from memaudit.io import read_json
from memaudit.rundir import RunDir
from memaudit.sweep.config import SweepConfig, SweepPoint, point_name


def interpolate_noise(levels: list[tuple[float, float]], target_ppl: float,
                      max_factor: float = 4.0) -> float | None:
    """The noise multiplier at which log perplexity, piecewise linear in log sigma through the
    measured `levels` [(sigma, perplexity)], meets `target_ppl`; None when the levels cannot say
    (fewer than two, no rise of perplexity with sigma at the end used, or a sigma more than
    `max_factor` beyond the measured ones)."""
    pts = sorted((math.log(s), math.log(p)) for s, p in levels
                 if math.isfinite(s) and s > 0 and p is not None and math.isfinite(p) and p > 0)
    if len(pts) < 2 or not (target_ppl > 0 and math.isfinite(target_ppl)):
        return None
    y = math.log(target_ppl)
    for (x0, y0), (x1, y1) in itertools.pairwise(pts):
        if y0 != y1 and min(y0, y1) <= y <= max(y0, y1):
            return math.exp(x0 + (y - y0) * (x1 - x0) / (y1 - y0))
    # outside the measured range: extend the end segment on the target's side
    (x0, y0), (x1, y1) = pts[-2:] if y > max(p[1] for p in pts) else pts[:2]
    slope = (y1 - y0) / (x1 - x0)
    if not slope > 0:  # perplexity does not rise with the noise there: no line to follow
        return None
    x = x0 + (y - y0) / slope
    lo, hi = pts[0][0] - math.log(max_factor), pts[-1][0] + math.log(max_factor)
    return math.exp(x) if lo <= x <= hi else None


def _perplexity(run_dir: Path) -> float | None:
    """A complete run's final holdout perplexity from its manifest, or None."""
    rd = RunDir(run_dir)
    if not rd.is_run() or rd.status() != "complete":
        return None
    p = (rd.read_manifest().get("result") or {}).get("final_holdout_perplexity")
    return float(p) if isinstance(p, int | float) and math.isfinite(p) and p > 0 else None


def trained_noise(run_dir: Path) -> float | None:
    """The noise multiplier a DP run trained with, from its ledger (the calibration, else its
    first mechanism's record), or None."""
    path = RunDir(run_dir).privacy_path
    if not path.is_file():
        return None
    led = read_json(path, what="privacy ledger")
    for rec in [led.get("calibration") or {}, *(led.get("mechanisms") or [])]:
        s = rec.get("noise_multiplier")
        if isinstance(s, int | float) and math.isfinite(s) and s > 0:
            return float(s)
    return None


def _eps(p: SweepPoint) -> float:
    return math.inf if p.level is None else float(p.level)


def _comparable(p: SweepPoint) -> bool:
    # ELS points meet ULS at equal epsilon (the report's samplings); a matched-utility point is
    # interpolated on one noise-to-perplexity curve per side, so they are not read for it
    return (p.level_kind == "epsilon" and not p.audit and not p.goldfish and p.matches is None
            and p.user_sampling != "els")


def _targets(cfg: SweepConfig, points: list[SweepPoint]) -> tuple[list[float], dict[float, list[SweepPoint]]]:
    """The target levels and, per level, the target backend's grid points at it."""
    m = cfg.match_utility
    comp = [p for p in points if _comparable(p) and p.backend == m.target_backend and math.isfinite(_eps(p))]
    finite = list(dict.fromkeys(_eps(p) for p in comp))  # the grid's order
    levels = finite if m.levels is None else [float(v) for v in m.levels]
    return levels, {lvl: [p for p in comp if _eps(p) == lvl] for lvl in levels}


def _side(cfg: SweepConfig, points: list[SweepPoint], t: SweepPoint) -> list[SweepPoint]:
    """The other backend's DP grid points of the target's model and seed: what a match reads."""
    other = CENTRALIZED if cfg.match_utility.target_backend == FEDERATED else FEDERATED
    return [p for p in points if _comparable(p) and p.backend == other and p.model == t.model
            and p.seed == t.seed and math.isfinite(_eps(p))]


def match_inputs(cfg: SweepConfig, points: list[SweepPoint]) -> set[str]:
    """Names of the grid points `plan_matches` reads: the sweep runs them first, then the rest of
    the grid together with the matched points, so no core waits for the planning."""
    _levels, targets = _targets(cfg, points)
    return {p.name for ts in targets.values() for t in ts for p in (t, *_side(cfg, points, t))}


def plan_matches(cfg: SweepConfig, points: list[SweepPoint], out: Path
                 ) -> tuple[list[SweepPoint], list[dict[str, Any]]]:
    """The matched-utility points to train after the `match_inputs` of `points` (complete under
    `out/runs/`), and one record per target: the noise multiplier chosen from which runs, or why
    no point was planned. It reads only those runs, so a re-run plans the same points."""
    m = cfg.match_utility
    other = CENTRALIZED if m.target_backend == FEDERATED else FEDERATED
    runs = out / "runs"
    ppl = {name: _perplexity(runs / name) for name in match_inputs(cfg, points)}
    levels, targets = _targets(cfg, points)
    taken = {p.name for p in points}
    extra: list[SweepPoint] = []
    records: list[dict[str, Any]] = []
    for lvl in levels:
        if not targets[lvl]:
            records.append({"target": f"{m.target_backend} at epsilon {lvl:g}", "point": None,
                            "reason": "no such grid point (the grid lacks this level or backend)"})
        for t in targets[lvl]:
            rec: dict[str, Any] = {"target": t.name, "target_perplexity": ppl[t.name], "point": None}
            records.append(rec)
            side = _side(cfg, points, t)
            if ppl[t.name] is None or not side:
                rec["reason"] = ("the target run is not complete" if ppl[t.name] is None
                                 else f"no {other} DP run of the same model and seed")
                continue
            near = [(abs(math.log(ppl[p.name]) - math.log(ppl[t.name])), p.name, _eps(p) == _eps(t))
                    for p in side if ppl[p.name] is not None]
            within = [x for x in near if x[0] <= m.tolerance]
            if within:  # a run at the target's epsilon first, as the report pairs them
                gap, name, equal = min(within, key=lambda x: (not x[2], x[0]))
                rec["reason"] = (f"already matched by {name} (|log ratio| {gap:.3g}"
                                 f"{', equal epsilon' if equal else ''})")
                continue
            noise = {p.name: trained_noise(runs / p.name) for p in side}
            dp = [p for p in side if noise.get(p.name) and ppl[p.name] is not None]
            rec["from"] = {p.name: [noise[p.name], ppl[p.name]] for p in dp}
            sigma = interpolate_noise([(noise[p.name], ppl[p.name]) for p in dp], ppl[t.name], m.max_factor)
            if sigma is None:
                rec["reason"] = (f"the {other} DP runs do not reach this perplexity within a factor "
                                 f"{m.max_factor:g} of their noise multipliers")
                continue
            sigma = float(f"{sigma:.3g}")
            template = min(dp, key=lambda p: abs(math.log(noise[p.name]) - math.log(sigma)))
            name = point_name(other, t.model, sigma, "noise_multiplier", t.seed)
            rec.update(noise_multiplier=sigma, point=name)
            if name in taken:
                rec["reason"] = "the interpolated noise multiplier is already a point"
                continue
            taken.add(name)
            extra.append(replace(template, name=name, level=sigma, level_kind="noise_multiplier",
                                 matches=t.name, overrides={**template.overrides, "privacy.target_epsilon": None,
                                                            "privacy.noise_multiplier": sigma}))
    return extra, records


def match_line(rec: dict[str, Any]) -> str:
    """One line for the terminal: the point a target got, or why it got none."""
    ppl = rec.get("target_perplexity")
    head = f"matched utility: {rec['target']}" + (f" (holdout perplexity {ppl:.4g})" if ppl else "")
    if rec.get("point") and not rec.get("reason"):
        return (f"{head}: {rec['point']} trained at noise multiplier {rec['noise_multiplier']:g}, "
                f"interpolated from {', '.join(rec.get('from') or {})}")
    return f"{head}: no point ({rec.get('reason')})"
