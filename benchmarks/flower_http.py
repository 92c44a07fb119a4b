"""A SuperNode's requests to the SuperLink's HTTP server: Flower's nine requests a message against
memaudit's two bundled ones (`memaudit.federated.flower.transport.bundle`); prints JSON.

    python benchmarks/flower_http.py [--requests 50] [--repeats 7] [--large-mib 5]

Each variant serves Flower's own Fleet router (its routes, protobuf parsing, SuperNode
signature check and node-id lookup) behind its middleware stack, with uvicorn on a thread of
this process; the Fleet handlers are stand-ins that answer at once (`standin_handlers`), so
what is timed is HTTP, the middleware layers and the signature check. One client signs every
request as a SuperNode does. The stack is the one Flower's SuperLink builds
(``flwr.superlink.main._get_middleware``; a leaner stack was measured per request 1.86x
faster and removed: it moved no round, ``benchmarks/flower_transport.py``).

Requests: ``small`` (a pull-object ask, about 60 bytes) and ``large`` (a push-object of
``--large-mib`` MiB: a node's masked input on the ``tiny`` model is 5 MiB). The statistic is
the median over ``--repeats`` of the mean seconds a request took in a batch of ``--requests``,
the kinds interleaved in every repeat.

``message_seconds``: one small message's exchange, every request a SuperNode makes for it
(`message_requests`, ``--requests`` / 5 of them a repeat): Flower's nine requests
(``flower_nine``) and memaudit's two bundled ones (``flower_bundled``).
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import json
import socket
import statistics
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

NODE_ID = 7
FAILING_OBJECT = "f" * 64


class _State:
    """The stand-in LinkState: the node's id by its public key."""

    object_store = None  # the stand-in handlers take no store

    def __init__(self, keys: dict[bytes, int]) -> None:
        self.keys = keys

    def get_node_id_by_public_key(self, public_key: bytes) -> int | None:
        return self.keys.get(public_key)


class _Links:
    def __init__(self, state: _State) -> None:
        self._state = state

    def state(self) -> _State:
        return self._state


MESSAGE_IDS = ["1" * 64, "2" * 64, "3" * 64]  # a message, its record dict, its record
RUN_ID = 3


def message_tree() -> Any:
    """The object tree of a memaudit message: the message, its record dict, its record."""
    from flwr.proto.message_pb2 import ObjectTree

    a, b, c = MESSAGE_IDS
    return ObjectTree(object_id=a, children=[ObjectTree(object_id=b, children=[ObjectTree(object_id=c)])])


def message_proto(node_id: int = NODE_ID) -> Any:
    """The message of `message_tree` as a pull of messages answers it (no content of its own)."""
    from flwr.proto.message_pb2 import Message, Metadata
    from flwr.proto.recorddict_pb2 import RecordDict

    return Message(metadata=Metadata(run_id=RUN_ID, message_id=MESSAGE_IDS[0], src_node_id=node_id,
                                     message_type="train.x", created_at=1.0, ttl=60.0), content=RecordDict())


def object_content(object_id: str) -> bytes:
    return b"content of " + object_id[:1].encode()


@contextlib.contextmanager
def standin_handlers(calls: list | None = None, missing: tuple[str, ...] = ()) -> Iterator[None]:
    """Flower's Fleet handlers of a message's exchange replaced by ones that answer at once: a
    pull of messages finds one message (`message_proto`, its three objects), a push of a reply
    asks for all three, a pull of `FAILING_OBJECT` raises (as a failing handler would), and an
    object of ``missing`` is registered but not yet pushed. ``calls`` records (handler, what it
    was asked)."""
    from flwr.proto.fleet_pb2 import PullMessagesResponse, PushMessagesResponse
    from flwr.proto.message_pb2 import (
        ConfirmMessageReceivedResponse,
        PullObjectResponse,
        PushObjectResponse,
    )
    from flwr.superlink.servicer.fleet import fleet_handlers

    record = calls.append if calls is not None else (lambda _call: None)

    def pull_messages(request: Any, state: Any, store: Any) -> Any:
        record(("pull_messages", request.node.node_id))
        return PullMessagesResponse(messages_list=[message_proto()], message_object_trees=[message_tree()])

    def pull_object(request: Any, state: Any) -> Any:
        record(("pull_object", (request.node.node_id, request.run_id, request.object_id)))
        if request.object_id == FAILING_OBJECT:  # a handler's unexpected exception
            raise RuntimeError("a stand-in handler failed")
        there = request.object_id not in missing
        return PullObjectResponse(object_found=True, object_available=there,
                                  object_content=object_content(request.object_id) if there else b"")

    def confirm(request: Any, state: Any, store: Any) -> Any:
        record(("confirm", (request.node.node_id, request.run_id, request.message_object_id)))
        return ConfirmMessageReceivedResponse()

    def push_messages(request: Any, state: Any) -> Any:
        record(("push_messages", request.node.node_id))
        return PushMessagesResponse(objects_to_push=MESSAGE_IDS, session_id="s-1")

    def push_object(request: Any, state: Any) -> Any:
        record(("push_object", (request.node.node_id, request.run_id, request.object_id,
                                request.object_content, request.session_id)))
        return PushObjectResponse(stored=True)

    names = ("pull_messages", "pull_object", "confirm_message_received", "push_messages", "push_object")
    saved = [getattr(fleet_handlers, n) for n in names]
    for n, f in zip(names, (pull_messages, pull_object, confirm, push_messages, push_object), strict=True):
        setattr(fleet_handlers, n, f)
    try:
        yield
    finally:
        for n, f in zip(names, saved, strict=True):
            setattr(fleet_handlers, n, f)


