"""One request each way per message between memaudit's SuperNode and memaudit's SuperLink.

A Flower 1.42 SuperNode makes nine Fleet requests for each message of a round: it asks for the
message, asks for each of its objects (the message, its record dict, its record: three for every
memaudit message), confirms the receipt, pushes the reply, and pushes each of the reply's
objects. Each request costs the SuperLink's one process its HTTP and protobuf work, and the node
an HTTP round trip. On 2 cores with 4 SuperNodes the 36 requests of a small exchange of a secure
round took most of its 0.1 s, on the cores the round's computation needs too.

memaudit's SuperLink (`memaudit.federated.flower.superlink`) also serves two Fleet routes that do
the same work with Flower's own handlers, in one request each way:

- ``PULL_PATH`` (`pull_bundle`): Flower's ``pull_messages`` (held until the message and all its
  objects are stored, `memaudit.federated.flower.transport.longpoll`), then Flower's ``pull_object`` for
  each of its objects, then Flower's ``confirm_message_received`` when every object came back:
  the message and its objects in one answer;
- ``PUSH_PATH`` (`push_bundle`): Flower's ``push_messages``, then Flower's ``push_object`` for
  each object the SuperLink asks for, from the objects the request brought; the answer is
  Flower's ``PushMessagesResponse`` naming any object still missing.

Both are Fleet routes: Flower's SuperNode authentication checks a request's signature and that
its ``node`` is the signer's (`NodeAuthMiddleware`, on every ``/v1/fleet/`` request with a
protobuf body), and the handlers act as that node only (the pushed message's request is given the
authenticated node). A node thus reads and writes exactly what Flower's nine requests would.

memaudit's SuperNode (`memaudit.federated.flower.supernode`) uses them through `Bundled`, which
hands Flower's SuperNode loop the same callbacks with the same results: ``receive`` makes the
bundled pull and keeps its objects, which ``pull_object`` then returns without a request (the
node's object store checks each object's content against its id, as for Flower's pulls);
``send`` and ``push_object`` collect the reply and its objects, pushed in one request once the
loop has handed over the last. Against a SuperLink without the routes (Flower's own: the first
bundled pull answers 404; a proxy may answer 405 or 501) the node uses Flower's requests from
then on.
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import threading
from collections.abc import Iterator
from typing import Annotated, Any

import httpx  # Flower's HTTP client: flwr brings httpx
from flwr.app.message import remove_content_from_message
from flwr.common.serde import message_from_proto, message_to_proto
from flwr.proto.fleet_pb2 import PullMessagesRequest, PushMessagesRequest, PushMessagesResponse
from flwr.proto.message_pb2 import (
    ConfirmMessageReceivedRequest,
    PullObjectRequest,
    PushObjectRequest,
)
from flwr.proto.node_pb2 import Node
from flwr.supercore import log
from flwr.supercore.protobuf.translation import PROTOBUF_REQUEST_DEPENDENCY, PROTOBUF_REQUEST_TYPES
from flwr.supercore.retry import make_simple_http_retry_invoker
from flwr.superlink.routers.fleet import router as fleet_router
from flwr.superlink.servicer.fleet import fleet_handlers as fleet
from flwr.supernode import fleet_http_connection as conn
from flwr.supernode import start_client_internal as loop

from memaudit.federated.flower.transport.bundle_pb2 import (
    BundledObject,
    PullBundleResponse,
    PushBundleRequest,
)
from memaudit.federated.flower.transport.longpoll import object_ids

PULL_PATH = "/v1/fleet/memaudit/pull-bundle"
PUSH_PATH = "/v1/fleet/memaudit/push-bundle"
BUNDLED = "memaudit: the SuperLink serves bundled Fleet requests: one request each way per message"
FLOWERS = "memaudit: the SuperLink has no bundled Fleet requests: Flower's requests, nine per message"
NO_ROUTE = (404, 405, 501)  # answers of a SuperLink (or a proxy before it) that has no bundle routes
SESSION = "memaudit-bundle"  # `Bundled.send`'s session: its objects go in the bundled push


# ------------------------------------------------------------------ the SuperLink's side
def pull_bundle(request: Any, state: Any) -> Any:
    """A node's message and all its objects (`PULL_PATH`), by Flower's handlers: the (held) pull
    of one message, a pull of each of its objects, and the receipt confirmed when every object
    is in the answer (``confirmed``; otherwise the node pulls the rest and confirms itself)."""
    pulled = fleet.pull_messages(request=request, state=state, store=state.object_store)
    out = PullBundleResponse(pulled=pulled)
    if not pulled.messages_list:  # Flower answers one message at most, and a node reads the first
        return out
    msg, tree = pulled.messages_list[0], pulled.message_object_trees[0]
    run_id, ids = msg.metadata.run_id, object_ids([tree])
    for oid in ids:
        got = fleet.pull_object(PullObjectRequest(node=request.node, run_id=run_id, object_id=oid), state)
        if got.object_found and got.object_available:
            out.objects.add(object_id=oid, object_content=got.object_content)
    out.confirmed = len(out.objects) == len(ids)
    if out.confirmed:
        fleet.confirm_message_received(ConfirmMessageReceivedRequest(
            node=request.node, run_id=run_id, message_object_id=msg.metadata.message_id),
            state=state, store=state.object_store)
    return out


def push_bundle(request: Any, state: Any) -> Any:
    """A node's reply and its objects (`PUSH_PATH`), by Flower's handlers: the push of the
    message as the authenticated node, then a push of each object the SuperLink asks for that
    the request brought. Returns Flower's answer to the push, naming the objects still missing."""
    push = PushMessagesRequest()
    push.CopyFrom(request.push)
    push.node.CopyFrom(request.node)  # the node the request was authenticated as
    answer = fleet.push_messages(request=push, state=state)
    run_id = push.messages_list[0].metadata.run_id if push.messages_list else 0
    given = {o.object_id: o.object_content for o in request.objects}
    missing = []
    for oid in answer.objects_to_push:
        if oid not in given or not fleet.push_object(PushObjectRequest(
                node=request.node, run_id=run_id, object_id=oid, object_content=given[oid],
                session_id=answer.session_id), state).stored:
            missing.append(oid)
    del answer.objects_to_push[:]
    answer.objects_to_push.extend(missing)
    return answer


