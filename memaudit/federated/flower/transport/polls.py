"""Flower 1.42's waits, made polls of a round's scale.

A Flower exchange is a chain of processes that look for each other's work by polling, and Flower
1.42 waits seconds between looks:

- a SuperNode that found no message waits 3 s before it asks the SuperLink again, and looks for
  its ClientApp's reply and its content every 0.5 s (``start_client_internal``);
- an object of a message that is not there yet (the sender announces a message before it has
  pushed its objects) is asked for again after 1 s, then 2, 4 ... up to 10 s
  (``inflatable_utils.pull_objects``): the SuperNode pulling the server's message, the ClientApp
  pulling it from the SuperNode, and the ServerApp pulling the nodes' replies each hit this once
  an exchange or more.

A memaudit round of the tiny model computes in under a second, so these waits were most of a
Flower round. `install` makes each at most a poll: `SUPERNODE_POLL_S` for the SuperNode's
loop when it found no message (`memaudit.federated.flower.supernode`), `LOCAL_POLL_S` for its
looks at its own memory (its ClientApp's reply, a reply's content), and `PULL_BACKOFF_S`
doubling to at most `PULL_BACKOFF_CAP_S` between asks for an object, with no limit on the
number of asks (Flower's limit of 500 would be reached in under two minutes; its 2-hour limit
on the time stays). Only the waits change, never what is asked or in what order.
"""

from __future__ import annotations

import functools
import time
from types import ModuleType
from typing import Any

from flwr.supercore.inflatable import inflatable_utils
from flwr.superlink.grid import http_grid
from flwr.supernode import start_client_internal as loop
from flwr.supernode.runtime import run_clientapp

SUPERNODE_POLL_S = 0.1
LOCAL_POLL_S = 0.01
IDLE_WAIT_S = 1.0  # Flower's waits from this long up are the loop's before it asks the SuperLink again
PULL_BACKOFF_S, PULL_BACKOFF_CAP_S = 0.02, 0.25


class PollWaits:
    """``time`` as a Flower module sees it: every wait is at most `poll` seconds, or `local`
    seconds when Flower asked for less than `IDLE_WAIT_S`; every other call is the ``time``
    module's.

    Flower 1.42's SuperNode loop waits 3 s when the SuperLink had no message for it (the next
    ask goes over the network to the SuperLink, which every idle node's asks keep busy), and
    0.5 s between looks at its own memory: for its ClientApp's reply, and for a reply's content.
    Those looks cost the node almost nothing, and a round waits on them once an exchange (five
    times a secure round): on 2 cores a secure round took 2.97 s with them at 0.01 s against
    3.25 s at 0.1 s, and a FedAvg round the same (median of rounds 5-10).

    The poll counts from the end of the last wait, so an ask that the SuperLink held
    (`memaudit.federated.flower.transport.longpoll`) for a poll or longer is followed by the next at once,
    and one answered at once (Flower's own SuperLink) by a wait of the poll's rest.

    >>> w = PollWaits(0.0)
    >>> t = time.monotonic(); w.sleep(3); w.sleep(0.5); time.monotonic() - t < 0.5
    True
    >>> w = PollWaits(0.2); w.sleep(0.001); time.sleep(0.2)  # an ask held 0.2 s
    >>> t = time.monotonic(); w.sleep(3); time.monotonic() - t < 0.1
    True
    >>> w.monotonic is time.monotonic
    True
    """
    def __init__(self, poll: float, local: float = LOCAL_POLL_S) -> None:
        self.poll, self.local = float(poll), float(local)
        self.woke = 0.0  # when the last wait ended: the loop's ask since then counts toward a poll

    def sleep(self, seconds: float) -> None:
        if seconds >= IDLE_WAIT_S:  # an ask of the SuperLink found nothing: ask again a poll after the last
            time.sleep(max(0.0, min(seconds, self.poll) - (time.monotonic() - self.woke)))
        else:
            time.sleep(min(seconds, self.local))
        self.woke = time.monotonic()

    def __getattr__(self, name: str) -> Any:
        return getattr(time, name)


def _short_pulls(module: ModuleType, name: str = "pull_objects") -> None:
    """`module`'s ``name`` (``pull_objects``, or ``pull_and_inflate_object_from_tree``, which takes
    the same waits) asks again for a missing object after `PULL_BACKOFF_S`."""
    setattr(module, name, functools.partial(
        getattr(inflatable_utils, name), initial_backoff=PULL_BACKOFF_S, backoff_cap=PULL_BACKOFF_CAP_S,
        max_tries_per_object=None))


def install(component: str, poll: float | None = None) -> None:
    """Make Flower's waits in this process polls, for ``component``: a ServerApp's pulls of replies
    (its Grid's), a ClientApp's pull of its message from the SuperNode (which hands out the task
    before it holds the message's objects), or the SuperNode's loop (its wait before it asks
    the SuperLink again at most ``poll`` seconds, default `SUPERNODE_POLL_S`) and its pulls of
    messages. Idempotent; nothing for a SuperLink (its ServerApps install ``"serverapp"``)."""
    if component == "serverapp":
        _short_pulls(http_grid)
    elif component == "clientapp":
        _short_pulls(run_clientapp, "pull_and_inflate_object_from_tree")
    elif component == "supernode":
        if not (loop.time is time or isinstance(loop.time, PollWaits)):
            raise RuntimeError("this Flower's SuperNode loop does not wait through the time module")
        loop.time = PollWaits(SUPERNODE_POLL_S if poll is None else poll)  # type: ignore[attr-defined]
        _short_pulls(loop)
