"""Every change memaudit makes to Flower's own code, behind one `install`.

memaudit runs Flower's SuperLink and SuperNode (the pinned ``flwr==1.42.0``) in its own processes
(`memaudit.federated.flower.superlink`, `memaudit.federated.flower.supernode`) and changes how
they move messages. Each change replaces or extends a name inside Flower; `PATCHES` lists every
one (module, attribute, layer, why), and `install` is the only caller of the code that makes
them. It first checks the installed Flower against `PINNED_FLWR` and refuses any other version
in one line (`FlowerVersionError`): the names patched here are Flower's internals, which a
release may move or change without notice.

The layers (`LAYERS`) and what a 4-SuperNode secure round measured with each off
(``benchmarks/flower_transport.py``, 3 interleaved runs a variant on a saturated 2-core host;
docs/results.md, "Flower's transport, layer by layer"):

- ``short_waits`` (`polls`): Flower's seconds-long waits between polls made a round's scale; off,
  a round took 2.0x as long (15.0 s against 7.4 s), beyond the spread of either;
- ``held_asks`` (`longpoll`): an ask for work is answered when there is work; off, within the
  spread on that host (earlier interleaved pairs on a quieter one: secure rounds 1.11-1.22x
  faster on 2 SuperNodes, 3 pairs; 1.57x on 4, 1 pair);
- ``bundled`` (`bundle`): a message and its reply in one Fleet request each way, not nine; off,
  within the spread on that host (earlier, 4 runs each: secure rounds 1.16-1.23x);
- ``local_runtime`` (`localruntime`): memaudit's SuperExec and the ServerApps ask Flower's runtime
  handlers in the component's own process, not its runtime API over HTTP (what runs the
  SuperExec there; not a layer that can be left out);
- ``fab_guard`` (`fabguard`): Flower's ``flwr-serverapp`` installs a run's app only when it is
  memaudit's (a refusal, not a speed-up: never off).

A lean HTTP stack on the SuperLink, 1.86x faster per request, moved no round (7.27 s off against
7.40 s on, the same CPU a round) and was removed.

This package imports Flower at module level: it is imported only where Flower runs (the
``flower`` extra); without Flower, importing it fails with one line naming the extra.

References:
    Flower 1.42.0, https://github.com/adap/flower/tree/v1.42.0
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Collection
from types import ModuleType
from typing import NamedTuple

from memaudit.errors import ConfigError

try:
    import flwr
except ImportError:  # the flower extra is not installed
    raise ConfigError("memaudit's Flower transport needs Flower; install the extra: "
                      "pip install 'memaudit[flower]'") from None

PINNED_FLWR = "1.42.0"  # pyproject's flower extra: flwr==1.42.0


class FlowerVersionError(ConfigError):
    """The installed Flower is not the version memaudit's transport patches."""


def check_version(version: str | None = None) -> None:
    """Raise `FlowerVersionError` (one line, with the fix) unless ``version`` (default: the
    installed ``flwr.__version__``) is `PINNED_FLWR`.

    >>> check_version(PINNED_FLWR)
    >>> check_version("1.43.0")
    Traceback (most recent call last):
    ...
    memaudit.federated.flower.transport.FlowerVersionError: memaudit's Flower transport patches flwr 1.42.0, and flwr 1.43.0 is installed; install flwr==1.42.0 (pip install 'memaudit[flower]')
    """
    found = flwr.__version__ if version is None else version
    if found != PINNED_FLWR:
        raise FlowerVersionError(f"memaudit's Flower transport patches flwr {PINNED_FLWR}, and flwr {found} "
                                 f"is installed; install flwr=={PINNED_FLWR} (pip install 'memaudit[flower]')")


class Patch(NamedTuple):
    """One name in Flower that `install` replaces or extends."""

    module: str  # Flower's module
    attribute: str  # a name in it, dotted for a class's attribute ("TaskIdentity.__class__.run_id")
    layer: str  # the entry of `LAYERS` that makes it
    component: str  # the process that makes it: "superlink", "supernode", "clientapp" or "serverapp"
    kind: str  # "replaced": a new object under the name; "extended": the same object, with entries added
    why: str


LAYERS = {
    "short_waits": "polls",
    "held_asks": "longpoll",
    "bundled": "bundle",
    "local_runtime": "localruntime",
    "fab_guard": "fabguard",
}
OPTIONAL = ("short_waits", "held_asks", "bundled")  # layers that `install(off=...)` may leave out
COMPONENTS = ("superlink", "supernode", "clientapp", "serverapp")

_LINK_RT, _NODE_RT = "flwr.superlink.servicer.runtime.runtime_handlers", "flwr.supernode.servicer.runtime.runtime_handlers"
_FLEET, _LOOP = "flwr.superlink.servicer.fleet.fleet_handlers", "flwr.supernode.start_client_internal"

