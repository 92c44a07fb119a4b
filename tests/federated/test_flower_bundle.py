"""A message pulled and a reply pushed in one request each (`memaudit.federated.flower.transport.bundle`).

The SuperLink's side runs behind memaudit's HTTP stack with Flower's SuperNode authentication
(`benchmarks/flower_http.fleet_app`), with Flower's Fleet handlers replaced by recording
stand-ins: a bundle must be exactly Flower's calls, made as the authenticated node. The
SuperNode's side (`Bundled`) is driven as Flower's SuperNode loop drives its callbacks.
Federation tests (tests/federated/test_flower_*.py) run every exchange through the bundles.

Adversaries: anyone who reaches the SuperLink (unsigned, forged, stale bundles, or a bundle that
names another node); a SuperLink that answers with objects whose content is not their id's.
"""

from __future__ import annotations

import sys
from typing import Any

import flwr  # noqa: F401 - installed by the set-up (.[flower]); missing it is a failure, not a skip
import httpx
import pytest
from starlette.testclient import TestClient

from memaudit.federated.flower.transport import bundle, bundle_pb2
from tests.conftest import REPO_ROOT

sys.path.insert(0, str(REPO_ROOT / "benchmarks"))
try:
    import flower_http as fh
finally:
    sys.path.remove(str(REPO_ROOT / "benchmarks"))

RUN, IDS = fh.RUN_ID, fh.MESSAGE_IDS  # a message, its record dict, its record
_tree, _message, _content = fh.message_tree, fh.message_proto, fh.object_content


@pytest.fixture(scope="module")
def node() -> fh.Node:
    return fh.Node()


@pytest.fixture(scope="module")
def client(node: fh.Node) -> TestClient:
    bundle.install("superlink")  # Flower's Fleet router gets the two routes
    return TestClient(fh.fleet_app(fh.flower_stack(), node.public),
                      raise_server_exceptions=False)


def _pull_body(node_id: int = fh.NODE_ID) -> bytes:
    from flwr.proto.fleet_pb2 import PullMessagesRequest
    from flwr.proto.node_pb2 import Node

    return PullMessagesRequest(node=Node(node_id=node_id)).SerializeToString()


def _push_body(node_id: int = fh.NODE_ID, inner: int = fh.NODE_ID, give: list[str] = IDS) -> bytes:
    from flwr.proto.fleet_pb2 import PushMessagesRequest
    from flwr.proto.node_pb2 import Node

    m = bundle_pb2
    push = PushMessagesRequest(node=Node(node_id=inner), messages_list=[_message(inner)],
                               message_object_trees=[_tree()], clientapp_runtime_list=[0.5])
    return m.PushBundleRequest(node=Node(node_id=node_id), push=push, objects=[
        m.BundledObject(object_id=i, object_content=b"reply " + i[:1].encode()) for i in give]).SerializeToString()


def test_a_bundled_pull_is_flowers_pull_of_the_message_its_objects_and_the_receipt(client, node):
    calls: list = []
    with fh.standin_handlers(calls):
        r = client.post(bundle.PULL_PATH, content=_pull_body(), headers=node.headers())
    assert r.status_code == 200, r.text
    got = bundle_pb2.PullBundleResponse.FromString(r.content)
    assert [m.metadata.message_id for m in got.pulled.messages_list] == [IDS[0]]
    assert {o.object_id: o.object_content for o in got.objects} == {i: _content(i) for i in IDS}
    assert got.confirmed
    assert calls == [("pull_messages", fh.NODE_ID), *[("pull_object", (fh.NODE_ID, RUN, i)) for i in IDS],
                     ("confirm", (fh.NODE_ID, RUN, IDS[0]))]

    calls = []  # an object not pushed yet: no receipt; the node asks for it Flower's way
    with fh.standin_handlers(calls, missing=(IDS[2],)):
        got = bundle_pb2.PullBundleResponse.FromString(
            client.post(bundle.PULL_PATH, content=_pull_body(), headers=node.headers()).content)
    assert [o.object_id for o in got.objects] == IDS[:2] and not got.confirmed
    assert "confirm" not in [c for c, _ in calls]


def test_a_bundled_push_is_flowers_push_made_as_the_signer(client, node):
    calls: list = []
    with fh.standin_handlers(calls):  # the inner request names node 99: the push is made as the signer
        r = client.post(bundle.PUSH_PATH, content=_push_body(inner=99, give=IDS[:2]), headers=node.headers())
    assert r.status_code == 200, r.text
    from flwr.proto.fleet_pb2 import PushMessagesResponse

    answer = PushMessagesResponse.FromString(r.content)
    assert list(answer.objects_to_push) == [IDS[2]]  # asked for and not brought: still missing
    assert calls == [("push_messages", fh.NODE_ID),
                     *[("push_object", (fh.NODE_ID, RUN, i, b"reply " + i[:1].encode(), "s-1")) for i in IDS[:2]]]


