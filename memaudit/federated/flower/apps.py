"""What memaudit's Flower ``ServerApp`` and ``ClientApp`` run (Flower's Message API); the apps
themselves are built in `memaudit.federated.flower.node`, which imports no JAX.

The ServerApp (`serve`) runs the federated trainer of a run directory (`memaudit.run.flower.serve_run`)
with the run's ``Grid``: every client stage of a round becomes one message per SuperNode that
hosts a sampled user. A node answers three message types (`answer`):

- ``query.memaudit_hello``: the names of the users in this node's partition and their digests
  (no data);
- ``train.memaudit_stage``: run one exported client stage for the slots of the users this node
  hosts (`memaudit.federated.flower.execute.NodeExecutor`) and reply with the rows and partial
  sums the server reads;
- ``train.memaudit_secagg``: one exchange of a secure-aggregation round for this node's
  users (`memaudit.federated.secagg.remote.node_step`): their protocol clients quantise the
  users' kept deltas and send masked inputs only.

The SuperNode's ClientApp is `memaudit.federated.flower.node`'s: it forwards each message to the node's
resident process (`memaudit.federated.flower.resident`), which answers with `answer` and keeps
the protocol clients' secret keys, the shares they received and a round's kept values in its
memory. With ``resident='false'`` in the node config the ClientApp answers in its own process
with the functions below, and those values go to files under ``cache-dir`` readable only by
the node's user (a ``flwr-clientapp`` process lives for one message).

The node's partition and its stage manifest come from its node config (``partition`` and
``manifest``, files written by `memaudit.federated.flower.nodes` from the operator's config): a
SuperNode without a manifest answers every message with a one-line error, and with one it runs
only the client stages the manifest lists, with the manifest's secure-aggregation policy and DP
parameters (`memaudit.federated.flower.trust.NodeTrust`); a refused call is answered with
``{"refused": one line}``, never data. XLA's compilation cache goes under ``cache-dir``
(default: a folder in the system temp dir).
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax

from memaudit.errors import DataError, MemauditError
from memaudit.federated.flower import wire
from memaudit.federated.flower.execute import NodeExecutor, call_from_wire
from memaudit.federated.flower.identity import load_node_identity
from memaudit.federated.flower.messages import payload_of
from memaudit.federated.flower.nodes import load_partition, user_digest
from memaudit.federated.flower.trust import NodeTrust

Context = Grid = Message = Any  # flwr's types, imported where used (flwr is an optional extra)


def serve(grid: Grid, context: Context) -> None:
    # lazy: flax (~2.5 s) and dp_accounting (~1.5 s) only when called; the transport needs flwr
    # (optional dependency), there wherever a ServerApp runs
    from memaudit.federated.flower import transport
    from memaudit.run.flower import serve_run

    transport.install("serverapp")  # the Grid asks again for a missing object after 0.02 s, not 1 s
    rc = context.run_config
    serve_run(grid, launch_dir=Path(str(rc["launch-dir"])), run_id=int(context.run_id))


def cache_dir(node_config: dict[str, Any], node_id: int) -> Path:
    d = node_config.get("cache-dir")
    base = Path(str(d)) if d else Path(tempfile.gettempdir()) / f"memaudit-flower-{os.getuid()}"
    return base / f"node-{node_id}"


def use_compilation_cache(node_config: dict[str, Any], node_id: int) -> None:
    """XLA's persistent compilation cache under the node's cache folder."""
    jax.config.update("jax_compilation_cache_dir", str(cache_dir(node_config, node_id) / "xla"))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)


def open_node(node_config: dict[str, Any], node_id: int, run_id: int, *, in_memory: bool = False) -> NodeExecutor:
    """The node's executor for a run: its partition, its manifest (`NodeTrust`) and identity.
    Values kept between a round's stages stay in memory (a resident process) or in files under
    the cache folder (one process per message)."""
    path, manifest = node_config.get("partition"), node_config.get("manifest")
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
        key = node_config.get("node-key") or Path(str(path)).with_suffix(".secagg.key")
        identity = load_node_identity(str(key), trust.nodes)
    users, arrays = load_partition(str(path))
    store = None if in_memory else cache_dir(node_config, node_id) / f"run-{run_id}"
    return NodeExecutor(users, arrays, store_dir=store, trust=trust, identity=identity)


def answer(kind: str, node: Callable[[], NodeExecutor], payload: bytes) -> dict[str, Any]:
    """The reply to one message of `kind` (hello, stage, secagg) whose payload is `payload`, by
    the node `node()` gives: the same for the resident process and for one process per message.
    A refusal is ``{"refused": one line}`` (``{"error": ...}`` for hello), never data."""
    try:
        executor = node()
        if kind == "hello":
            a = executor.arrays
            digests = [user_digest(a["input_ids"][k], a["example_mask"][k]) for k in range(len(executor.users))]
            return {"users": executor.users, "digests": digests, "platform": executor.platform}
        if kind == "stage":
            outputs = executor.run(call_from_wire(wire.unpack(payload)))
            # "compiled": the node ran this stage's module for the first time in its process
            # (traced and compiled, or read from its compilation cache): the round waited on that
            return {"outputs": {str(k): v for k, v in outputs.items()}, "compiled": executor.new_module}
        return executor.secagg(wire.unpack(payload))
    except MemauditError as e:  # refused (no manifest, a stage not in it, a non-finite update)
        line = (str(e).splitlines() or [type(e).__name__])[0]
        return {"error": line} if kind == "hello" else {"refused": line}
    except (TypeError, KeyError) as e:  # not a memaudit call: no data
        if kind != "stage":
            raise
        return {"refused": (str(e).splitlines() or [type(e).__name__])[0]}


def _reply(message: Message, obj: Any) -> Message:
    # optional dependency: flwr (the flower extra)
    from flwr.app import Message

    return Message(wire.content(obj), reply_to=message)


def _in_process(kind: str, message: Message, context: Context) -> Message:
    conf = dict(context.node_config)
    if kind == "stage":
        use_compilation_cache(conf, context.node_id)
    payload = payload_of(message)
    return _reply(message, answer(kind, lambda: open_node(conf, context.node_id, context.run_id), payload))


def hello(message: Message, context: Context) -> Message:
    return _in_process("hello", message, context)


def stage(message: Message, context: Context) -> Message:
    return _in_process("stage", message, context)


def secagg(message: Message, context: Context) -> Message:
    return _in_process("secagg", message, context)
