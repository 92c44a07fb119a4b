"""Probing a sweep point: the sweep's probe settings on a run (its public base as the membership
reference unless `probe.reference` names one: `point.point_probe_config`), its probes.json written
atomically (each probe kept as it finishes, so that a probe stage stopped part-way resumes
at the next probe); re-probed only where the one rule (`memaudit.sweep.point.probe_reason`) finds the
stored probes.json stale. Shared by the sweep's points and its public-base reference.

torch is imported with the probes inside `probe_run`: `memaudit --help` and the sweep's
planning import this module and must not pay it.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from memaudit.probes.document import write_probes
from memaudit.rundir import RunDir
from memaudit.sweep.config import SweepConfig
from memaudit.sweep.point import point_probe_config, probe_reason

Progress = Callable[[int, int, dict], None] | None
# under the sweep's --out: sensitive (scores of the private documents), never collected
SCORE_CACHE = "cache/probes"


def score_cache(rd: RunDir) -> Path | None:
    """The sweep's folder of what its points' probes share (`memaudit.probes.score_cache`: every
    point scores the same documents against the same public base, and checks the same split):
    for a run in a sweep's `runs/`; None for a run elsewhere."""
    return rd.path.parent.parent / SCORE_CACHE if rd.path.parent.name == "runs" else None


def probe_run(cfg: SweepConfig, rd: RunDir, progress: Progress, *, keep_target_scores: bool = False) -> None:
    """Probe the run in `rd` under the sweep's probe settings and write its probes.json;
    `keep_target_scores` for the public base's own run, whose scores its fine-tunes reference."""
    # lazy: torch (~2 s), not for `memaudit --help`
    from memaudit.probes.runner import run_probes
    from memaudit.probes.scoring import resolve_device
    from memaudit.probes.targets import resolve_target

    settings = point_probe_config(cfg, rd)
    settings = settings.model_copy(update={"device": resolve_device(settings.device)})
    # each finished probe is kept: a piece stopped part-way resumes at the next probe
    result = run_probes(resolve_target(rd.path), settings, progress=progress, partial=rd.probes_partial_path,
                        cache=score_cache(rd), keep_target_scores=keep_target_scores)
    write_probes(rd.probes_path, result.document)
    rd.probes_partial_path.unlink(missing_ok=True)


def probe_if_stale(cfg: SweepConfig, rd: RunDir, progress: Progress, *, keep_target_scores: bool = False) -> bool:
    """Probe a complete run unless the one rule finds its probes.json current
    (`point.probe_reason`); returns whether it probed."""
    if probe_reason(cfg, rd) is None:
        return False
    probe_run(cfg, rd, progress, keep_target_scores=keep_target_scores)
    return True
