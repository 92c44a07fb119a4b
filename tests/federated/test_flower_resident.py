"""A SuperNode's resident process (`memaudit.federated.flower.node`, `memaudit.federated.flower.resident`):
the ClientApp Flower starts per message imports no JAX and forwards to it; it answers as the
in-process ClientApp does (the same checks), only to a client holding its key, and goes away
with the process it watches. The weights of whole Flower runs through residents equal the
in-JAX program's in test_flower_deploy.py."""

from __future__ import annotations

import fcntl
import hashlib
import os
import shutil
import signal
import socket
import stat
import subprocess
import sys
import tempfile
import time
from multiprocessing import AuthenticationError
from multiprocessing.connection import Client

import numpy as np
import pytest

from memaudit.federated.flower import node as flower_node
from memaudit.federated.flower import wire
from memaudit.federated.flower.apps import answer, open_node
from memaudit.federated.flower.execute import call_to_wire
from tests.federated.test_flower_node_trust import _identity_call


def test_the_clientapp_flower_starts_per_message_imports_no_jax():
    code = ("import sys, memaudit.federated.flower.node as f; "
            "assert f.client_app is not None and f.server_app is not None; "
            "print(sorted(m for m in ('jax', 'flax', 'optax', 'torch') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


@pytest.fixture()
def node_config(tmp_path):
    part = tmp_path / "node-0.npz"
    rng = np.random.default_rng(0)
    np.savez(part, users=np.asarray(["u0", "u1"]), input_ids=rng.integers(0, 50, (2, 2, 4)).astype(np.int32),
             attention_mask=np.ones((2, 2, 4), np.int32), example_mask=np.ones((2, 2), np.float32))
    (tmp_path / "manifest.json").write_text(
        '{"schema": 1, "stages": [], "resident": [], "policy": null, "dp": null}')
    return {"partition": str(part), "manifest": str(tmp_path / "manifest.json"), "cache-dir": str(tmp_path / "cache")}


def test_a_resident_answers_as_the_clientapp_only_to_its_key_and_leaves_with_its_supernode(node_config, monkeypatch):
    watched = subprocess.Popen(["sleep", "600"])  # the SuperExec that starts the ClientApps
    try:
        d = flower_node.resident_dir()
        name = flower_node.resident_name(node_config, 3, watched.pid)
        sock, key = d / f"{name}.sock", d / f"{name}.key"

        def ask(kind, payload):
            return wire.unpack(flower_node.ask(flower_node.resident(node_config, 3, watched.pid), kind, 7, payload))

        def here(kind, payload):  # the in-process ClientApp's answer
            return answer(kind, lambda: open_node(node_config, 3, 7), payload)

        hello = ask("hello", b"")
        assert hello == here("hello", b"") and hello["users"] == ["u0", "u1"] and len(hello["digests"]) == 2
        # a module not in the node's manifest (an identity over the node's rows): refused, no data
        call = wire.pack(call_to_wire(_identity_call()))
        refused = ask("stage", call)
        assert refused == here("stage", call) and set(refused) == {"refused"}
        assert "not one of this node's 0 allowed" in refused["refused"]

        # the same resident answers every later message: no second start
        monkeypatch.setattr(flower_node, "_start", lambda *a: pytest.fail("a second resident was started"))
        assert ask("hello", b"")["users"] == ["u0", "u1"]
        head = flower_node.resident(node_config, 3, watched.pid)
        with pytest.raises(RuntimeError, match=r"resident process failed \(ValueError\)"):
            flower_node.ask(head, "shell", 7, b"")  # not a request it knows: one line, no traceback

        # only this user can reach it
        assert stat.S_IMODE(d.stat().st_mode) == 0o700
        assert stat.S_IMODE(key.stat().st_mode) == 0o600 and stat.S_IMODE(sock.stat().st_mode) == 0o600
        # an attacker without the key (another program on the node) is refused, and the node goes on
        with pytest.raises(AuthenticationError):
            Client(str(sock), family="AF_UNIX", authkey=b"\0" * 32)
        assert ask("hello", b"")["users"] == ["u0", "u1"]
    finally:
        watched.kill()
        watched.wait()
    deadline = time.monotonic() + 30
    while sock.exists() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not sock.exists() and not key.exists()  # gone with the SuperNode, its key with it
    assert not (d / f"{name}.pid").exists()


def test_a_resident_off_node_config_runs_the_message_in_the_clientapp_process(node_config, monkeypatch):
    """``resident='false'``: the ClientApp answers in its own process (no socket, no resident)."""
    import types

    import flwr  # noqa: F401 - installed by the set-up (.[flower]): missing it is a failure, not a skip

    from memaudit.federated.flower import apps

    monkeypatch.setattr(apps, "_reply", lambda message, obj: obj)
    monkeypatch.setattr(flower_node, "resident", lambda *a: pytest.fail("a resident was asked"))
    msg = types.SimpleNamespace(metadata=types.SimpleNamespace(message_type="query.memaudit_hello"),
                                content=wire.record(b""))
    ctx = types.SimpleNamespace(node_config={**node_config, "resident": "false"}, node_id=3, run_id=7)
    body = flower_node._forward(msg, ctx)
    assert body == answer("hello", lambda: open_node(node_config, 3, 7), b"") and body["users"] == ["u0", "u1"]


@pytest.fixture()
def own_dir(monkeypatch):
    """`flower_node.resident_dir()` in a folder of this test's own (short: a socket's path has at most
    107 bytes), so that no other run's residents are in it."""
    root = tempfile.mkdtemp(prefix="memaudit-")
    monkeypatch.setattr(tempfile, "tempdir", root)
    yield flower_node.resident_dir()
    shutil.rmtree(root, ignore_errors=True)


def test_a_killed_residents_socket_and_key_are_swept_when_the_next_resident_starts(node_config, own_dir, monkeypatch):
    """A resident SIGKILLed (or killed by the OOM killer) cannot remove its files: the next resident
    started on the node removes them (the key is a secret), and leaves a live resident's alone."""
    watched = subprocess.Popen(["sleep", "600"])  # the SuperExec that starts the ClientApps
    started, popen = [], subprocess.Popen
    monkeypatch.setattr(flower_node.subprocess, "Popen", lambda *a, **k: started.append(popen(*a, **k)) or started[-1])
    try:
        def files(name):
            return sorted(p.name[len(name):] for p in own_dir.glob(f"{name}.*"))

        def hello(node_id):
            conn = flower_node.resident(node_config, node_id, watched.pid)
            return wire.unpack(flower_node.ask(conn, "hello", 7, b""))["users"]

        live, killed = (flower_node.resident_name(node_config, i, watched.pid) for i in (3, 4))
        assert hello(3) == hello(4) == ["u0", "u1"] and len(started) == 2
        live_files = files(live)
        assert {".sock", ".key", ".lock"} <= set(files(killed))
        started[1].send_signal(signal.SIGKILL)
        os.waitid(os.P_PID, started[1].pid, os.WEXITED | os.WNOWAIT)  # dead, not reaped: a zombie
        assert {".sock", ".key", ".lock"} <= set(files(killed))  # left behind
        said = (own_dir / f"{killed}.log").stat().st_size > 0

        assert hello(5) == ["u0", "u1"] and len(started) == 3  # another resident starts: it sweeps
        assert files(killed) == ([".log"] if said else [])  # a log that says something is kept
        assert files(live) == live_files  # the live resident's files are untouched, and it answers
        assert hello(3) == ["u0", "u1"] and len(started) == 3
    finally:
        watched.kill()
        watched.wait()
        for p in started:  # each leaves with the process it watches
            p.wait(timeout=30)


def test_the_sweep_removes_only_what_no_live_or_starting_resident_holds(own_dir):
    """Only the files of a resident that is gone: its recorded pid is dead (or now another process's),
    no starter holds its lock, or it never recorded a pid and is older than the start timeout and
    nothing listens on its socket (a resident of a memaudit before pid files)."""
    watched = subprocess.Popen(["sleep", "600"])
    gone = subprocess.Popen(["true"])
    gone.wait()
    old = time.time() - flower_node.START_TIMEOUT_S - 60
    listening = socket.socket(socket.AF_UNIX)
    held = None

    def make(tag, pid=None, start="", log=b"", age=None):
        name = hashlib.sha256(tag.encode()).hexdigest()[:20]
        for suffix in (".key", ".lock", ".sock"):
            (own_dir / f"{name}{suffix}").write_bytes(b"k" * 32 if suffix == ".key" else b"")
        (own_dir / f"{name}.log").write_bytes(log)
        if pid is not None:
            (own_dir / f"{name}.pid").write_text(f"{pid} {start}\n")
        for p in own_dir.glob(f"{name}.*"):
            os.utime(p, (age, age) if age else None)
        return name

    try:
        start = flower_node._process_start(watched.pid)
        make("live", watched.pid, start)
        reused = make("reused", watched.pid, "1")  # the pid is now another process's
        dead, dead_said = make("dead", gone.pid), make("dead, its log says why", gone.pid, log=b"MemoryError\n")
        starting = make("starting", gone.pid)
        held = open(own_dir / f"{starting}.lock", "a")  # noqa: SIM115
        fcntl.flock(held, fcntl.LOCK_EX)  # a starter holds its lock
        make("young")  # its starter may still be at work
        never = make("never started", age=old)
        legacy = make("legacy", age=old)
        (own_dir / f"{legacy}.sock").unlink()
        listening.bind(str(own_dir / f"{legacy}.sock"))
        listening.listen()
        (own_dir / "notes.txt").write_text("mine")
        before = {p.name for p in own_dir.iterdir()}

        swept = flower_node.sweep_residents()
        assert sorted(swept) == sorted([dead, dead_said, never] + ([reused] if start else []))
        left = {p.name for p in own_dir.iterdir()}
        assert before - left == {f"{n}.{s}" for n in swept for s in ("key", "lock", "sock", "pid", "log")
                                 if f"{n}.{s}" in before} - {f"{dead_said}.log"}
        assert (own_dir / f"{dead_said}.log").read_bytes() == b"MemoryError\n"
        assert stat.S_IMODE(own_dir.stat().st_mode) == 0o700
        assert flower_node.sweep_residents() == []
    finally:
        watched.kill()
        watched.wait()
        listening.close()
        if held:
            held.close()
