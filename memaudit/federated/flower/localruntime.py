"""A SuperNode's runtime API called in the SuperNode's own process.

memaudit's SuperExec answers a SuperNode's ClientApp tasks with memaudit's ClientApp
(`memaudit.federated.flower.superexec`). As a process beside the SuperNode it reached the
node's messages through Flower's runtime API over HTTP on 127.0.0.1: a task's message pulled
object by object from the SuperNode's memory and its reply pushed back, each request framed,
sent, parsed and answered by the SuperNode's HTTP server. Measured on the tiny preset
(2026-12-05, 2 cores): 0.07-0.09 s to pull a stage message (7.2 MB) and 0.065-0.075 s to push a
node's reply, each way of every round; 17-37 ms for each small message of a secure round.

On memaudit's SuperNode the SuperExec runs as a thread of the SuperNode's process
(`memaudit.federated.flower.supernode`), and `LocalRuntime` answers its calls with Flower's
own runtime handlers (`flwr.supernode.servicer.runtime.runtime_handlers`) on the SuperNode's
own state: the same requests, the same checks (a task's token names its task, as the HTTP
API's `authenticate_task` checks), the same answers, without HTTP between two parts of one
process. What stays: the handlers' work, Flower's serialisation of a message into its objects
and back, and the hash of every object's content against its id.

Only the process that holds the state can call it; nothing here listens on a port, so the
SuperNode's runtime API over HTTP keeps its own checks for any other caller.
"""

from __future__ import annotations

import threading
from typing import Any

_FACTORY: list[Any] = []
_READY = threading.Event()


def capture_state() -> None:
    """Record the SuperNode's state factory when Flower's SuperNode builds its runtime API
    (``flwr.supernode.main.create_app``), for `node_state`. Idempotent."""
    # optional dependency: flwr (the flower extra); called only on a SuperNode
    import flwr.supernode.main as api

    if getattr(api.create_app, "__memaudit_capture__", False):
        return
    create = api.create_app

    def create_app(state_factory: Any = None, *args: Any, **kwargs: Any) -> Any:
        if state_factory is not None:
            _FACTORY[:] = [state_factory]
            _READY.set()
        return create(state_factory, *args, **kwargs)

    create_app.__memaudit_capture__ = True  # type: ignore[attr-defined]
    api.create_app = create_app


def node_state(timeout: float | None = None) -> Any:
    """The SuperNode's `NodeState`, once Flower's SuperNode has made it (`capture_state`)."""
    if not _READY.wait(timeout):
        raise RuntimeError("the SuperNode made no state within the wait")
    return _FACTORY[0].state()


class LocalRuntime:
    """Flower's runtime API client (``RuntimeHttpClient``), for the calls memaudit's SuperExec
    makes, answered in this process by Flower's handlers on ``state``. ``token``: the task's,
    as the HTTP client's token header; empty for `AcquireTask`, which needs none."""

    def __init__(self, state: Any, token: str = "") -> None:
        self.state, self.token = state, token

    def with_token(self, token: str) -> LocalRuntime:
        return LocalRuntime(self.state, token)

    def _task(self) -> Any:
        # optional dependency: flwr (the flower extra)
        from flwr.supercore.error import ApiErrorCode, FlowerError

        task = self.state.get_task_by_token(self.token) if self.token else None
        if task is None:  # as the HTTP API's authenticate_task
            raise FlowerError(ApiErrorCode.RUNTIME_AUTHENTICATION_FAILED, "Runtime task-token authentication failed.")
        return task

    @staticmethod
    def _handlers() -> Any:
        # looked up at each call: memaudit's held asks wrap acquire_task in this module
        from flwr.supernode.servicer.runtime import runtime_handlers

        return runtime_handlers

    def AcquireTask(self, request: Any) -> Any:  # Flower's names
        return self._handlers().acquire_task(request, self.state)

    def SendTaskHeartbeat(self, request: Any) -> Any:
        from flwr.supercore.servicer.runtime import runtime_handlers as core

        return core.send_task_heartbeat(request, self.state, self._task())

    def PullTaskInput(self, request: Any) -> Any:
        return self._handlers().pull_task_input(request, self.state, self._task())

    def PushTaskOutput(self, request: Any) -> Any:
        return self._handlers().push_task_output(request, self.state, self._task())

    def PullMessages(self, request: Any) -> Any:
        return self._handlers().pull_messages(request, self.state, self._task())

    def PushMessages(self, request: Any) -> Any:
        return self._handlers().push_messages(request, self.state, self._task())

    def PullObject(self, request: Any) -> Any:
        return self._handlers().pull_object(request, self.state, self._task())

    def PushObject(self, request: Any) -> Any:
        return self._handlers().push_object(request, self.state, self._task())

    def ConfirmMessageReceived(self, request: Any) -> Any:
        return self._handlers().confirm_message_received(request, self.state, self._task())

    def close(self) -> None:
        return None


__all__ = ["LocalRuntime", "capture_state", "node_state"]
