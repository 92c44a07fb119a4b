"""The SuperLink's HTTP stack with fewer layers on a SuperNode's requests, each answered as before.

Flower 1.42's SuperLink serves the Fleet API (the SuperNodes' asks and pushes) and the Control
API (``flwr run``, ``flwr ls``) from one FastAPI app behind eight Starlette
``BaseHTTPMiddleware`` layers. Each layer costs every request a task group and a memory
stream, and every chunk of a request's body a task group more, all on the server's one event
loop. On 2 cores with 4 SuperNodes that loop was busy about half of every round of a secure
run, most of it in these layers, and an exchange of a few hundred bytes took 0.3-0.4 s.

`install` (memaudit's SuperLink, through `memaudit.federated.flower.transport.install`) builds the app with
`lean_stack`, which keeps every layer in Flower's order and changes how four kinds run:

- `ControlOnly`: the four layers that act on Control API paths only (``/v1/control/``: the
  sensitive-response headers, account authentication, the license check, the Control event
  log), each of which passes any other request through untouched, run on Control API requests
  only (`acts_on_control_only`, checked against Flower's route table when installed);
- `WhenFleetLogged`: the Fleet event log, which passes every request through when the
  SuperLink has no Fleet event log plugin, runs only when it has one;
- `CheckThenPass`: SuperNode authentication, whose ``dispatch`` checks the request's signature,
  timestamp and node id (raising on failure) and then returns ``call_next`` untouched, runs
  that same ``dispatch`` as a plain ASGI layer;
- `ErrorsTranslated`: the error translation, whose ``dispatch`` returns ``call_next``'s response
  untouched and turns an exception into a JSON answer, runs the app as a plain ASGI layer and
  hands an exception to that same ``dispatch``;
- `Translated`: the protobuf translation of a Fleet request runs by its own ``dispatch``, with a
  ``call_next`` that hands the app the body the ``dispatch`` read and returns the app's response
  read whole.

No layer of a Fleet request is a ``BaseHTTPMiddleware`` any more. What a request of either API
gets back does not change: ``tests/federated/test_flower_leanhttp.py`` sends Flower's stack and
this one the same requests (signed, unsigned, forged, stale, another node's id, the wrong media
type, a malformed body, a failing handler, an unknown route, a Control API call) and compares
the answers byte for byte. A request costs the server 1.86x less, a 5 MiB push 3.17x
(`benchmarks/flower_http.py`, 2026-12-06).
"""

from __future__ import annotations

from typing import Any

from flwr.supercore.error.http import http_error_translator
from flwr.supercore.protobuf.translation import ProtobufTranslationMiddleware
from flwr.superlink import main as app_module
from flwr.superlink.routers.control import middlewares as control
from flwr.superlink.routers.fleet.middlewares import FleetEventLogMiddleware
from flwr.superlink.routers.fleet.node_auth import NodeAuthMiddleware
from starlette.datastructures import URL  # Flower's HTTP stack: flwr brings starlette
from starlette.middleware import Middleware
from starlette.middleware.base import BaseHTTPMiddleware
from starlette.requests import Request
from starlette.responses import Response

CONTROL_PREFIX = "/v1/control/"
FLEET_PREFIX = "/v1/fleet/"


def _path(scope: dict[str, Any]) -> str:
    # as Starlette's ``Request.url.path``, which the wrapped layers test
    return URL(scope=scope).path


class _Wrapping:
    """An ASGI layer around ``app`` holding Flower's ``middleware`` built on that same app."""
    def __init__(self, app: Any, middleware: type, **options: Any) -> None:
        self.app = app
        self.wrapped = middleware(app, **options)


class ControlOnly(_Wrapping):
    """An ASGI layer running ``middleware`` (a Starlette middleware class) on Control API
    requests only; HTTP requests to any other path go straight to ``app``."""
    def passes(self, scope: dict[str, Any]) -> bool:
        """Whether the wrapped layer would let this request through untouched."""
        return scope["type"] == "http" and not _path(scope).startswith(CONTROL_PREFIX)

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if self.passes(scope):
            await self.app(scope, receive, send)
        else:
            await self.wrapped(scope, receive, send)


