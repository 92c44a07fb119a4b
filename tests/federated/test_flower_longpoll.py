"""Held asks (`memaudit.federated.flower.transport.longpoll`): an ask that finds nothing waits in the
answering process until something it could return is stored; an answer naming a message waits
until the message's objects are all stored. Against fakes shaped as Flower's handlers and store,
and against Flower's own handler modules for what memaudit's SuperLink and SuperNode install.
The end-to-end runs on memaudit's SuperLink and SuperNodes (tests/federated/test_flower_*.py)
go through the held handlers."""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace

import pytest

from memaudit.federated.flower.transport import longpoll
from memaudit.federated.flower.transport.longpoll import (
    Wakeups,
    has_messages,
    hold,
    message_objects,
    objects_ready,
)


def _tree(oid, *children):
    return SimpleNamespace(object_id=oid, children=list(children))


class Link:
    """A SuperLink as the held handlers see it: messages waiting for a node, and an object
    store (``get``: None unknown, b"" registered and not pushed, else the content)."""

    def __init__(self, wakeups):
        self.wakeups, self.queue, self.objects, self.asks = wakeups, [], {}, 0

    def pull_messages(self, request, state, store):  # Flower's fleet handler's signature
        self.asks += 1
        msgs, self.queue = self.queue[:1], self.queue[1:]
        return SimpleNamespace(messages_list=[m for m, _ in msgs], message_object_trees=[t for _, t in msgs])

    def announce(self, name, tree):
        """The sender's first request: the message and its object tree, no contents yet."""
        todo = [tree]
        while todo:
            t = todo.pop()
            self.objects.setdefault(t.object_id, b"")
            todo += t.children
        self.queue.append((name, tree))
        self.wakeups.notify()

    def push(self, oid):
        self.objects[oid] = b"content of " + oid.encode()
        self.wakeups.notify()


def _held(link, hold_s=30.0):
    return hold(link.pull_messages, found=has_messages, objects=message_objects(lambda b: b.arguments["store"]),
                wakeups=link.wakeups, hold_s=hold_s)


def _after_ask(link, *steps):
    """Run `steps` in a thread once the held ask has asked once (so they land while it waits)."""
    def run():
        while link.asks < 1:
            time.sleep(0.001)
        for step in steps:
            step()
    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t


def test_an_ask_that_finds_nothing_returns_the_message_stored_while_it_waits():
    link = Link(Wakeups())
    tree = _tree("m", _tree("a"))
    assert link.pull_messages(None, None, link.objects).messages_list == []  # Flower's: empty at once
    link.asks = 0
    t = _after_ask(link, lambda: link.announce("msg", tree), lambda: link.push("a"), lambda: link.push("m"))
    answer = _held(link)(request=None, state=None, store=link.objects)
    t.join()
    assert answer.messages_list == ["msg"]
    assert link.asks <= 2  # asked again on the announce only: not a busy loop


def test_an_answer_waits_until_every_object_of_its_message_is_stored():
    """Failed before: the receiver got the message when the sender announced it, and asked for
    each missing object on a doubling backoff (0.3 s of a 0.29 s exchange, measured)."""
    link = Link(Wakeups())
    tree = _tree("m", _tree("r", _tree("c1"), _tree("c2")))
    link.announce("msg", tree)
    seen = []
    pushes = [lambda o=o: (seen.append(objects_ready(link.objects, [tree])), link.push(o)) for o in ("c1", "c2", "r", "m")]
    t = _after_ask(link, *pushes)
    answer = _held(link)(None, None, link.objects)
    t.join()
    assert answer.messages_list == ["msg"] and seen == [False] * 4
    assert objects_ready(link.objects, answer.message_object_trees)  # all four were there at the answer


def test_a_held_ask_answers_with_what_it_has_at_the_limit():
    link = Link(Wakeups())
    assert _held(link, hold_s=0.05)(None, None, link.objects).messages_list == []  # nothing came
    assert link.asks == 1
    tree = _tree("m", _tree("a"))
    link.announce("msg", tree)  # a sender that died after announcing: its objects never come
    answer = _held(link, hold_s=0.05)(None, None, link.objects)
    assert answer.messages_list == ["msg"] and not objects_ready(link.objects, answer.message_object_trees)


