"""Sweep points as scheduler jobs, through submitit: one job per point.

`executor.kind: slurm` submits to SLURM (`submitit.SlurmExecutor`); `local` runs the
same jobs as processes on this machine (`submitit.LocalExecutor`, which emulates a multi-task
job) and `debug` in this process (`submitit.DebugExecutor`). A parallel point
(world size W > 1) is ONE job of W tasks, one per rank, over `ceil(W / gpus_per_node)` nodes;
each task finds its rank and the rendezvous in SLURM's environment (`memaudit.sweep.slurm_env`)
and runs the centralized grid's per-rank entry point. The driver submits a job for every point
that the one rule (`memaudit.sweep.point.point_action`, as `--jobs` asks it) does not skip; in
the job, rank 0 asks the rule again, hands its training step (trained, resumed or skipped) to the
other ranks through a file in the job folder, and alone probes and returns the outcome.

The sweep directory must be on a file system every node sees; run.lock (O_EXCL create, host,
pid, heartbeat; `memaudit.rundir.RunLock`) keeps two jobs off one point across hosts.

References:
  submitit (Meta), https://github.com/facebookincubator/submitit .
"""

from __future__ import annotations

import json
import math
import os
import secrets
import time
from collections.abc import Callable
from pathlib import Path
from shutil import which
from typing import TYPE_CHECKING, Any

from memaudit.errors import ConfigError, MemauditError
from memaudit.io import atomic_write_json
from memaudit.run import dispatch as switch
from memaudit.rundir import RunDir
from memaudit.sweep import slurm_env, work
from memaudit.sweep.config import JobResources, job_resources, point_config
from memaudit.sweep.point import Verb, point_action
from memaudit.sweep.work import PointOutcome

if TYPE_CHECKING:
    from memaudit.sweep.config import ExecutorConfig, SweepConfig, SweepPoint

INSTALL_HINT = "pip install memaudit[slurm]"
HANDOFF_WAIT_S = 600.0


def slurm_parameters(ex: ExecutorConfig, res: JobResources, *, job_name: str) -> dict[str, Any]:
    """`submitit.SlurmExecutor.update_parameters` keywords for one point's job."""
    params: dict[str, Any] = {"job_name": job_name, "nodes": res.nodes, "ntasks_per_node": res.tasks_per_node,
                              "time": ex.timeout_min, "setup": list(ex.setup)}
    if res.gpus_per_node:
        params["gpus_per_node"] = res.gpus_per_node
    if res.cpus_per_task is not None:
        params["cpus_per_task"] = res.cpus_per_task
    if ex.mem_gb is not None:
        params["mem"] = f"{math.ceil(ex.mem_gb)}GB"
    for key in ("partition", "account", "qos", "constraint"):
        if getattr(ex, key) is not None:
            params[key] = getattr(ex, key)
    if ex.slurm_additional:
        params["additional_parameters"] = dict(ex.slurm_additional)
    return params


def _submitit() -> Any:
    try:
        # optional dependency: submitit (the slurm extra)
        import submitit
    except ImportError:
        raise ConfigError(f"the slurm executors need submitit, which is not installed; install the "
                          f"extra: {INSTALL_HINT}") from None
    return submitit


def check_executor(ex: ExecutorConfig) -> None:
    """One line, before anything is written, when `ex.kind` cannot run here."""
    if ex.kind == "processes":
        return
    _submitit()
    if ex.kind == "slurm" and which("srun") is None:
        raise ConfigError("--executor slurm: no 'srun' on this machine; run the sweep on a SLURM "
                          "login node, or try it here with --executor local")


def make_executor(ex: ExecutorConfig, folder: Path) -> Any:
    """The submitit executor of `ex.kind` writing its job files under `folder`."""
    submitit = _submitit()
    if ex.kind == "slurm":
        try:
            return submitit.SlurmExecutor(folder=str(folder), python=None)
        except RuntimeError as e:  # no srun on this machine
            raise ConfigError(f"--executor slurm: {str(e).strip().splitlines()[0]} (run the sweep on a "
                              "SLURM login node, or try it here with --executor local)") from None
    if ex.kind == "local":
        return submitit.LocalExecutor(folder=str(folder))
    if ex.kind == "debug":
        return submitit.DebugExecutor(folder=str(folder))
    raise ConfigError(f"executor.kind={ex.kind} is not a submitit executor")


