"""A SuperNode's or SuperLink's runtime API, called in its own process.

memaudit's SuperExec answers a SuperNode's ClientApp tasks with memaudit's ClientApp, and a
SuperLink's ServerApp tasks with memaudit's ServerApp (`memaudit.federated.flower.superexec`).
As processes beside the SuperNode and the SuperLink they reached the messages through Flower's
runtime API over HTTP on 127.0.0.1, object by object, each request framed, sent, parsed and
answered by the component's HTTP server. Measured on the tiny preset (2026-12-05, 2 cores):
0.07-0.09 s for a node to pull a stage message (7.2 MB) and 0.065-0.075 s to push its reply,
0.10 s for the ServerApp to push the weights, 17-37 ms for each small message of a secure round.

On memaudit's SuperNode and SuperLink the SuperExec, and the SuperLink's ServerApps, run as
threads of the component's process (`memaudit.federated.flower.superexec.beside`), and
`LocalRuntime` answers their calls with Flower's own runtime handlers
(``flwr.supernode.servicer.runtime.runtime_handlers``, ``flwr.superlink.servicer.runtime.
runtime_handlers``) on the component's own state: the same requests, the same checks (a
task's token names its task, as the HTTP API's `authenticate_task` checks), the same answers,
without HTTP between two parts of one process. A ServerApp's Grid is Flower's own, asking a
`LocalRuntime` (`local_grid`). What stays: the handlers' work, Flower's serialisation of a
message into its objects and back, and the hash of every object's content against its id.

Only the process that holds the state can call it; nothing here listens on a port. The
component's runtime API over HTTP keeps its own checks for any other caller, with a SuperExec
secret no one holds (`memaudit.federated.flower.superexec.runtime_secret`): it hands no task
outside this process.
"""

from __future__ import annotations

import threading
from types import ModuleType
from typing import Any

from flwr.supercore.error import ApiErrorCode, FlowerError
from flwr.supercore.servicer.runtime import runtime_handlers as core_handlers
from flwr.supercore.task_identity import TaskIdentity
from flwr.superlink import main as superlink_main
from flwr.superlink.grid import HttpGrid
from flwr.superlink.servicer.runtime import runtime_handlers as superlink_handlers
from flwr.supernode import main as supernode_main
from flwr.supernode.servicer.runtime import runtime_handlers as supernode_handlers

_FACTORY: dict[str, Any] = {}
_READY = {"supernode": threading.Event(), "superlink": threading.Event()}
# a handler is looked up in its module at each call: memaudit's held asks replace some there
_HANDLERS: dict[str, ModuleType] = {"supernode": supernode_handlers, "superlink": superlink_handlers}
_MAINS: dict[str, ModuleType] = {"supernode": supernode_main, "superlink": superlink_main}


def capture_state(component: str = "supernode") -> None:
    """Record the state factory of this process's SuperNode or SuperLink (``component``) when
    Flower builds its runtime API (``create_app`` in ``flwr.supernode.main`` or
    ``flwr.superlink.main``), for `component_state`. Idempotent."""
    api = _MAINS[component]
    if getattr(api.create_app, "__memaudit_capture__", False):
        return
    create = api.create_app

    def create_app(*args: Any, **kwargs: Any) -> Any:
        app = create(*args, **kwargs)
        factory = getattr(app.state, "runtime_state_factory", None)
        if factory is not None:
            _FACTORY[component] = factory
            _READY[component].set()
        return app

    create_app.__memaudit_capture__ = True  # type: ignore[attr-defined]
    api.create_app = create_app


def component_state(component: str = "supernode", timeout: float | None = None) -> Any:
    """The state of this process's SuperNode (its `NodeState`) or SuperLink (its `LinkState`),
    once Flower has made it (`capture_state`)."""
    if not _READY[component].wait(timeout):
        raise RuntimeError(f"the {component} made no state within the wait")
    return _FACTORY[component].state()


