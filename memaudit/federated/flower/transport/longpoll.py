"""Long polls: a SuperLink or SuperNode answers an ask for work when there is work.

Every hop of a Flower 1.42 exchange is a poll: the SuperNode asks the SuperLink for a message,
memaudit's SuperExec asks its SuperNode for a task, the ServerApp asks the SuperLink for
replies, each on its own clock (`memaudit.federated.flower.transport.polls`). A message therefore waits
half a poll on average at each hop it crosses, and more when a sender announces it before its
objects are there: the receiver then asks for the objects on a doubling backoff. On 2 cores a
small exchange of a secure round took 0.24-0.28 s, most of it waits.

In memaudit's SuperLink (`memaudit.federated.flower.superlink`) and SuperNode
(`memaudit.federated.flower.supernode`), through `install`, `hold` makes an ask that finds nothing wait in the
answering process, for at most `HOLD_S`, until something it could return was stored there
(`Wakeups`); an answer that names a message waits, within the same limit, until every object of
that message is in the store, so the receiver pulls them at once. The answer is the one Flower
gives, later: what is asked, what is returned and in what order do not change, and a sender
that dies mid-push costs the receiver `HOLD_S` and then Flower's own backoff. The askers
(`memaudit.federated.flower.transport.polls.PollWaits`, `memaudit.federated.flower.superexec.serve`,
`memaudit.federated.flower.trainer.FlowerNodes`) ask again at most every poll, counting the
time the ask was held: against a held ask they ask again at once, against Flower's own
SuperLink (which answers at once) they keep their poll.

At most `MAX_HELD` asks are held at a time in one process; a further ask is answered at once,
as Flower would, so a federation of many nodes cannot take every thread of the SuperLink's API.

Held asks change when an answer comes, never what a node accepts: a node checks what it runs
and what it sends as before (docs/flower.md, "What each party trusts"), and holds only its own
SuperExec's asks.
"""

from __future__ import annotations

import functools
import inspect
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any

from flwr.superlink.servicer.fleet import fleet_handlers as fleet
from flwr.superlink.servicer.runtime import runtime_handlers as link_runtime
from flwr.supernode import start_client_internal as loop
from flwr.supernode.servicer.runtime import runtime_handlers as node_runtime

HOLD_S = 1.0  # well under Flower's 30 s request timeout, and its heartbeats' intervals
MAX_HELD = 16  # of the API server's threads (anyio's default pool: 40)


class Wakeups:
    """A process's "something was stored" signal: `notify` after a store; `wait(gen, until)`
    returns True once a store happened after `generation` returned `gen`, False at `until`."""
    def __init__(self, max_held: int = MAX_HELD) -> None:
        self._cond = threading.Condition()
        self._gen = 0
        self._slots = threading.BoundedSemaphore(max_held)

    def notify(self) -> None:
        with self._cond:
            self._gen += 1
            self._cond.notify_all()

    def generation(self) -> int:
        with self._cond:
            return self._gen

    def wait(self, gen: int, until: float) -> bool:
        with self._cond:
            while self._gen == gen:
                left = until - time.monotonic()
                if left <= 0:
                    return False
                self._cond.wait(left)
            return True

    def slot(self) -> bool:
        """Take one of the ``max_held`` places of a held ask (give it back with `release`)."""
        return self._slots.acquire(blocking=False)

    def release(self) -> None:
        self._slots.release()


WAKEUPS = Wakeups()


def object_ids(trees: Iterable[Any]) -> list[str]:
    """The ids of every object of these object trees (Flower ``ObjectTree`` protos)."""
    out, todo = [], list(trees)
    while todo:
        tree = todo.pop()
        out.append(tree.object_id)
        todo.extend(tree.children)
    return out


def missing(store: Any, ids: Iterable[str]) -> list[str]:
    """The objects of `ids` whose content `store` (a Flower ``ObjectStore``: ``get`` is None for
    an unknown object, empty bytes for one registered but not yet pushed) does not hold yet."""
    return [i for i in ids if not store.get(i)]


