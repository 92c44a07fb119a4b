"""Run a sweep: train every grid point, probe it, then write one report.

Points run in this process, in `jobs` worker processes, or as scheduler jobs
(`memaudit.sweep.executors`); the semantics are the same everywhere, because every executor
asks one rule what a point needs (`memaudit.sweep.point.point_action`): trained anew (no run, or
one trained under another config or from other base weights), resumed (interrupted with a
checkpoint), probed (complete, probes.json older than the model or written under other probe
settings) or skipped. A failed point is recorded while the rest go on; re-running the same
command after a kill finishes the sweep without redoing completed work. All points share the
corpus, split, canaries and initial weights (data preparation and initialisation are
deterministic in the config's data and model seeds).
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import queue as queue_mod
import signal
import threading
from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait
from dataclasses import asdict
from pathlib import Path
from typing import Any

from memaudit.backends import ALIASES
from memaudit.errors import MemauditError, RunDirError
from memaudit.io import atomic_write_json
from memaudit.reports import build as report_build
from memaudit.run import timebox
from memaudit.rundir import RunDir, SweepDir, check_output_folder
from memaudit.sweep.config import SweepConfig, SweepPoint, plan_points
from memaudit.sweep.executors import check_executor, run_jobs
from memaudit.sweep.match import match_inputs, plan_matches
from memaudit.sweep.pretrain import base_references, pretrain_bases, stale_bases
from memaudit.sweep.regime import resolve_regime
from memaudit.sweep.replace import refuse_replacing, replaced_points, replaced_references
from memaudit.sweep.work import STOPPED, PointOutcome, Progress, limit_threads, one_line, run_point


def _point_in_worker(cfg: SweepConfig, p: SweepPoint, run_path: str, threads: int, queue: Any,
                     debug: bool, overwrite: bool = False) -> PointOutcome:
    limit_threads(threads)
    return run_point(cfg, p, RunDir(run_path), lambda d, t, info: queue.put((p.name, d, t, info)), debug,
                     overwrite=overwrite)


class Terminated(KeyboardInterrupt):
    """SIGTERM reached the sweep (`kill`, a scheduler's cancel): handled as an interrupt."""


def _raise_terminated(signum: int, frame: Any) -> None:
    raise Terminated


@contextlib.contextmanager
def _sigterm_interrupts():
    """SIGTERM raises `Terminated` in the main thread while the block runs (elsewhere it is left
    as it is: Python can set a handler in the main thread only)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    before = signal.signal(signal.SIGTERM, _raise_terminated)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, before)


def _concurrent(cfg: SweepConfig, points: list[SweepPoint], out: Path, on_done: Callable[[int, PointOutcome], None],
                progress: Progress, debug: bool, overwrite: bool = False) -> None:
    """Points in `cfg.jobs` spawned processes, each with an equal share of the CPU threads.

    An interrupt ends the workers with the sweep. Ctrl-C reaches them itself (the terminal signals
    the whole process group), and the sweep waits for them. SIGTERM reaches the sweep alone, and
    the workers would go on training and writing into --out after it, even into the run folders
    of the next sweep started there; the sweep terminates them first (a terminated point resumes
    from its last checkpoint when the sweep is run again)."""
    ctx = mp.get_context("spawn")  # no fork of a process that may hold torch/XLA threads
    jobs = min(cfg.jobs, len(points))
    threads = max(1, (os.cpu_count() or 1) // jobs)
    index = {p.name: i for i, p in enumerate(points)}
    with _sigterm_interrupts(), ctx.Manager() as manager, ProcessPoolExecutor(jobs, mp_context=ctx) as pool:
        q = manager.Queue()
        pending = {pool.submit(_point_in_worker, cfg, p, str(out / "runs" / p.name), threads, q, debug,
                               overwrite): p for p in points}
        finished = 0

        def drain() -> None:
            while True:
                try:
                    name, d, t, info = q.get_nowait()
                except queue_mod.Empty:
                    return
                if progress is not None:
                    progress(finished, len(points), {"point": name, "done": d, "total": t, **info})

        try:
            while pending:
                done, _ = wait(pending, timeout=0.5, return_when=FIRST_COMPLETED)
                drain()
                for fut in done:
                    p = pending.pop(fut)
                    try:
                        outcome = fut.result()
                    except Exception as e:  # noqa: BLE001 - the worker process itself died
                        outcome = PointOutcome(p.name, p.backend, "failed", "trained", False, 0.0, one_line(e))
                    finished += 1
                    on_done(index[p.name], outcome)
        except KeyboardInterrupt as e:
            if isinstance(e, Terminated):  # the workers did not get it: end them (and the queue's manager)
                for child in mp.active_children():
                    child.terminate()
            pool.shutdown(wait=True, cancel_futures=True)  # Ctrl-C: the workers got the signal too
            raise


def _run_points(cfg: SweepConfig, points: list[SweepPoint], out: Path,
                on_done: Callable[[int, PointOutcome], None], progress: Progress, debug: bool,
                overwrite: bool = False) -> None:
    """Train and probe `points` on the sweep's executor; `on_done(i, outcome)` hears each end.
    A complete point is trained anew only with `overwrite`."""
    if cfg.executor.kind != "processes":
        run_jobs(cfg, points, out, on_done, progress, debug, overwrite=overwrite)
    elif cfg.jobs > 1 and len(points) > 1:
        _concurrent(cfg, points, out, on_done, progress, debug, overwrite)
    else:
        for i, p in enumerate(points):
            def sub(done: int, tot: int, info: dict, _p: SweepPoint = p, _i: int = i) -> None:
                if progress is not None:
                    progress(_i, len(points), {"point": _p.name, "done": done, "total": tot, **info})

            on_done(i, run_point(cfg, p, RunDir(out / "runs" / p.name), sub, debug, overwrite=overwrite))


def split_first(points: list[SweepPoint], needed: set[str], jobs: int
                ) -> tuple[list[SweepPoint], list[SweepPoint]]:
    """The points to run before planning (`needed`, topped up from the others to a multiple of
    `jobs`, so that no worker idles in the first batch's last round) and the rest, in grid order.

    >>> from memaudit.sweep.config import SweepPoint
    >>> pts = [SweepPoint(n, "centralized", None, "epsilon", 0, False, False) for n in "abcde"]
    >>> [[p.name for p in b] for b in split_first(pts, {"b", "d", "e"}, jobs=2)]
    [['b', 'd', 'e', 'a'], ['c']]
    """
    first = [p for p in points if p.name in needed]
    rest = [p for p in points if p.name not in needed]
    fill = -len(first) % jobs
    return first + rest[:fill], rest[fill:]


def adopt_renamed_points(out: Path) -> dict[str, str]:
    """Point folders named by a backend's old name (runs/parallel-...: swept before the centralized
    backend was renamed) moved to their names now (runs/centralized-...), so the sweep finds them
    and decides on them by `point_action` instead of training them a second time. A folder already
    under the new name is never replaced (both stay), and a folder that is not a memaudit run (no
    run.json, or one that is not memaudit's manifest) is not touched: only runs are adopted.
    Returns {old name: new name} of those moved.

    >>> import tempfile; out = Path(tempfile.mkdtemp()); (out / "runs" / "parallel-eps8-s0").mkdir(parents=True)
    >>> atomic_write_json(out / "runs" / "parallel-eps8-s0" / "run.json", {"status": "complete"})
    >>> (out / "runs" / "parallel-notes").mkdir()
    >>> adopt_renamed_points(out), sorted(p.name for p in (out / "runs").iterdir())
    ({'parallel-eps8-s0': 'centralized-eps8-s0'}, ['centralized-eps8-s0', 'parallel-notes'])
    """
    runs = out / "runs"
    moved: dict[str, str] = {}
    if not runs.is_dir():
        return moved
    for old in sorted(runs.iterdir()):
        prefix, sep, rest = old.name.partition("-")
        if not sep or prefix not in ALIASES or not old.is_dir() or not _is_memaudit_run(old):
            continue
        new = runs / f"{ALIASES[prefix]}-{rest}"
        if new.exists():
            continue
        os.replace(old, new)  # one rename on the same file system: the folder is whole under one name
        moved[old.name] = new.name
    return moved


def _is_memaudit_run(path: Path) -> bool:
    """Whether `path` holds a memaudit run manifest (run.json with a known status)."""
    try:
        RunDir(path).read_manifest()
    except (MemauditError, OSError, ValueError):  # RunDirError, unreadable JSON
        return False
    return True


def check_sweep_dir(out: Path) -> None:
    """One line, before anything is written, for an --out that cannot hold a sweep."""

    check_output_folder(out, what="sweep --out")
    held = (SweepDir.lock_name,)  # this sweep's own lock, taken first
    if out.is_dir() and any(p.name not in held for p in out.iterdir()) and not (out / "sweep.json").is_file():
        raise RunDirError(f"sweep --out '{out}' is a non-empty directory that is not a memaudit "
                          "sweep; choose an empty or new directory")


def run_sweep(cfg: SweepConfig, out: str | os.PathLike, *, progress: Progress = None,
              debug: bool = False, overwrite: bool = False, stop_after: float | None = None,
              report: bool = True) -> dict[str, Any]:
    """Train and probe every point of the grid under `out/runs/`, then write `out/report/`.

    With `cfg.jobs` > 1 the points run in that many processes at once (small models do not
    use a machine's cores well one at a time); each point's work is the same either way.
    The sweep holds `out/sweep.lock` throughout (a second sweep on `out` is refused), and
    trains a complete point anew only with `overwrite` (`memaudit.sweep.replace`).

    `stop_after`: seconds of this invocation (`memaudit.run.timebox`): training stops at the first
    checkpoint after which another stretch would not fit, no point or probe starts once they are
    spent, and the summary's status is "stopped" (no report yet); the same call again goes on.

    `report=False`: the points only, no `out/report/` (a leased machine's sweep whose results
    `memaudit collect` takes home, where `memaudit report` builds the one report of all machines);
    an earlier report in `out` is left as it was, and the summary names none.
    """
    out = Path(out)
    check_output_folder(out, what="sweep --out")
    if stop_after is not None and cfg.executor.kind not in ("processes", "debug"):
        raise ValueError(f"--stop-after needs the processes or debug executor (points on this machine), "
                         f"not {cfg.executor.kind}; drop --stop-after or run with --executor processes")
    with timebox.time_box(stop_after), SweepDir(out).locked():
        return _run_sweep_locked(cfg, out, progress=progress, debug=debug, overwrite=overwrite, report=report)


def _prepare_points(cfg: SweepConfig, out: Path, progress: Progress, overwrite: bool
                    ) -> tuple[list[SweepPoint], list[Path]]:
    """The grid's points (fine-tuning their public bases, with the regime's schedule) and the
    reference runs to report; without `overwrite` it stops, before anything is replaced, where
    a complete run would be trained anew (`memaudit.sweep.replace`)."""
    points = base_points = plan_points(cfg)
    adopted = adopt_renamed_points(out)
    if adopted and progress is not None:
        progress(0, len(points), {"adopted": adopted})
    # ---- public pretraining (memaudit.sweep.pretrain): one base model, trained once (or reused),
    # that every point fine-tunes (model.init_from), and its zero-fine-tuning reference run
    if cfg.pretrain is not None:
        refuse_replacing(out, stale_bases(cfg, out, points), overwrite=overwrite)
        points = base_points = pretrain_bases(cfg, out, points, progress, overwrite=overwrite)
    out.mkdir(parents=True, exist_ok=True)
    if not (out / "sweep.json").is_file():
        atomic_write_json(out / "sweep.json", {"plan": None, "outcomes": [], "status": "planning"})
    points = resolve_regime(cfg, points, out)
    found = replaced_points(cfg, points, out)
    if cfg.pretrain is not None:
        found += replaced_references(cfg, base_points, out)
    refuse_replacing(out, found, overwrite=overwrite)
    if timebox.should_stop():
        raise timebox.TimeUp("time box ended before the reference runs")
    references = base_references(cfg, out, base_points, progress) if cfg.pretrain is not None else []
    return points, references


def _run_sweep_locked(cfg: SweepConfig, out: Path, *, progress: Progress, debug: bool,
                      overwrite: bool, report: bool = True) -> dict[str, Any]:
    # lazy: matplotlib (~0.4 s) and jsonschema (~0.2 s) only when called
    from memaudit.reports.write import write_report

    check_sweep_dir(out)
    check_executor(cfg.executor)  # submitit missing, or no srun: one line, nothing written
    try:
        points, references = _prepare_points(cfg, out, progress, overwrite)
    except timebox.TimeUp:  # the box ended in the public pretraining or its reference's probes
        summary = {"plan": None, "outcomes": [], "status": STOPPED, "report": None}
        atomic_write_json(out / "sweep.json", summary)
        return summary
    plan = {"regime": cfg.regime, "executor": cfg.executor.kind,
            "points": [asdict(p) | {"config": None} for p in points]}
    atomic_write_json(out / "sweep.json", {"plan": plan, "outcomes": [], "status": "running"})
    slots: list[PointOutcome | None] = []

    def run_batch(batch: list[SweepPoint]) -> None:
        offset = len(slots)
        slots.extend([None] * len(batch))

        def on_done(i: int, outcome: PointOutcome) -> None:
            slots[offset + i] = outcome
            atomic_write_json(out / "sweep.json", {"plan": plan, "outcomes": [asdict(o) for o in slots if o],
                                                   "status": "running"})
            if progress is not None:
                progress(sum(o is not None for o in slots), len(slots),
                         {"point": outcome.name, "status": outcome.status})

        def batch_progress(done: int, total: int, info: dict) -> None:  # counted over the sweep
            progress(offset + done, len(slots), info)

        _run_points(cfg, batch, out, on_done, batch_progress if progress is not None else None, debug,
                    overwrite)

    if not cfg.match_utility.enabled:
        run_batch(points)
    else:  # ---- matched-utility points (memaudit.sweep.match), placed from the grid's utilities:

        first, rest = split_first(points, match_inputs(cfg, points),
                                  cfg.jobs if cfg.executor.kind == "processes" else 1)
        run_batch(first)
        if any(o is not None and o.status == STOPPED for o in slots):  # matches wait for their inputs
            run_batch(rest)
        else:
            extra, plan["matches"] = plan_matches(cfg, points, out)
            plan["points"] += [asdict(p) | {"config": None} for p in extra]
            if progress is not None:
                for rec in plan["matches"]:
                    progress(len(slots), len(points) + len(extra), {"match": rec})
            run_batch(rest + extra)
    outcomes = [o for o in slots if o is not None]
    if any(o.status == STOPPED for o in outcomes):  # a time box ended: the report waits for the rest
        summary = {"plan": plan, "outcomes": [asdict(o) for o in outcomes], "status": STOPPED, "report": None}
        atomic_write_json(out / "sweep.json", summary)
        return summary
    done = references + [out / "runs" / o.name for o in outcomes if o.status == "complete"]
    failed = [o for o in outcomes if o.status != "complete"]
    report_paths = None
    if done and report:
        rep = report_build.build_report(done)
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