def _task_call(handler: str, *, core: bool = False) -> Any:
    """A `LocalRuntime` method: Flower's runtime handler ``handler`` (the component's, or with
    ``core`` the shared one) called with the request, the state and the token's task."""

    def call(self: LocalRuntime, request: Any) -> Any:
        module = core_handlers if core else self._handlers()
        return getattr(module, handler)(request, self.state, self._task())

    call.__name__ = handler
    return call


class LocalRuntime:
    """Flower's runtime API client (``RuntimeHttpClient``), for the calls memaudit's SuperExec
    and a ServerApp's Grid make, answered in this process by Flower's handlers of ``component``
    (``"supernode"`` or ``"superlink"``) on ``state``. ``token``: the task's, as the HTTP
    client's token header; empty for `AcquireTask`, which needs none."""

    def __init__(self, state: Any, token: str = "", component: str = "supernode") -> None:
        self.state, self.token, self.component = state, token, component

    def with_token(self, token: str) -> LocalRuntime:
        return LocalRuntime(self.state, token, self.component)

    def _task(self) -> Any:
        task = self.state.get_task_by_token(self.token) if self.token else None
        if task is None:  # as the HTTP API's authenticate_task
            raise FlowerError(ApiErrorCode.RUNTIME_AUTHENTICATION_FAILED, "Runtime task-token authentication failed.")
        return task

    def _handlers(self) -> ModuleType:
        return _HANDLERS[self.component]

    def AcquireTask(self, request: Any) -> Any:  # Flower's names
        return self._handlers().acquire_task(request, self.state)

    # the calls of a task, each Flower's handler of the same name on this state, for the task
    # this token names ("core": the handler is the shared one of flwr.supercore)
    SendTaskHeartbeat = _task_call("send_task_heartbeat", core=True)
    PullTaskInput = _task_call("pull_task_input")
    PushTaskOutput = _task_call("push_task_output")
    GetNodes = _task_call("get_nodes")
    PullMessages = _task_call("pull_messages")
    PushMessages = _task_call("push_messages")
    PullObject = _task_call("pull_object")
    PushObject = _task_call("push_object")
    ConfirmMessageReceived = _task_call("confirm_message_received")
    PushLogs = _task_call("push_logs", core=True)

    def close(self) -> None:
        return None


_IDENTITY = threading.local()


def identity_per_thread() -> None:
    """Make Flower's ``TaskIdentity`` (the task, run and node a process's messages are created
    for, one per process in Flower) one per thread in this process, so that the ServerApps of
    runs served side by side as threads of one SuperLink each create their messages for their
    own run. Idempotent."""
    meta = type(TaskIdentity)
    if getattr(getattr(vars(meta).get("task_id"), "fget", None), "__memaudit_per_thread__", False):
        return

    def per_thread(name: str) -> property:
        def get(cls: Any) -> int:
            value = getattr(_IDENTITY, name, None)
            if value is None:  # Flower's own error, for a thread that has no task
                raise RuntimeError(f"TaskIdentity.{name} is not set.")
            return value

        def put(cls: Any, value: int) -> None:
            setattr(_IDENTITY, name, value)

        get.__memaudit_per_thread__ = True  # type: ignore[attr-defined]
        return property(get, put)

    for name in ("task_id", "run_id", "node_id"):
        setattr(meta, name, per_thread(name))


def local_grid(client: LocalRuntime) -> Any:
    """Flower's Grid for a ServerApp (``HttpGrid``), asking ``client`` (a ServerApp task's
    `LocalRuntime` on the SuperLink's state) in place of the runtime API over HTTP."""
    grid = HttpGrid(token=client.token)
    grid._client = client  # what HttpGrid._connect would make, here the handlers themselves
    return grid


def install(component: str) -> None:
    """In a SuperNode's or SuperLink's process (``component``), before Flower builds its runtime
    API: its state recorded for memaudit's SuperExec (`capture_state`); in a SuperLink's,
    ``TaskIdentity`` one per thread too (`identity_per_thread`), for its ServerApps side by side.
    Idempotent; nothing for another component."""
    if component in _MAINS:
        capture_state(component)
    if component == "superlink":
        identity_per_thread()


__all__ = ["LocalRuntime", "capture_state", "component_state", "identity_per_thread", "install", "local_grid"]
