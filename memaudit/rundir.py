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
import json
import math
import os
import secrets
import socket
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, Self

from memaudit import __version__
from memaudit.backends import BACKENDS, backend_name
from memaudit.errors import MemauditError, RunDirError
from memaudit.io import atomic_write_bytes, atomic_write_json, read_json

MANIFEST = "run.json"
LOCK = "run.lock"
HEARTBEAT_S = 5.0
STALE_AFTER_S = 120.0
UNREADABLE_STALE_S = 30.0  # an unreadable run.lock older than this is stale
# Everything a training run writes (the run-directory contract), and nothing else.
RUN_ARTIFACTS = ("model", "adapter", "data", "state", "split.json", "canaries.json", "privacy.json",
                 "metrics.jsonl", "sensitive_metrics.jsonl", "dp_secret.json", "probes.json", "probes.partial.json", "run.json")
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


def _normalise_lock(lock: Any) -> dict[str, Any]:
    """run.lock's fields with their types, or {} when they are not all there."""
    if not isinstance(lock, dict):
        return {}
    try:
        return {"pid": int(lock["pid"]), "host": str(lock["host"]),
                "heartbeat": float(lock["heartbeat"]), "token": str(lock.get("token", ""))}
    except (KeyError, TypeError, ValueError):
        return {}


@dataclass(frozen=True)
class RunDir:
    path: Path
    what: ClassVar[str] = "run"  # in messages
    lock_name: ClassVar[str] = LOCK

    def __init__(self, path: str | os.PathLike) -> None:
        object.__setattr__(self, "path", Path(path))

    # ---- paths
    @property
    def manifest_path(self) -> Path:
        return self.path / MANIFEST

    @property
    def lock_path(self) -> Path:
        return self.path / self.lock_name

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

    @property
    def probes_partial_path(self) -> Path:
        """The probes an interrupted probe stage finished (sensitive: 0600; `run_probes(partial=)`)."""
        return self.path / "probes.partial.json"

    # ---- manifest
    def is_run(self) -> bool:
        return self.manifest_path.is_file()

    def read_manifest(self) -> dict[str, Any]:
        """run.json, checked to be a memaudit manifest (a dict with a known status)."""
        if not self.is_run():
            raise RunDirError(
                f"'{self.path}' is not a memaudit run (no run.json); pass a directory written by "
                "`memaudit train`"
            )
        m = read_json(self.manifest_path, what="run manifest")
        if not isinstance(m, dict) or m.get("status") not in STATUSES:
            raise RunDirError(f"'{self.manifest_path}' is not a memaudit run manifest (no valid "
                              "status); restore it from a backup or start a new run with --out")
        for key, kind in (("config", dict), ("backend", str)):
            if key in m and not isinstance(m[key], kind):
                raise RunDirError(f"'{self.manifest_path}' has a malformed '{key}'; restore it from a "
                                  "backup or start a new run with --out")
        return m

    def write_manifest(self, manifest: dict[str, Any]) -> None:
        atomic_write_json(self.manifest_path, manifest)

    def update_manifest(self, **fields: Any) -> dict[str, Any]:
        m = self.read_manifest()
        m.update(fields)
        self.write_manifest(m)
        return m

    def status(self) -> str:
        """running | complete | failed | interrupted (a dead 'running' run is interrupted)."""
        st = self.read_manifest()["status"]
        if st == "running" and not self.lock_alive():
            return "interrupted"
        return st

    # ---- lock
    def read_lock(self) -> dict[str, Any] | None:
        """run.lock's fields, or None when there is no lock; {} when it is unreadable."""
        try:
            lock = read_json(self.lock_path, what="run lock")
        except FileNotFoundError:
            return None
        except MemauditError:
            return {}
        return _normalise_lock(lock)

    def lock_alive(self) -> bool:
        lock = self.read_lock()
        if lock is None:
            return False
        if not lock:  # unreadable: alive while it is young (being written), stale after that
            return self._lock_age() < UNREADABLE_STALE_S
        if lock["host"] == socket.gethostname():
            return _pid_alive(lock["pid"])
        return time.time() - lock["heartbeat"] < STALE_AFTER_S

    def lock_holder(self) -> str:
        """Who holds run.lock, for messages."""
        lock = self.read_lock()
        name = self.lock_name
        if lock:
            return f"process {lock['pid']} on {lock['host']}, {name}"
        return (f"{name} is unreadable and recent; if no memaudit process works on this "
                f"{self.what}, delete {name}")

    def read_lock_file(self, path: Path) -> dict[str, Any] | None:
        try:
            return _normalise_lock(read_json(path, what="run lock"))
        except (FileNotFoundError, MemauditError):
            return None

    def _lock_age(self) -> float:
        try:
            return time.time() - self.lock_path.stat().st_mtime
        except FileNotFoundError:
            return math.inf

    def locked(self, *, heartbeat_s: float = HEARTBEAT_S) -> contextlib.AbstractContextManager[RunLock]:
        """Hold run.lock (atomic O_EXCL create, heartbeat thread) for the duration of the block."""
        return RunLock(self, heartbeat_s=heartbeat_s)


