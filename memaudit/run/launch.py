"""The centralized grid's entry: backend choice, process-group init and the ranks' processes.

Works under `torchrun` or any launcher that sets RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR
and MASTER_PORT (SLURM users: `srun torchrun --nnodes $SLURM_NNODES --nproc-per-node G
--rdzv-backend c10d --rdzv-endpoint $HEAD:29500 -m memaudit.cli train CONFIG`).
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import signal
import socket
import sys
import time
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

from memaudit.errors import MemauditError
from memaudit.models.presets import llama_config
from memaudit.parallel.dims import ParallelDims
from memaudit.rundir import RunDir


@dataclass(frozen=True)
class DistEnv:
    rank: int
    world_size: int
    local_rank: int


def env_info() -> DistEnv | None:
    """The launcher's environment (torchrun / elastic), or None when not started by one."""
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        return None
    return DistEnv(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), int(os.environ.get("LOCAL_RANK", "0")))


def resolve_backend(requested: str, *, dims: ParallelDims, local_world: int | None = None) -> str:
    """'gloo' or 'nccl' for `parallel.dist_backend` (auto: NCCL when CUDA has enough devices).

    Raises a one-line ValueError when NCCL is asked for without enough CUDA devices.
    """
    # lazy: torch (~2 s) only when called; this module imports without it
    import torch

    if requested not in ("auto", "gloo", "nccl"):
        raise ValueError(f"parallel.dist_backend={requested!r} is unknown; use auto, gloo or nccl")
    need = local_world if local_world is not None else dims.world_size
    have = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if requested == "nccl" and have < need:
        raise ValueError(
            f"parallel.dist_backend=nccl needs {need} CUDA devices on this node but {have} are available; "
            "use parallel.dist_backend=gloo (CPU) or a smaller grid"
        )
    if requested == "auto":
        return "nccl" if have >= need and have > 0 else "gloo"
    return requested


def init_distributed(dims: ParallelDims, *, requested_backend: str = "auto") -> str:
    """Initialise the default process group from the launcher's environment; returns the backend.

    The grid must match WORLD_SIZE (one-line ValueError otherwise). A 1x1x1x1 grid without a
    launcher initialises nothing.
    """
    # lazy: torch (~2 s) only when called; this module imports without it
    import torch
    import torch.distributed as dist

    env = env_info()
    if env is None:
        dims.check_world(1)
        return "none"
    dims.check_world(env.world_size)
    local = int(os.environ.get("LOCAL_WORLD_SIZE", env.world_size))
    backend = resolve_backend(requested_backend, dims=dims, local_world=local)
    if backend == "nccl":
        torch.cuda.set_device(env.local_rank)
    if not dist.is_initialized():
        dist.init_process_group(backend, rank=env.rank, world_size=env.world_size, timeout=dist_timeout())
    return backend


def dist_timeout() -> timedelta:
    """How long a collective waits for a missing peer before it raises (MEMAUDIT_DIST_TIMEOUT_S,
    default 1800 s: the other ranks wait in a barrier while the writer prepares the data)."""
    raw = os.environ.get("MEMAUDIT_DIST_TIMEOUT_S", "1800")
    try:
        secs = float(raw)
    except ValueError:
        raise ValueError(f"MEMAUDIT_DIST_TIMEOUT_S={raw!r} is not a number of seconds; unset it or "
                         "use e.g. 600") from None
    if not secs > 0:
        raise ValueError(f"MEMAUDIT_DIST_TIMEOUT_S={raw!r} must be > 0; unset it or use e.g. 600")
    return timedelta(seconds=secs)


# ----------------------------------------------------------------------------- training
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# Imported once by the fork server; each rank then forks from it instead of importing torch and
# transformers itself (seconds of CPU per rank). The server starts single-threaded, without CUDA.
PRELOAD = ["torch", "torch.distributed", "transformers", "transformers.models.llama.modeling_llama",
           "memaudit.parallel.layout", "memaudit.train.trainer"]


QUIET_TRACKER = "ignore:resource_tracker:UserWarning"


