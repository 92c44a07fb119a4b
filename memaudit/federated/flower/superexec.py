"""memaudit's SuperExec: a SuperNode's messages answered by memaudit's own ClientApp, in one
long-lived process, and no other app run.

Flower 1.42's SuperExec starts a ``flwr-clientapp`` process for every message a SuperNode
receives, and that process installs and imports whatever app the run's FAB holds. Two costs
follow. Every message pays a Python start and Flower's imports (about 0.8 s on 2 cores), twice a
FedAvg round and five times a round with secure aggregation. And a foreign app, submitted by
anyone who reaches the SuperLink's Control API (``flwr run``; the open-source SuperLink
authenticates no account), runs its own code on the node, as the node's user and with the
node's config: it can read the partition file.

memaudit's SuperNode (`memaudit.federated.flower.supernode`) runs Flower's SuperNode with
``--isolation process`` and starts this process in place of Flower's SuperExec. It asks the
SuperNode's runtime API for a ClientApp task every ``poll`` seconds and, for each task:

- reads the run's FAB (its bytes, never the hash the server states) and **refuses** any FAB
  that is not memaudit's app as `memaudit.federated.flower.deploy.write_app` writes it, file for
  file and byte for byte: the reply is an error (`REFUSED`) and the task ends ``failed``; nothing
  of the FAB is installed, imported or run;
- answers memaudit's app with the ClientApp of **this node's installation**
  (`memaudit.flower_node.client_app`), never code from the FAB, in this process: no process is
  started and nothing imported again per message. The ClientApp hands the payload to the node's
  resident process as before (`memaudit.flower_node`); everything the node checks is unchanged.

The adversary this defends against: whoever can submit a run to the SuperLink (a foreign
ServerApp with a foreign ClientApp). They get refusals, and their code never runs on the node
(`tests/federated/test_flower_deploy.py::test_a_foreign_app_is_refused_by_the_supernode`).
What a foreign ServerApp can send to memaudit's ClientApp is bounded by the node's own checks
(docs/flower.md). The process exits when its parent (the SuperNode) is gone.
"""

from __future__ import annotations

import argparse
import io
import os
import sys
import tempfile
import threading
import time
import tomllib
import traceback
import zipfile
from pathlib import Path
from typing import Any

from memaudit.federated.flower.deploy import write_app

POLL_S = 0.05  # the runtime API is on this host: asking often costs little
MAX_FAB_BYTES = 1 << 20  # memaudit's app is two small files; a larger FAB is not it
REFUSED = ("this SuperNode runs only memaudit's app (memaudit.federated.flower.deploy.write_app); "
           "the run's app is another, and was refused")
CONTENT = ".info/CONTENT"  # the FAB's manifest of its files' hashes, written by flwr's build


def memaudit_app_files() -> dict[str, bytes]:
    """The files of memaudit's app, as this installation writes them: name -> bytes."""
    with tempfile.TemporaryDirectory() as d:
        app = write_app(Path(d) / "app")
        return {p.name: p.read_bytes() for p in sorted(app.iterdir()) if p.is_file()}


def _same(name: str, got: bytes, want: bytes) -> bool:
    """A file of the FAB against memaudit's: byte for byte, except ``pyproject.toml``, which
    ``flwr run`` re-writes (its TOML normalised) and is compared as the TOML it holds."""
    if got == want:
        return True
    if name != "pyproject.toml":
        return False
    try:
        return tomllib.loads(got.decode("utf-8")) == tomllib.loads(want.decode("utf-8"))
    except (UnicodeDecodeError, tomllib.TOMLDecodeError):
        return False


def is_memaudit_app(fab: bytes, expected: dict[str, bytes]) -> bool:
    """Whether a FAB's bytes are memaudit's app: exactly `expected`'s files (and flwr's CONTENT
    manifest), the module byte for byte and ``pyproject.toml`` as the same TOML. Anything
    unreadable, larger than `MAX_FAB_BYTES`, or with another file is not.

    >>> import io, zipfile
    >>> def fab(files):
    ...     b = io.BytesIO()
    ...     with zipfile.ZipFile(b, "w") as z:
    ...         for n, v in files.items():
    ...             z.writestr(n, v)
    ...     return b.getvalue()
    >>> app = {"pyproject.toml": b"[project]\\nname = 'a'", "app.py": b"x = 1"}
    >>> is_memaudit_app(fab({**app, CONTENT: b"..."}), app)
    True
    >>> is_memaudit_app(fab({**app, "pyproject.toml": b'[project]\\nname = "a"', CONTENT: b""}), app)
    True
    >>> is_memaudit_app(fab({**app, "app.py": b"import os"}), app), is_memaudit_app(b"PK", app)
    (False, False)
    """
    if len(fab) > MAX_FAB_BYTES:
        return False
    try:
        with zipfile.ZipFile(io.BytesIO(fab)) as z:
            infos = z.infolist()
            if sorted(i.filename for i in infos) != sorted([*expected, CONTENT]):
                return False
            if sum(i.file_size for i in infos) > MAX_FAB_BYTES:  # declared sizes: no inflating a bomb
                return False
            return all(_same(name, z.read(name), data) for name, data in expected.items())
    except (zipfile.BadZipFile, zipfile.LargeZipFile, ValueError, OSError, EOFError, RuntimeError):
        return False


