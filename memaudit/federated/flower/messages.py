"""What memaudit's Flower messages are, importable without JAX: the record and field that carry
the payload bytes (`memaudit.federated.flower.wire` packs what goes in them), the message types
of memaudit's ClientApp (`memaudit.federated.flower.node`), the functions that put the payload into a
message's content (`record`, `shared_record`) and take it out (`payload_of`, `bytes_of`), and the
server's signature on a message (`sign_messages`, `server_refusal`).

**The server's signature.** Whoever holds a run's ServerApp task speaks for the run: Flower's
SuperLink relays what it pushes to the nodes as the run's server. ``python -m
memaudit.federated.flower.nodes`` makes a server key (``serverapp.key``, 0600, it stays on the
SuperLink's host) beside the partitions and lists its public half in the stage manifest
(``server``); memaudit's SuperLink is started with it (``--server-key``) and memaudit's ServerApp,
once it is bound to its run (`memaudit.run.flower.bind_launch`), signs every
message it sends: the run id, the node it is for, its type and group, and the sha256 of its
payloads. A node whose manifest names a server key answers a message only when that key signed
it for this run and this node (`server_refusal`); any other message gets an error that carries
no data. Adversary: anyone who holds a run's ServerApp task without the key (a stranger on a
SuperLink that hands tasks out, a ServerApp of another run replaying a signed message). Test:
``tests/federated/test_flower_deploy.py::test_a_node_answers_only_its_runs_server``.
"""

import hashlib
import json
import os
from pathlib import Path
from typing import Any

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

RECORD, FIELD = "memaudit", "payload"
SHARED = "memaudit_shared"  # the record of values sent once for all the nodes of an exchange
STYPE = "memaudit.payload"  # an Array that carries a payload's bytes, never an array
INLINE_MAX = 1 << 20  # a payload up to this many bytes travels as a ConfigRecord value (`record`)
SPLIT = b"\xc1"  # a byte msgpack never uses: a payload that starts with it has the shared values first
HELLO, STAGE, SECAGG = "memaudit_hello", "memaudit_stage", "memaudit_secagg"
KINDS = {HELLO: "hello", STAGE: "stage", SECAGG: "secagg"}  # message type -> what the node does


def _carrier(payload: bytes) -> Any:
    """The record that carries `payload`. Up to `INLINE_MAX` bytes: a ``ConfigRecord`` value, one
    object (Flower pushes and pulls each object of a message in a request of its own, at every
    hop). Larger: an ``ArrayRecord`` holding it as one ``Array`` of raw bytes (dtype uint8,
    stype `STYPE`), never converted to an array, which Flower cuts into chunks of 5 MB, hashes
    once and pushes side by side; a ``ConfigRecord`` value is serialised whole on every look at
    the message (four times in a ClientApp's push) and cannot pass protobuf's 2 GB."""
    # optional dependency: flwr (the flower extra)
    from flwr.app import Array, ArrayRecord, ConfigRecord

    if len(payload) <= INLINE_MAX:
        return ConfigRecord({FIELD: payload})
    return ArrayRecord({FIELD: Array(dtype="uint8", shape=(len(payload),), stype=STYPE, data=payload)})


def record(payload: bytes, shared: Any = None) -> Any:
    """A Flower ``RecordDict`` carrying `payload` and, when given, `shared`: a record
    (`shared_record`) that every message of an exchange holds as the same object, so that Flower
    pushes its bytes to the SuperLink once and stores them once (objects are kept by the sha256
    of their content)."""
    # optional dependency: flwr (the flower extra)
    from flwr.app import RecordDict

    records = {RECORD: _carrier(payload)}
    if shared is not None:
        records[SHARED] = shared
    return RecordDict(records)


def shared_record(payload: bytes) -> Any:
    """The record of an exchange's shared values (`record`)."""
    return _carrier(payload)


def bytes_of(rec: Any) -> bytes:
    """The payload bytes of a record of a memaudit message; KeyError or TypeError when it is not
    one (a sender that is not memaudit's)."""
    value = rec[FIELD]
    if isinstance(value, bytes):  # a ConfigRecord value
        return value
    data = getattr(value, "data", None)
    if getattr(value, "stype", None) != STYPE or not isinstance(data, bytes):
        raise TypeError("not a memaudit payload")
    return data


