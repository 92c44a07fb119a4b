"""Session fixtures: the serial reference, and one spawned gloo group per world size."""

from __future__ import annotations

import json
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


def world_results(world: int, ref_path: Path, tmp: Path, jobs_path: Path) -> dict[str, str | None]:
    """Spawn `world` gloo processes once; every case's error (None = passed), merged over ranks."""
    if world not in _CACHE:
        import torch.multiprocessing as mp

        out = tmp / f"w{world}"
        out.mkdir(parents=True, exist_ok=True)
        from memaudit.parallel.launch import rank_context

        # fork from a server that imported torch (and peft, for the LoRA cases) once
        rank_context(("tests.parallel._workers", "peft"))
        mp.start_processes(_workers.worker, args=(world, _free_port(), str(out), str(ref_path), str(jobs_path)),
                           nprocs=world, join=True, start_method="forkserver")
        merged: dict[str, str | None] = {}
        for r in range(world):
            for k, v in json.loads((out / f"rank{r}.json").read_text()).items():
                merged[k] = merged.get(k) or (f"rank {r}: {v}" if v else None)
        _CACHE[world] = merged
    return _CACHE[world]


@pytest.fixture(scope="session")
def train_runs(tmp_path_factory, tiny_corpus) -> tuple[Path, Path]:
    """(jobs file the workers read, folder where they write their runs of the Trainer on the grid's layout)."""
    base = tmp_path_factory.mktemp("train_jobs")
    jobs = base / "jobs.json"
    jobs.write_text(json.dumps({"corpus": str(tiny_corpus), "out": str(base / "runs")}))
    (base / "runs").mkdir()
    return jobs, base / "runs"


@pytest.fixture(scope="session")
def results(serial_ref, train_runs, tmp_path_factory):
    _, path = serial_ref
    tmp = tmp_path_factory.mktemp("worlds")
    return lambda world: world_results(world, path, tmp, train_runs[0])