def quiet_resource_tracker() -> None:
    """Python processes started from here on (multiprocessing's resource tracker, the
    forkserver) run with `QUIET_TRACKER`: a rank killed with SIGKILL leaves its semaphores to
    the resource tracker, which removes them and, at its exit, warned about them on the
    launcher's stderr, after the launcher's own one-line error."""
    if QUIET_TRACKER not in sys.warnoptions:
        sys.warnoptions.append(QUIET_TRACKER)


def rank_context(extra_preload: tuple[str, ...] = ()) -> Any:
    """The multiprocessing context the ranks start in (forkserver with PRELOAD; the first caller
    in a process fixes the server's preload list), its resource tracker quiet
    (`quiet_resource_tracker`)."""
    quiet_resource_tracker()
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload([*PRELOAD, *extra_preload])
    return ctx


GRACE_S = 5.0  # after one rank dies: how long the others get to exit, then SIGTERM, then SIGKILL


def _rank_main(rank: int, world: int, port: int, cfg: Any, run_path: str, resume: bool, queue: Any,
               overwrite: bool = False) -> None:
    """One spawned rank: environment as torchrun would set it, then the trainer on the grid's layout."""
    os.setsid()  # its own process group: the launcher can kill the rank and anything it started
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    pid_dir = os.environ.get("MEMAUDIT_PARALLEL_PID_DIR")  # tests: which process is which rank
    if pid_dir:
        Path(pid_dir, f"rank{rank}.pid").write_text(str(os.getpid()))
    if "OMP_NUM_THREADS" not in os.environ:  # as torchrun: the ranks share this node's cores
        # lazy: torch (~2 s) only when called; this module imports without it
        import torch

        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))

    progress = None
    if rank == 0:
        def progress(done: int, total: int, info: dict) -> None:
            queue.put(("progress", done, total, {k: v for k, v in info.items() if isinstance(v, int | float | str)}))
    # the launcher holds run.lock for the ranks
    result = _run_here(cfg, RunDir(run_path), resume=resume, progress=progress, overwrite=overwrite,
                       lock_held=True)
    if rank == 0:
        queue.put(("result", result))


def _signal_ranks(procs: Any, sig: int) -> None:
    """Send `sig` to every live rank's process group (each rank leads its own session)."""
    for p in procs.processes:
        if p.pid is None:
            continue
        try:
            os.killpg(p.pid, sig)
        except (ProcessLookupError, PermissionError):
            pass


def _stop_ranks(procs: Any, *, grace: float) -> None:
    """SIGTERM the ranks (the writer marks run.json interrupted), wait up to `grace`, then SIGKILL
    their process groups, so that no rank is left blocked in a collective."""
    _signal_ranks(procs, signal.SIGTERM)
    deadline = time.monotonic() + grace
    for p in procs.processes:
        p.join(timeout=max(0.0, deadline - time.monotonic()))
    _signal_ranks(procs, signal.SIGKILL)
    for p in procs.processes:
        p.join(timeout=grace)


def _mark_stopped(run: Any, status: str, error: str) -> None:
    """The writer rank cannot always record the end (SIGKILL): leave run.json truthful."""
    try:
        m = run.read_manifest()
    except Exception:  # noqa: BLE001 - no manifest yet: nothing to correct
        return
    if m.get("status") == "running":
        timings = dict(m.get("timings", {}))
        timings["finished"] = time.time()
        fields = {"error": error} if status == "failed" else {}
        run.update_manifest(status=status, timings=timings, **fields)


