"""memaudit's SuperExec: a SuperNode's messages answered by memaudit's own ClientApp, in the
SuperNode's own process, and no other app run.

Flower 1.42's SuperExec starts a ``flwr-clientapp`` process for every message a SuperNode
receives, and that process installs and imports whatever app the run's FAB holds. Two costs
follow. Every message pays a Python start and Flower's imports (about 0.8 s on 2 cores), twice a
FedAvg round and five times a round with secure aggregation. And a foreign app, submitted by
anyone who reaches the SuperLink's Control API (``flwr run``; the open-source SuperLink
authenticates no account), runs its own code on the node, as the node's user and with the
node's config: it can read the partition file.

memaudit's SuperNode (`memaudit.federated.flower.supernode`) runs Flower's SuperNode with
``--isolation process`` and, in place of Flower's SuperExec, this SuperExec as a thread of the
same process (`beside`): it asks Flower's runtime handlers on the SuperNode's own state
(`memaudit.federated.flower.transport.localruntime`), not the runtime API over HTTP, for a ClientApp
task, and, for each task:

- reads the run's FAB (its bytes, never the hash the server states) and **refuses** any FAB
  that is not memaudit's app as `memaudit.federated.flower.deploy.write_app` writes it, file for
  file and byte for byte: the reply is an error (`REFUSED`) and the task ends ``failed``; nothing
  of the FAB is installed, imported or run;
- answers memaudit's app with the ClientApp of **this node's installation**
  (`memaudit.federated.flower.node.client_app`), never code from the FAB, in this process: no process is
  started and nothing imported again per message. The ClientApp hands the payload to the node's
  resident process as before (`memaudit.federated.flower.node`); everything the node checks is unchanged.

memaudit's SuperLink (`memaudit.federated.flower.superlink`) runs this SuperExec the same way,
for ServerApp tasks: each run's ServerApp is a thread of the SuperLink's process
(`serve_serverapp`), run only for memaudit's FAB.

The same loop also runs as a process of its own on a runtime API over HTTP
(``python -m memaudit.federated.flower.superexec --runtime-api-address HOST:PORT``), beside
Flower's own ``flower-supernode --isolation process`` (or ``flower-superlink``, ``--task
serverapp``: each ServerApp then a ``flwr-serverapp`` process whose FAB install is guarded).

The adversary this defends against: whoever can submit a run to the SuperLink (a foreign
ServerApp with a foreign ClientApp). They get refusals, and their code never runs on the node
(`tests/federated/test_flower_deploy.py::test_a_foreign_app_is_refused_by_the_supernode`).
What a foreign ServerApp can send to memaudit's ClientApp is bounded by the node's own checks
(docs/flower.md). As a process of its own it exits when its parent (the SuperNode or
SuperLink) is gone.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import secrets
import subprocess
import sys
import tempfile
import threading
import time
import tomllib
import traceback
import zipfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from flwr.app import Message, RecordDict
from flwr.app.error import Error
from flwr.common.config import get_fused_config_from_fab
from flwr.common.constant import ErrorCode, SubStatus
from flwr.common.serde import context_from_proto, context_to_proto, fab_from_proto, run_from_proto
from flwr.proto.log_pb2 import PushLogsRequest
from flwr.proto.runtime_pb2 import (
    AcquireTaskRequest,
    PullTaskInputRequest,
    PushTaskOutputRequest,
    SendTaskHeartbeatRequest,
)
from flwr.supercore.app_utils import start_parent_process_monitor
from flwr.supercore.constant import TaskType
from flwr.supercore.heartbeat import HeartbeatSender
from flwr.supercore.interceptors import RuntimeTokenHttpInterceptor, RuntimeVersionHttpInterceptor
from flwr.supercore.retry import make_simple_http_retry_invoker
from flwr.supercore.runtime import RuntimeHttpClient
from flwr.supercore.task_identity import TaskIdentity
from flwr.superlink.cli.flwr_serverapp import flwr_serverapp
from flwr.supernode.runtime.run_clientapp import pull_task_input, push_message, push_task_output

from memaudit.errors import MemauditError
from memaudit.federated.flower import transport
from memaudit.federated.flower.deploy import write_app
from memaudit.federated.flower.transport.localruntime import (
    LocalRuntime,
    component_state,
    local_grid,
)

POLL_S = 0.05  # the runtime API is on this host: asking often costs little
MAX_FAB_BYTES = 1 << 20  # memaudit's app is two small files; a larger FAB is not it
REFUSED = ("this SuperNode runs only memaudit's app (memaudit.federated.flower.deploy.write_app); "
           "the run's app is another, and was refused")
REFUSED_SERVER = ("this SuperLink runs only memaudit's app (memaudit.federated.flower.deploy.write_app); "
                  "the run's app is another, and was refused")
CONTENT = ".info/CONTENT"  # the FAB's manifest of its files' hashes, written by flwr's build
RUNTIME_PORTS = {"clientapp": 9094, "serverapp": 8000}  # flower-supernode's, flower-superlink's defaults


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

    return RuntimeHttpClient.from_server_address(
        server_address=address, insecure=insecure, root_certificates=certificates,
        interceptors=[RuntimeVersionHttpInterceptor(component_name="flwr-clientapp"), *extra],
        retry_invoker=make_simple_http_retry_invoker())


def task_heartbeat(client: Any) -> Any:
    """Flower's task heartbeat (``make_task_heartbeat_fn_http``) for a process that outlives its
    tasks: a heartbeat the SuperNode refuses or cannot take is a failed heartbeat (tried again
    until the sender stops), never a signal. Flower's answers a refused heartbeat with SIGINT to
    its own process, which ends a ``flwr-clientapp`` process; here it ended the node's SuperExec
    when a task's first heartbeat came back after the task's output was in (its token void), and
    the node answered nothing more for the run."""
    request = SendTaskHeartbeatRequest()

    def beat() -> bool:
        try:
            return bool(client.SendTaskHeartbeat(request).success)
        except Exception:  # noqa: BLE001 - the runtime API gone or refusing: a failed heartbeat
            return False

    return beat


def serve_task(address: str, token: str, insecure: bool, certificates: bytes | None,
               expected: dict[str, bytes], client_app: Any, *, local: Any = None) -> bool:
    """One ClientApp task, as ``flwr-clientapp`` would run it, with memaudit's ClientApp and the
    FAB check; whether it completed. ``local``: the SuperNode's runtime in this process
    (`memaudit.federated.flower.transport.localruntime.LocalRuntime`), in place of its API over HTTP."""
    client = (local.with_token(token) if local is not None
              else _runtime_client(address, insecure, certificates, RuntimeTokenHttpInterceptor(token)))
    heartbeat = HeartbeatSender(task_heartbeat(client))
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
        if heartbeat.is_running:  # before the output: once it is in, the task's token is void
            heartbeat.stop()
        push_task_output(client=client, context=context, sub_status=status, details=details)
        client.close()
    return status == SubStatus.COMPLETED


def _start_serverapp(address: str, token: str, root_certificates: str | None) -> None:
    """A ServerApp task: Flower's ``flwr-serverapp``, in a process of its own (a run lasts), that
    installs the run's FAB only when it is memaudit's app (`run_serverapp`)."""
    tls = ["--insecure"] if root_certificates is None else ["--root-certificates", root_certificates]
    subprocess.Popen([sys.executable, "-m", "memaudit.federated.flower.superexec", "--run-serverapp",
                      "--runtime-api-address", address, "--token", token, "--parent-pid", str(os.getpid()),
                      *tls], stdin=subprocess.DEVNULL)


def run_serverapp(argv: list[str]) -> None:
    """Flower's ``flwr-serverapp`` (`argv`: its arguments), refusing a FAB that is not memaudit's
    app before anything of it is installed or imported: the run ends failed with `REFUSED_SERVER`
    as its reason."""
    expected = memaudit_app_files()

    def memaudits_only(content: bytes) -> None:
        if not is_memaudit_app(content, expected):
            print("memaudit SuperExec: refused a ServerApp that is not memaudit's", file=sys.stderr, flush=True)
            raise RuntimeError(REFUSED_SERVER)

    transport.install("serverapp", fab_check=memaudits_only)
    sys.argv = ["flwr-serverapp", *argv]
    flwr_serverapp()


def _run_log(client: Any, line: str) -> None:
    """One line in the run's log on the SuperLink (what ``flwr run --stream`` shows the
    submitter), as a ``flwr-serverapp`` process's log uploader would send it."""
    try:
        client.PushLogs(PushLogsRequest(logs=[line + "\n"]))
    except Exception:  # noqa: BLE001 - the run's log is best effort; the task's status says it too
        traceback.print_exc(file=sys.stderr)