class RunLock:
    """An exclusive lock on a run directory that also holds on NFS and Lustre.

    The lock is a file created with O_CREAT | O_EXCL (atomic on every POSIX file system
    memaudit supports, unlike flock), holding pid, host, a random token and a heartbeat that
    a thread refreshes. A lock whose process is dead (same host) or whose heartbeat stopped
    (another host) is stale: a newcomer moves it aside under a unique name, checks that what
    it moved is the stale lock it judged (and puts it back with an atomic link otherwise),
    and then creates its own. When the heartbeat finds another token in the file, the lock
    was lost: `lost` is set and the holder stops at its next metrics line.
    """

    def __init__(self, run: RunDir, *, heartbeat_s: float = HEARTBEAT_S) -> None:
        self.run, self.heartbeat_s = run, heartbeat_s
        self.token = secrets.token_hex(16)
        self.lost = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._made_dir = False

    def _payload(self) -> bytes:
        return (json.dumps({"pid": os.getpid(), "host": socket.gethostname(), "heartbeat": time.time(),
                            "token": self.token}) + "\n").encode()

    def _create(self) -> bool:
        path = self.run.lock_path
        try:
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            return False
        with os.fdopen(fd, "wb") as f:
            f.write(self._payload())
            f.flush()
            os.fsync(f.fileno())
        return True

    def _break_stale(self, seen: dict[str, Any] | None) -> None:
        path = self.run.lock_path
        aside = path.with_name(f".{path.name}.stale-{self.token}")
        try:
            os.rename(path, aside)
        except FileNotFoundError:
            return  # someone else broke it first
        moved = self.run.read_lock_file(aside)
        if moved and moved != seen:
            with contextlib.suppress(FileExistsError):  # a live lock: put it back, never clobber
                os.link(aside, path)
        with contextlib.suppress(FileNotFoundError):
            aside.unlink()

    def __enter__(self) -> Self:
        self._made_dir = not self.run.path.exists()
        self.run.path.mkdir(parents=True, exist_ok=True)
        for _ in range(8):
            if self._create():
                break
            seen = self.run.read_lock()
            if self.run.lock_alive():
                raise RunDirError(f"{self.run.what} '{self.run.path}' is in use ({self.run.lock_holder()}); "
                                  "wait for it to finish or stop it first")
            self._break_stale(seen)
        else:
            raise RunDirError(f"could not take '{self.run.lock_path}': other processes keep "
                              f"taking it; make sure only one memaudit works on this {self.run.what}")
        self._thread = threading.Thread(target=self._beat, name="memaudit-heartbeat", daemon=True)
        self._thread.start()
        return self

    def _beat(self) -> None:
        while not self._stop.wait(self.heartbeat_s):
            lock = self.run.read_lock()
            if lock is not None and lock and lock.get("token") != self.token:
                self.lost.set()
                return
            with contextlib.suppress(OSError):
                atomic_write_bytes(self.run.lock_path, self._payload())

    def check(self) -> None:
        """Raise if another process took this lock (after judging ours stale)."""
        if self.lost.is_set():
            raise RunDirError(f"{self.run.what} '{self.run.path}' was taken over by another process "
                              f"({self.run.lock_name} changed); stop the other process, then --resume")

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=2 * self.heartbeat_s)
        lock = self.run.read_lock()
        if lock and lock.get("token") == self.token:
            with contextlib.suppress(FileNotFoundError):
                self.run.lock_path.unlink()
        if self._made_dir:  # a refused or failed start leaves no empty folder behind
            with contextlib.suppress(OSError):
                self.run.path.rmdir()