def objects_ready(store: Any, trees: Iterable[Any]) -> bool:
    """Whether every object of these object trees has its content in `store`."""
    return not missing(store, object_ids(trees))


def hold(handler: Callable[..., Any], *, found: Callable[[Any], bool],
         objects: Callable[[Any, inspect.BoundArguments], tuple[Any, list[str]]] | None = None,
         wakeups: Wakeups = WAKEUPS, hold_s: float = HOLD_S) -> Callable[..., Any]:
    """`handler` (a Flower API handler) held: called again after each store while its answer is
    not `found`, and its `found` answer returned once the store holds every object that
    ``objects(answer, arguments)`` names (a store and object ids; each store takes off the
    ones that came, so a message of many chunks is not walked whole at every push), each for at
    most `hold_s` seconds from the ask."""
    sig = inspect.signature(handler)

    @functools.wraps(handler)
    def held(*args: Any, **kwargs: Any) -> Any:
        if not wakeups.slot():
            return handler(*args, **kwargs)
        try:
            until = time.monotonic() + hold_s
            while True:
                gen = wakeups.generation()
                answer = handler(*args, **kwargs)
                if found(answer):
                    break
                if not wakeups.wait(gen, until):
                    return answer
            if objects is not None:
                store, pending = objects(answer, sig.bind(*args, **kwargs))
                while True:
                    gen = wakeups.generation()
                    pending = missing(store, pending)
                    if not pending or not wakeups.wait(gen, until):
                        break
            return answer
        finally:
            wakeups.release()

    held.__memaudit_held__ = True  # type: ignore[attr-defined]
    return held


def notifying(handler: Callable[..., Any], wakeups: Wakeups = WAKEUPS) -> Callable[..., Any]:
    """`handler` (one that stores a message, an object or a task), then `wakeups.notify()`."""
    @functools.wraps(handler)
    def stored(*args: Any, **kwargs: Any) -> Any:
        try:
            return handler(*args, **kwargs)
        finally:
            wakeups.notify()

    stored.__memaudit_held__ = True  # type: ignore[attr-defined]
    return stored


def has_messages(answer: Any) -> bool:
    return len(answer.messages_list) > 0


def has_task(answer: Any) -> bool:
    return bool(answer.HasField("task"))


def message_objects(store_of: Callable[[inspect.BoundArguments], Any]
                    ) -> Callable[[Any, inspect.BoundArguments], tuple[Any, list[str]]]:
    """`objects` for a pull of messages: the store (`store_of` the handler's arguments) and every
    object of every message in the answer."""
    return lambda answer, bound: (store_of(bound), object_ids(answer.message_object_trees))


def _patch(module: Any, name: str, wrap: Callable[[Callable[..., Any]], Callable[..., Any]]) -> None:
    if not getattr(getattr(module, name), "__memaudit_held__", False):
        setattr(module, name, wrap(getattr(module, name)))


def install(component: str) -> None:
    """In a SuperLink's process (``component``): the SuperNodes' asks for a message and the
    ServerApp's asks for replies are held; a push of a message or an object from either side
    wakes them. In a SuperNode's: its SuperExec's asks for a task are held until the node has
    pulled a message and all its objects from the SuperLink. Idempotent; nothing for another
    component."""
    if component == "superlink":
        for module in (fleet, link_runtime):
            _patch(module, "push_messages", notifying)
            _patch(module, "push_object", notifying)
        _patch(fleet, "pull_messages", lambda h: hold(
            h, found=has_messages, objects=message_objects(lambda b: b.arguments["store"])))
        _patch(link_runtime, "pull_messages", lambda h: hold(
            h, found=has_messages, objects=message_objects(lambda b: b.arguments["state"].object_store)))
    elif component == "supernode":
        _patch(loop, "_pull_and_store_message", notifying)
        _patch(node_runtime, "acquire_task", lambda h: hold(h, found=has_task))


__all__ = ["HOLD_S", "MAX_HELD", "WAKEUPS", "Wakeups", "has_messages", "has_task", "hold",
           "install", "message_objects", "missing", "notifying", "object_ids",
           "objects_ready"]
