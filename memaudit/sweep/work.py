"""One sweep point's work, the same under every executor: train, resume or leave it as the one
rule (`memaudit.sweep.point.point_action`) says, probe it where the rule says, and return a
`PointOutcome`; a failure is recorded in the outcome, not raised. The processes executor
(`memaudit.sweep.runner`) and the scheduler jobs (`memaudit.sweep.executors`) both call
`run_point`.
"""

from __future__ import annotations

import os
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass

from memaudit.errors import without_values  # the backend switch; its backends load when chosen
from memaudit.run import dispatch as switch
from memaudit.run import timebox
from memaudit.rundir import RunDir, prepare_new_run
from memaudit.sweep.config import SweepConfig, SweepPoint, point_config
from memaudit.sweep.point import PointAction, Verb, point_action
from memaudit.sweep.probing import probe_run
from memaudit.sweep.replace import refuse_replacing_point

Progress = Callable[[int, int, dict], None] | None
STOPPED = "stopped"
"""A point's status when a time box (`sweep --stop-after`) ended before it finished: resumed, or
started, by the next invocation."""


@dataclass
class PointOutcome:
    name: str
    backend: str
    status: str  # complete | failed | stopped (a time box ended first)
    action: str  # trained | resumed | skipped
    probed: bool
    seconds: float
    error: str | None = None


def one_line(e: BaseException) -> str:
    """A failed point's error as its outcome (and the sweep's terminal line) shows it: never a
    data value quoted by Python's conversion errors."""
    lines = str(e).strip().splitlines()
    return f"{type(e).__name__}: {without_values(lines[0]) if lines else ''}"


def train_point(cfg, rd: RunDir, action: PointAction, progress: Progress,
                 on_action: Callable[[str], None] | None = None, *, overwrite: bool = False) -> str:
    """Train, resume or leave one point as `action` says; returns the outcome's action word.
    `on_action` hears it before any training starts (the other ranks of a scheduler job wait
    for it). A complete point is trained anew only with `overwrite` (`sweep --overwrite`)."""
    if action.verb is Verb.TRAIN:
        refuse_replacing_point(rd, action.reason, overwrite=overwrite)
        rd = prepare_new_run(rd.path, overwrite=True)
    if on_action is not None:
        on_action(action.action)
    if action.verb in (Verb.TRAIN, Verb.RESUME):
        switch.dispatch(cfg, rd, resume=action.verb is Verb.RESUME, progress=progress,
                        overwrite=action.verb is Verb.TRAIN)
    return action.action


def run_point(cfg: SweepConfig, p: SweepPoint, rd: RunDir, sub: Callable[[int, int, dict], None],
               debug: bool, on_action: Callable[[str], None] | None = None, *,
               overwrite: bool = False) -> PointOutcome:
    """Train and probe one point; a failure is recorded in the outcome, not raised."""
    t0 = time.time()
    outcome = PointOutcome(p.name, p.backend, "failed", "trained", False, 0.0)
    try:
        if timebox.should_stop():  # --stop-after: the box ended before this point began
            raise timebox.TimeUp("time box ended before the point")
        action = point_action(cfg, p, rd.path)
        outcome.action = train_point(point_config(cfg, p), rd, action, sub, on_action, overwrite=overwrite)
        if action.verb is not Verb.SKIP and action.verb is not Verb.PROBE:
            timebox.note_work()  # trained or resumed to its end
        if action.probes:
            if timebox.should_stop():  # its probes wait for the next invocation (point_action: probe)
                raise timebox.TimeUp("time box ended before the probes")
            probe_run(cfg, rd, lambda d, t, info: sub(d, t, {"stage": "probe", **info}))
            timebox.note_work()
            outcome.probed = True
        outcome.status = "complete"
    except timebox.TimeUp:  # stopped at a checkpoint or a boundary: the next invocation goes on
        outcome.status = STOPPED
    except KeyboardInterrupt:
        raise
    except Exception as e:  # noqa: BLE001 - a failed point is recorded, the sweep goes on
        outcome.error = one_line(e)
        if debug:
            traceback.print_exc()
    outcome.seconds = time.time() - t0
    return outcome


# XLA's CPU backend on one thread: without it its Eigen pool keeps a thread per core in every
# process, and the waiting threads spin on the cores other processes need
XLA_ONE_THREAD = "--xla_cpu_multi_thread_eigen=false"


def limit_threads(threads: int) -> None:
    """Run this worker process's torch and XLA on `threads` CPU threads (before jax loads)."""
    os.environ["OMP_NUM_THREADS"] = str(threads)
    if threads == 1:
        flags = os.environ.get("XLA_FLAGS", "")
        os.environ["XLA_FLAGS"] = f"{flags} {XLA_ONE_THREAD} intra_op_parallelism_threads=1"
    import torch  # lazy: torch (~2 s) in the worker only, after the thread settings above

    torch.set_num_threads(threads)
