"""memaudit's SuperNode and SuperExec, in process: which FABs the node runs, the poll it waits,
the SuperExec it starts, and its bad arguments. The deployment itself (a foreign app submitted
to a real SuperLink and refused) is tests/federated/test_flower_deploy.py."""

from __future__ import annotations

import io
import time
import zipfile

import flwr  # noqa: F401 - installed by the set-up (.[flower]); missing it is a failure, not a skip
import pytest

from memaudit.federated.flower.deploy import write_app
from memaudit.federated.flower.superexec import (
    CONTENT,
    MAX_FAB_BYTES,
    is_memaudit_app,
    memaudit_app_files,
    superexec_command,
)
from memaudit.federated.flower.supernode import main
from memaudit.federated.flower.transport import polls
from memaudit.federated.flower.transport.polls import LOCAL_POLL_S, PULL_BACKOFF_S, PollWaits


@pytest.fixture(scope="module")
def fab(tmp_path_factory):
    """memaudit's app as `flwr run` builds it (flwr re-writes its pyproject.toml)."""
    from flwr.cli.build import build_fab_from_disk

    return build_fab_from_disk(write_app(tmp_path_factory.mktemp("app") / "app"))


def _rezip(fab: bytes, change: dict[str, bytes | None]) -> bytes:
    src = zipfile.ZipFile(io.BytesIO(fab))
    files = {n: src.read(n) for n in src.namelist()}
    for n, v in change.items():
        if v is None:
            files.pop(n, None)
        else:
            files[n] = v
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w", zipfile.ZIP_DEFLATED) as z:
        for n, v in files.items():
            z.writestr(n, v)
    return out.getvalue()


def test_the_supernode_runs_memaudits_app_and_nothing_else(fab):
    expected = memaudit_app_files()
    assert is_memaudit_app(fab, expected)
    module = "memaudit_flower_app.py"
    same_toml = expected["pyproject.toml"].replace(b'version = "1.0.0"', b"version = '1.0.0'")
    assert is_memaudit_app(_rezip(fab, {"pyproject.toml": same_toml}), expected)  # the same TOML
    refused = {
        "a module that does something else": {module: expected[module] + b"import os\n"},
        "another component": {"pyproject.toml": expected["pyproject.toml"].replace(
            b"memaudit_flower_app:client_app", b"evil:client_app")},
        "one file more": {"evil.py": b"import os\n"},
        "its module missing": {module: None},
        "a pyproject that is not TOML": {"pyproject.toml": b"[project"},
    }
    for case, change in refused.items():
        assert not is_memaudit_app(_rezip(fab, change), expected), case
    assert not is_memaudit_app(b"not a zip", expected)
    assert not is_memaudit_app(fab + b"\0" * MAX_FAB_BYTES, expected)  # larger than any memaudit FAB
    bomb = _rezip(fab, {CONTENT: b"0" * (MAX_FAB_BYTES + 1)})  # compresses to a few KiB
    assert len(bomb) < MAX_FAB_BYTES and not is_memaudit_app(bomb, expected)


def test_flowers_waits_become_polls_and_nothing_else_changes():
    from flwr.superlink.grid import http_grid
    from flwr.supernode import start_client_internal as loop
    from flwr.supernode.runtime import run_clientapp

    saved = (loop.time, loop.pull_objects, http_grid.pull_objects, run_clientapp.pull_and_inflate_object_from_tree)
    try:
        polls.install("serverapp")  # the ServerApp: its Grid's pulls only
        assert loop.time is time and http_grid.pull_objects.keywords["initial_backoff"] == PULL_BACKOFF_S
        assert run_clientapp.pull_and_inflate_object_from_tree is saved[3]
        polls.install("clientapp")  # memaudit's SuperExec: its pull of a task's message
        assert run_clientapp.pull_and_inflate_object_from_tree.keywords["initial_backoff"] == PULL_BACKOFF_S
        polls.install("supernode", poll=0.01)
        assert isinstance(loop.time, PollWaits) and loop.time.poll == 0.01
        assert loop.pull_objects.keywords == {"initial_backoff": PULL_BACKOFF_S, "backoff_cap": 0.25,
                                              "max_tries_per_object": None}
        t = time.monotonic()
        loop.time.sleep(3)  # after an ask that found no message
        loop.time.sleep(0.5)  # between looks for a ClientApp's reply
        assert time.monotonic() - t < 0.5
        t = time.monotonic()
        loop.time.sleep(0.005)  # a shorter wait is kept
        assert time.monotonic() - t >= 0.004
        assert loop.time.time is time.time
        polls.install("supernode", poll=0.05)  # again: replaces the poll, not wraps it
        assert loop.time.poll == 0.05 and loop.pull_objects.func is saved[1]
    finally:
        loop.time, loop.pull_objects, http_grid.pull_objects, run_clientapp.pull_and_inflate_object_from_tree = saved


