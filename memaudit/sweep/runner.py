"""Run a sweep: train every grid point, probe it, then write one report.

Completed runs are skipped, interrupted ones resumed, and a failed point is recorded while
the rest go on; re-running the same command after a kill finishes the sweep without
redoing completed work. All points share the corpus, split, canaries and initial weights
(data preparation and initialisation are deterministic in the config's data and model seeds).
"""

from __future__ import annotations

import os
import time
import traceback
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from memaudit.io import atomic_write_json
from memaudit.rundir import RunDir, prepare_new_run
from memaudit.sweep.config import SweepConfig, SweepPoint, plan_points, point_config

Progress = Callable[[int, int, dict], None] | None


@dataclass
class PointOutcome:
    name: str
    backend: str
    status: str  # complete | failed
    action: str  # trained | resumed | skipped
    probed: bool
    seconds: float
    error: str | None = None


def _one_line(e: BaseException) -> str:
    lines = str(e).strip().splitlines()
    return f"{type(e).__name__}: {lines[0] if lines else ''}"


def _train_point(cfg, rd: RunDir, progress: Progress) -> str:
    """Train (or resume) one point; returns the action taken."""
    from memaudit.train.dispatch import dispatch

    if rd.is_run():
        status = rd.status()
        if status == "complete":
            return "skipped"
        if status in ("interrupted", "failed") and rd.state_dir.is_dir() and any(rd.state_dir.iterdir()):
            dispatch(cfg, rd, resume=True, progress=progress)
            return "resumed"
    rd = prepare_new_run(rd.path, overwrite=True)
    dispatch(cfg, rd, resume=False, progress=progress)
    return "trained"


def _probe_point(cfg: SweepConfig, rd: RunDir, progress: Progress) -> bool:
    """Probe a complete run unless its probes.json is newer than its model."""
    from memaudit.io import atomic_write_json as write
    from memaudit.probes import PROBES
    from memaudit.probes.runner import ProbeSettings, run_probes
    from memaudit.probes.scoring import resolve_device
    from memaudit.probes.targets import resolve_target

    model_file = rd.model_dir / "config.json"
    if rd.probes_path.is_file() and rd.probes_path.stat().st_mtime >= model_file.stat().st_mtime:
        return False
    names = tuple(cfg.probe.probes) if cfg.probe.probes else PROBES
    extra = dict(cfg.probe.extra)
    settings = ProbeSettings(probes=names, device=resolve_device("auto"), batch_size=cfg.probe.batch_size, **extra)
    target = resolve_target(rd.path)
    result = run_probes(target, settings, progress=progress)
    write(rd.probes_path, result.document)
    return True


def run_sweep(cfg: SweepConfig, out: str | os.PathLike, *, progress: Progress = None,
              debug: bool = False) -> dict[str, Any]:
    """Train and probe every point of the grid under `out/runs/`, then write `out/report/`."""
    from memaudit.reports.build import build_report
    from memaudit.reports.write import write_report

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    points = plan_points(cfg)
    outcomes: list[PointOutcome] = []
    plan = {"points": [asdict(p) | {"config": None} for p in points]}
    atomic_write_json(out / "sweep.json", {"plan": plan, "outcomes": [], "status": "running"})
    total = len(points)
    for i, p in enumerate(points):
        t0 = time.time()
        rd = RunDir(out / "runs" / p.name)

        def sub(done: int, tot: int, info: dict, _p: SweepPoint = p, _i: int = i) -> None:
            if progress is not None:
                progress(_i, total, {"point": _p.name, "done": done, "total": tot, **info})

        outcome = PointOutcome(p.name, p.backend, "failed", "trained", False, 0.0)
        try:
            run_cfg = point_config(cfg, p)
            outcome.action = _train_point(run_cfg, rd, sub)
            outcome.probed = _probe_point(cfg, rd, lambda d, t, info: sub(d, t, {"stage": "probe", **info}))
            outcome.status = "complete"
        except KeyboardInterrupt:
            raise
        except Exception as e:  # noqa: BLE001 - a failed point is recorded, the sweep goes on
            outcome.error = _one_line(e)
            if debug:
                traceback.print_exc()
        outcome.seconds = time.time() - t0
        outcomes.append(outcome)
        atomic_write_json(out / "sweep.json", {"plan": plan, "outcomes": [asdict(o) for o in outcomes],
                                               "status": "running"})
        if progress is not None:
            progress(i + 1, total, {"point": p.name, "status": outcome.status})
    done = [out / "runs" / o.name for o in outcomes if o.status == "complete"]
    failed = [o for o in outcomes if o.status != "complete"]
    report_paths = None
    if done:
        rep = build_report(done)
        if failed:
            rep["findings"]["caveats"].append(
                f"{len(failed)} sweep point(s) failed and are not in this report: "
                + ", ".join(f"{o.name} ({o.error})" for o in failed)
            )
        report_paths = write_report(rep, out / "report")
    summary = {
        "plan": plan,
        "outcomes": [asdict(o) for o in outcomes],
        "status": "complete" if not failed else "partial",
        "report": {k: str(v) for k, v in report_paths.items()} if report_paths else None,
    }
    atomic_write_json(out / "sweep.json", summary)
    return summary
