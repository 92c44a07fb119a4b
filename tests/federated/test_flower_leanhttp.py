"""memaudit's SuperLink HTTP stack (`memaudit.federated.flower.transport.leanhttp`) answers every request
as Flower 1.42's own stack does, with fewer layers on a SuperNode's requests.

Adversary: anyone who reaches the SuperLink's address and sends Fleet API requests of their
choosing: unsigned, signed by another key, for another node's id, stale, of the wrong media
type or a malformed body. Each must get exactly the answer Flower's stack gives (the oracle is
Flower's own stack, built in the same test), and a Control API request must still meet the
Control API's layers.
"""

from __future__ import annotations

import sys
from typing import Any

import flwr  # noqa: F401 - installed by the set-up (.[flower]); missing it is a failure, not a skip
import pytest
from starlette.middleware.base import BaseHTTPMiddleware
from starlette.responses import PlainTextResponse
from starlette.testclient import TestClient

from memaudit.federated.flower.transport import leanhttp
from tests.conftest import REPO_ROOT

sys.path.insert(0, str(REPO_ROOT / "benchmarks"))
try:
    import flower_http as fh
finally:
    sys.path.remove(str(REPO_ROOT / "benchmarks"))


def _stacks() -> dict[str, list[Any]]:
    return {"flower": fh.flower_stack(), "lean": leanhttp.lean_stack(fh.flower_stack())}


@pytest.fixture(scope="module")
def node() -> fh.Node:
    return fh.Node()


@pytest.fixture(scope="module")
def clients(node: fh.Node):
    with fh.standin_handlers():
        made = {k: TestClient(fh.fleet_app(s, node.public), raise_server_exceptions=False)
                for k, s in _stacks().items()}
        yield made


def test_the_control_api_layers_are_wrapped_and_the_fleet_layers_kept_in_order():
    from flwr.supercore.protobuf.translation import ProtobufTranslationMiddleware
    from flwr.superlink.routers.control import middlewares as control
    from flwr.superlink.routers.fleet.middlewares import FleetEventLogMiddleware
    from flwr.superlink.routers.fleet.node_auth import NodeAuthMiddleware

    flower, lean = fh.flower_stack(), leanhttp.lean_stack(fh.flower_stack())
    assert len(lean) == len(flower)
    seen = {}
    for f, m in zip(flower, lean, strict=True):
        if m.cls is leanhttp.ErrorsTranslated:  # Flower's BaseHTTPMiddleware(dispatch=translator)
            assert f.cls is BaseHTTPMiddleware and f.kwargs == m.kwargs
            continue
        inner = m.kwargs.get("middleware", m.cls) if m.cls is not f.cls else m.cls
        assert inner is f.cls  # every layer is there, in Flower's order
        seen[f.cls] = m.cls
    assert {c for c, w in seen.items() if w is leanhttp.ControlOnly} == {
        control.ControlSensitiveResponseMiddleware, control.ControlEventLogMiddleware,
        control.ControlLicenseMiddleware, control.ControlAuthenticationMiddleware}
    assert seen[FleetEventLogMiddleware] is leanhttp.WhenFleetLogged
    assert seen[NodeAuthMiddleware] is leanhttp.CheckThenPass
    assert seen[ProtobufTranslationMiddleware] is leanhttp.Translated
    # no layer is left a BaseHTTPMiddleware of its own; the error translation runs Flower's dispatch
    assert [c.__name__ for c, w in seen.items() if w is c] == []
    assert sum(m.cls is leanhttp.ErrorsTranslated for m in lean) == 1


