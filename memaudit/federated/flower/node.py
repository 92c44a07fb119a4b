"""memaudit's Flower apps as a SuperNode loads them, without JAX.

Flower 1.42's SuperExec starts a new ``flwr-clientapp`` process for every message a SuperNode
receives (memaudit's SuperNode, `memaudit.federated.flower.supernode`, runs this ClientApp in one
long-lived SuperExec process instead: `memaudit.federated.flower.superexec`). A
ClientApp that imported JAX, read its partition and deserialised its client stages in that
process paid seconds of start-up per message, four times a round under secure aggregation. Here
the ClientApp only forwards the message's payload (memaudit's one bytes field,
`memaudit.federated.flower.wire`) to the node's **resident process**
(`memaudit.federated.flower.resident`), which keeps JAX, the partition, the manifest, the
deserialised stages and their compiled executables, and a round's kept values, across messages
and rounds, and answers with the reply's payload.

The resident is started by the first message and lives as long as the SuperNode: it is a child
in the SuperNode's process group (killing the SuperNode's group kills it), it exits when the
ClientApp's parent is gone (Flower's SuperExec, itself watching the SuperNode; on memaudit's
SuperNode the SuperNode itself), and after ``resident-idle`` seconds without a message (node
config, default 900). It listens on a Unix socket in a folder only this user can enter (0700,
checked), and answers only a client that proves it holds a 32-byte key in a 0600 file there
(``multiprocessing``'s HMAC challenge); bytes travel as bytes, never pickled. One resident
serves one node config (partition, manifest, node key, cache folder) of one SuperNode.
``resident=false`` in the node config runs each message in the ``flwr-clientapp`` process
instead (`memaudit.federated.flower.apps`).

A resident killed without leaving (SIGKILL, the OOM killer) cannot remove its socket and key:
whoever starts a resident first removes those of every resident that is gone (`sweep_residents`).

Everything the node checks (the stage manifest, the policy, the DP bound, the partition's users)
is checked by the resident exactly as by the in-process ClientApp: the same code
(`memaudit.federated.flower.apps.answer`). Before that, the ClientApp answers a message only when
the server key of the node's manifest signed it for its run and this node
(`memaudit.federated.flower.messages.server_refusal`); any other gets an error and reaches no resident.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import re
import secrets
import socket
import stat
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from multiprocessing.connection import Client, Connection
from pathlib import Path
from typing import Any

from memaudit.federated.flower.messages import (
    HELLO,
    KINDS,
    SECAGG,
    STAGE,
    manifest_server,
    payload_of,
    record,
    server_refusal,
)

START_TIMEOUT_S = 120.0
# a resident's files in `resident_dir`: <name>.sock, .key, .lock, .pid (and .pid.tmp while written), .log
_FILE = re.compile(r"([0-9a-f]{20})\.(sock|key|lock|pid|pid\.tmp|log)")


def _flag(value: Any, default: bool) -> bool:
    if value is None:
        return default
    return str(value).strip().lower() not in ("0", "false", "no", "off")


def resident_dir() -> Path:
    """The folder of this user's resident sockets and keys: created 0700, refused when another
    user owns it or others may write to it."""
    d = Path(tempfile.gettempdir()) / f"memaudit-resident-{os.getuid()}"
    d.mkdir(mode=0o700, exist_ok=True)
    st = d.lstat()
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & 0o077:
        raise PermissionError(f"{d} is not a folder only this user can enter; remove it")
    return d


def resident_name(node_config: dict[str, Any], node_id: int, watch_pid: int) -> str:
    """One resident per node config and SuperNode (the pid of the ClientApp's parent: Flower's
    SuperExec, or on memaudit's SuperNode the SuperNode)."""
    conf = {str(k): str(v) for k, v in node_config.items()}
    blob = json.dumps([conf, int(node_id), int(watch_pid), sys.executable], sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:20]


def _connect(sock: Path, key: Path) -> Connection | None:
    if not (sock.exists() and key.is_file()):
        return None
    try:
        return Client(str(sock), family="AF_UNIX", authkey=key.read_bytes())
    except (ConnectionRefusedError, FileNotFoundError):
        return None


def _process_start(pid: int) -> str | None:
    """When live process `pid` started (Linux: clock ticks after boot, from ``/proc/<pid>/stat``;
    ``""`` where there is no ``/proc``), or None: no such process, or a zombie (killed, not reaped)."""
    if pid <= 0:
        return None
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        if Path("/proc/self/stat").exists():
            return None  # Linux: no such process of this user's (they are all listed)
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return None
        except PermissionError:  # exists, another user's
            pass
        return ""
    return None if fields[0] in ("Z", "X") else fields[19]


def _record_pid(d: Path, name: str, pid: int) -> None:
    """``<name>.pid``: the resident's pid and start time, 0600, written whole (a rename)."""
    tmp = d / f"{name}.pid.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(f"{pid} {_process_start(pid) or ''}\n")
    os.replace(tmp, d / f"{name}.pid")


def _listening(sock: Path) -> bool:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(1.0)
    try:
        s.connect(str(sock))
        return True
    except OSError:
        return False
    finally:
        s.close()


def _gone(d: Path, name: str) -> bool:
    """Whether resident `name` is gone: its recorded process is dead, or is now another process
    (pid reuse, told by the start time where ``/proc`` has it: elsewhere a live pid counts as the
    resident). With no pid recorded (a starter that died before recording it, or a resident of a
    memaudit before pid files): its files are older than `START_TIMEOUT_S` and nothing listens on its
    socket."""
    try:
        pid, _, start = (d / f"{name}.pid").read_text().partition(" ")
    except FileNotFoundError:
        newest = 0.0  # the lock's time says nothing: a sweep may have just made it
        for p in d.glob(f"{name}.*"):
            with contextlib.suppress(FileNotFoundError):
                if p.suffix != ".lock":
                    newest = max(newest, p.stat().st_mtime)
        return time.time() - newest > START_TIMEOUT_S and not _listening(d / f"{name}.sock")
    try:
        now = _process_start(int(pid))
    except ValueError:  # not a pid: never written by memaudit
        return True
    start = start.strip()
    return now is None or bool(start and now and start != now)


def _sweep(d: Path, name: str) -> bool:
    fd = os.open(d / f"{name}.lock", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return False  # a starter holds it: that resident is starting
        if not _gone(d, name):
            return False
        for suffix in (".sock", ".key", ".pid", ".pid.tmp", ".lock"):
            (d / f"{name}{suffix}").unlink(missing_ok=True)
        log = d / f"{name}.log"
        with contextlib.suppress(FileNotFoundError):
            if log.stat().st_size == 0:
                log.unlink()
        return True
    finally:
        os.close(fd)


def sweep_residents(keep: str = "") -> list[str]:
    """Remove the socket, key, lock and pid files of this user's residents that are gone without
    removing them (killed by SIGKILL or the OOM killer), and their empty logs (a log that says
    something is kept: it tells why the resident died); the names swept. A name whose lock a
    starter holds, or whose resident is alive, is left alone, as is `keep`."""
    d = resident_dir()
    names: dict[str, set[str]] = {}
    for p in d.iterdir():
        m = _FILE.fullmatch(p.name)
        if m and m[1] != keep:
            names.setdefault(m[1], set()).add(m[2])
    swept = []
    for name, kinds in sorted(names.items()):
        if kinds == {"log"}:  # only a log: the operator's
            continue
        try:
            if _sweep(d, name):
                swept.append(name)
        except OSError as e:  # the next start tries again; this one goes on
            print(f"memaudit: could not sweep resident {name}: {e}", file=sys.stderr)
    return swept


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    """Hold ``flock`` on the file at `path`; again on a new file when the one locked was removed
    meanwhile (by a sweep, or a resident leaving), so that two starters never both hold one."""
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            held, there = os.fstat(fd), os.stat(path)
            if (held.st_dev, held.st_ino) == (there.st_dev, there.st_ino):
                break
        except FileNotFoundError:
            pass
        except BaseException:
            os.close(fd)
            raise
        os.close(fd)
    try:
        yield
    finally:
        os.close(fd)


def _start(d: Path, name: str, node_config: dict[str, Any], node_id: int, watch_pid: int) -> None:
    sock, key = d / f"{name}.sock", d / f"{name}.key"
    sock.unlink(missing_ok=True)
    fd = os.open(key, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(secrets.token_bytes(32))
    log = open(d / f"{name}.log", "ab")  # noqa: SIM115 - the resident's own stderr
    # no new session: the resident stays in the SuperNode's process group
    proc = subprocess.Popen([sys.executable, "-m", "memaudit.federated.flower.resident",
                             "--socket", str(sock), "--key-file", str(key), "--node-id", str(node_id),
                             "--watch-pid", str(watch_pid), "--node-config", json.dumps(node_config)],
                            stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, close_fds=True)
    log.close()
    _record_pid(d, name, proc.pid)


_WATCHED: list[int] = []  # the process a resident watches, where it is not the ClientApp's parent


def watch_this_process() -> None:
    """The ClientApp runs in its SuperNode's own process (memaudit's SuperNode,
    `memaudit.federated.flower.superexec.beside`): the residents it starts watch this process.
    A ClientApp in a process of its own (Flower's SuperExec) leaves them watching its parent."""
    _WATCHED[:] = [os.getpid()]


def watched_pid() -> int:
    """The process whose end ends the residents this process starts (`watch_this_process`)."""
    return _WATCHED[0] if _WATCHED else os.getppid()


def resident(node_config: dict[str, Any], node_id: int, watch_pid: int | None = None) -> Connection:
    """A connection to this node's resident process, started if none answers; it watches
    ``watch_pid`` (default `watched_pid`)."""
    watch_pid = watched_pid() if watch_pid is None else watch_pid
    d = resident_dir()
    name = resident_name(node_config, node_id, watch_pid)
    sock, key = d / f"{name}.sock", d / f"{name}.key"
    conn = _connect(sock, key)
    if conn is not None:
        return conn
    with _locked(d / f"{name}.lock"):  # one starter at a time
        conn = _connect(sock, key)
        if conn is not None:
            return conn
        sweep_residents(keep=name)  # the files of residents killed without leaving
        _start(d, name, node_config, node_id, watch_pid)
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            conn = _connect(sock, key)
            if conn is not None:
                return conn
            time.sleep(0.1)
    raise RuntimeError(f"this node's resident process did not start within {START_TIMEOUT_S:g} s; "
                       f"see {d / (name + '.log')}")


def ask(conn: Connection, kind: str, run_id: int, payload: bytes) -> bytes:
    """One request to a resident: the reply's payload, or RuntimeError with its one line."""
    with conn:
        conn.send_bytes(json.dumps({"kind": kind, "run_id": int(run_id)}).encode())
        conn.send_bytes(payload)
        head = json.loads(conn.recv_bytes())
        body = conn.recv_bytes()
    if not head.get("ok"):
        raise RuntimeError(head.get("error", "the node's resident process failed"))
    return body


def _forward(message: Any, context: Any) -> Any:
    # optional dependency: flwr (the flower extra); the apps below are only built with it
    from flwr.app import Message
    from flwr.app.error import Error
    from flwr.common.constant import ErrorCode

    manifest = context.node_config.get("manifest")
    refusal = server_refusal(message, int(context.node_id), manifest_server(str(manifest)) if manifest else "")
    if refusal is not None:  # not from this run's server: an error, nothing read or run
        print(f"memaudit ClientApp: {refusal}", file=sys.stderr, flush=True)
        return Message(Error(code=ErrorCode.CLIENT_APP_RAISED_EXCEPTION, reason=refusal), reply_to=message)
    kind = KINDS[message.metadata.message_type.split(".", 1)[1]]
    if not _flag(context.node_config.get("resident"), True):
        # lazy: JAX, the partition and the stages in this flwr-clientapp process
        from memaudit.federated.flower import apps

        return getattr(apps, kind)(message, context)
    conn = resident(dict(context.node_config), int(context.node_id))
    return Message(record(ask(conn, kind, int(context.run_id), payload_of(message))), reply_to=message)


def _serve(grid: Any, context: Any) -> None:
    # lazy: the ServerApp runs the trainer (JAX, flax, dp_accounting) only when it is called
    from memaudit.federated.flower.apps import serve

    serve(grid, context)


def _apps() -> tuple[Any, Any]:
    # optional dependency: flwr (the flower extra)
    from flwr.clientapp import ClientApp
    from flwr.serverapp import ServerApp

    server, client = ServerApp(), ClientApp()
    server.main()(_serve)
    client.query(HELLO)(_forward)
    client.train(STAGE)(_forward)
    client.train(SECAGG)(_forward)
    return server, client


try:
    server_app, client_app = _apps()
except ImportError:  # without the .[flower] extra: importable (doctests), no apps
    server_app = client_app = None