def _run_here(cfg: Any, run: Any, *, resume: bool, progress: Any, overwrite: bool = False,
              lock_held: bool = False) -> dict:
    # lazy: torch (~2 s) only when called; this module imports without it
    import torch.distributed as dist

    # lazy: torch (~2 s) and dp_accounting (~1.5 s) only when called; this module imports without it
    from memaudit.parallel.layout import TensorParallelLayout
    from memaudit.run.driver import run_trainer
    from memaudit.train.trainer import Trainer

    dims = ParallelDims.from_config(cfg.parallel)
    init_distributed(dims, requested_backend=cfg.parallel.dist_backend)
    try:
        trainer = Trainer(cfg, run, TensorParallelLayout(cfg), progress=progress)
        return run_trainer(trainer, resume=resume, overwrite=overwrite, lock_held=lock_held)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def launch_training(cfg: Any, run: Any, *, resume: bool = False, progress: Any = None,
                    overwrite: bool = False, lock_held: bool = False) -> dict:
    """Train `cfg` on its grid: in this process when a launcher (torchrun) started it,
    otherwise by starting `world_size` local processes (forked from a fork server that has
    imported torch; gloo on CPU, NCCL with enough GPUs).

    Each rank leads its own process group. When one rank dies, the others get GRACE_S seconds
    to notice (a collective with a dead peer raises; the writer marks run.json failed), then
    SIGTERM, then SIGKILL of their process groups; run.json is marked failed if the writer
    could not do it, and a one-line MemauditError names the rank; `--resume` continues from
    the last checkpoint. Ctrl-C or SIGTERM of the launcher stops the ranks the same way
    (status interrupted). Returns the writer's result summary.
    """
    dims = ParallelDims.from_config(cfg.parallel)
    if cfg.model.name_or_path is None:  # one clear line before any process starts

        dims.check_model(llama_config(cfg.model.preset))
    env = env_info()
    if env is not None:
        return _run_here(cfg, run, resume=resume, progress=progress if env.rank == 0 else None,
                         overwrite=overwrite, lock_held=lock_held)
    resolve_backend(cfg.parallel.dist_backend, dims=dims)  # fail early, with one line
    with contextlib.nullcontext() if lock_held else run.locked():  # held for the ranks
        return _spawn(cfg, run, dims, resume=resume, progress=progress, overwrite=overwrite)


def _spawn(cfg: Any, run: Any, dims: ParallelDims, *, resume: bool, progress: Any, overwrite: bool) -> dict:
    # lazy: torch (~2 s) only when called; this module imports without it
    import torch.multiprocessing as mp


    ctx = rank_context()
    q = ctx.SimpleQueue()
    procs = mp.start_processes(_rank_main, args=(dims.world_size, _free_port(), cfg, str(run.path), resume, q,
                                                 overwrite),
                               nprocs=dims.world_size, join=False, start_method="forkserver")
    result: dict | None = None

    def drain() -> None:
        nonlocal result
        while not q.empty():
            msg = q.get()
            if msg[0] == "progress" and progress is not None:
                progress(msg[1], msg[2], msg[3])
            elif msg[0] == "result":
                result = msg[1]

    # lazy: numpy (~0.4 s) only when called; this module imports without it
    from memaudit.run.lifecycle import sigterm_as_interrupt

    try:
        with sigterm_as_interrupt():  # SIGTERM of the launcher stops the ranks too
            while not procs.join(timeout=0.5, grace_period=GRACE_S):
                drain()
    except mp.ProcessRaisedException as e:
        last = [ln for ln in str(e).strip().splitlines() if ln.strip()][-1]
        msg = f"parallel rank {e.error_index} failed: {last}"
        _stop_ranks(procs, grace=GRACE_S)
        _mark_stopped(run, "failed", msg[:300])
        raise MemauditError(msg) from None
    except mp.ProcessExitedException as e:
        msg = (f"parallel rank {e.error_index} exited with code {e.exit_code}; "
               "the other ranks were stopped; continue with --resume")
        _stop_ranks(procs, grace=GRACE_S)
        _mark_stopped(run, "failed", msg)
        raise MemauditError(msg) from None
    except BaseException:  # Ctrl-C or SIGTERM of the launcher: stop the ranks, then re-raise
        _stop_ranks(procs, grace=GRACE_S)
        _mark_stopped(run, "interrupted", "")
        raise
    drain()
    if result is None:
        raise MemauditError("the parallel ranks finished without a result; see run.json")
    return result