def payload_of(message: Any) -> bytes:
    """The payload bytes a memaudit Flower message carries; with a shared record, `SPLIT`, the
    shared payload's length (8 bytes, big-endian), the shared payload, then the message's own
    (`memaudit.federated.flower.wire.unpack` reads them)."""
    own = bytes_of(message.content[RECORD])
    if SHARED not in message.content:
        return own
    shared = bytes_of(message.content[SHARED])
    return b"".join([SPLIT, len(shared).to_bytes(8, "big"), shared, own])


SIGNED = "memaudit_server"  # the record of the server's signature over a message
SERVER_KEY = "serverapp.key"  # its file, beside the manifest (python -m memaudit.federated.flower.nodes)
_DOMAIN = b"memaudit/flower/server-message/v1"
_KEY: list[Ed25519PrivateKey] = []  # this process's server key (`use_server_key`)


def use_server_key(path: str | Path) -> None:
    """Sign this process's ServerApps' messages with the key at `path` (hex of its 32 raw
    bytes, as ``python -m memaudit.federated.flower.nodes`` writes ``serverapp.key``).

    Raises:
        ValueError: one line, when the file cannot be read as such a key.
    """
    p = Path(path).expanduser()
    try:
        key = Ed25519PrivateKey.from_private_bytes(bytes.fromhex(p.read_text().strip()))
    except (OSError, ValueError) as e:
        raise ValueError(f"the server key '{p}' cannot be read ({type(e).__name__}); give the serverapp.key "
                         "written with the partitions (python -m memaudit.federated.flower.nodes)") from None
    _KEY[:] = [key]


def server_key() -> Ed25519PrivateKey | None:
    """The key this process signs its messages with, or None (`use_server_key`)."""
    return _KEY[0] if _KEY else None


def _digests(message: Any, cache: dict[int, str] | None = None) -> list[str]:
    """sha256 of a message's own payload and of its shared one ("" without)."""
    cache = {} if cache is None else cache
    out = [hashlib.sha256(bytes_of(message.content[RECORD])).hexdigest()]
    if SHARED in message.content:
        rec = message.content[SHARED]  # the same object in every message of an exchange: hashed once
        if id(rec) not in cache:
            cache[id(rec)] = hashlib.sha256(bytes_of(rec)).hexdigest()
        out.append(cache[id(rec)])
    else:
        out.append("")
    return out


def statement(run_id: int, message: Any, digests: list[str]) -> bytes:
    """What the server signs for `message`: the domain, the run, the node it is for, its type and
    group, and its payloads' digests."""
    md = message.metadata
    body = [int(run_id), int(md.dst_node_id), str(md.message_type), str(md.group_id), *digests]
    return hashlib.sha256(_DOMAIN + json.dumps(body).encode()).digest()


def sign_messages(messages: list[Any], key: Ed25519PrivateKey, run_id: int) -> None:
    """Add the server's signature (`SIGNED`) to each of `messages`, to be sent as run `run_id`."""
    # optional dependency: flwr (the flower extra)
    from flwr.app import ConfigRecord

    cache: dict[int, str] = {}
    for m in messages:
        m.content[SIGNED] = ConfigRecord({"sig": key.sign(statement(run_id, m, _digests(m, cache)))})


_MANIFEST_SERVER: dict[tuple[str, int, int], str] = {}


def manifest_server(manifest: str | Path) -> str:
    """The server key a stage manifest names (hex; "" where it names none or cannot be read: the
    node's own checks then refuse what it runs)."""
    p = Path(manifest).expanduser()
    try:
        st = os.stat(p)
    except OSError:
        return ""
    k = (str(p), st.st_mtime_ns, st.st_size)
    if k not in _MANIFEST_SERVER:
        try:
            _MANIFEST_SERVER[k] = str(json.loads(p.read_text()).get("server") or "")
        except (OSError, ValueError, AttributeError):
            _MANIFEST_SERVER[k] = ""
    return _MANIFEST_SERVER[k]


def server_refusal(message: Any, node_id: int, server: str) -> str | None:
    """Why this node (`node_id`, whose manifest names the server key `server`, hex) does not answer
    `message`, in one line; None when `server` signed it for its run and this node. With no
    `server` every message is answered (a manifest written before the key: write it again)."""
    if not server:
        return None
    if int(message.metadata.dst_node_id) != int(node_id):
        return "refused: the message is for another node"
    try:
        sig = bytes(message.content[SIGNED]["sig"])
        Ed25519PublicKey.from_public_bytes(bytes.fromhex(server)).verify(
            sig, statement(message.metadata.run_id, message, _digests(message)))
    except (KeyError, TypeError, ValueError, InvalidSignature):
        return ("refused: the message is not signed by this node's server for this run (its stage "
                "manifest's server key)")
    return None