def test_a_supernode_looks_at_its_own_memory_at_the_local_poll():
    """The loop's 3 s wait (no message: the next ask goes to the SuperLink) becomes the node's
    poll; its 0.5 s waits (looks at its own memory for the ClientApp's reply or a reply's
    content) become `LOCAL_POLL_S`, whatever the poll. Failed before: every wait was the poll."""
    w = PollWaits(0.3)
    t = time.monotonic()
    w.sleep(0.5)  # between looks for the ClientApp's reply
    assert time.monotonic() - t < 0.15
    t = time.monotonic()
    w.sleep(3)  # after an ask that found no message
    assert time.monotonic() - t >= 0.29
    t = time.monotonic()
    w.sleep(0.001)  # a shorter wait is kept
    assert w.local == LOCAL_POLL_S < 0.05


def test_an_object_not_there_yet_is_asked_for_again_within_a_poll():
    """The SuperNode hands its SuperExec a task before it holds the message's objects: Flower's
    first retry came after 1 s (then 2 s: 1.1 or 3.1 s per message, measured); memaudit's after
    0.02 s."""
    from flwr.supercore.inflatable.inflatable_utils import ObjectUnavailableError
    from flwr.superlink.grid import http_grid

    saved = http_grid.pull_objects
    ready_at = time.monotonic() + 0.3

    def pull(object_id):
        if time.monotonic() < ready_at:
            raise ObjectUnavailableError(object_id)
        return b"x"

    try:
        polls.install("serverapp")
        t = time.monotonic()
        assert http_grid.pull_objects(["a", "b"], pull) == {"a": b"x", "b": b"x"}
        assert time.monotonic() - t < 0.8  # Flower's own: 1 s, then 2 s
    finally:
        http_grid.pull_objects = saved


def test_the_superexec_each_starts():
    cmd = superexec_command(["--superlink", "l:9091", "--host", "0.0.0.0", "--port", "9200"], 42, task="clientapp")
    assert cmd[1:] == ["-m", "memaudit.federated.flower.superexec", "--runtime-api-address",
                       "127.0.0.1:9200", "--parent-pid", "42", "--task", "clientapp"]
    tls = superexec_command(["--host=10.0.0.7", "--ssl-ca-certfile", "ca.crt"], 1, task="clientapp")
    assert "10.0.0.7:9094" in tls and tls[-2:] == ["--root-certificates", "ca.crt"]
    link = superexec_command(["--host", "::", "--insecure"], 3, task="serverapp")  # flower-superlink's port
    assert "[::1]:8000" in link and link[-2:] == ["--task", "serverapp"]