def test_bundles_meet_flowers_supernode_authentication(client, node):
    other = fh.Node()
    stale = node.headers()
    stale["flwr-timestamp"] = "2020-01-01T00:00:00+00:00"
    forged = other.headers()
    forged["flwr-public-key"] = node.headers()["flwr-public-key"]
    for path, body, other_node in [(bundle.PULL_PATH, _pull_body(), _pull_body(fh.NODE_ID + 1)),
                                   (bundle.PUSH_PATH, _push_body(), _push_body(fh.NODE_ID + 1))]:
        asks = {"signed": (body, node.headers()),
                "unsigned": (body, {"content-type": "application/protobuf"}),
                "another key's signature": (body, forged),
                "a key the SuperLink does not know": (body, other.headers()),
                "another node's id": (other_node, node.headers()),
                "stale": (body, stale)}
        with fh.standin_handlers():
            codes = {k: client.post(path, content=b, headers=hd).status_code for k, (b, hd) in asks.items()}
        assert codes == {k: 200 if k == "signed" else 401 for k in asks}, path


# ------------------------------------------------------------------ the SuperNode's side
class Flower:
    """Flower's connection callbacks, recording; `pulled` what its own pull_object returns."""

    def __init__(self) -> None:
        self.calls: list[tuple] = []

    def connection(self) -> tuple:
        def rec(name: str, result: Any = None) -> Any:
            def f(*args: Any) -> Any:
                self.calls.append((name, *args))
                return result
            return f

        return (fh.NODE_ID, rec("receive"), rec("send", ({IDS[0]}, "flower-session")), rec("get_run"),
                rec("get_fab"), rec("pull_object", b"flower's"), rec("push_object"), rec("confirm"))


class Client:
    """The bundle calls of a SuperNode's Fleet client, answered as memaudit's SuperLink would."""

    def __init__(self, *, routes: bool = True, confirmed: bool = True, lacking: tuple[str, ...] = (),
                 status: int = 404) -> None:
        self.routes, self.confirmed, self.lacking, self.status = routes, confirmed, lacking, status
        self.calls: list[tuple[str, Any]] = []

    def _no_route(self) -> None:
        request = httpx.Request("POST", "http://link" + bundle.PULL_PATH)
        raise httpx.HTTPStatusError(str(self.status), request=request,
                                    response=httpx.Response(self.status, request=request))

    def PullBundle(self, request: Any) -> Any:
        from flwr.proto.fleet_pb2 import PullMessagesResponse

        self.calls.append(("PullBundle", request))
        if not self.routes:
            self._no_route()
        m = bundle_pb2
        return m.PullBundleResponse(
            pulled=PullMessagesResponse(messages_list=[_message()], message_object_trees=[_tree()]),
            objects=[m.BundledObject(object_id=i, object_content=b"bundled " + i[:1].encode()) for i in IDS[:2]],
            confirmed=self.confirmed)

    def PushBundle(self, request: Any) -> Any:
        from flwr.proto.fleet_pb2 import PushMessagesResponse

        self.calls.append(("PushBundle", request))
        return PushMessagesResponse(objects_to_push=list(self.lacking), session_id="s-2")


def _loop(b: bundle.Bundled) -> tuple[Any, list[bytes]]:
    """One message through the callbacks, in the order Flower's SuperNode loop calls them."""
    from flwr.common.serde import message_from_proto

    got = b.receive()
    contents = [b.pull_object(RUN, i) for i in IDS]
    b.confirm_message_received(RUN, IDS[0])
    reply = message_from_proto(_message())
    ids, session = b.send(reply, _tree(), 0.25)
    for i in sorted(ids):
        b.push_object(RUN, session, i, b"reply " + i[:1].encode())
    return got, contents


