"""Distributed start-up for the parallel backend: backend choice and process-group init.

Works under `torchrun` or any launcher that sets RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR
and MASTER_PORT (SLURM users: `srun torchrun --nnodes $SLURM_NNODES --nproc-per-node G
--rdzv-backend c10d --rdzv-endpoint $HEAD:29500 -m memaudit.cli train CONFIG`).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from memaudit.parallel.dims import ParallelDims


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
        dist.init_process_group(backend, rank=env.rank, world_size=env.world_size)
    return backend


# ----------------------------------------------------------------------------- training
def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_main(rank: int, world: int, port: int, cfg: Any, run_path: str, resume: bool, queue: Any) -> None:
    """One spawned rank: environment as torchrun would set it, then the parallel trainer."""
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    from memaudit.rundir import RunDir

    progress = None
    if rank == 0:
        def progress(done: int, total: int, info: dict) -> None:
            queue.put(("progress", done, total, {k: v for k, v in info.items() if isinstance(v, int | float | str)}))
    result = _run_here(cfg, RunDir(run_path), resume=resume, progress=progress)
    if rank == 0:
        queue.put(("result", result))


def _run_here(cfg: Any, run: Any, *, resume: bool, progress: Any) -> dict:
    import torch.distributed as dist

    from memaudit.parallel.trainer_hooks import ParallelTrainer

    dims = ParallelDims.from_config(cfg.parallel)
    init_distributed(dims, requested_backend=cfg.parallel.dist_backend)
    try:
        return ParallelTrainer(cfg, run, progress=progress).fit(resume=resume)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def launch_training(cfg: Any, run: Any, *, resume: bool = False, progress: Any = None) -> dict:
    """Train `cfg` on its grid: in this process when a launcher (torchrun) started it,
    otherwise by spawning `world_size` local processes (gloo on CPU, NCCL with enough GPUs).

    When one rank dies, the others are terminated (SIGTERM: the writer marks run.json
    interrupted) and a one-line MemauditError names the rank; `--resume` continues from the
    last checkpoint. Returns the writer's result summary.
    """

    import torch.multiprocessing as mp

    from memaudit.errors import MemauditError

    dims = ParallelDims.from_config(cfg.parallel)
    if cfg.model.name_or_path is None:  # one clear line before any process starts
        from memaudit.models.presets import llama_config

        dims.check_model(llama_config(cfg.model.preset))
    env = env_info()
    if env is not None:
        return _run_here(cfg, run, resume=resume, progress=progress if env.rank == 0 else None)
    resolve_backend(cfg.parallel.dist_backend, dims=dims)  # fail early, with one line
    ctx = mp.get_context("spawn")
    q = ctx.SimpleQueue()
    procs = mp.start_processes(_rank_main, args=(dims.world_size, _free_port(), cfg, str(run.path), resume, q),
                               nprocs=dims.world_size, join=False, start_method="spawn")
    result: dict | None = None

    def drain() -> None:
        nonlocal result
        while not q.empty():
            msg = q.get()
            if msg[0] == "progress" and progress is not None:
                progress(msg[1], msg[2], msg[3])
            elif msg[0] == "result":
                result = msg[1]

    try:
        while not procs.join(timeout=0.5):
            drain()
    except mp.ProcessRaisedException as e:
        last = [ln for ln in str(e).strip().splitlines() if ln.strip()][-1]
        raise MemauditError(f"parallel rank {e.error_index} failed: {last}") from None
    except mp.ProcessExitedException as e:
        raise MemauditError(f"parallel rank {e.error_index} exited with code {e.exit_code}; "
                            "the other ranks were stopped; continue with --resume") from None
    drain()
    if result is None:
        raise MemauditError("the parallel ranks finished without a result; see run.json")
    return result
