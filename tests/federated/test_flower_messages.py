"""What a memaudit Flower message costs to push (`memaudit.federated.flower.messages`): a payload over
1 MiB travels as one Array of raw bytes, which Flower cuts into chunks and serialises once per
step; a smaller one stays a ConfigRecord value, one object.

Before: every payload was a ConfigRecord value, which Flower serialises whole on each look at the
message (its id, its object tree, its push): a ClientApp's push of a 7.2 MB node reply took
0.14-0.16 s of a FedAvg round on 2 cores (3 runs), and the same push of an Array 0.09-0.11 s
(9 runs). A ConfigRecord value is also one protobuf message, which cannot pass 2 GB: the weights
of a 1B model in float32 (4 GB) could not be sent at all.
"""

from __future__ import annotations

import os

import pytest

from memaudit.federated.flower.messages import (
    INLINE_MAX,
    RECORD,
    SHARED,
    payload_of,
    record,
    shared_record,
)


def _pushed_bytes(message, monkeypatch) -> int:
    """The bytes Flower's serialisers produce while a sender does what Flower's ``push_message``
    does with `message`: its id, its object tree, then each object's content."""
    from flwr.supercore.inflatable import inflatable_object as io

    out = [0]
    for cls in {type(o) for o in io.get_all_nested_objects(message).values()}:
        real = cls.deflate

        def deflate(self, real=real):
            body = real(self)
            out[0] += len(body)
            return body

        monkeypatch.setattr(cls, "deflate", deflate)
    message.metadata.__dict__["_message_id"] = message.object_id
    with io.no_object_id_recompute():
        io.get_object_tree(message)
        for obj in io.get_all_nested_objects(message).values():
            obj.deflate()
    return out[0]


def test_a_message_push_serialises_its_payload_at_most_twice(monkeypatch):
    import flwr  # noqa: F401 - installed by the set-up (.[flower]): missing it is a failure, not a skip
    from flwr.app import Message
    from flwr.supercore.task_identity import TaskIdentity

    for attr in ("_run_id", "_node_id", "_task_id"):  # as inside a ServerApp or ClientApp
        monkeypatch.setattr(TaskIdentity, attr, 1)
    own, shared = os.urandom(6 << 20), os.urandom(3 << 20)  # the first over one 5 MB chunk
    message = Message(record(own, shared_record(shared)), dst_node_id=1, message_type="train.x")
    assert payload_of(message)[9 + len(shared):] == own
    assert _pushed_bytes(message, monkeypatch) <= 2 * (len(own) + len(shared)) + 64 * 1024
    assert message.content[RECORD] is not message.content[SHARED]


def test_a_small_payload_is_one_object_and_anything_else_is_refused():
    """A payload up to INLINE_MAX is a ConfigRecord value (one object: a request a hop), a larger
    one an Array; what memaudit never sends is refused."""
    import flwr  # noqa: F401 - installed by the set-up (.[flower]): missing it is a failure, not a skip
    from flwr.app import Array, ArrayRecord, ConfigRecord, RecordDict

    class Sent:  # a message as a reader sees it
        def __init__(self, content):
            self.content = content

    small, large = b"\x80" * INLINE_MAX, b"\x80" * (INLINE_MAX + 1)
    assert isinstance(record(small)[RECORD], ConfigRecord) and payload_of(Sent(record(small))) == small
    assert isinstance(record(large)[RECORD], ArrayRecord) and payload_of(Sent(record(large))) == large
    with pytest.raises(TypeError):  # a ConfigRecord value that is not bytes
        payload_of(Sent(RecordDict({RECORD: ConfigRecord({"payload": 3})})))
    with pytest.raises(TypeError):  # an Array that is an array, not memaudit's bytes
        payload_of(Sent(RecordDict({RECORD: ArrayRecord({"payload": Array(dtype="uint8", shape=(1,),
                                                                          stype="numpy.ndarray", data=b"\x80")})})))


def test_a_payload_over_protobufs_2_gb_limit_is_sent_in_chunks(monkeypatch):
    """Before: serialising the message raised ``DecodeError`` (protobuf's 2 GB limit)."""
    import flwr  # noqa: F401 - installed by the set-up (.[flower]): missing it is a failure, not a skip
    from flwr.app import Message
    from flwr.supercore.inflatable import inflatable_object as io
    from flwr.supercore.task_identity import TaskIdentity

    for attr in ("_run_id", "_node_id", "_task_id"):
        monkeypatch.setattr(TaskIdentity, attr, 1)
    size = (2 << 30) + 4096  # zeros: pages the kernel maps on reading, never allocated
    message = Message(record(bytes(size)), dst_node_id=1, message_type="train.x")
    objects = io.get_all_nested_objects(message)
    assert max(len(o.deflate()) for o in objects.values()) < 6 << 20  # each object a chunk or a head


def test_a_node_answers_only_messages_its_server_signed_for_its_run(monkeypatch):
    """Adversary: whoever holds a run's ServerApp task without the server key (a stranger, or a
    ServerApp of another run replaying a signed message). Each forgery is refused in one line;
    the server's own message, as sent, is answered; a manifest naming no key checks nothing."""
    import copy

    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
    from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat
    from flwr.app import Message
    from flwr.supercore.task_identity import TaskIdentity

    for attr in ("_run_id", "_node_id", "_task_id"):  # as inside a ServerApp
        monkeypatch.setattr(TaskIdentity, attr, 1)

    from memaudit.federated.flower.messages import server_refusal, sign_messages

    key, other = Ed25519PrivateKey.generate(), Ed25519PrivateKey.generate()
    server = key.public_key().public_bytes(Encoding.Raw, PublicFormat.Raw).hex()
    shared = shared_record(os.urandom(1 << 21))  # an Array, the same object in both messages

    def messages():
        return [Message(record(b"payload %d" % n, shared), dst_node_id=n, message_type="train.memaudit_stage",
                        group_id="3") for n in (7, 8)]

    def sent(msgs, run_id=5):
        for m in msgs:
            m.metadata.__dict__["_run_id"] = run_id  # what the Grid sets when it pushes
        return msgs

    honest = messages()
    sign_messages(honest, key, run_id=5)
    sent(honest)
    assert [server_refusal(m, n, server) for m, n in zip(honest, (7, 8), strict=True)] == [None, None]
    unsigned, foreign = sent(messages()), messages()
    sign_messages(foreign, other, run_id=5)
    sent(foreign)
    replayed = sent(copy.deepcopy(honest), run_id=6)  # another run's ServerApp sends run 5's message
    swapped = copy.deepcopy(honest[0])
    swapped.content[RECORD] = record(b"payload 9")[RECORD]
    redirected = copy.deepcopy(honest[0])
    redirected.metadata.__dict__["_dst_node_id"] = 8
    for m, n in [(unsigned[0], 7), (foreign[0], 7), (replayed[0], 7), (swapped, 7), (redirected, 8),
                 (honest[0], 8)]:
        why = server_refusal(m, n, server)
        assert why is not None and why.startswith("refused:") and len(why.splitlines()) == 1
    assert server_refusal(unsigned[0], 7, "") is None