def flower_stack() -> list[Any]:
    """The middleware stack Flower 1.42's SuperLink builds."""
    from flwr.superlink import main as app_module

    built = app_module._get_middleware
    return (getattr(built, "__wrapped_flower__", None) or built)()


def fleet_app(middleware: list[Any], public_key: bytes) -> Any:
    """Flower's Fleet router behind ``middleware``, knowing one node (``NODE_ID``) by
    ``public_key``."""
    from fastapi import FastAPI
    from flwr.superlink.routers.fleet.router import router

    app = FastAPI(middleware=middleware)
    app.include_router(router)
    app.state.linkstate_factory = _Links(_State({public_key: NODE_ID}))
    app.state.enable_supernode_auth = False
    app.state.fleet_event_log_plugin = None
    app.state.control_event_log_plugin = None
    return app


class Node:
    """A SuperNode's signing key and its signed headers (Flower's ``NodeAuthHttpInterceptor``)."""

    def __init__(self) -> None:
        from flwr.supercore.primitives.asymmetric import generate_key_pairs, public_key_to_bytes

        self.private, public = generate_key_pairs()
        self.public = public_key_to_bytes(public)

    def headers(self, public: bytes | None = None) -> dict[str, str]:
        from flwr.common.constant import TIMESTAMP_HEADER
        from flwr.supercore.constant import (
            FLEET_HTTP_PUBLIC_KEY_HEADER,
            FLEET_HTTP_SIGNATURE_HEADER,
        )
        from flwr.supercore.date import now
        from flwr.supercore.primitives.asymmetric import sign_message

        stamp = now().isoformat()
        return {"content-type": "application/protobuf",
                FLEET_HTTP_PUBLIC_KEY_HEADER: base64.b64encode(public or self.public).decode("ascii"),
                TIMESTAMP_HEADER: stamp,
                FLEET_HTTP_SIGNATURE_HEADER: base64.b64encode(
                    sign_message(self.private, stamp.encode("ascii"))).decode("ascii")}


def pull_object_body(node_id: int = NODE_ID, object_id: str = "a" * 64) -> bytes:
    from flwr.proto.message_pb2 import PullObjectRequest
    from flwr.proto.node_pb2 import Node as NodeProto

    return PullObjectRequest(node=NodeProto(node_id=node_id), run_id=1, object_id=object_id).SerializeToString()


def push_object_body(nbytes: int, node_id: int = NODE_ID) -> bytes:
    from flwr.proto.message_pb2 import PushObjectRequest
    from flwr.proto.node_pb2 import Node as NodeProto

    return PushObjectRequest(node=NodeProto(node_id=node_id), run_id=1, object_id="b" * 64,
                             object_content=b"\x01" * nbytes).SerializeToString()