class WhenFleetLogged(ControlOnly):
    """Flower's Fleet event log layer, run only when the SuperLink has a Fleet event log plugin
    (``--enable-event-log`` with one installed): without one it lets every request through."""
    def passes(self, scope: dict[str, Any]) -> bool:
        app = scope.get("app")
        state = getattr(app, "state", None)
        return state is not None and getattr(state, "fleet_event_log_plugin", None) is None


class CheckThenPass(_Wrapping):
    """A Starlette ``BaseHTTPMiddleware`` whose ``dispatch`` only checks the request (it may
    raise) and then returns ``call_next(request)`` untouched, run as a plain ASGI layer: its
    own ``dispatch`` runs first, with a ``call_next`` that marks the request passed, and the
    app inside it runs after. A ``dispatch`` that answers on its own has its response sent; one
    that raises raises here, to the same outer layers. Without the task group and streams
    ``BaseHTTPMiddleware`` spends on every request and every chunk of its body. Only for a
    ``dispatch`` that does not read the body: the app inside reads it from the same ``receive``
    (SuperNode authentication reads headers and the protobuf request parsed further out)."""
    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.wrapped(scope, receive, send)
            return

        passed = _Passed()

        async def call_next(request: Any) -> Any:
            return passed

        answer = await self.wrapped.dispatch(Request(scope, receive), call_next)
        if answer is passed:
            await self.app(scope, receive, send)
        else:
            await answer(scope, receive, send)


class ErrorsTranslated:
    """Flower's error translation (a ``BaseHTTPMiddleware`` whose ``dispatch`` returns
    ``call_next``'s response untouched and turns an exception into a JSON answer) as a plain
    ASGI layer: the app inside runs on the request's own ``receive`` and ``send``, and an
    exception it raises before its response has started goes to that same ``dispatch``, as
    ``call_next`` raising it, whose answer is sent. One raised after the response started
    propagates, as it does from ``BaseHTTPMiddleware``."""
    def __init__(self, app: Any, dispatch: Any) -> None:
        self.app, self.dispatch = app, dispatch

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = False

        async def sending(message: dict[str, Any]) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, sending)
        except Exception as exc:  # handed to Flower's translator, as BaseHTTPMiddleware does
            if started:
                raise

            failure = exc

            async def call_next(request: Any) -> Any:
                raise failure

            answer = await self.dispatch(Request(scope, receive), call_next)
            await answer(scope, receive, send)


class Translated(_Wrapping):
    """Flower's protobuf translation (a ``BaseHTTPMiddleware`` whose ``dispatch`` parses the
    request's body into the route's protobuf request, calls ``call_next`` and replaces its
    response with the handler's protobuf result) run by its own ``dispatch`` without that
    class's task group and streams: ``call_next`` runs the app inside on the body the
    ``dispatch`` read, reads the app's response whole and returns it, and the ``dispatch``'s
    answer is sent. Only on Fleet API requests, whose results are single messages; every other
    request goes through Flower's layer as it is (a Control API result may stream)."""
    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http" or not _path(scope).startswith(FLEET_PREFIX):
            await self.wrapped(scope, receive, send)
            return

        async def call_next(request: Any) -> Any:
            body = await request.body()  # the dispatch read it: cached
            given = False

            async def again() -> dict[str, Any]:
                nonlocal given
                if given:
                    return await receive()
                given = True
                return {"type": "http.request", "body": body, "more_body": False}

            sent: dict[str, Any] = {"start": None, "body": []}

            async def kept(message: dict[str, Any]) -> None:
                if message["type"] == "http.response.start":
                    sent["start"] = message
                elif message["type"] == "http.response.body":
                    sent["body"].append(message.get("body", b""))

            await self.app(scope, again, kept)
            response = Response(b"".join(sent["body"]), status_code=sent["start"]["status"])
            response.raw_headers = list(sent["start"].get("headers", []))
            return response

        answer = await self.wrapped.dispatch(Request(scope, receive), call_next)
        await answer(scope, receive, send)