def test_asks_beyond_the_limit_are_answered_at_once():
    """At most `max_held` asks wait in a process; a further one is Flower's plain answer, so a
    large federation cannot hold every thread of the SuperLink's API."""
    link = Link(Wakeups(max_held=1))
    first = threading.Thread(target=_held(link), args=(None, None, link.objects), daemon=True)
    first.start()
    while link.asks == 0:
        time.sleep(0.001)
    assert _held(link)(None, None, link.objects).messages_list == []  # answered while the first waits
    assert first.is_alive()
    link.announce("msg", _tree("m"))
    link.push("m")
    first.join()
    assert not first.is_alive()


def test_memaudits_superlink_and_supernode_hold_flowers_handlers(monkeypatch):
    """What the SuperLink and SuperNode processes install: the asks for messages (SuperNodes',
    the ServerApp's) and for a task (the SuperExec's) held; every push, and the node's pull of a
    message from the SuperLink, wakes them. Installed twice, each is wrapped once."""
    import flwr  # noqa: F401 - installed by the set-up (.[flower]): missing it is a failure, not a skip
    from flwr.superlink.servicer.fleet import fleet_handlers as fleet
    from flwr.superlink.servicer.runtime import runtime_handlers as runtime
    from flwr.supernode import start_client_internal as loop
    from flwr.supernode.servicer.runtime import runtime_handlers as node

    names = [(fleet, "pull_messages"), (fleet, "push_messages"), (fleet, "push_object"),
             (runtime, "pull_messages"), (runtime, "push_messages"), (runtime, "push_object"),
             (loop, "_pull_and_store_message"), (node, "acquire_task")]
    def flowers(f):  # another test in this process may have run a SuperNode's main already
        return f.__wrapped__ if getattr(f, "__memaudit_held__", False) else f

    originals = {(m.__name__, n): flowers(getattr(m, n)) for m, n in names}
    for m, n in names:
        monkeypatch.setattr(m, n, originals[(m.__name__, n)])  # Flower's; restored after the test
    for _ in range(2):
        longpoll.install("superlink")
        longpoll.install("supernode")
    for m, n in names:
        wrapped = getattr(m, n)
        assert getattr(wrapped, "__memaudit_held__", False) and wrapped.__wrapped__ is originals[(m.__name__, n)]
    assert not getattr(node.pull_object, "__memaudit_held__", False)  # only those


class _Clock:
    """`time` for `memaudit.federated.flower.trainer`: a clock that moves only when a pull is
    held (`hold` seconds) or the trainer sleeps, and a record of the sleeps."""

    def __init__(self):
        self.now, self.sleeps = 0.0, []

    def monotonic(self):
        return self.now

    def sleep(self, s):
        self.sleeps.append(s)
        self.now += s


def test_the_serverapp_asks_again_at_once_after_a_held_ask_and_keeps_its_poll_otherwise(monkeypatch):
    from memaudit.federated.flower import trainer

    def run(hold_s):
        clock = _Clock()
        monkeypatch.setattr(trainer, "time", clock)

        class Grid:  # the replies come on the third ask
            asks = 0

            def push_messages(self, msgs):
                return ["m1"]

            def pull_messages(self, ids):
                Grid.asks += 1
                clock.now += hold_s
                done = SimpleNamespace(metadata=SimpleNamespace(reply_to_message_id="m1"))
                return [done] if Grid.asks == 3 else []

        got = trainer.FlowerNodes(Grid(), None).exchange([object()], timeout=60)
        assert len(got) == 1 and Grid.asks == 3
        return clock.sleeps

    poll = trainer.FlowerNodes.POLL_S
    assert run(0.0) == [poll, poll]  # Flower's SuperLink answers at once: a poll between asks
    assert run(poll) == [0.0, 0.0]  # memaudit's held each ask a poll or more: asked again at once
    assert run(poll / 2) == pytest.approx([poll / 2, poll / 2])  # the poll's rest