def message_requests(node_id: int = NODE_ID) -> dict[str, list[tuple[str, bytes]]]:
    """One small message's exchange as a SuperNode makes it (`message_tree`, a reply of the same
    shape): Flower's nine requests, and memaudit's two (`memaudit.federated.flower.transport.bundle`)."""
    from flwr.proto.fleet_pb2 import PullMessagesRequest, PushMessagesRequest
    from flwr.proto.message_pb2 import ConfirmMessageReceivedRequest, PushObjectRequest
    from flwr.proto.node_pb2 import Node as NodeProto

    from memaudit.federated.flower.transport import bundle, bundle_pb2

    node = NodeProto(node_id=node_id)
    pull = PullMessagesRequest(node=node).SerializeToString()
    push = PushMessagesRequest(node=node, messages_list=[message_proto(node_id)],
                               message_object_trees=[message_tree()], clientapp_runtime_list=[0.5])
    m = bundle_pb2
    return {
        "nine": [("/v1/fleet/pull-messages", pull),
                 *[("/v1/fleet/pull-object", pull_object_body(node_id, i)) for i in MESSAGE_IDS],
                 ("/v1/fleet/confirm-message-received", ConfirmMessageReceivedRequest(
                     node=node, run_id=RUN_ID, message_object_id=MESSAGE_IDS[0]).SerializeToString()),
                 ("/v1/fleet/push-messages", push.SerializeToString()),
                 *[("/v1/fleet/push-object", PushObjectRequest(
                     node=node, run_id=RUN_ID, object_id=i, object_content=object_content(i),
                     session_id="s-1").SerializeToString()) for i in MESSAGE_IDS]],
        "bundled": [(bundle.PULL_PATH, pull),
                    (bundle.PUSH_PATH, m.PushBundleRequest(node=node, push=push, objects=[
                        m.BundledObject(object_id=i, object_content=object_content(i))
                        for i in MESSAGE_IDS]).SerializeToString())]}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def served(app: Any) -> Iterator[str]:
    """``app`` served by uvicorn on a thread; yields its base URL."""
    import uvicorn

    port = _free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="error",
                                           lifespan="off"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not server.started:
        if time.monotonic() > deadline:
            raise RuntimeError("uvicorn did not start")
        time.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(10)


def variants() -> dict[str, list[Any]]:
    return {"flower": flower_stack()}


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=50)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--large-mib", type=float, default=5.0)
    args = ap.parse_args(argv)
    import httpx

    from memaudit.federated.flower.transport import bundle

    bundle.install("superlink")  # the bundle routes on Flower's Fleet router, as memaudit's SuperLink has them
    node = Node()
    exchange = message_requests()
    ways = {"flower_nine": ("flower", "nine"), "flower_bundled": ("flower", "bundled")}
    per_message: dict[str, list[float]] = {w: [] for w in ways}
    bodies = {"small": ("/v1/fleet/pull-object", pull_object_body()),
              "large": ("/v1/fleet/push-object", push_object_body(int(args.large_mib * 2**20)))}
    times: dict[str, dict[str, list[float]]] = {v: {k: [] for k in bodies} for v in variants()}
    with contextlib.ExitStack() as stack:
        stack.enter_context(standin_handlers())
        urls = {v: stack.enter_context(served(fleet_app(mw, node.public))) for v, mw in variants().items()}
        clients = {v: stack.enter_context(httpx.Client(base_url=u, timeout=30)) for v, u in urls.items()}
        warm = [(v, kind, path, body) for kind, (path, body) in bodies.items() for v in clients]
        warm += [(v, w, path, body) for w, (v, kind) in ways.items() for path, body in exchange[kind]]
        for v, kind, path, body in warm:  # warm every server and check it answers 200
            r = clients[v].post(path, content=body, headers=node.headers())
            if r.status_code != 200:
                raise RuntimeError(f"{v} answered {r.status_code} to {kind} ({path}): {r.text[:200]}")
        for _ in range(args.repeats):
            for kind, (path, body) in bodies.items():
                n = args.requests if kind == "small" else max(1, args.requests // 5)
                for v, c in clients.items():
                    t0 = time.perf_counter()
                    for _ in range(n):
                        c.post(path, content=body, headers=node.headers())
                    times[v][kind].append((time.perf_counter() - t0) / n)
            for w, (v, kind) in ways.items():  # one message's exchange, all its requests
                t0 = time.perf_counter()
                for _ in range(args.requests // 5):
                    for path, body in exchange[kind]:
                        clients[v].post(path, content=body, headers=node.headers())
                per_message[w].append((time.perf_counter() - t0) / (args.requests // 5))
    med = {v: {k: statistics.median(ts) for k, ts in d.items()} for v, d in times.items()}
    out = {"benchmark": "flower_http", "statistic": "median over repeats of mean seconds per request",
           "requests_small": args.requests, "requests_large": max(1, args.requests // 5),
           "repeats": args.repeats, "large_bytes": int(args.large_mib * 2**20),
           "seconds": med,
           "speedup_over_flower": {v: {k: med["flower"][k] / med[v][k] for k in bodies} for v in med}}
    msg = {w: statistics.median(ts) for w, ts in per_message.items()}
    out.update(message_requests={k: len(v) for k, v in exchange.items()}, messages=args.requests // 5,
               message_seconds=msg, message_speedup_over_flower_nine={w: msg["flower_nine"] / t for w, t in msg.items()})
    print(json.dumps(out, indent=2))
    return out


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