class _Passed:
    """`CheckThenPass`'s stand-in for the inner app's response."""


def acts_on_control_only() -> tuple[type, ...]:
    """Flower's middleware classes that act on Control API requests only: each returns
    ``call_next(request)`` untouched for a path outside ``/v1/control/``. The sensitive-response
    layer acts on the routes of a table: it counts only when every route there is a Control
    API route."""
    out: list[type] = [control.ControlEventLogMiddleware, control.ControlLicenseMiddleware,
                       control.ControlAuthenticationMiddleware]
    if all(path.startswith(CONTROL_PREFIX) for _, path in control.CONTROL_SENSITIVE_ROUTE_KEYS):
        out.append(control.ControlSensitiveResponseMiddleware)
    return tuple(out)


def lean(stack: list[Any], control_only: tuple[type, ...], fleet_log: type | None = None,
         checks: tuple[type, ...] = (), translator: Any = None, protobuf: type | None = None) -> list[Any]:
    """``stack`` (Starlette ``Middleware`` entries) with each layer of a ``control_only`` class
    wrapped in `ControlOnly`, the ``fleet_log`` layer in `WhenFleetLogged`, each layer of a
    ``checks`` class in `CheckThenPass`, the ``BaseHTTPMiddleware`` whose dispatch is
    ``translator`` run as `ErrorsTranslated`, and the ``protobuf`` layer in `Translated`, in
    place and order."""
    def wrapped(m: Any) -> Any:
        if m.args:
            return m
        if translator is not None and m.cls is BaseHTTPMiddleware and m.kwargs == {"dispatch": translator}:
            return Middleware(ErrorsTranslated, dispatch=translator)
        if m.cls in control_only:
            return Middleware(ControlOnly, middleware=m.cls, **m.kwargs)
        if fleet_log is not None and m.cls is fleet_log:
            return Middleware(WhenFleetLogged, middleware=m.cls, **m.kwargs)
        if m.cls in checks:
            return Middleware(CheckThenPass, middleware=m.cls, **m.kwargs)
        if protobuf is not None and m.cls is protobuf:
            return Middleware(Translated, middleware=m.cls, **m.kwargs)
        return m

    return [wrapped(m) for m in stack]


def lean_stack(stack: list[Any]) -> list[Any]:
    """Flower's SuperLink middleware ``stack`` (``flwr.superlink.main._get_middleware()``) as
    memaudit's SuperLink runs it: the Control API's layers in `ControlOnly`, the Fleet event log
    in `WhenFleetLogged`, SuperNode authentication in `CheckThenPass`, the error translation in
    `ErrorsTranslated`, the protobuf translation of a Fleet request in `Translated`."""
    return lean(stack, acts_on_control_only(), FleetEventLogMiddleware, (NodeAuthMiddleware,),
                http_error_translator, ProtobufTranslationMiddleware)


def install(component: str) -> None:
    """In a SuperLink's process (``component``), before it builds its app: `lean_stack` in place of
    Flower's middleware stack. Idempotent; nothing for another component."""
    if component != "superlink":
        return
    built = app_module._get_middleware
    if getattr(built, "__memaudit_lean__", False):
        return

    def get_middleware() -> list[Any]:
        return lean_stack(built())

    get_middleware.__memaudit_lean__ = True  # type: ignore[attr-defined]
    get_middleware.__wrapped_flower__ = built  # type: ignore[attr-defined]
    app_module._get_middleware = get_middleware


__all__ = ["CONTROL_PREFIX", "FLEET_PREFIX", "CheckThenPass", "ControlOnly", "ErrorsTranslated", "Translated",
           "WhenFleetLogged", "acts_on_control_only", "install", "lean", "lean_stack"]
