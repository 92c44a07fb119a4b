"""Session fixtures: the serial reference, and one spawned gloo group per world size."""

from __future__ import annotations

import fcntl
import json
import os
import socket
from pathlib import Path

import pytest
import torch

from tests.parallel import _workers


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="session")
def serial_ref(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict, Path]:
    torch.set_num_threads(1)  # 2 shared cores: threads only add contention
    ref = _workers.serial_reference()
    path = tmp_path_factory.mktemp("ref") / "ref.pt"
    torch.save(ref, path)
    return ref, path


_CACHE: dict[int, dict[str, str | None]] = {}


def _spawn_world(world: int, ref_path: Path, out: Path, jobs_path: Path) -> dict[str, str | None]:
    """Spawn `world` gloo processes once; every case's error (None = passed), merged over ranks."""
    import torch.multiprocessing as mp

    from memaudit.run.launch import rank_context

    out.mkdir(parents=True, exist_ok=True)
    # fork from a server that imported torch (and peft, for the LoRA cases) once
    rank_context(("tests.parallel._workers", "peft"))
    mp.start_processes(_workers.worker, args=(world, _free_port(), str(out), str(ref_path), str(jobs_path)),
                       nprocs=world, join=True, start_method="forkserver")
    merged: dict[str, str | None] = {}
    for r in range(world):
        for k, v in json.loads((out / f"rank{r}.json").read_text()).items():
            merged[k] = merged.get(k) or (f"rank {r}: {v}" if v else None)
    return merged


def world_results(world: int, ref_path: Path, tmp: Path, jobs_path: Path,
                  shared: Path | None = None) -> dict[str, str | None]:
    """Every case's error of the `world`-process group, spawned once per test session.

    Under pytest-xdist the test files that read a world (equivalence, LoRA, trainer) may run on
    different workers: the first to ask spawns it under a file lock in `shared` (the workers'
    common temporary folder) and writes the merged results there; the others wait for the lock
    and read them, instead of spawning the same group a second time on the same cores."""
    if world in _CACHE:
        return _CACHE[world]
    if shared is None:
        _CACHE[world] = _spawn_world(world, ref_path, tmp / f"w{world}", jobs_path)
        return _CACHE[world]
    shared.mkdir(parents=True, exist_ok=True)
    done = shared / f"w{world}.json"
    with open(shared / f"w{world}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        if not done.is_file():
            merged = _spawn_world(world, ref_path, shared / f"w{world}", jobs_path)
            tmp_done = done.with_suffix(".tmp")
            tmp_done.write_text(json.dumps(merged))
            os.replace(tmp_done, done)
    _CACHE[world] = json.loads(done.read_text())
    return _CACHE[world]


def _shared(tmp_path_factory: pytest.TempPathFactory) -> Path | None:
    """Under pytest-xdist, the workers' common folder (pytest-xdist's documented way to share a
    session fixture); None in one process."""
    if not os.environ.get("PYTEST_XDIST_WORKER"):
        return None
    return tmp_path_factory.getbasetemp().parent / "grid-worlds"


@pytest.fixture(scope="session")
def train_runs(tmp_path_factory, tiny_corpus) -> tuple[Path, Path]:
    """(jobs file the workers read, folder where they write their runs of the Trainer on the grid's
    layout: shared by the pytest workers, since one of them spawns each world)."""
    base = tmp_path_factory.mktemp("train_jobs")
    jobs = base / "jobs.json"
    shared = _shared(tmp_path_factory)
    runs = (shared / "train_runs") if shared is not None else base / "runs"
    runs.mkdir(parents=True, exist_ok=True)
    # the corpus is the same on every worker (`data synth --seed 1`)
    jobs.write_text(json.dumps({"corpus": str(tiny_corpus), "out": str(runs)}))
    return jobs, runs


@pytest.fixture(scope="session")
def results(serial_ref, train_runs, tmp_path_factory):
    _, path = serial_ref
    tmp = tmp_path_factory.mktemp("worlds")
    shared = _shared(tmp_path_factory)
    return lambda world: world_results(world, path, tmp, train_runs[0], shared)