def serve_serverapp(local: Any, token: str, expected: dict[str, bytes]) -> bool:
    """One ServerApp task in this process, memaudit's SuperLink's (``local``: its runtime,
    `memaudit.federated.flower.transport.localruntime.LocalRuntime`), as Flower's ``flwr-serverapp``
    runs one: the task's run, context and FAB pulled, the ServerApp called with a Grid, the
    task's status pushed, a heartbeat meanwhile. The FAB must be memaudit's app
    (`is_memaudit_app`); the ServerApp called is this installation's
    (`memaudit.federated.flower.node.server_app`), never code from the FAB, and nothing of it is installed.
    Any other FAB ends the task failed with `REFUSED_SERVER`. Whether the ServerApp completed."""
    # lazy: memaudit's ServerApp module, loaded on a SuperLink only (its JAX with it)
    from memaudit.federated.flower.node import server_app

    client = local.with_token(token)
    heartbeat = HeartbeatSender(task_heartbeat(client))
    heartbeat.start()
    context = None
    status, details = SubStatus.FAILED, "memaudit's ServerApp failed; the SuperLink's log says why"
    try:
        res = client.PullTaskInput(PullTaskInputRequest())
        # the task this thread's messages are created for (one per thread: identity_per_thread)
        TaskIdentity.task_id, TaskIdentity.run_id = res.task_id, res.run.run_id
        TaskIdentity.node_id = res.context.node_id
        context, run, fab = context_from_proto(res.context), run_from_proto(res.run), fab_from_proto(res.fab)
        if not is_memaudit_app(fab.content, expected):
            details = REFUSED_SERVER
            print("memaudit SuperExec: refused a ServerApp that is not memaudit's", file=sys.stderr, flush=True)
            _run_log(client, REFUSED_SERVER)
        else:
            grid = local_grid(client)
            grid.set_run(run)
            context.run_config = get_fused_config_from_fab(fab.content, run)
            server_app(grid=grid, context=context)
            status, details = SubStatus.COMPLETED, ""
    except Exception as e:  # noqa: BLE001 - one run fails, the SuperLink goes on
        traceback.print_exc(file=sys.stderr)  # the SuperLink's own log
        details = f"memaudit's ServerApp raised {type(e).__name__}"
        # the run's log (`flwr run --stream`, `flwr log`) gets memaudit's own one-line errors,
        # which carry no data value; of any other exception, its type only
        text = (str(e).strip().splitlines() or [""])[0] if isinstance(e, MemauditError | ValueError) else ""
        _run_log(client, f"{details}: {text}" if text else details)
    finally:
        if heartbeat.is_running:  # before the output: once it is in, the task's token is void
            heartbeat.stop()
        if context is not None:
            context.state = RecordDict()  # as flwr-serverapp: the run's state is not pushed back
        try:
            client.PushTaskOutput(PushTaskOutputRequest(context=context_to_proto(context) if context else None,
                                                        sub_status=status, details=details))
        except Exception:  # noqa: BLE001 - the task expires on the SuperLink
            traceback.print_exc(file=sys.stderr)
    return status == SubStatus.COMPLETED