def _requests(node: fh.Node) -> dict[str, tuple[str, bytes, dict[str, str]]]:
    other = fh.Node()
    stale = node.headers()
    stale["flwr-timestamp"] = "2020-01-01T00:00:00+00:00"
    forged = other.headers()
    forged["flwr-public-key"] = node.headers()["flwr-public-key"]  # node's key, another's signature
    wrong_type = node.headers()
    wrong_type["content-type"] = "application/json"
    pull, push = fh.pull_object_body(), fh.push_object_body(1 << 20)
    return {
        "signed pull": ("/v1/fleet/pull-object", pull, node.headers()),
        "signed 1 MiB push": ("/v1/fleet/push-object", push, node.headers()),
        "unsigned": ("/v1/fleet/pull-object", pull, {"content-type": "application/protobuf"}),
        "another key's signature": ("/v1/fleet/pull-object", pull, forged),
        "a key the SuperLink does not know": ("/v1/fleet/pull-object", pull, other.headers()),
        "another node's id": ("/v1/fleet/pull-object", fh.pull_object_body(fh.NODE_ID + 1), node.headers()),
        "stale timestamp": ("/v1/fleet/pull-object", pull, stale),
        "wrong media type": ("/v1/fleet/pull-object", pull, wrong_type),
        "malformed body": ("/v1/fleet/pull-object", b"\xff\x00 not protobuf", node.headers()),
        "unknown fleet route": ("/v1/fleet/no-such-call", pull, node.headers()),
        "a handler that fails": ("/v1/fleet/pull-object", fh.pull_object_body(object_id=fh.FAILING_OBJECT),
                                 node.headers()),
        "control api": ("/v1/control/list-runs", b"", {"content-type": "application/protobuf"}),
    }


def test_every_request_gets_flowers_answer(clients, node):
    answers = {}
    for name, (path, body, headers) in _requests(node).items():
        got = {k: c.post(path, content=body, headers=headers) for k, c in clients.items()}
        answers[name] = got["flower"].status_code
        seen = {k: (r.status_code, r.content, r.headers.get("content-type"), r.headers.get("content-length"))
                for k, r in got.items()}
        assert seen["lean"] == seen["flower"], name
    # the oracle itself: Flower lets the node's signed asks through and refuses the rest
    assert answers["signed pull"] == answers["signed 1 MiB push"] == 200
    for name in ("unsigned", "another key's signature", "a key the SuperLink does not know",
                 "another node's id", "stale timestamp"):
        assert answers[name] == 401, name
    assert answers["wrong media type"] >= 400 and answers["malformed body"] >= 400
    assert answers["control api"] >= 400  # the Control API's authentication layer ran
    assert answers["a handler that fails"] == 500


def test_the_fleet_event_log_runs_when_the_superlink_has_one(node):
    class Plugin:
        def __init__(self) -> None:
            self.events: list[str] = []

        def compose_log_before_event(self, **kw: Any) -> str:
            return "before " + kw["method_name"]

        def compose_log_after_event(self, **kw: Any) -> str:
            return "after " + kw["method_name"]

        def write_log(self, event: str) -> None:
            self.events.append(event)

    with fh.standin_handlers():
        for stack in _stacks().values():
            app = fh.fleet_app(stack, node.public)
            app.state.fleet_event_log_plugin = plugin = Plugin()
            r = TestClient(app).post("/v1/fleet/pull-object", content=fh.pull_object_body(),
                                     headers=node.headers())
            assert r.status_code == 200
            assert plugin.events == ["before /v1/fleet/pull-object", "after /v1/fleet/pull-object"]


def test_a_check_that_answers_on_its_own_has_its_answer_sent():
    from starlette.applications import Starlette
    from starlette.middleware import Middleware
    from starlette.routing import Route

    class Gate(BaseHTTPMiddleware):
        async def dispatch(self, request, call_next):
            if request.url.path == "/closed":
                return PlainTextResponse("closed", status_code=403)
            return await call_next(request)

    def endpoint(request):
        return PlainTextResponse("inner " + request.url.path)

    routes = [Route("/open", endpoint, methods=["POST"]), Route("/closed", endpoint, methods=["POST"])]
    app = Starlette(routes=routes, middleware=[Middleware(leanhttp.CheckThenPass, middleware=Gate)])
    c = TestClient(app)
    assert (c.post("/open", content=b"x" * 100_000).text, c.post("/closed").status_code) == ("inner /open", 403)


def test_install_is_idempotent_and_keeps_flowers_stack(monkeypatch):
    from flwr.superlink import main as app_module

    current = app_module._get_middleware  # lean already where a test ran a SuperLink in this process
    original = getattr(current, "__wrapped_flower__", current)
    monkeypatch.setattr(app_module, "_get_middleware", original)
    leanhttp.install("superlink")
    once = app_module._get_middleware
    leanhttp.install("superlink")
    assert app_module._get_middleware is once and once.__wrapped_flower__ is original
    assert [m.cls for m in once()] == [m.cls for m in leanhttp.lean_stack(original())]