PATCHES: tuple[Patch, ...] = (
    # short_waits (polls.py)
    Patch("flwr.superlink.grid.http_grid", "pull_objects", "short_waits", "serverapp", "replaced",
          "the ServerApp asks again for a reply's missing object after 0.02 s, not 1 s doubling to 10 s"),
    Patch("flwr.supernode.runtime.run_clientapp", "pull_and_inflate_object_from_tree", "short_waits", "clientapp",
          "replaced", "the ClientApp asks again for its message's missing object after 0.02 s, not 1 s"),
    Patch(_LOOP, "time", "short_waits", "supernode", "replaced",
          "the SuperNode loop waits a poll (0.1 s) when it found no message, not 3 s, and 0.01 s for its "
          "ClientApp's reply, not 0.5 s"),
    Patch(_LOOP, "pull_objects", "short_waits", "supernode", "replaced",
          "the SuperNode asks again for a message's missing object after 0.02 s, not 1 s"),
    # held_asks (longpoll.py)
    *(Patch(m, name, "held_asks", "superlink", "replaced", why) for m in (_FLEET, _LINK_RT) for name, why in (
        ("push_messages", "a push wakes the held asks"), ("push_object", "a push wakes the held asks"))),
    Patch(_FLEET, "pull_messages", "held_asks", "superlink", "replaced",
          "a SuperNode's ask for a message waits (at most 1 s) for one whose objects are all stored"),
    Patch(_LINK_RT, "pull_messages", "held_asks", "superlink", "replaced",
          "the ServerApp's ask for replies waits (at most 1 s) for one whose objects are all stored"),
    Patch(_LOOP, "_pull_and_store_message", "held_asks", "supernode", "replaced",
          "a message pulled from the SuperLink wakes the SuperExec's held ask for a task"),
    Patch(_NODE_RT, "acquire_task", "held_asks", "supernode", "replaced",
          "the SuperExec's ask for a task waits (at most 1 s) until the node holds a message"),
    # bundled (bundle.py)
    Patch("flwr.supercore.protobuf.translation", "PROTOBUF_REQUEST_TYPES", "bundled", "superlink", "extended",
          "the protobuf request types of the two bundle routes"),
    Patch("flwr.superlink.routers.fleet.router", "router", "bundled", "superlink", "extended",
          "the two bundle routes on the Fleet API (a message, a reply, each with its objects)"),
    Patch("flwr.supernode.fleet_http_connection", "FleetHttpClient", "bundled", "supernode", "replaced",
          "Flower's Fleet HTTP client with the two bundled calls"),
    Patch(_LOOP, "http_request_response", "bundled", "supernode", "replaced",
          "the node's Fleet connection, pulling and pushing a message with its objects in one request"),
    # local_runtime (localruntime.py)
    Patch("flwr.superlink.main", "create_app", "local_runtime", "superlink", "replaced",
          "records the SuperLink's state factory, for the SuperExec and ServerApps in its process"),
    Patch("flwr.supernode.main", "create_app", "local_runtime", "supernode", "replaced",
          "records the SuperNode's state factory, for the SuperExec in its process"),
    *(Patch("flwr.supercore.task_identity", f"TaskIdentity.__class__.{name}", "local_runtime", "superlink",
            "replaced", "one per thread: ServerApps of runs side by side, each a thread, create messages for "
            "their own run") for name in ("task_id", "run_id", "node_id")),
    # fab_guard (fabguard.py)
    Patch("flwr.superlink.runtime.run_serverapp", "install_from_fab", "fab_guard", "serverapp", "replaced",
          "Flower's flwr-serverapp installs a run's app only when it is memaudit's"),
)

_off: set[str] = set()  # layers left out in this process (the first `install` that named them)


def install(component: str, *, off: Collection[str] = (), poll: float | None = None,
            fab_check: Callable[[bytes], None] | None = None) -> None:
    """Install memaudit's transport in this process for ``component``, after checking the
    installed Flower (`check_version`): every `PATCHES` entry of that component whose layer is not
    in ``off`` (for this process: a later `install` leaves them out too). Idempotent.

    Args:
        component: ``"superlink"`` (before its app is built; a ServerApp runs in it as a thread),
            ``"supernode"`` (before it connects), ``"clientapp"`` (memaudit's SuperExec on a
            SuperNode) or ``"serverapp"`` (a ServerApp's process or thread; with ``fab_check``,
            Flower's ``flwr-serverapp`` process, whose app installs are guarded).
        off: layers of `OPTIONAL` to leave out (the benchmark's "off" runs).
        poll: the SuperNode loop's poll in seconds (default `polls.SUPERNODE_POLL_S`).
        fab_check: ``flwr-serverapp``'s guard, called with a FAB's bytes before Flower installs
            it: raises to refuse it.
    """
    check_version()
    if component not in COMPONENTS:
        raise ValueError(f"no transport for {component!r}; give one of {', '.join(COMPONENTS)}")
    unknown = set(off) - set(OPTIONAL)
    if unknown:
        raise ValueError(f"cannot leave out {sorted(unknown)}; the layers that may be off: {', '.join(OPTIONAL)}")
    _off.update(off)
    used = {p.layer for p in PATCHES if p.component == component}
    layers = {name: _layer(name) for name in LAYERS if name in used and name not in _off}
    for name, module in layers.items():
        module.install(component, **({"poll": poll} if name == "short_waits" else {}),
                       **({"fab_check": fab_check} if name == "fab_guard" else {}))


def _layer(name: str) -> ModuleType:
    # lazy: a layer's module imports Flower's internals at module level, only after check_version
    return importlib.import_module(f"{__name__}.{LAYERS[name]}")


def resolve(patch: Patch) -> object:
    """What the name of ``patch`` holds now in the installed Flower."""
    obj: object = importlib.import_module(patch.module)
    for part in patch.attribute.split("."):
        obj = getattr(obj, part)
    return obj


__all__ = ["COMPONENTS", "LAYERS", "OPTIONAL", "PATCHES", "PINNED_FLWR", "FlowerVersionError", "Patch",
           "check_version", "install", "resolve"]
