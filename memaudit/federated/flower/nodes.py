"""Each SuperNode's data: its partition of the prepared corpus (its users' sequences only).

`write_partitions(cfg, out, nodes)` prepares the run's data from the config (as the training
run will), makes every training user a client (`memaudit.federated.data.build_client_data`),
deals the users into ``nodes`` contiguous blocks and writes ``node-<i>.npz`` per node: the
users' names, their packed sequences, attention masks and example masks, and one digest per
user, and ``manifest.json``: the stage manifest of the config
(`memaudit.federated.flower.manifest.build_trust`: the client stages a node may run, the
secure-aggregation policy and DP parameters it enforces, and the server's public key), and
``serverapp.key``: the key memaudit's SuperLink signs its messages with (``--server-key``), which
stays on the SuperLink's host. A SuperNode is started with
``--node-config "partition='.../node-<i>.npz' manifest='.../manifest.json'"``; the server
checks every node's digests against its own prepared data, so a partition made from another
config is refused before the first round, and a node refuses every stage that is not its
manifest's. Pin the tokenizer (``data.tokenizer``, the one the partitions were made with,
printed by the command) so server and nodes tokenize alike.

    python -m memaudit.federated.flower.nodes CONFIG --nodes 2 --out parts/ [key=value ...]
        [--variant 'privacy.noise_multiplier=0.8 ...' ...]
"""

from __future__ import annotations

import argparse
import hashlib
import io
import json
import sys
from pathlib import Path
from typing import Any

import numpy as np

from memaudit.config import load_config
from memaudit.data import prepare_data
from memaudit.errors import DataError, MemauditError
from memaudit.federated.data import build_client_data
from memaudit.federated.flower.identity import new_node_key, public_hex, write_node_key
from memaudit.federated.flower.messages import SERVER_KEY
from memaudit.io import atomic_write_bytes
from memaudit.models.presets import get_preset
from memaudit.rundir import RunDir

ARRAYS = ("input_ids", "attention_mask", "example_mask")


def user_digest(ids: np.ndarray, mask: np.ndarray) -> str:
    """sha256 of a user's real sequences (rows with example mask 1)."""
    rows = np.asarray(ids)[np.asarray(mask, bool)]
    return hashlib.sha256(np.ascontiguousarray(rows.astype(np.int32)).tobytes()).hexdigest()[:32]


def client_digests(clients: Any) -> dict[str, str]:
    """user name -> digest, for `memaudit.federated.data.ClientData`."""
    return {u: user_digest(clients.input_ids[k], clients.example_mask[k])
            for k, u in enumerate(clients.users)}


def split_users(users: list[str], nodes: int) -> list[list[str]]:
    """Contiguous blocks of users, one per node (sizes differ by at most one).

    >>> split_users(["a", "b", "c"], 2)
    [['a', 'b'], ['c']]
    """
    if nodes < 1 or nodes > len(users):
        raise DataError(f"--nodes {nodes}: give between 1 and the {len(users)} training users")
    return [list(b) for b in np.array_split(np.asarray(users, dtype=object), nodes)]


def write_partitions(cfg: Any, out: Path, nodes: int, variants: Any = (), *,
                     manifest: bool = True, platforms: tuple[str, ...] = ("cpu",)) -> dict[str, Any]:
    """Prepare the data of ``cfg`` under ``out/prepared``; write ``out/node-<i>.npz`` and
    ``out/manifest.json`` (the stages of ``cfg`` and of each config in ``variants``: other
    training settings on the same ``data`` section, run on the same SuperNodes) for SuperNodes
    on ``platforms``. Without ``manifest`` (nodes in the server's own process, which check
    nothing) no manifest is written."""
    for v in variants:
        if v.data != cfg.data:
            raise DataError("a --variant changes the data section; write its partitions separately")
    out = Path(out)
    scratch = RunDir(out / "prepared")
    prepared = prepare_data(cfg.data, scratch, vocab_size=get_preset(cfg.model.preset).vocab_size)
    clients = build_client_data(prepared.train)
    blocks = split_users(list(clients.users), nodes)
    index = {u: k for k, u in enumerate(clients.users)}
    files = []
    for i, block in enumerate(blocks):
        rows = [index[u] for u in block]
        arrays = {"users": np.asarray(block, dtype=str), "input_ids": clients.input_ids[rows],
                  "attention_mask": clients.attention_mask[rows],
                  "example_mask": clients.example_mask[rows]}

        buf = io.BytesIO()
        np.savez(buf, **arrays)
        path = out / f"node-{i}.npz"
        atomic_write_bytes(path, buf.getvalue())
        files.append(str(path))
    # lazy: the manifest traces the round (flax, optax: seconds); a SuperNode reading its
    # partition through this module does not pay for it
    from memaudit.federated.flower.manifest import write_manifest

    keys = [new_node_key() for _ in blocks] if manifest else []  # the nodes' PKI: node i's key to node i only
    for i, key in enumerate(keys):
        write_node_key(out / f"node-{i}.secagg.key", key)
    server = new_node_key() if manifest else None  # the ServerApp's: stays on the SuperLink's host
    if server is not None:
        write_node_key(out / SERVER_KEY, server)
    path = (write_manifest([cfg, *variants], prepared, scratch, out / "manifest.json",
                           nodes=tuple(public_hex(k) for k in keys), hosted=max(len(b) for b in blocks),
                           platforms=platforms, server=public_hex(server))
            if server is not None else None)
    return {"partitions": files, "users": [len(b) for b in blocks], "manifest": None if path is None else str(path),
            "node_keys": [str(out / f"node-{i}.secagg.key") for i in range(len(keys))],
            "server_key": None if server is None else str(out / SERVER_KEY),
            "tokenizer": str(scratch.data_dir / "tokenizer")}


def load_partition(path: str | Path) -> tuple[list[str], dict[str, np.ndarray]]:
    """A node's users and arrays; one-line `DataError` for a missing, damaged or empty file."""
    p = Path(path).expanduser()
    try:
        with np.load(p, allow_pickle=False) as z:
            users = [str(u) for u in z["users"]]
            arrays = {k: np.asarray(z[k]) for k in ARRAYS}
    except (OSError, KeyError, ValueError) as e:
        raise DataError(f"the node partition '{p}' cannot be read ({type(e).__name__}); write it "
                        "with python -m memaudit.federated.flower.nodes") from None
    if not users:
        raise DataError(f"the node partition '{p}' holds no users; give this SuperNode a "
                        "non-empty partition")
    return users, arrays


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m memaudit.federated.flower.nodes",
                                 description="Write each SuperNode's partition of a run's data.")
    ap.add_argument("config", help="the run's YAML config")
    ap.add_argument("overrides", nargs="*", help="key=value overrides, as for memaudit train")
    ap.add_argument("--nodes", type=int, required=True)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--variant", action="append", default=[], metavar="'key=value ...'",
                    help="overrides of another run on the same data these SuperNodes may serve "
                         "(its stages join the manifest); repeatable")
    ap.add_argument("--platforms", nargs="+", default=["cpu"], choices=["cpu", "cuda", "tpu"],
                    help="the SuperNodes' JAX platforms: the manifest allows the stages lowered "
                         "for each (default: cpu)")
    a = ap.parse_args(argv)
    try:
        cfg = load_config(a.config, a.overrides)
        variants = [load_config(a.config, [*a.overrides, *v.split()]) for v in a.variant]
        info = write_partitions(cfg, a.out, a.nodes, variants, platforms=tuple(a.platforms))
    except (MemauditError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(json.dumps(info, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
