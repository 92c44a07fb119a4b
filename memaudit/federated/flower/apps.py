"""memaudit's Flower ``ServerApp`` and ``ClientApp`` (Flower's Message API).

The ServerApp runs the federated trainer of a run directory (`memaudit.federated.flower.trainer`)
with the run's ``Grid``: every client stage of a round becomes one message per SuperNode that
hosts a sampled user. The ClientApp answers two message types:

- ``query.memaudit_hello``: the names of the users in this node's partition and their digests
  (no data);
- ``train.memaudit_stage``: run one exported client stage for the slots of the users this node
  hosts (`memaudit.federated.flower.execute.NodeExecutor`) and reply with the rows and partial
  sums the server reads;
- ``train.memaudit_secagg``: one exchange of a secure-aggregation round for this node's
  users (`memaudit.federated.secagg.remote.node_step`): their protocol clients, whose secret
  keys and received shares stay in a file under ``cache-dir`` readable only by the node's
  user, quantise the users' kept deltas and send masked inputs only.

The node's partition and its stage manifest come from its node config (``partition`` and
``manifest``, files written by `memaudit.federated.flower.nodes` from the operator's config): a
SuperNode without a manifest answers every message with a one-line error, and with one it runs
only the client stages the manifest lists, with the manifest's secure-aggregation policy and DP
parameters (`memaudit.federated.flower.trust.NodeTrust`); a refused call is answered with
``{"refused": one line}``, never data. Values a later stage of the same round reads, and XLA's
compilation cache, go under ``cache-dir`` (default: a folder in the system temp dir).
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Any

import jax

from memaudit.errors import DataError, MemauditError
from memaudit.federated.flower import wire
from memaudit.federated.flower.execute import NodeExecutor, call_from_wire
from memaudit.federated.flower.identity import load_node_identity
from memaudit.federated.flower.nodes import load_partition, user_digest
from memaudit.federated.flower.trust import NodeTrust
from memaudit.federated.flower.wire import HELLO, SECAGG, STAGE

Context = Grid = Message = Any  # flwr's types, imported where used (flwr is an optional extra)


def serve(grid: Grid, context: Context) -> None:
    # lazy: flax (~2.5 s) and dp_accounting (~1.5 s) only when called
    from memaudit.federated.flower.trainer import serve_run

    rc = context.run_config
    serve_run(grid, launch_dir=Path(str(rc["launch-dir"])))


def _cache_dir(context: Context) -> Path:
    d = context.node_config.get("cache-dir")
    base = Path(str(d)) if d else Path(tempfile.gettempdir()) / f"memaudit-flower-{os.getuid()}"
    return base / f"node-{context.node_id}"


def _node(context: Context) -> Any:
    path, manifest = context.node_config.get("partition"), context.node_config.get("manifest")
    if not path:
        raise DataError("this SuperNode has no partition; start it with --node-config "
                        "\"partition='node-<i>.npz' manifest='manifest.json'\"")
    if not manifest:
        raise DataError("this SuperNode has no stage manifest, so it runs nothing a server sends; start "
                        "it with --node-config \"partition='node-<i>.npz' manifest='manifest.json'\" "
                        "(python -m memaudit.federated.flower.nodes writes both)")
    trust = NodeTrust.load(str(manifest))
    identity = None
    if trust.nodes:  # the node's long-term key: ``node-key``, or node-<i>.secagg.key beside its partition
        key = context.node_config.get("node-key") or Path(str(path)).with_suffix(".secagg.key")
        identity = load_node_identity(str(key), trust.nodes)
    users, arrays = load_partition(str(path))
    store = _cache_dir(context) / f"run-{context.run_id}"
    return NodeExecutor(users, arrays, store_dir=store, trust=trust, identity=identity)


def _reply(message: Message, obj: Any) -> Message:
    # optional dependency: flwr (the flower extra)
    from flwr.app import Message

    return Message(wire.content(obj), reply_to=message)


def hello(message: Message, context: Context) -> Message:
    try:
        node = _node(context)
    except MemauditError as e:
        return _reply(message, {"error": str(e)})

    a = node.arrays
    digests = [user_digest(a["input_ids"][k], a["example_mask"][k]) for k in range(len(node.users))]
    return _reply(message, {"users": node.users, "digests": digests})


def stage(message: Message, context: Context) -> Message:
    jax.config.update("jax_compilation_cache_dir", str(_cache_dir(context) / "xla"))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)

    try:
        node = _node(context)
        call = call_from_wire(wire.read(message))
        outputs = node.run(call)
    except (MemauditError, TypeError, KeyError) as e:  # refused, or not a memaudit call: no data
        return _reply(message, {"refused": (str(e).splitlines() or [type(e).__name__])[0]})
    return _reply(message, {"outputs": {str(k): v for k, v in outputs.items()}})


def secagg(message: Message, context: Context) -> Message:
    try:
        node = _node(context)
        return _reply(message, node.secagg(wire.read(message)))
    except MemauditError as e:  # refused (no manifest, a non-finite update): the node leaves
        return _reply(message, {"refused": (str(e).splitlines() or [type(e).__name__])[0]})


def _apps() -> tuple[Any, Any]:
    # optional dependency: flwr (the flower extra)
    from flwr.clientapp import ClientApp
    from flwr.serverapp import ServerApp

    server, client = ServerApp(), ClientApp()
    server.main()(serve)
    client.query(HELLO)(hello)
    client.train(STAGE)(stage)
    client.train(SECAGG)(secagg)
    return server, client


try:
    server_app, client_app = _apps()
except ImportError:  # without the .[flower] extra: importable (doctests), no apps
    server_app = client_app = None
