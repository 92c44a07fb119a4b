"""The run directory: the contract between train, probe and report.

    RUN_DIR/
      run.json        manifest (version, resolved config, backend, seeds, data fingerprint,
                      status, timings)
      run.lock        pid + host + heartbeat while a process works on the run
      model/          Hugging Face checkpoint + tokenizer
      data/           the prepared corpus exactly as trained (sensitive)
      split.json      held-out users; member and holdout document ids
      canaries.json   inserted, reference and audit canaries (sensitive)
      privacy.json    the DP ledger
      metrics.jsonl   one line per step or round
      state/          everything needed to resume exactly
      probes.json     written by `memaudit probe`

Status is one of running | complete | failed | interrupted. A manifest that says
"running" whose lock names a dead process (or a stale heartbeat) reads as "interrupted".
"""

from __future__ import annotations

import contextlib
import os
import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from memaudit import __version__
from memaudit.errors import RunDirError
from memaudit.io import atomic_write_json, read_json

MANIFEST = "run.json"
LOCK = "run.lock"
HEARTBEAT_S = 5.0
STALE_AFTER_S = 120.0
STATUSES = ("running", "complete", "failed", "interrupted")


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # A zombie (killed, not yet reaped) still answers kill(0); read its state.
    with contextlib.suppress(OSError):
        stat = Path(f"/proc/{pid}/stat").read_text()
        if stat.rsplit(")", 1)[1].split()[0] == "Z":
            return False
    return True


@dataclass(frozen=True)
class RunDir:
    path: Path

    def __init__(self, path: str | os.PathLike) -> None:
        object.__setattr__(self, "path", Path(path))

    # ---- paths
    @property
    def manifest_path(self) -> Path:
        return self.path / MANIFEST

    @property
    def lock_path(self) -> Path:
        return self.path / LOCK

    @property
    def model_dir(self) -> Path:
        return self.path / "model"

    @property
    def data_dir(self) -> Path:
        return self.path / "data"

    @property
    def state_dir(self) -> Path:
        return self.path / "state"

    @property
    def split_path(self) -> Path:
        return self.path / "split.json"

    @property
    def canaries_path(self) -> Path:
        return self.path / "canaries.json"

    @property
    def privacy_path(self) -> Path:
        return self.path / "privacy.json"

    @property
    def metrics_path(self) -> Path:
        return self.path / "metrics.jsonl"

    @property
    def probes_path(self) -> Path:
        return self.path / "probes.json"

    # ---- manifest
    def is_run(self) -> bool:
        return self.manifest_path.is_file()

    def read_manifest(self) -> dict[str, Any]:
        if not self.is_run():
            raise RunDirError(
                f"'{self.path}' is not a memaudit run (no run.json); pass a directory written by "
                "`memaudit train`"
            )
        try:
            return read_json(self.manifest_path)
        except ValueError:
            raise RunDirError(f"'{self.manifest_path}' is corrupt JSON; re-run training") from None

    def write_manifest(self, manifest: dict[str, Any]) -> None:
        atomic_write_json(self.manifest_path, manifest)

    def update_manifest(self, **fields: Any) -> dict[str, Any]:
        m = self.read_manifest()
        m.update(fields)
        self.write_manifest(m)
        return m

    def status(self) -> str:
        """running | complete | failed | interrupted (a dead 'running' run is interrupted)."""
        m = self.read_manifest()
        st = m.get("status", "interrupted")
        if st == "running" and not self.lock_alive():
            return "interrupted"
        return st

    # ---- lock
    def read_lock(self) -> dict[str, Any] | None:
        try:
            return read_json(self.lock_path)
        except (FileNotFoundError, ValueError):
            return None

    def lock_alive(self) -> bool:
        lock = self.read_lock()
        if lock is None:
            return False
        if lock.get("host") == socket.gethostname():
            return _pid_alive(int(lock["pid"]))
        return time.time() - float(lock.get("heartbeat", 0)) < STALE_AFTER_S

    @contextlib.contextmanager
    def locked(self, *, heartbeat_s: float = HEARTBEAT_S) -> Iterator[None]:
        """Hold run.lock with a heartbeat thread for the duration of the block."""
        if self.lock_alive():
            lock = self.read_lock() or {}
            raise RunDirError(
                f"run '{self.path}' is in use by live process {lock.get('pid')}; wait for it to "
                "finish or stop it first"
            )
        self.path.mkdir(parents=True, exist_ok=True)
        stop = threading.Event()

        def beat() -> None:
            atomic_write_json(
                self.lock_path,
                {"pid": os.getpid(), "host": socket.gethostname(), "heartbeat": time.time()},
            )

        beat()

        def loop() -> None:
            while not stop.wait(heartbeat_s):
                with contextlib.suppress(OSError):
                    beat()

        t = threading.Thread(target=loop, name="memaudit-heartbeat", daemon=True)
        t.start()
        try:
            yield
        finally:
            stop.set()
            t.join(timeout=2 * heartbeat_s)
            with contextlib.suppress(FileNotFoundError):
                self.lock_path.unlink()


def new_manifest(
    *, config: dict[str, Any], backend: str, seeds: dict[str, Any], data_fingerprint: str | None
) -> dict[str, Any]:
    return {
        "memaudit_version": __version__,
        "backend": backend,
        "config": config,
        "seeds": seeds,
        "data_fingerprint": data_fingerprint,
        "status": "running",
        "timings": {"created": time.time()},
    }


def prepare_new_run(path: str | os.PathLike, *, overwrite: bool) -> RunDir:
    """Check that `path` may receive a new run. Nothing on disk is touched on refusal."""
    rd = RunDir(path)
    if rd.path.exists() and not rd.path.is_dir():
        raise RunDirError(f"output '{rd.path}' exists and is not a directory; choose another --out")
    if rd.is_run():
        if rd.lock_alive():
            raise RunDirError(f"run '{rd.path}' is being written by a live process; choose another --out")
        st = rd.status()
        if not overwrite:
            hint = "use --resume to continue it" if st == "interrupted" else "pass --overwrite to replace it"
            raise RunDirError(f"output '{rd.path}' already holds a {st} run; {hint}")
    elif rd.path.is_dir() and any(rd.path.iterdir()) and not overwrite:
        raise RunDirError(
            f"output '{rd.path}' is a non-empty directory that is not a run; choose an empty --out "
            "or pass --overwrite"
        )
    return rd


def open_for_resume(path: str | os.PathLike) -> RunDir:
    rd = RunDir(path)
    if not rd.path.is_dir() or not rd.is_run():
        raise RunDirError(
            f"--resume '{rd.path}' is not a memaudit run (no run.json); pass a run directory"
        )
    if rd.lock_alive():
        lock = rd.read_lock() or {}
        raise RunDirError(
            f"run '{rd.path}' is still alive (process {lock.get('pid')}); stop it before --resume"
        )
    return rd