def serve(address: str, *, insecure: bool, root_certificates: str | None, parent_pid: int | None,
          poll: float = POLL_S, task: str = "clientapp", local: Any = None) -> None:
    """Ask the runtime API at `address` for tasks and serve them: ClientApp tasks (a SuperNode's)
    one at a time in this process, ServerApp tasks (a SuperLink's) each in a process of its own.
    ``local``: the runtime of this process's SuperNode or SuperLink
    (`memaudit.federated.flower.transport.localruntime`), asked in place of `address`; a SuperLink's
    ServerApp tasks then run each in a thread of this process (`serve_serverapp`).
    ``parent_pid`` None: no parent to watch (a thread of it)."""
    if parent_pid is not None:
        start_parent_process_monitor(parent_pid)  # the SuperNode or SuperLink gone: this process goes
    certificates = None if root_certificates is None else Path(root_certificates).read_bytes()
    client = local if local is not None else _runtime_client(address, insecure, certificates)
    kind = TaskType.CLIENT_APP if task == "clientapp" else TaskType.SERVER_APP
    request = AcquireTaskRequest(supported_task_types=[kind.value])
    if kind == TaskType.CLIENT_APP:
        # lazy as flwr: memaudit's ClientApp is built only where the flower extra is installed
        from memaudit.federated.flower.node import client_app

        transport.install("clientapp")  # a message's objects re-asked after 0.02 s, not 1 s
    expected = memaudit_app_files()
    while True:
        asked = time.monotonic()
        try:
            res = client.AcquireTask(request)
        except Exception:  # noqa: BLE001 - the runtime API is starting, or briefly away
            time.sleep(max(poll, 0.5))
            continue
        if not (res.HasField("task") and res.token):  # an ask the node held counts toward the poll
            time.sleep(max(0.0, poll - (time.monotonic() - asked)))
            continue
        try:
            if kind == TaskType.CLIENT_APP:
                serve_task(address, res.token, insecure, certificates, expected, client_app, local=local)
            elif local is not None:  # a run lasts: its own thread
                threading.Thread(target=serve_serverapp, args=(local, res.token, expected),
                                 name="memaudit-serverapp", daemon=True).start()
            else:
                _start_serverapp(address, res.token, root_certificates)
        except Exception:  # noqa: BLE001 - one task lost (Flower expires it); the next is served
            traceback.print_exc(file=sys.stderr)