def _install_superlink() -> None:
    """In a SuperLink's process, before it builds its app: `PULL_PATH` and `PUSH_PATH` on Flower's
    Fleet router, with their protobuf request types where Flower's translation looks them up.
    Idempotent."""
    if ("POST", PULL_PATH) in PROTOBUF_REQUEST_TYPES:
        return
    state_dep = fleet_router.LinkStateDependency

    def fleet_pull_bundle(request, state):  # annotations set below
        return pull_bundle(request, state)

    def fleet_push_bundle(request, state):  # annotations set below
        return push_bundle(request, state)

    fleet_pull_bundle.__annotations__ = {"request": Annotated[PullMessagesRequest, PROTOBUF_REQUEST_DEPENDENCY],
                                         "state": state_dep, "return": PullBundleResponse}
    fleet_push_bundle.__annotations__ = {"request": Annotated[PushBundleRequest, PROTOBUF_REQUEST_DEPENDENCY],
                                         "state": state_dep, "return": PushMessagesResponse}
    PROTOBUF_REQUEST_TYPES[("POST", PULL_PATH)] = PullMessagesRequest
    PROTOBUF_REQUEST_TYPES[("POST", PUSH_PATH)] = PushBundleRequest
    prefix = fleet_router.router.prefix
    fleet_router.router.post(PULL_PATH.removeprefix(prefix))(fleet_pull_bundle)
    fleet_router.router.post(PUSH_PATH.removeprefix(prefix))(fleet_push_bundle)


