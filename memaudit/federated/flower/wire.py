"""What travels in memaudit's Flower messages: msgpack with NumPy arrays, in one bytes field.

A message's content is ``RecordDict({"memaudit": ConfigRecord({"payload": bytes})})``; the
payload is a msgpack map whose arrays are extension objects (dtype name, shape, raw bytes),
read back with ``np.frombuffer`` (never unpickled).

>>> import numpy as np
>>> out = unpack(pack({"a": np.arange(3, dtype=np.int32), "b": [1, "x"]}))
>>> out["a"].tolist(), out["b"]
([0, 1, 2], [1, 'x'])
"""

from __future__ import annotations

from typing import Any

import ml_dtypes
import msgpack
import numpy as np

# named where the SuperNode's ClientApp reads them without JAX (`memaudit.flower_node`)
from memaudit.flower_messages import FIELD, HELLO, RECORD, SECAGG, STAGE, payload_of, record

__all__ = ["FIELD", "HELLO", "RECORD", "SECAGG", "STAGE", "content", "dtype_of", "pack", "read", "unpack"]

_ARRAY = 7


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
    return msgpack.unpackb(data, ext_hook=_ext, raw=False, strict_map_key=False)


def content(obj: Any) -> Any:
    """A Flower ``RecordDict`` carrying ``obj``."""
    return record(pack(obj))


def read(message: Any) -> Any:
    """The object a memaudit Flower message carries."""
    return unpack(payload_of(message))