def flag_value(args: list[str], flag: str, default: str | None = None) -> str | None:
    """The value of ``flag`` in a command line (``--flag V`` or ``--flag=V``).

    >>> flag_value(["--port", "9100"], "--port"), flag_value(["--host=h"], "--host"), flag_value([], "--x", "d")
    ('9100', 'h', 'd')
    """
    for i, a in enumerate(args):
        if a == flag and i + 1 < len(args):
            return args[i + 1]
        if a.startswith(flag + "="):
            return a.split("=", 1)[1]
    return default


def superexec_command(flower_args: list[str], parent_pid: int, *, task: str) -> list[str]:
    """memaudit's SuperExec for the SuperNode (``task="clientapp"``) or SuperLink (``"serverapp"``)
    these arguments start: on its runtime API (``--host``/``--port``), with the CA certificate of
    its TLS (``--ssl-ca-certfile``) when it serves TLS.

    >>> superexec_command(["--port", "9100", "--insecure"], 7, task="clientapp")[3:]
    ['--runtime-api-address', '127.0.0.1:9100', '--parent-pid', '7', '--task', 'clientapp']
    """
    host = flag_value(flower_args, "--host", "127.0.0.1") or "127.0.0.1"
    host = "127.0.0.1" if host == "0.0.0.0" else ("::1" if host == "::" else host)
    host = f"[{host}]" if ":" in host else host
    port = flag_value(flower_args, "--port", str(RUNTIME_PORTS[task]))
    cmd = [sys.executable, "-m", "memaudit.federated.flower.superexec", "--runtime-api-address",
           f"{host}:{port}", "--parent-pid", str(parent_pid), "--task", task]
    ca = flag_value(flower_args, "--ssl-ca-certfile")
    return cmd + (["--root-certificates", ca] if ca else [])


