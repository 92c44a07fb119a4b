"""What memaudit's Flower messages are, importable without JAX: the record and field that carry
the payload bytes (`memaudit.federated.flower.wire` packs what goes in them), the message types
of memaudit's ClientApp (`memaudit.flower_node`), and the functions that put the payload into a
message's content (`record`, `shared_record`) and take it out (`payload_of`, `bytes_of`)."""

from typing import Any

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
