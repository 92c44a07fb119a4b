"""What memaudit's Flower messages are, importable without JAX: the record and field that carry
the payload bytes (`memaudit.federated.flower.wire` packs what goes in them), the message types
of memaudit's ClientApp (`memaudit.flower_node`), and the two functions that put the payload into
a message's content and take it out."""

from typing import Any

RECORD, FIELD = "memaudit", "payload"
HELLO, STAGE, SECAGG = "memaudit_hello", "memaudit_stage", "memaudit_secagg"
KINDS = {HELLO: "hello", STAGE: "stage", SECAGG: "secagg"}  # message type -> what the node does


def record(payload: bytes) -> Any:
    """A Flower ``RecordDict`` carrying `payload`."""
    # optional dependency: flwr (the flower extra)
    from flwr.app import ConfigRecord, RecordDict

    return RecordDict({RECORD: ConfigRecord({FIELD: payload})})


def payload_of(message: Any) -> bytes:
    """The payload bytes a memaudit Flower message carries."""
    return bytes(message.content[RECORD][FIELD])
