"""Comparisons between runs: a metric pooled over seeds and its test between two groups of runs.

Shared by the report's matched-epsilon and treatment comparisons (`memaudit.reports.build`), the
matched-utility pairs (`memaudit.reports.frontier`) and the scale section (`memaudit.reports.scale`).

References:
  Good. Permutation, Parametric, and Bootstrap Tests of Hypotheses. Springer 2005.
"""

from __future__ import annotations

import math
import statistics
from typing import Any

from memaudit.probes.records import Cell, Test
from memaudit.reports.entries import RunEntry, entries


def nominal_epsilon(run: dict[str, Any] | RunEntry) -> float:
    """A run's nominal epsilon: its target, else its ledger's (2 decimals); inf without DP."""
    p = RunEntry.of(run).privacy
    if p.mechanism == "none":
        return math.inf
    return float(p.target_epsilon) if p.target_epsilon is not None else round(p.epsilon, 2)


def pool(cells: list[Cell | None]) -> Cell | None:
    """One metric over seeds: one run's cell as it is; several seeds' mean with a half-width that
    adds within-run and between-seed spread (no interval when any run has none)."""
    cells = [c for c in cells if c is not None and c.value is not None]
    if not cells:
        return None
    if len(cells) == 1:
        return cells[0].replace(n_seeds=1)
    vals = [c.value for c in cells]
    mean = statistics.fmean(vals)
    base = {"value": mean, "n": cells[0].n, "unit": cells[0].unit, "n_seeds": len(vals)}
    if any(c.lower_bound for c in cells):  # a mean with a lower bound in it is one too
        return Cell(**base, lower_bound=True, note="a lower bound in some seeds (canaries at the estimator's ceiling)",
                    keys=(*POOLED, "lower_bound", "note"))
    if any(c.interval is None for c in cells):
        return Cell(**base, note="n too small in some seeds", keys=(*POOLED, "note"))
    within = statistics.fmean((c.ci_high - c.ci_low) / 2 for c in cells)
    between = 1.96 * statistics.stdev(vals) / math.sqrt(len(vals))
    half = math.sqrt(within**2 + between**2)
    return Cell(**base, interval=(mean - half, mean + half), note=None, keys=(*POOLED, "note"))


POOLED = ("value", "n", "unit", "n_seeds", "ci_low", "ci_high")  # a pooled cell's keys, its note after


def compare_groups(a_runs: list[dict[str, Any] | RunEntry], b_runs: list[dict[str, Any] | RunEntry], key: str,
                   alternative: str) -> Test | None:
    """The test of metric `key` between two groups of runs (None when it cannot be tested).

    Both groups with several seeds: a permutation test over the seeds' values (a statement about
    the configurations). Otherwise the first run of each group, tested on its units (a statement
    about these runs).
    """
    # lazy: probes.stats costs ~0.5 s of import (numpy, scipy), and frontier (which `memaudit --help`
    # imports for DEFAULT_TOLERANCE) imports this module
    from memaudit.probes.stats import compare_seeds, compare_units

    a_runs, b_runs = entries(a_runs), entries(b_runs)
    if len(a_runs) > 1 and len(b_runs) > 1:
        va, vb = _values(a_runs, key), _values(b_runs, key)
        if len(va) > 1 and len(vb) > 1:
            kind = (a_runs[0].units_of(key) or {}).get("kind", "mean")
            return compare_seeds(va, vb, alternative=alternative, kind=kind).replace(scope="configurations")
    ua, ub = a_runs[0].units_of(key), b_runs[0].units_of(key)
    if not ua or not ub:
        return None
    return compare_units(ua, ub, alternative=alternative).replace(scope="runs", runs=(a_runs[0].id, b_runs[0].id))


def _values(runs: list[RunEntry], key: str) -> list[float]:
    """The runs' values of metric `key`, where they measured it."""
    cells = (r.cell(key) for r in runs)
    return [c.value for c in cells if c is not None and c.value is not None]