def test_a_node_pulls_and_pushes_a_message_in_one_request_each():
    flower, client = Flower(), Client()
    b = bundle.Bundled(flower.connection(), client, lambda f, req: f(req))
    got, contents = _loop(b)
    assert got[0].metadata.message_id == IDS[0] and got[1].object_id == IDS[0]
    # two objects came with the bundle; the third, not yet on the SuperLink, is asked Flower's way
    assert contents == [b"bundled 1", b"bundled 2", b"flower's"]
    assert [c[0] for c in client.calls] == ["PullBundle", "PushBundle"]
    assert flower.calls == [("pull_object", RUN, IDS[2])]  # the SuperLink confirmed the receipt
    push = client.calls[1][1]
    assert push.node.node_id == fh.NODE_ID and push.push.clientapp_runtime_list == [0.25]
    assert {o.object_id: o.object_content for o in push.objects} == {i: b"reply " + i[:1].encode() for i in IDS}


def test_what_a_bundle_lacks_goes_flowers_way():
    flower, client = Flower(), Client(confirmed=False, lacking=(IDS[1],))
    _loop(bundle.Bundled(flower.connection(), client, lambda f, req: f(req)))
    assert [c[0] for c in flower.calls] == ["pull_object", "confirm", "push_object"]
    assert flower.calls[1] == ("confirm", RUN, IDS[0])  # not confirmed with the bundle: the node confirms
    assert flower.calls[2] == ("push_object", RUN, "s-2", IDS[1], b"reply 2")


@pytest.mark.parametrize("status", [404, 405, 501])
def test_a_supernode_uses_flowers_requests_against_a_superlink_without_bundles(status):
    flower, client = Flower(), Client(routes=False, status=status)
    b = bundle.Bundled(flower.connection(), client, lambda f, req: f(req))
    assert b.receive() is None and b.receive() is None  # Flower's receive found no message
    ids, session = b.send(object(), _tree(), 0.1)
    b.push_object(RUN, session, IDS[0], b"x")
    assert [c[0] for c in client.calls] == ["PullBundle"]  # asked once, then never again
    assert [c[0] for c in flower.calls] == ["receive", "receive", "send", "push_object"]
    assert (ids, session) == ({IDS[0]}, "flower-session")


def test_a_node_stores_no_bundled_object_whose_content_is_not_its_ids():
    """A SuperLink that answers a bundled pull with tampered content: the node's object store
    (where Flower's loop puts every pulled object) refuses it, as for Flower's own pulls."""
    from flwr.app import ConfigRecord
    from flwr.supercore.inflatable.inflatable_object import get_object_tree
    from flwr.supercore.object_store import ObjectStoreFactory

    record = ConfigRecord({"stage": b"the server's bytes"})
    store = ObjectStoreFactory().store()
    assert store.preregister(RUN, get_object_tree(record)) == [record.object_id]

    class Tampering(Client):
        def PullBundle(self, request: Any) -> Any:
            answer = super().PullBundle(request)
            answer.objects.add(object_id=record.object_id,
                               object_content=record.deflate().replace(b"server's", b"forger's"))
            return answer

    b = bundle.Bundled(Flower().connection(), Tampering(), lambda f, req: f(req))
    b.receive()
    with pytest.raises(ValueError, match="does not match content hash"):
        store.put(record.object_id, b.pull_object(RUN, record.object_id))
    assert store.get(record.object_id) == b""  # still registered, never filled


def test_installs_are_idempotent(monkeypatch):
    from flwr.supercore.protobuf.translation import PROTOBUF_REQUEST_TYPES
    from flwr.superlink.routers.fleet.router import router
    from flwr.supernode import fleet_http_connection as conn
    from flwr.supernode import start_client_internal as loop

    monkeypatch.setattr(conn, "FleetHttpClient", conn.FleetHttpClient)  # restored after the test
    monkeypatch.setattr(loop, "http_request_response", loop.http_request_response)
    bundle.install("supernode")
    once = (conn.FleetHttpClient, loop.http_request_response)
    bundle.install("supernode")
    assert (conn.FleetHttpClient, loop.http_request_response) == once
    assert conn.FleetHttpClient.__memaudit_bundle__
    bundle.install("superlink")
    bundle.install("superlink")
    paths = [r.path for r in router.routes]
    assert paths.count(bundle.PULL_PATH) == paths.count(bundle.PUSH_PATH) == 1
    assert PROTOBUF_REQUEST_TYPES[("POST", bundle.PUSH_PATH)] is bundle_pb2.PushBundleRequest


def test_a_refused_bundle_is_not_taken_for_a_missing_route():
    """A 401 (the SuperLink refused the node's signature) is raised, as for Flower's own pull;
    the node does not quietly switch to Flower's requests."""
    b = bundle.Bundled(Flower().connection(), Client(routes=False, status=401), lambda f, req: f(req))
    with pytest.raises(httpx.HTTPStatusError):
        b.receive()
    assert b.on