@pytest.mark.parametrize("argv, says", [
    (["--isolation", "subprocess", "--insecure"], "--isolation is memaudit's SuperExec"),
    (["--superexec-auth-secret-file", "s", "--insecure"], "--superexec-auth-secret-file is made by memaudit"),
    (["--poll", "5", "--insecure"], "outside 0.01-3 s"),
    (["--poll", "0", "--insecure"], "outside 0.01-3 s"),
    (["--fleet", "grpc", "--insecure"], "give bundled or flower"),
])
def test_bad_supernode_arguments_get_one_line(argv, says, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert says in err and len(err.splitlines()) == 1 and "Traceback" not in err


@pytest.mark.parametrize("argv, says", [
    (["--insecure", "--isolation=subprocess"], "--isolation is memaudit's SuperExec on this SuperLink"),
    (["--insecure", "--superexec-auth-secret-file=s"], "--superexec-auth-secret-file is made by memaudit"),
    (["--insecure", "--server-key", "/no/such/serverapp.key"], "the server key '/no/such/serverapp.key' cannot be read"),
])
def test_a_superlink_with_its_own_isolation_gets_one_line(argv, says, capsys):
    from memaudit.federated.flower import superlink

    assert superlink.main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert says in err and len(err.splitlines()) == 1


def test_flower_takes_the_runtime_secret_from_the_pipe():
    """The secret reaches Flower's own loader through the pipe, 32 random bytes, a new one each
    time; the pipe is closed afterwards."""
    import os

    from flwr.supercore.auth import load_superexec_auth_secret

    from memaudit.federated.flower.superexec import SECRET_FLAG, runtime_secret

    secrets = []
    for _ in range(2):
        with runtime_secret() as args:
            assert args[0] == SECRET_FLAG
            secrets.append(load_superexec_auth_secret(args[1]))
            fd = int(args[1].rsplit("/", 1)[1])
        with pytest.raises(OSError):
            os.fstat(fd)
    assert [len(s) for s in secrets] == [32, 32] and secrets[0] != secrets[1]


def test_the_superlinks_serverapp_installs_memaudits_app_only(fab, monkeypatch):
    """memaudit's SuperLink starts each ServerApp as Flower's flwr-serverapp with its FAB install
    guarded: a foreign FAB raises before anything of it is written or imported."""
    import importlib
    import sys

    from memaudit.federated.flower import superexec

    task = importlib.import_module("flwr.superlink.runtime.run_serverapp")
    installed = []
    monkeypatch.setattr(task, "install_from_fab", lambda content, **kw: installed.append(content))
    monkeypatch.setattr(superexec, "flwr_serverapp", lambda: None)
    monkeypatch.setattr(sys, "argv", list(sys.argv))
    superexec.run_serverapp(["--insecure", "--token", "t"])
    assert sys.argv[0] == "flwr-serverapp"
    task.install_from_fab(fab, skip_prompt=True)
    assert installed == [fab]
    with pytest.raises(RuntimeError, match="this SuperLink runs only memaudit's app"):
        task.install_from_fab(_rezip(fab, {"evil.py": b"import os\n"}), skip_prompt=True)
    assert installed == [fab]


def test_a_launch_folder_is_served_by_one_serverapp(tmp_path):
    """A run submitted again with another run's launch-dir (anyone who reaches the SuperLink can
    submit memaudit's own app) would train that run a second time beside the first. The second
    ServerApp is refused before it reads the launch file, and leaves nothing for the submitter."""
    from memaudit.errors import MemauditError
    from memaudit.run.flower import CLAIM, serve_run

    launch = _launch_folder(tmp_path, 7)
    (launch / "launch.json").write_text("{}")  # the first ServerApp fails on it, and says so
    with pytest.raises(KeyError):
        serve_run(None, launch_dir=launch, run_id=7)
    assert (launch / CLAIM).is_file() and (launch / "error.json").is_file()
    (launch / "error.json").unlink()
    with pytest.raises(MemauditError, match="already served by another ServerApp"):
        serve_run(None, launch_dir=launch, run_id=7)
    assert not (launch / "error.json").exists() and not (launch / "result.json").exists()


def _launch_folder(tmp_path, run_id, name="launch"):
    """A launch folder as memaudit train leaves it once flwr run said the run's id."""
    from memaudit.federated.flower import deploy

    launch = tmp_path / name
    launch.mkdir(mode=0o700)
    (launch / "launch.json").write_text("{}")
    (launch / "flwr-run.log").write_text(f"Loading project configuration...\nSuccessfully started run {run_id}\n")
    assert deploy.record_run_id(launch)
    return launch


def test_a_launch_folder_is_served_only_as_the_run_it_was_submitted_as(tmp_path):
    """Anyone who reaches the SuperLink can submit memaudit's own app naming a launch folder
    that no ServerApp has taken yet (its path is in the real run's config). Their ServerApp
    runs as another Flower run than the one memaudit train recorded in the folder: it is
    refused before it reads or writes anything there, the claim included, so the real run is
    still served. A folder another local user could have written, or one whose run id never
    comes, is refused too."""
    import os

    from memaudit.errors import MemauditError
    from memaudit.run.flower import CLAIM, bind_launch, serve_run

    launch = _launch_folder(tmp_path, 1234)
    before = sorted(p.name for p in launch.iterdir())
    with pytest.raises(MemauditError, match="submitted as another Flower run than 99") as e:
        serve_run(None, launch_dir=launch, run_id=99)  # the stranger's run
    assert "\n" not in str(e.value)
    assert sorted(p.name for p in launch.iterdir()) == before  # no claim, no error.json
    assert (launch / "flower-run.json").stat().st_mode & 0o777 == 0o600
    with pytest.raises(KeyError):  # the real run: bound, claimed, and on to the (empty) launch file
        serve_run(None, launch_dir=launch, run_id=1234)
    assert (launch / CLAIM).is_file()

    loose = _launch_folder(tmp_path, 5, "loose")
    os.chmod(loose, 0o777)  # another local user could have put a launch file there
    with pytest.raises(MemauditError, match="not this user's alone"):
        bind_launch(loose, 5)
    os.chmod(loose, 0o700)
    os.chmod(loose / "flower-run.json", 0o666)
    with pytest.raises(MemauditError, match="run id file .* not this user's alone"):
        bind_launch(loose, 5)
    link = tmp_path / "link"
    link.symlink_to(_launch_folder(tmp_path, 6, "target"))
    with pytest.raises(MemauditError, match="not this user's alone"):
        bind_launch(link, 6)

    pending = tmp_path / "pending"
    pending.mkdir(mode=0o700)
    with pytest.raises(MemauditError, match="no Flower run id was recorded .* within 0.2 s"):
        bind_launch(pending, 5, wait_s=0.2)


def test_a_task_that_fails_costs_that_task_not_the_node(monkeypatch, capsys):
    """A ClientApp task whose serving raises (the runtime API gone mid-task, a bug) is logged on
    the node and the SuperExec goes on to the next task: the node is not lost for the run."""
    import os
    from types import SimpleNamespace

    from memaudit.federated.flower import superexec

    tasks = iter(["t1", "t2", None])

    class Runtime:
        def AcquireTask(self, request):  # Flower's name
            token = next(tasks)
            if token is None:
                raise KeyboardInterrupt  # ends the loop for the test
            return SimpleNamespace(HasField=lambda name: True, token=token)

    served = []

    def serve_task(address, token, *rest, **kw):
        served.append(token)
        if token == "t1":
            raise ConnectionError("the runtime API went away")
        return True

    monkeypatch.setattr(superexec, "_runtime_client", lambda *a: Runtime())
    monkeypatch.setattr(superexec, "serve_task", serve_task)
    monkeypatch.setattr(superexec, "start_parent_process_monitor", lambda pid: None)
    monkeypatch.setattr(superexec.transport, "install", lambda *a, **kw: None)
    with pytest.raises(KeyboardInterrupt):
        superexec.serve("127.0.0.1:1", insecure=True, root_certificates=None, parent_pid=os.getppid())
    assert served == ["t1", "t2"]
    assert "ConnectionError" in capsys.readouterr().err


def test_a_heartbeat_after_the_task_ended_does_not_stop_the_superexec(monkeypatch):
    """Found in the 4-SuperNode benchmark: a task's first heartbeat, still in flight when the
    ClientApp pushed the task's output, came back refused (the task's token is void once its
    output is in), and Flower's heartbeat answers that with SIGINT to its own process (it ends a
    flwr-clientapp process that way). Here the process is the node's long-lived SuperExec: it
    died, and the node answered nothing more for the run. Now the heartbeat stops before the
    output goes in and a refused heartbeat is a failed one, never a signal. Failed before: the
    SIGINT came."""
    import signal
    import threading
    from types import SimpleNamespace

    from memaudit.federated.flower import superexec

    done = threading.Event()  # the task's output is in: its token is void

    class Runtime:
        def SendTaskHeartbeat(self, request):  # Flower's name
            done.wait(1.0)  # in flight until the output is in (or a second has passed)
            return SimpleNamespace(success=not done.is_set())

        def close(self):
            return None

    monkeypatch.setattr(superexec, "_runtime_client", lambda *a: Runtime())
    message = SimpleNamespace()
    # Flower's runtime calls, as the SuperExec holds them
    monkeypatch.setattr(superexec, "pull_task_input", lambda client: (message, SimpleNamespace(run_id=1), None,
                                                                        SimpleNamespace(content=b"fab")))
    monkeypatch.setattr(superexec, "push_message", lambda client, reply, context: None)
    monkeypatch.setattr(superexec, "push_task_output", lambda **kw: done.set())
    monkeypatch.setattr(superexec, "is_memaudit_app", lambda fab, expected: True)
    signals = []
    old = signal.signal(signal.SIGINT, lambda *a: signals.append(a))
    try:
        ok = superexec.serve_task("127.0.0.1:1", "token", True, None, {}, lambda message, context: "reply")
        done.wait(2.0)
        time.sleep(0.3)  # a heartbeat thread left running would answer by now
    finally:
        signal.signal(signal.SIGINT, old)
    assert ok and done.is_set()
    assert signals == []


def _node_with_a_task(fab: bytes, content: dict):
    """A SuperNode's state holding one ClientApp task, made by Flower's own loop
    (``_pull_and_store_message``) from a message of the server's: the state, the node's object
    store, and the message."""
    import hashlib

    from flwr.app import ConfigRecord, Message, Metadata, RecordDict
    from flwr.supercore.fab import Fab
    from flwr.supercore.inflatable.inflatable_object import get_all_nested_objects, get_object_tree
    from flwr.supercore.object_store import ObjectStoreFactory
    from flwr.supercore.run import Run
    from flwr.supernode import start_client_internal as loop
    from flwr.supernode.nodestate import NodeStateFactory

    factory = NodeStateFactory(objectstore_factory=ObjectStoreFactory())
    state, store = factory.state(), factory.objectstore_factory.store()
    state.set_node_id(7)
    fab_hash = hashlib.sha256(fab).hexdigest()
    run = Run.create_empty(3)
    run.fab_hash = fab_hash
    meta = Metadata(run_id=3, message_id="", src_node_id=0, dst_node_id=7, reply_to_message_id="", group_id="",
                    created_at=time.time(), ttl=600.0, message_type="query")
    msg = Message(metadata=meta, content=RecordDict({"c": ConfigRecord(content)}))
    msg.metadata.__dict__["_message_id"] = msg.object_id
    objects = get_all_nested_objects(msg)
    tree = get_object_tree(msg)
    run_id = loop._pull_and_store_message(
        state=state, object_store=store, node_config={}, receive=lambda: (msg, tree),
        get_run=lambda rid: run, get_fab=lambda h, rid: Fab(fab_hash, fab, {}),
        pull_object=lambda rid, oid: objects[oid].deflate(), confirm_message_received=lambda rid, mid: None,
        trusted_entities=None)
    assert run_id == 3
    return factory, state, store, msg


def _sent_replies(state, store) -> list:
    """What the SuperNode's loop sends the SuperLink next (Flower's ``_push_messages``): the
    replies, inflated from the objects it pushes."""
    from flwr.app import Message
    from flwr.supercore.inflatable.inflatable_object import iterate_object_tree
    from flwr.supercore.inflatable.inflatable_utils import inflate_object_from_contents
    from flwr.supernode import start_client_internal as loop

    sent, pushed = [], {}

    def send(message, tree, runtime):
        sent.append((message, tree))
        return {o.object_id for o in iterate_object_tree(tree)}, "session"

    loop._push_messages(state=state, object_store=store, send=send,
                        push_object=lambda rid, session, oid, content: pushed.__setitem__(oid, content))
    out = []
    for message, tree in sent:
        out.append(inflate_object_from_contents(tree.object_id, pushed, keep_object_contents=True))
        assert isinstance(out[-1], Message)
    return out


def test_the_superexec_in_the_supernodes_process_serves_a_task_through_flowers_handlers(fab):
    """memaudit's SuperExec, a thread of the SuperNode's process, asks Flower's own runtime
    handlers on the node's state (`LocalRuntime`) in place of the runtime API over HTTP: it
    acquires the task the SuperNode's loop made, reads its message, and its ClientApp's reply
    is what the loop sends the SuperLink; the task ends completed. A foreign FAB is refused on
    this path as on HTTP, and a token that names no task is refused as the HTTP API refuses it."""
    from flwr.app import ConfigRecord, Message, RecordDict
    from flwr.proto.runtime_pb2 import AcquireTaskRequest, PullTaskInputRequest
    from flwr.supercore.constant import TaskType
    from flwr.supercore.error import FlowerError

    from memaudit.federated.flower.superexec import REFUSED, serve_task
    from memaudit.federated.flower.transport.localruntime import LocalRuntime

    seen = []

    def client_app(message, context):
        seen.append((message.metadata.message_type, dict(message.content["c"]), context.node_id))
        return Message(RecordDict({"c": ConfigRecord({"read": message.content["c"]["x"] + 1})}), reply_to=message)

    ask = AcquireTaskRequest(supported_task_types=[TaskType.CLIENT_APP.value])
    for app, want in ((fab, "answered"), (_rezip(fab, {"evil.py": b"import os\n"}), "refused")):
        _factory, state, store, msg = _node_with_a_task(app, {"x": 41})
        local = LocalRuntime(state)
        res = local.AcquireTask(ask)
        assert res.HasField("task") and res.token
        ok = serve_task("", res.token, True, None, memaudit_app_files(), client_app, local=local)
        (reply,) = _sent_replies(state, store)
        assert reply.metadata.reply_to_message_id == msg.metadata.message_id
        if want == "answered":
            assert ok and seen == [("query", {"x": 41}, 7)]
            assert reply.content["c"]["read"] == 42
        else:
            assert not ok and len(seen) == 1  # the foreign app's message never reached the ClientApp
            assert reply.has_error() and reply.error.reason == REFUSED
        with pytest.raises(FlowerError, match="authentication failed"):  # its token is void once its output is in
            local.with_token(res.token).PullTaskInput(PullTaskInputRequest())
        assert not local.AcquireTask(ask).HasField("task")  # one task, served once
    with pytest.raises(FlowerError, match="authentication failed"):
        LocalRuntime(state, "a token of no task").PullTaskInput(PullTaskInputRequest())


def test_memaudits_supernode_runs_its_superexec_as_a_thread_on_the_nodes_own_state(fab, monkeypatch):
    """`beside` for a SuperNode starts no process: its SuperExec is a thread that finds the
    state Flower's SuperNode makes (``flwr.supernode.main.create_app``) and serves the tasks on
    it, and the node's resident process watches the SuperNode's process (the ClientApp's own),
    not its parent. Failed before: a SuperExec process was started, asking the runtime API
    over HTTP."""
    import os
    import subprocess
    import threading

    import flwr.supernode.main as api
    from flwr.app import ConfigRecord, Message, RecordDict
    from flwr.common.constant import Status
    from flwr.supernode.servicer.runtime import runtime_handlers

    from memaudit.federated.flower import node as flower_node
    from memaudit.federated.flower import superexec
    from memaudit.federated.flower.transport import localruntime

    monkeypatch.setattr(subprocess, "Popen", lambda *a, **k: pytest.fail("a SuperExec process was started"))
    monkeypatch.setattr(api, "create_app", api.create_app)  # the capture is undone after the test
    monkeypatch.setattr("memaudit.federated.flower.node.client_app", lambda message, context: Message(
        RecordDict({"c": ConfigRecord({"read": 1})}), reply_to=message))
    done = threading.Event()
    acquire = runtime_handlers.acquire_task

    def acquire_until_done(request, state):
        if done.is_set():
            raise SystemExit  # ends the SuperExec's thread when the test is over
        return acquire(request, state)

    monkeypatch.setattr(runtime_handlers, "acquire_task", acquire_until_done)
    replies = []

    def flower_supernode():  # Flower's SuperNode: makes its state and its runtime API, then its loop
        factory, state, store, _msg = _node_with_a_task(fab, {"x": 1})
        api.create_app(state_factory=factory)
        deadline = time.monotonic() + 10
        while not state.get_tasks(statuses=[Status.FINISHED]) and time.monotonic() < deadline:
            time.sleep(0.02)  # the SuperExec's thread serves the task
        if state.get_tasks(statuses=[Status.FINISHED]):
            replies.extend(_sent_replies(state, store))

    monkeypatch.setattr("sys.argv", ["memaudit-supernode"])
    monkeypatch.setattr(localruntime, "_READY", {"supernode": threading.Event()})  # this test's SuperNode's
    monkeypatch.setattr(localruntime, "_FACTORY", {})
    localruntime.capture_state("supernode")  # as memaudit's SuperNode's transport.install does
    monkeypatch.setattr(flower_node, "_WATCHED", [])
    assert flower_node.watched_pid() == os.getppid()  # a ClientApp in a process of its own
    try:
        assert superexec.beside(flower_supernode, ["--insecure"], task="clientapp") == 0
    finally:
        done.set()
    assert [r.content["c"]["read"] for r in replies] == [1]
    assert flower_node.watched_pid() == os.getpid()  # the SuperNode's process


def test_serverapps_side_by_side_create_messages_for_their_own_runs(monkeypatch):
    """memaudit's SuperLink serves each run's ServerApp as a thread of its process. Flower's
    `TaskIdentity` (the run a process's new messages are for) is one per process; with two runs
    at once, one run's messages were created for the other's. `identity_per_thread` makes it
    one per thread. Failed before: both threads' messages named the run set last."""
    import threading

    from flwr.app import ConfigRecord, Message, RecordDict
    from flwr.supercore.task_identity import TaskIdentity

    from memaudit.federated.flower.transport import localruntime
    from memaudit.federated.flower.transport.localruntime import identity_per_thread

    meta = type(TaskIdentity)
    for name in ("task_id", "run_id", "node_id"):  # Flower's own, back after the test
        monkeypatch.setattr(meta, name, meta.__dict__[name])
    # no thread has an identity yet (another test in this process may have set this thread's)
    monkeypatch.setattr(localruntime, "_IDENTITY", threading.local())
    identity_per_thread()
    identity_per_thread()  # idempotent
    both_set = threading.Barrier(2)
    made = {}

    def serverapp(run_id):
        TaskIdentity.task_id, TaskIdentity.run_id, TaskIdentity.node_id = 10 * run_id, run_id, 0
        both_set.wait()  # each thread sets its identity before either creates a message
        made[run_id] = Message(RecordDict({"c": ConfigRecord({"x": 1})}), dst_node_id=5,
                               message_type="query").metadata.run_id

    threads = [threading.Thread(target=serverapp, args=(r,)) for r in (1, 2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert made == {1: 1, 2: 2}
    with pytest.raises(RuntimeError, match="TaskIdentity.run_id is not set"):  # this thread serves no task
        TaskIdentity.run_id  # noqa: B018


class _LinkRuntime:
    """A ServerApp task's runtime on a SuperLink (`LocalRuntime`'s calls), recording them."""

    def __init__(self, fab: bytes, token: str = "t") -> None:
        import hashlib

        from flwr.app import Context, RecordDict
        from flwr.common.serde import context_to_proto, fab_to_proto, run_to_proto
        from flwr.proto.runtime_pb2 import PullTaskInputResponse
        from flwr.supercore.fab import Fab
        from flwr.supercore.run import Run

        run = Run.create_empty(5)
        run.fab_hash = hashlib.sha256(fab).hexdigest()
        run.override_config = {"launch-dir": "/nowhere"}
        context = Context(run_id=5, node_id=0, node_config={}, state=RecordDict(), run_config={})
        self.input = PullTaskInputResponse(context=context_to_proto(context), run=run_to_proto(run),
                                           fab=fab_to_proto(Fab(run.fab_hash, fab, {})), task_id=9)
        self.token, self.logs, self.output = token, [], None

    def with_token(self, token):
        assert token == self.token
        return self

    def SendTaskHeartbeat(self, request):
        return type("R", (), {"success": True})()

    def PullTaskInput(self, request):
        return self.input

    def PushLogs(self, request):
        self.logs.extend(request.logs)

    def PushTaskOutput(self, request):
        self.output = request


@pytest.mark.parametrize("app, raises, status, log", [
    ("memaudit", None, "completed", []),
    ("foreign", None, "failed", ["REFUSED"]),
    ("memaudit", "memaudit", "failed", ["memaudit's ServerApp raised MemauditError: the launch folder is gone"]),
    ("memaudit", "other", "failed", ["memaudit's ServerApp raised KeyError"]),
])
def test_a_serverapp_task_in_the_superlinks_process(fab, monkeypatch, app, raises, status, log):
    """A ServerApp task served in memaudit's SuperLink's process (`serve_serverapp`): memaudit's
    app runs this installation's ServerApp with a Grid on the SuperLink's runtime (no HTTP) and
    the run's config from the FAB; a foreign FAB is refused (its ServerApp never called) and the
    run's log says so, as the submitter's `flwr run --stream` shows it; a failing ServerApp ends
    the task failed with one line in the run's log: memaudit's own error text, of anything else
    its type only (an exception's text could carry a data value)."""
    from memaudit.errors import MemauditError
    from memaudit.federated.flower import node as flower_node
    from memaudit.federated.flower import superexec

    calls = []

    def server_app(grid, context):
        calls.append((grid._client, grid.run.run_id, context.run_config["launch-dir"]))
        if raises == "memaudit":
            raise MemauditError("the launch folder is gone")
        if raises == "other":
            raise KeyError("a value from the data")

    monkeypatch.setattr(flower_node, "server_app", server_app)
    client = _LinkRuntime(fab if app == "memaudit" else _rezip(fab, {"evil.py": b"import os\n"}))
    ok = superexec.serve_serverapp(client, "t", memaudit_app_files())
    assert ok == (status == "completed") and client.output.sub_status == status
    assert calls == ([] if app == "foreign" else [(client, 5, "/nowhere")])
    want = [superexec.REFUSED_SERVER if x == "REFUSED" else x for x in log]
    assert [x.rstrip("\n") for x in client.logs] == want
    assert "a value from the data" not in "".join(client.logs) + client.output.details


def test_memaudits_superlink_serves_serverapps_as_threads_of_its_process(monkeypatch):
    """`beside` for a SuperLink starts no SuperExec process: its SuperExec is a thread that
    asks Flower's runtime handlers on the state Flower's SuperLink makes, and starts each
    ServerApp task as a thread. Failed before: a SuperExec process was started (and it started
    a ``flwr-serverapp`` process for each run)."""
    import subprocess
    import threading
    from types import SimpleNamespace

    import flwr.superlink.main as api
    from flwr.superlink.servicer.runtime import runtime_handlers

    from memaudit.federated.flower import superexec
    from memaudit.federated.flower.transport import localruntime

    monkeypatch.setattr(subprocess, "Popen", lambda *a, **k: pytest.fail("a process was started"))
    state = object()
    monkeypatch.setattr(api, "create_app", lambda *a, **k: SimpleNamespace(
        state=SimpleNamespace(runtime_state_factory=SimpleNamespace(state=lambda: state))))
    monkeypatch.setattr(localruntime, "_READY", {"superlink": threading.Event()})
    monkeypatch.setattr(localruntime, "_FACTORY", {})
    localruntime.capture_state("superlink")  # as memaudit's SuperLink's transport.install does
    tokens = iter(["run-1"])

    def acquire(request, on):
        assert on is state
        token = next(tokens, None)
        if token is None:
            raise SystemExit  # ends the SuperExec's thread
        return SimpleNamespace(HasField=lambda name: True, token=token)

    monkeypatch.setattr(runtime_handlers, "acquire_task", acquire)
    served = []
    started = threading.Event()

    def serve_serverapp(local, token, expected):
        served.append((threading.current_thread().name, local.component, local.state is state, token))
        started.set()

    monkeypatch.setattr(superexec, "serve_serverapp", serve_serverapp)
    monkeypatch.setattr("sys.argv", ["memaudit-superlink"])

    def flower_superlink():
        api.create_app()
        assert started.wait(10)

    assert superexec.beside(flower_superlink, ["--insecure"], task="serverapp") == 0
    assert served == [("memaudit-serverapp", "superlink", True, "run-1")]