def beside(flower_main: Any, flower_args: list[str], *, task: str) -> int:
    """Run Flower's SuperNode or SuperLink (`flower_main`, its command-line entry) in this process
    with ``--isolation process``, and memaudit's SuperExec for `task` beside it, as a thread of
    this process on the SuperNode's or SuperLink's own state (`serve` with a `LocalRuntime`; a
    SuperLink's ServerApp tasks each a thread too), and Flower's runtime API closed to every
    other caller (`runtime_secret`). ``--isolation`` or ``--superexec-auth-secret-file`` in
    `flower_args` is refused (exit 2)."""
    what = {"clientapp": ("SuperNode", "flower-supernode"), "serverapp": ("SuperLink", "flower-superlink")}[task]
    for flag, why in (("--isolation", "is memaudit's SuperExec"),
                      (SECRET_FLAG, "is made by memaudit (runtime_secret)")):
        if flag_value(flower_args, flag) is not None:
            print(f"memaudit: error: {flag} {why} on this {what[0]}; remove it, or run {what[1]} itself",
                  file=sys.stderr)
            return 2
    # a thread of this process, on the SuperNode's or SuperLink's own state (recorded by the
    # transport's local_runtime layer, which the SuperNode's or SuperLink's main installed)
    component = {"clientapp": "supernode", "serverapp": "superlink"}[task]

    def serve_here() -> None:
        if task == "clientapp":
            # lazy, as the ClientApp in serve: memaudit's ClientApp module, loaded on a SuperNode only
            from memaudit.federated.flower.node import watch_this_process

            watch_this_process()  # the node's resident ends with this process, not with its parent
        serve("", insecure=True, root_certificates=None, parent_pid=None, task=task,
              local=LocalRuntime(component_state(component), component=component))

    threading.Thread(target=serve_here, name="memaudit-superexec", daemon=True).start()
    with runtime_secret() as secret:
        sys.argv = [what[1], *flower_args, "--isolation", "process", *secret]
        flower_main()
    return 0


SECRET_FLAG = "--superexec-auth-secret-file"


@contextlib.contextmanager
def runtime_secret() -> Iterator[list[str]]:
    """Flower's SuperExec authentication, with a secret no one holds: the arguments that give
    Flower's SuperLink or SuperNode a fresh random 32-byte secret through a pipe of this process
    (never a file).

    Flower 1.42 serves the runtime API on the component's own address (a SuperLink's: the one its
    SuperNodes and ``flwr`` reach), and without a SuperExec secret it hands a pending task, and
    the token that reads its run and speaks for it, to whoever asks
    (``/v1/runtime/acquire-task``). With one, it answers that ask only when it is signed with
    the secret (``flwr.supercore.dependencies.superexec``). memaudit's SuperExec asks Flower's
    handlers in this process (`memaudit.federated.flower.transport.localruntime`), not over HTTP, so it
    needs no secret, and no one outside this process can sign: every task is acquired here.
    Test: ``tests/federated/test_flower_deploy.py::test_nobody_takes_the_server_seat``."""
    read, write = os.pipe()
    try:
        os.write(write, secrets.token_bytes(32))
    finally:
        os.close(write)
    try:
        yield [SECRET_FLAG, f"/dev/fd/{read}"]  # read once, in this process, by Flower's argument parsing
    finally:
        os.close(read)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--run-serverapp"]:  # one ServerApp task (started by `serve`)
        run_serverapp(argv[1:])
        return 0
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runtime-api-address", required=True, help="the runtime API, host:port")
    ap.add_argument("--root-certificates", default=None,
                    help="CA certificate of the runtime API's TLS (omit for plain HTTP on this host)")
    ap.add_argument("--parent-pid", type=int, required=True)
    ap.add_argument("--task", choices=sorted(RUNTIME_PORTS), default="clientapp",
                    help="clientapp: a SuperNode's; serverapp: a SuperLink's")
    ap.add_argument("--poll", type=float, default=POLL_S, help="seconds between asks for a task")
    a = ap.parse_args(argv)
    serve(a.runtime_api_address, insecure=a.root_certificates is None, root_certificates=a.root_certificates,
          parent_pid=a.parent_pid, poll=a.poll, task=a.task)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