class SweepDir(RunDir):
    """A sweep's --out folder, for its lock only: `sweep.lock` (the run lock's protocol: O_EXCL
    create, pid, host, heartbeat; a dead holder's lock is taken over), held by the process that
    drives the sweep, so that two sweeps never write one folder."""

    what: ClassVar[str] = "sweep"
    lock_name: ClassVar[str] = "sweep.lock"


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


def _listing(path: Path, limit: int = 3) -> str:
    names = sorted(p.name for p in path.iterdir())
    more = f" and {len(names) - limit} more" if len(names) > limit else ""
    return ", ".join(names[:limit]) + more


def check_output_folder(path: Path, *, what: str) -> None:
    """One line for a folder that cannot be made: `path` is a file, or lies under one."""
    if path.exists() and not path.is_dir():
        raise RunDirError(f"{what} '{path}' exists and is not a directory; choose another --out")
    for parent in path.parents:
        if parent.exists():
            if not parent.is_dir():
                raise RunDirError(f"{what} '{path}' lies under '{parent}', which is a file; "
                                  "choose another --out")
            return


def written_by_memaudit(manifest: dict[str, Any]) -> bool:
    """Whether run.json is a manifest memaudit wrote (`new_manifest`): its version, backend and
    config are there with their types, not only a `status` field."""
    return (isinstance(manifest.get("memaudit_version"), str)
            and backend_name(manifest.get("backend")) in BACKENDS
            and isinstance(manifest.get("config"), dict))


def require_memaudit_manifest(rd: RunDir) -> None:
    """Refuse to replace a folder whose run.json memaudit did not write (one line, nothing
    touched): `--overwrite` deletes only what memaudit made."""
    if not written_by_memaudit(rd.read_manifest()):
        raise RunDirError(f"'{rd.manifest_path}' was not written by memaudit (no memaudit_version, "
                          "backend and config), so --overwrite does not replace this folder; "
                          "choose another --out")


def prepare_new_run(path: str | os.PathLike, *, overwrite: bool) -> RunDir:
    """Check that `path` may receive a new run. Nothing on disk is touched, whatever the answer.

    `--overwrite` replaces a memaudit run only; a folder that is not one is refused (its files
    are not memaudit's to delete), and so is a run that a live process is writing.
    """
    rd = RunDir(path)
    check_output_folder(rd.path, what="output")
    if rd.is_run():
        if rd.lock_alive():
            raise RunDirError(f"run '{rd.path}' is being written by a live process ({rd.lock_holder()}); "
                              "choose another --out")
        st = rd.status()
        if overwrite:
            require_memaudit_manifest(rd)
        if not overwrite:
            hint = "use --resume to continue it" if st == "interrupted" else "pass --overwrite to replace it"
            raise RunDirError(f"output '{rd.path}' already holds a {st} run; {hint}")
    elif rd.path.is_dir() and any(rd.path.iterdir()):
        raise RunDirError(
            f"output '{rd.path}' is a non-empty directory that is not a memaudit run (it holds "
            f"{_listing(rd.path)}); choose an empty or new --out"
        )
    return rd


def open_for_resume(path: str | os.PathLike) -> RunDir:
    rd = RunDir(path)
    if not rd.path.is_dir() or not rd.is_run():
        raise RunDirError(
            f"--resume '{rd.path}' is not a memaudit run (no run.json); pass a run directory"
        )
    rd.read_manifest()  # a malformed manifest is one line here, before anything else
    if rd.lock_alive():
        raise RunDirError(f"run '{rd.path}' is still alive ({rd.lock_holder()}); stop it before --resume")
    return rd
