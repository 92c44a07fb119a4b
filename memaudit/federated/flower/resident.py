"""A SuperNode's resident process: memaudit's client side, kept warm across messages.

Started by the node's first message (`memaudit.federated.flower.node.resident`), it holds what a
``flwr-clientapp`` process would otherwise rebuild for every message: JAX, the node's partition
and manifest, the client stages deserialised and compiled (`NodeExecutor` caches them by the
sha256 of their bytes), and the values a round's later stages read, in memory. Every message
is answered by `memaudit.federated.flower.apps.answer`, the code the in-process ClientApp runs,
so the manifest, the policy, the DP bound and the partition's users are checked the same way.

One request on a connection: a JSON header ``{"kind", "run_id"}`` and the message's payload
bytes; the reply is a JSON header ``{"ok": true}`` (or ``{"ok": false, "error": one line}``) and
the reply's payload bytes. Connections come only through the socket in the 0700 folder of
`memaudit.federated.flower.node.resident_dir` and prove the key of a 0600 file there.

The process exits when the process it watches (the ClientApp's parent: Flower's SuperExec, or on
memaudit's SuperNode the SuperNode) is gone, or after ``resident-idle`` seconds without a
request (node config, default 900).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import sys
import threading
import time
import traceback
from collections import OrderedDict
from multiprocessing import AuthenticationError
from multiprocessing.connection import Listener
from pathlib import Path
from typing import Any

from memaudit.federated.flower.apps import answer, open_node, use_compilation_cache
from memaudit.federated.flower.execute import NodeExecutor
from memaudit.federated.flower.messages import KINDS
from memaudit.federated.flower.wire import pack

IDLE_S = 900.0
RUNS_KEPT = 2  # executors of the latest runs (a run's kept values live in its executor)


class Resident:
    """The node's executors by run, built on first use."""

    def __init__(self, node_config: dict[str, Any], node_id: int) -> None:
        self.node_config, self.node_id = node_config, node_id
        self.runs: OrderedDict[int, NodeExecutor] = OrderedDict()
        # the deserialised stages and their compiled callables, by the sha256 of the module's
        # bytes (content, never a name): shared by the runs, so a node that serves run after
        # run (a sweep's points) compiles each stage once
        self.modules: dict[str, Any] = {}

    def executor(self, run_id: int) -> NodeExecutor:
        if run_id not in self.runs:
            self.runs[run_id] = open_node(self.node_config, self.node_id, run_id, in_memory=True)
            self.runs[run_id].modules = self.modules
            while len(self.runs) > RUNS_KEPT:
                self.runs.popitem(last=False)
        self.runs.move_to_end(run_id)
        return self.runs[run_id]

    def handle(self, kind: str, run_id: int, payload: bytes) -> bytes:
        if kind not in KINDS.values():
            raise ValueError(f"unknown request {kind!r}")
        return pack(answer(kind, lambda: self.executor(run_id), payload))


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, another user's
        return True
    return True


def _leave(socket_path: str) -> None:
    """Remove this resident's socket, key and pid file (its log stays, when it says something), and
    exit. A resident killed without leaving has its files removed by the next resident's starter
    (`memaudit.federated.flower.node.sweep_residents`)."""
    base = Path(socket_path)
    for p in (base, base.with_suffix(".key"), base.with_suffix(".lock")):
        p.unlink(missing_ok=True)
    pid = base.with_suffix(".pid")  # written by the starter; removed only when it names this process
    with contextlib.suppress(OSError, ValueError, IndexError):
        if int(pid.read_text().split()[0]) == os.getpid():
            pid.unlink()
    log = base.with_suffix(".log")
    if log.is_file() and log.stat().st_size == 0:
        log.unlink(missing_ok=True)
    os._exit(0)  # no state is worth keeping: a round in flight is a dropped node


def _watch(pid: int, idle_s: float, last: list[float], socket_path: str) -> None:
    while _alive(pid) and time.monotonic() - last[0] < idle_s:
        time.sleep(0.5)
    _leave(socket_path)  # the SuperNode is gone, or nothing came for idle_s


def serve(socket_path: str, key: bytes, node_config: dict[str, Any], node_id: int, watch_pid: int) -> None:
    use_compilation_cache(node_config, node_id)
    idle = float(node_config.get("resident-idle", IDLE_S))
    node = Resident(node_config, node_id)
    last = [time.monotonic()]
    threading.Thread(target=_watch, args=(watch_pid, idle, last, socket_path), daemon=True).start()
    signal.signal(signal.SIGTERM, lambda *_: _leave(socket_path))  # the SuperNode's group stopped
    old = os.umask(0o177)  # the socket file: this user only
    try:
        listener = Listener(socket_path, family="AF_UNIX", authkey=key)
    finally:
        os.umask(old)
    with listener:
        while True:
            try:
                conn = listener.accept()
            except (AuthenticationError, EOFError, OSError) as e:  # failed the key challenge, or left
                print(f"refused a connection: {type(e).__name__}", file=sys.stderr, flush=True)
                continue
            last[0] = time.monotonic()
            with conn:
                try:
                    head = json.loads(conn.recv_bytes())
                    payload = conn.recv_bytes()
                    body = node.handle(str(head["kind"]), int(head["run_id"]), payload)
                    conn.send_bytes(b'{"ok": true}')
                    conn.send_bytes(body)
                except Exception as e:  # noqa: BLE001 - one request fails, the node goes on
                    traceback.print_exc(file=sys.stderr)  # the node's own log, never to the server
                    # the type only: a message could carry a data value, and this line reaches the server
                    line = f"the node's resident process failed ({type(e).__name__}); its log is on the node"
                    try:
                        conn.send_bytes(json.dumps({"ok": False, "error": line}).encode())
                        conn.send_bytes(b"")
                    except OSError:
                        pass
            last[0] = time.monotonic()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--socket", required=True)
    ap.add_argument("--key-file", required=True)
    ap.add_argument("--node-id", type=int, required=True)
    ap.add_argument("--watch-pid", type=int, required=True)
    ap.add_argument("--node-config", required=True, help="the SuperNode's node config, as JSON")
    a = ap.parse_args(argv)
    serve(a.socket, Path(a.key_file).read_bytes(), json.loads(a.node_config), a.node_id, a.watch_pid)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
