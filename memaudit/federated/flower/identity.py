"""Node identities: the PKI behind secure aggregation's malicious-server mode on Flower.

Adversary: the server (the ServerApp, or anyone driving memaudit's ClientApp) deviating from
the protocol to unmask one user's delta. In the malicious-server mode each protocol client
signs its messages with an Ed25519 key, but on Flower a node makes its clients' keys each round
and the server relays them: a server that swaps a client's verification key for its own, or
adds clients it controls (Sybils), would sign for them, pass the consistency check and collect
enough shares to unmask an honest client. Bonawitz et al. assume a PKI for this; here it is the
operator's:

- ``python -m memaudit.federated.flower.nodes`` makes one long-term Ed25519 key per node
  (``node-<i>.secagg.key``, 0600, goes to node i only) and lists every node's public key in the stage
  manifest (`memaudit.federated.flower.trust.NodeTrust.nodes`), which every node holds;
- at the advertise step a node signs its clients' round keys (`sign_keys`: round id, node
  index, client ids and keys);
- at the next step every node accepts only keys in a bundle signed by a node of its manifest
  (`authenticated_keys`), each client id claimed once: a substituted, added or unsigned key
  leaves the client without a verification key and the round aborts.

What it does not stop: a node colluding with the server (the policy's ``colluding`` clients
bound that), or the server dropping honest nodes (the threshold and minimum survivors bound it).

Reference: Bonawitz et al., "Practical Secure Aggregation for Privacy-Preserving Machine
Learning", CCS 2017, section 6 (the malicious-server protocol and its PKI).
"""

from __future__ import annotations

import hashlib
import struct
from pathlib import Path
from typing import Any

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from memaudit.errors import DataError
from memaudit.federated.flower.trust import StageRefused
from memaudit.io import atomic_write_bytes

_DOMAIN = b"memaudit/secagg/node-keys/v1"
_RAW_PUB = (serialization.Encoding.Raw, serialization.PublicFormat.Raw)
_RAW_PRIV = (serialization.Encoding.Raw, serialization.PrivateFormat.Raw, serialization.NoEncryption())


def new_node_key() -> Ed25519PrivateKey:
    return Ed25519PrivateKey.generate()


def public_hex(key: Ed25519PrivateKey) -> str:
    """The node's public key as the manifest lists it (32 raw bytes in hex)."""
    return key.public_key().public_bytes(*_RAW_PUB).hex()


def write_node_key(path: Path, key: Ed25519PrivateKey) -> Path:
    """The node's signing key (hex of the 32 raw bytes), atomically and readable only by its owner."""
    atomic_write_bytes(path, key.private_bytes(*_RAW_PRIV).hex().encode())
    return path


def load_node_identity(path: str | Path, nodes: tuple[str, ...]) -> tuple[int, Ed25519PrivateKey]:
    """(this node's index in the manifest, its signing key); one-line `DataError` when the key
    file is missing, damaged, or not one of the manifest's nodes."""
    p = Path(path).expanduser()
    try:
        key = Ed25519PrivateKey.from_private_bytes(bytes.fromhex(p.read_text().strip()))
    except (OSError, ValueError) as e:
        raise DataError(f"this SuperNode's key '{p}' cannot be read ({type(e).__name__}); give it the "
                        "node-<i>.secagg.key written beside its partition (python -m memaudit.federated.flower.nodes)") from None
    pub = public_hex(key)
    if pub not in nodes:
        raise DataError(f"this SuperNode's key '{p}' is not one of the stage manifest's {len(nodes)} nodes; "
                        "give it the key and manifest written together for this federation")
    return nodes.index(pub), key


def keys_message(round_id: int, node: int, keys: dict[int, bytes]) -> bytes:
    """What a node signs: the domain, the round id, its index and its clients' keys in id order."""
    h = hashlib.sha256(_DOMAIN + struct.pack(">QI", int(round_id), int(node)))
    for cid in sorted(keys):
        h.update(struct.pack(">I", int(cid)) + bytes(keys[cid]))
    return h.digest()


def sign_keys(identity: tuple[int, Ed25519PrivateKey], round_id: int, keys: dict[int, bytes]) -> dict[str, Any]:
    """The ``keys_sig`` a node adds to its advertise reply."""
    node, key = identity
    return {"node": int(node), "sig": key.sign(keys_message(round_id, node, keys))}


def authenticated_keys(bundles: Any, nodes: tuple[str, ...], round_id: int) -> dict[int, bytes]:
    """The clients' verification keys the server relayed, kept only where a manifest node
    signed them for this round (``bundles``: ``[{"node", "keys", "sig"}]``).

    Raises:
        StageRefused: a bundle that is malformed, from no manifest node or a node twice, with a
            signature that does not verify, or a client id claimed by two bundles.
    """
    out: dict[int, bytes] = {}
    seen: set[int] = set()
    for b in bundles if isinstance(bundles, list) else ():
        try:
            node, keys, sig = int(b["node"]), {int(c): bytes(k) for c, k in b["keys"].items()}, bytes(b["sig"])
        except (KeyError, TypeError, ValueError, AttributeError):
            raise StageRefused("the server relayed a malformed signed key bundle") from None
        if not 0 <= node < len(nodes) or node in seen:
            raise StageRefused(f"the server relayed keys of node {node}, which is not a manifest node "
                               "or came twice")
        try:
            Ed25519PublicKey.from_public_bytes(bytes.fromhex(nodes[node])).verify(
                sig, keys_message(round_id, node, keys))
        except InvalidSignature:
            raise StageRefused(f"the keys relayed for node {node} are not the ones it signed "
                               "(substituted by the server)") from None
        if out.keys() & keys.keys():
            raise StageRefused("the server relayed one client's keys from two nodes")
        seen.add(node)
        out.update(keys)
    return out


__all__ = ["authenticated_keys", "keys_message", "load_node_identity", "new_node_key", "public_hex",
           "sign_keys", "write_node_key"]
