"""What memaudit's Flower messages are, importable without JAX: the record and field that carry
the payload bytes (`memaudit.federated.flower.wire` packs what goes in them), the message types
of memaudit's ClientApp (`memaudit.flower_node`), and the two functions that put the payload into
a message's content and take it out."""

from typing import Any

RECORD, FIELD = "memaudit", "payload"
SHARED = "memaudit_shared"  # the record of values sent once for all the nodes of an exchange
SPLIT = b"\xc1"  # a byte msgpack never uses: a payload that starts with it has the shared values first
HELLO, STAGE, SECAGG = "memaudit_hello", "memaudit_stage", "memaudit_secagg"
KINDS = {HELLO: "hello", STAGE: "stage", SECAGG: "secagg"}  # message type -> what the node does


def record(payload: bytes, shared: Any = None) -> Any:
    """A Flower ``RecordDict`` carrying `payload` and, when given, `shared`: a ``ConfigRecord``
    (`shared_record`) that every message of an exchange holds as the same object, so that Flower
    pushes its bytes to the SuperLink once and stores them once (objects are kept by the sha256
    of their content)."""
    # optional dependency: flwr (the flower extra)
    from flwr.app import ConfigRecord, RecordDict

    records = {RECORD: ConfigRecord({FIELD: payload})}
    if shared is not None:
        records[SHARED] = shared
    return RecordDict(records)


def shared_record(payload: bytes) -> Any:
    """The ``ConfigRecord`` of an exchange's shared values (`record`)."""
    # optional dependency: flwr (the flower extra)
    from flwr.app import ConfigRecord

    return ConfigRecord({FIELD: payload})


def payload_of(message: Any) -> bytes:
    """The payload bytes a memaudit Flower message carries; with a shared record, `SPLIT`, the
    shared payload's length (8 bytes, big-endian), the shared payload, then the message's own
    (`memaudit.federated.flower.wire.unpack` reads them)."""
    own = message.content[RECORD][FIELD]
    if SHARED not in message.content:
        return bytes(own)
    shared = message.content[SHARED][FIELD]
    return b"".join([SPLIT, len(shared).to_bytes(8, "big"), shared, own])
