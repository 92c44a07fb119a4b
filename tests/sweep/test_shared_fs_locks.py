"""run.lock on a file system shared by several hosts (scheduler jobs on other nodes): O_EXCL
keeps a second host out while the holder beats; a lock from another host is judged by its
heartbeat only (its pid means nothing here), a lock from this host by its pid."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time

import pytest

from memaudit.errors import RunDirError
from memaudit.rundir import STALE_AFTER_S, RunDir


def _as_host(monkeypatch, name: str) -> None:
    monkeypatch.setattr(socket, "gethostname", lambda: name)


def _write_lock(rd: RunDir, *, host: str, pid: int, age_s: float) -> None:
    rd.path.mkdir(parents=True, exist_ok=True)
    rd.lock_path.write_text(json.dumps({"pid": pid, "host": host, "heartbeat": time.time() - age_s,
                                        "token": "t" * 32}))


def _dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


def test_two_hosts_cannot_both_hold_a_run(tmp_path, monkeypatch):
    rd = RunDir(tmp_path / "run")
    _as_host(monkeypatch, "node-a")
    with rd.locked(heartbeat_s=60):  # no beat while the test plays the other host
        _as_host(monkeypatch, "node-b")
        assert rd.lock_alive()
        with pytest.raises(RunDirError, match="in use .*node-a"), rd.locked():
            pass
        _as_host(monkeypatch, "node-a")
    assert not rd.lock_path.exists()


def test_other_hosts_lock_is_judged_by_heartbeat_not_pid(tmp_path, monkeypatch):
    _as_host(monkeypatch, "node-b")
    rd = RunDir(tmp_path / "run")
    # our own pid is alive on this host, but on node-a it names nothing: a stopped heartbeat is stale
    _write_lock(rd, host="node-a", pid=os.getpid(), age_s=STALE_AFTER_S + 5)
    assert not rd.lock_alive()
    with rd.locked() as lock:
        assert json.loads(rd.lock_path.read_text())["token"] == lock.token
    # a dead pid here, but a fresh heartbeat from node-a: alive, refused
    _write_lock(rd, host="node-a", pid=_dead_pid(), age_s=1.0)
    assert rd.lock_alive()
    with pytest.raises(RunDirError, match="in use"), rd.locked():
        pass


def test_this_hosts_lock_is_judged_by_pid(tmp_path, monkeypatch):
    _as_host(monkeypatch, "node-b")
    rd = RunDir(tmp_path / "run")
    _write_lock(rd, host="node-b", pid=_dead_pid(), age_s=0.0)  # fresh beat, dead process
    assert not rd.lock_alive()
    with rd.locked():
        pass