def _runtime_client(address: str, insecure: bool, certificates: bytes | None, *extra: Any) -> Any:
    # optional dependency: flwr (the flower extra); this process exists only on a SuperNode
    from flwr.supercore.interceptors import RuntimeVersionHttpInterceptor
    from flwr.supercore.retry import make_simple_http_retry_invoker
    from flwr.supercore.runtime import RuntimeHttpClient

    return RuntimeHttpClient.from_server_address(
        server_address=address, insecure=insecure, root_certificates=certificates,
        interceptors=[RuntimeVersionHttpInterceptor(component_name="flwr-clientapp"), *extra],
        retry_invoker=make_simple_http_retry_invoker())


def serve_task(address: str, token: str, insecure: bool, certificates: bytes | None,
               expected: dict[str, bytes], client_app: Any) -> bool:
    """One ClientApp task, as ``flwr-clientapp`` would run it, with memaudit's ClientApp and the
    FAB check; whether it completed."""
    # optional dependency: flwr (the flower extra)
    from flwr.app import Message
    from flwr.app.error import Error
    from flwr.common.constant import ErrorCode, SubStatus
    from flwr.supercore.heartbeat import HeartbeatSender, make_task_heartbeat_fn_http
    from flwr.supercore.interceptors import RuntimeTokenHttpInterceptor
    from flwr.supernode.runtime.run_clientapp import pull_task_input, push_message, push_task_output

    client = _runtime_client(address, insecure, certificates, RuntimeTokenHttpInterceptor(token))
    heartbeat = HeartbeatSender(make_task_heartbeat_fn_http(client))
    heartbeat.start()
    message = context = reply = None
    status, details = SubStatus.FAILED, "memaudit's ClientApp failed; the node's log says why"
    try:
        message, context, _run, fab = pull_task_input(client)
        if not is_memaudit_app(fab.content, expected):
            details = REFUSED
            print(f"memaudit SuperExec: refused run {context.run_id}: not memaudit's app",
                  file=sys.stderr, flush=True)
            reply = Message(Error(code=ErrorCode.LOAD_CLIENT_APP_EXCEPTION, reason=REFUSED),
                            reply_to=message)
        else:
            reply = client_app(message=message, context=context)
            status, details = SubStatus.COMPLETED, ""
    except Exception as e:  # noqa: BLE001 - one task fails, the node goes on
        traceback.print_exc(file=sys.stderr)  # the node's own log, never to the server
        if message is not None:  # the type only: an exception's text could carry a data value
            reply = Message(Error(code=ErrorCode.CLIENT_APP_RAISED_EXCEPTION,
                                  reason=f"memaudit's ClientApp raised {type(e).__name__}"),
                            reply_to=message)
    finally:
        try:
            if reply is not None and context is not None:
                push_message(client, reply, context)
        except Exception:  # noqa: BLE001 - the server sees a missing reply: a dropped node
            traceback.print_exc(file=sys.stderr)
        push_task_output(client=client, context=context, sub_status=status, details=details)
        if heartbeat.is_running:
            heartbeat.stop()
        client.close()
    return status == SubStatus.COMPLETED


def _exit_with(parent_pid: int) -> None:
    """Exit when the process that started this one (the SuperNode) is gone."""
    def watch() -> None:
        while os.getppid() == parent_pid:
            time.sleep(0.2)
        os._exit(0)  # nothing to keep: a task in flight is a dropped node

    threading.Thread(target=watch, daemon=True).start()


def serve(address: str, *, insecure: bool, root_certificates: str | None, parent_pid: int,
          poll: float = POLL_S) -> None:
    """Ask the runtime API at `address` for ClientApp tasks and serve them, one at a time."""
    # optional dependency: flwr (the flower extra)
    from flwr.proto.runtime_pb2 import AcquireTaskRequest
    from flwr.supercore.constant import TaskType

    # lazy as flwr: memaudit's ClientApp is built only where the flower extra is installed
    from memaudit.flower_node import client_app

    _exit_with(parent_pid)
    certificates = None if root_certificates is None else Path(root_certificates).read_bytes()
    expected = memaudit_app_files()
    client = _runtime_client(address, insecure, certificates)
    request = AcquireTaskRequest(supported_task_types=[TaskType.CLIENT_APP.value])
    while True:
        try:
            res = client.AcquireTask(request)
        except Exception:  # noqa: BLE001 - the SuperNode's API is starting, or briefly away
            time.sleep(max(poll, 0.5))
            continue
        if res.HasField("task") and res.token:
            serve_task(address, res.token, insecure, certificates, expected, client_app)
            continue  # a round's next message may be waiting already
        time.sleep(poll)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runtime-api-address", required=True, help="the SuperNode's runtime API, host:port")
    ap.add_argument("--root-certificates", default=None,
                    help="CA certificate of the runtime API's TLS (omit for plain HTTP on this host)")
    ap.add_argument("--parent-pid", type=int, required=True)
    ap.add_argument("--poll", type=float, default=POLL_S, help="seconds between asks for a task")
    a = ap.parse_args(argv)
    serve(a.runtime_api_address, insecure=a.root_certificates is None,
          root_certificates=a.root_certificates, parent_pid=a.parent_pid, poll=a.poll)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