# ------------------------------------------------------------------ the SuperNode's side
class Bundled:
    """The callbacks of Flower's Fleet connection (``http_request_response``'s tuple), with a
    message pulled and a reply pushed in one request each (`PULL_PATH`, `PUSH_PATH`) while the
    SuperLink serves them; Flower's own callbacks otherwise, and for anything a bundle lacked."""
    def __init__(self, connection: tuple, client: Any, invoke: Any) -> None:
        (self.node_id, self._receive, self._send, self.get_run, self.get_fab, self._pull_object,
         self._push_object, self._confirm) = connection
        self.client, self.invoke = client, invoke
        self.on = True  # False once the SuperLink answered a bundled pull as one without the routes
        self.pulled: dict[str, bytes] = {}  # objects of the message last received
        self.confirmed: set[str] = set()  # messages the SuperLink confirmed with their bundle
        self.outgoing: dict[str, Any] | None = None

    def callbacks(self) -> tuple:
        return (self.node_id, self.receive, self.send, self.get_run, self.get_fab, self.pull_object,
                self.push_object, self.confirm_message_received)

    def _node(self) -> Any:

        return Node(node_id=self.node_id)

    def receive(self) -> Any:
        if not self.on:
            return self._receive()

        try:
            answer = self.invoke(self.client.PullBundle, PullMessagesRequest(node=self._node()))
        except httpx.HTTPStatusError as e:
            if e.response.status_code not in NO_ROUTE:
                raise
            self.on = False  # a SuperLink without the bundle routes: Flower's requests from now on
            _said(FLOWERS)
            return self._receive()
        _said(BUNDLED)
        pulled = answer.pulled
        if not pulled.messages_list:
            return None
        self.pulled = {o.object_id: o.object_content for o in answer.objects}
        if answer.confirmed:
            self.confirmed.add(pulled.messages_list[0].metadata.message_id)
        return message_from_proto(pulled.messages_list[0]), pulled.message_object_trees[0]

    def pull_object(self, run_id: int, object_id: str) -> bytes:
        got = self.pulled.pop(object_id, None)
        return self._pull_object(run_id, object_id) if got is None else got

    def confirm_message_received(self, run_id: int, object_id: str) -> None:
        self.pulled.clear()
        if object_id in self.confirmed:
            self.confirmed.discard(object_id)
            return
        self._confirm(run_id, object_id)

    def send(self, message: Any, tree: Any, runtime: float) -> tuple[set[str], str]:
        if not self.on:
            return self._send(message, tree, runtime)

        if message.has_content():
            message = remove_content_from_message(message)
        ids = set(object_ids([tree]))
        push = PushMessagesRequest(node=self._node(), messages_list=[message_to_proto(message)],
                                   message_object_trees=[tree], clientapp_runtime_list=[runtime])
        self.outgoing = {"push": push, "ids": ids, "objects": {}}
        return set(ids), SESSION

    def push_object(self, run_id: int, session_id: str, object_id: str, content: bytes) -> None:
        out = self.outgoing
        if session_id != SESSION or out is None:
            return self._push_object(run_id, session_id, object_id, content)
        out["objects"][object_id] = content
        if len(out["objects"]) < len(out["ids"]):
            return None
        self.outgoing = None
        request = PushBundleRequest(node=self._node(), push=out["push"], objects=[
            BundledObject(object_id=k, object_content=v) for k, v in out["objects"].items()])
        answer = self.invoke(self.client.PushBundle, request)
        for oid in answer.objects_to_push:  # anything the SuperLink still lacks, Flower's way
            self._push_object(run_id, answer.session_id, oid, out["objects"][oid])
        return None


_told: set[str] = set()


def _said(line: str) -> None:
    """``line`` in the SuperNode's log (Flower's logger), once per process."""
    if line not in _told:
        _told.add(line)
        log(logging.INFO, line)


_clients = threading.local()  # the Fleet client Flower's connection made last in this thread


def _bundle_client(base: type) -> type:
    class BundleClient(base):  # type: ignore[misc, valid-type]
        """Flower's Fleet HTTP client with the two bundled calls."""
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            _clients.last = self

        def PullBundle(self, request: Any) -> Any:
            return self._unary_unary(path=PULL_PATH, rpc_method="/memaudit.flower.Fleet/PullBundle",
                                     request=request, response_type=PullBundleResponse)

        def PushBundle(self, request: Any) -> Any:

            return self._unary_unary(path=PUSH_PATH, rpc_method="/memaudit.flower.Fleet/PushBundle",
                                     request=request, response_type=PushMessagesResponse)

    BundleClient.__memaudit_bundle__ = True  # type: ignore[attr-defined]
    return BundleClient


def _install_supernode() -> None:
    """In a SuperNode's process, before it connects: its Fleet connection pulls a message and
    pushes a reply in one request each where the SuperLink serves the bundle routes (`Bundled`).
    Idempotent."""
    if getattr(conn.FleetHttpClient, "__memaudit_bundle__", False):
        return
    conn.FleetHttpClient = _bundle_client(conn.FleetHttpClient)
    flower = loop.http_request_response
    signature = inspect.signature(flower)

    @contextlib.contextmanager
    def bundled(*args: Any, **kwargs: Any) -> Iterator[tuple]:
        _clients.last = None
        with flower(*args, **kwargs) as connection:
            client = _clients.last
            if client is None:  # the connection was made without Flower's Fleet client
                yield connection
                return
            retry = make_simple_http_retry_invoker()  # with the limits Flower's own calls get
            bound = signature.bind(*args, **kwargs).arguments
            if bound.get("max_retries") is not None:
                retry.max_tries = bound["max_retries"] + 1
            if bound.get("max_wait_time") is not None:
                retry.max_time = bound["max_wait_time"]
            yield Bundled(connection, client, retry.invoke).callbacks()

    loop.http_request_response = bundled


def install(component: str) -> None:
    """In a SuperLink's process (``component``), before it builds its app: the bundle routes
    (`_install_superlink`). In a SuperNode's, before it connects: its bundled Fleet connection
    (`_install_supernode`). Idempotent; nothing for another component."""
    if component == "superlink":
        _install_superlink()
    elif component == "supernode":
        _install_supernode()


__all__ = ["BUNDLED", "FLOWERS", "PULL_PATH", "PUSH_PATH", "Bundled", "install", "pull_bundle", "push_bundle"]