# ----------------------------------------------------------------------------- in the job
def _threads(cpus: int | None, tasks: int) -> int:
    return cpus or max(1, (os.cpu_count() or 1) // max(tasks, 1))


def _handoff_path(folder: str, job_id: str, nonce: str) -> Path:
    """Rank 0's decision for this submission (`nonce`: job ids, local pids, repeat) and this
    attempt (a requeued job decides anew)."""
    restart = os.environ.get("SLURM_RESTART_COUNT", "0")
    return Path(folder) / f"{job_id}-{nonce}-r{restart}.action.json"


def _wait_for_action(path: Path, timeout: float = HANDOFF_WAIT_S) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if path.is_file():
            return str(json.loads(path.read_text())["action"])
        time.sleep(0.2)
    raise MemauditError(f"rank 0 of this job did not decide within {timeout:.0f}s ({path} missing); "
                        "see rank 0's log in the job folder")


def point_job(cfg: SweepConfig, point: SweepPoint, run_path: str, folder: str, threads: int | None,
              debug: bool = False, nonce: str = "", overwrite: bool = False) -> PointOutcome | None:
    """One point's job (every task runs it): rank 0 trains, probes and returns the outcome;
    the other ranks train with it and return None."""
    env = slurm_env.slurm_view(os.environ)
    rdv = slurm_env.rendezvous(env) if env is not None and int(env["SLURM_NTASKS"]) > 1 else None
    if threads is not None:
        work.limit_threads(threads)
    if rdv is None:
        return work.run_point(cfg, point, RunDir(run_path), lambda *a: None, debug, overwrite=overwrite)
    slurm_env.export(rdv)  # RANK, WORLD_SIZE, ... : launch_training runs this rank in place
    handoff = _handoff_path(folder, rdv.job_id, nonce)
    if rdv.rank == 0:
        def decided(action: str) -> None:
            atomic_write_json(handoff, {"action": action})

        try:
            return work.run_point(cfg, point, RunDir(run_path), lambda *a: None, debug, on_action=decided,
                                  overwrite=overwrite)
        finally:
            if not handoff.is_file():  # failed before deciding: let the other ranks go
                decided("skipped")
    action = _wait_for_action(handoff)
    if action != "skipped":
        switch.dispatch(point_config(cfg, point), RunDir(run_path), resume=action == "resumed", overwrite=True)
    return None


# ----------------------------------------------------------------------------- the driver
def _job_error(e: BaseException, job: Any) -> str:
    """One line for a job that died (submitit's errors carry the whole log after the first)."""
    try:
        log = f"; log: {job.paths.stderr}"
    except Exception:  # noqa: BLE001 - a message without the path still says what happened
        log = ""
    if type(e).__name__ == "UncompletedJobError":
        return (f"job {job.job_id} ended without a result (killed, out of memory or past "
                f"executor.timeout_min){log}; re-run the sweep to resume the point")
    lines = [ln.strip() for ln in str(e).strip().splitlines() if ln.strip()]
    return f"{type(e).__name__}: {lines[0][:200] if lines else ''}{log}"


def run_jobs(cfg: SweepConfig, points: list[SweepPoint], out: Path,
             on_done: Callable[[int, PointOutcome], None], progress: Any, debug: bool, *,
             overwrite: bool = False) -> None:
    """Each point that `point_action` does not skip as one job; outcomes reported as jobs end,
    in any order."""

    ex = cfg.executor
    folder = Path(ex.folder) if ex.folder else out / "jobs"
    executor = make_executor(ex, folder)
    todo: list[tuple[int, SweepPoint, JobResources]] = []
    for i, p in enumerate(points):
        try:
            skip = point_action(cfg, p, out / "runs" / p.name).verb is Verb.SKIP
        except MemauditError:  # an unreadable run.json: the point's job records the one line
            skip = False
        if skip:  # no scheduler slot for finished work
            on_done(i, PointOutcome(p.name, p.backend, "complete", "skipped", False, 0.0))
            continue
        todo.append((i, p, job_resources(ex, point_config(cfg, p))))
    limit = ex.max_parallel or (cfg.jobs if ex.kind == "local" else len(todo)) or 1
    running: dict[int, tuple[SweepPoint, Any, float]] = {}
    try:
        while todo or running:
            while todo and len(running) < limit:
                i, p, res = todo.pop(0)
                running[i] = (p, _submit(executor, cfg, p, res, out, folder, debug, overwrite), time.time())
            for i in [i for i, (_, job, _) in running.items() if ex.kind == "debug" or job.done()]:
                p, job, t0 = running.pop(i)
                try:
                    outcome = job.task(0).result()
                except Exception as e:  # noqa: BLE001 - the job itself died: a failed point
                    outcome = PointOutcome(p.name, p.backend, "failed", "trained", False, 0.0,
                                           _job_error(e, job))
                outcome.seconds = time.time() - t0
                on_done(i, outcome)
            if running:
                time.sleep(0.5)
    except KeyboardInterrupt:
        for _, job, _ in running.values():  # as with --jobs: Ctrl-C stops the points in flight
            try:
                job.cancel(check=False)
            except Exception:  # noqa: BLE001, S110 - best effort on the way out
                pass
        raise


def _submit(executor: Any, cfg: SweepConfig, p: SweepPoint, res: JobResources, out: Path, folder: Path,
            debug: bool, overwrite: bool = False) -> Any:
    ex = cfg.executor
    if ex.kind == "slurm":
        executor.update_parameters(**slurm_parameters(ex, res, job_name=f"memaudit-{p.name}"))
        threads = res.cpus_per_task
    elif ex.kind == "local":
        executor.update_parameters(tasks_per_node=res.tasks_per_node, timeout_min=ex.timeout_min,
                                   gpus_per_node=res.gpus_per_node, **({"setup": list(ex.setup)} if ex.setup else {}))
        share = max(1, min(cfg.jobs, ex.max_parallel or cfg.jobs)) * res.tasks
        threads = _threads(res.cpus_per_task, share)
    else:
        threads = None  # in this process: leave its threads alone
    return executor.submit(point_job, cfg, p, str(out / "runs" / p.name), str(folder), threads, debug,
                           secrets.token_hex(8), overwrite)
