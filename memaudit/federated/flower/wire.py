"""What travels in memaudit's Flower messages: msgpack with NumPy arrays, in one bytes field.

A message's content is ``RecordDict({"memaudit": record})``, the record holding the payload's
bytes as a ``ConfigRecord`` value up to 1 MiB and as one ``Array`` of stype ``memaudit.payload``
above (`memaudit.federated.flower.messages.record`); the payload is a msgpack map whose arrays are
extension objects (dtype name, shape, raw bytes), read back with ``np.frombuffer`` (never
unpickled).

>>> import numpy as np
>>> out = unpack(pack({"a": np.arange(3, dtype=np.int32), "b": [1, "x"]}))
>>> out["a"].tolist(), out["b"]
([0, 1, 2], [1, 'x'])

The messages of one exchange can also hold one ``"memaudit_shared"`` record, the same object in
each: the values every node's payload names by a `Shared` reference (a client stage's module and
the model's weights), which Flower then pushes and stores once for all the nodes.

>>> shared = pack({"w": np.ones(2, np.float32)})
>>> node = pack({"x": Shared("w"), "slots": [3]})
>>> got = unpack(SPLIT + len(shared).to_bytes(8, "big") + shared + node)
>>> got["x"].tolist(), got["slots"]
([1.0, 1.0], [3])
"""

from __future__ import annotations

from typing import Any

import ml_dtypes
import msgpack
import numpy as np

# named where the SuperNode's ClientApp reads them without JAX (`memaudit.federated.flower.node`)
from memaudit.federated.flower.messages import (
    FIELD,
    HELLO,
    RECORD,
    SECAGG,
    SPLIT,
    STAGE,
    payload_of,
    record,
    shared_record,
)

__all__ = ["FIELD", "HELLO", "RECORD", "SECAGG", "STAGE", "Shared", "content", "dtype_of", "pack", "read", "record",
           "shared_record", "unpack"]

_ARRAY, _SHARED = 7, 8


class Shared:
    """In a payload, the value of `key` in the exchange's shared values (`pack_shared`)."""

    def __init__(self, key: str) -> None:
        self.key = key


def dtype_of(name: str) -> np.dtype:
    """The numpy dtype named ``name`` (also bfloat16 and the other ml_dtypes)."""
    try:
        return np.dtype(name)
    except TypeError:  # bfloat16 and other ml_dtypes
        return np.dtype(getattr(ml_dtypes, name))


_dtype = dtype_of


def _default(obj: Any) -> Any:
    if isinstance(obj, np.generic):
        obj = np.asarray(obj)
    if isinstance(obj, np.ndarray):
        if obj.dtype == object:
            raise TypeError("object arrays cannot be sent")
        head = msgpack.packb([obj.dtype.name, list(obj.shape)])
        return msgpack.ExtType(_ARRAY, head + np.ascontiguousarray(obj).tobytes())
    if isinstance(obj, Shared):
        return msgpack.ExtType(_SHARED, obj.key.encode())
    if hasattr(obj, "__array__"):  # a jax.Array
        return _default(np.asarray(obj))
    raise TypeError(f"cannot send a {type(obj).__name__}")


def _ext(code: int, data: bytes) -> Any:
    if code != _ARRAY:
        return msgpack.ExtType(code, data)
    unp = msgpack.Unpacker(raw=False)
    unp.feed(data)
    name, shape = next(unp)
    offset = unp.tell()
    return np.frombuffer(data, dtype=_dtype(name), offset=offset).reshape(shape).copy()


def pack(obj: Any) -> bytes:
    return msgpack.packb(obj, default=_default, use_bin_type=True)


def unpack(data: bytes) -> Any:
    """What `pack` packed; a payload of a message with shared values (`SPLIT` first:
    `memaudit.federated.flower.messages.payload_of`) with each `Shared` reference replaced by its value
    (a reference to a key the shared values lack raises KeyError)."""
    if data[:1] != SPLIT:
        return msgpack.unpackb(data, ext_hook=_ext, raw=False, strict_map_key=False)
    view = memoryview(data)
    n = int.from_bytes(view[1:9], "big")
    shared = msgpack.unpackb(view[9:9 + n], ext_hook=_ext, raw=False, strict_map_key=False)

    def ext(code: int, raw: bytes) -> Any:
        return shared[raw.decode()] if code == _SHARED else _ext(code, raw)

    return msgpack.unpackb(view[9 + n:], ext_hook=ext, raw=False, strict_map_key=False)


def content(obj: Any, shared: Any = None) -> Any:
    """A Flower ``RecordDict`` carrying ``obj``, and the exchange's ``shared`` record (`shared_record`
    of `pack` of the values ``obj``'s `Shared` references name)."""
    return record(pack(obj), shared)


def read(message: Any) -> Any:
    """The object a memaudit Flower message carries."""
    return unpack(payload_of(message))
