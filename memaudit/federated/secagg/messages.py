"""Wire format of the secure-aggregation protocol.

Every message is bytes: a fixed header (magic, version, type, round id, sender,
recipient, body length) and a body of length-prefixed fields. Parsing checks
every length, so a truncated or padded message raises :class:`MessageError`.
The encrypted Shamir shares inside are authenticated with an AEAD whose
associated data binds sender, recipient and round id (see client.py).
"""

from __future__ import annotations

import enum
import struct
from dataclasses import dataclass

import numpy as np

MAGIC = b"MASA"
VERSION = 1
SERVER = 0xFFFFFFFF
_HEADER = struct.Struct(">4sBBQIIQ")  # magic, version, type, round, sender, recipient, body length


class SecAggError(RuntimeError):
    """Base class of secure-aggregation failures."""


class MessageError(SecAggError):
    """A message could not be parsed (truncated, padded, wrong magic or version)."""


class AuthenticationError(SecAggError):
    """An encrypted share failed AEAD verification (tampered or misrouted)."""


class ReplayError(SecAggError):
    """A message carries the wrong round id or type, or was already received."""


class SecAggAbort(SecAggError):
    """The round cannot release a sum safely (too few survivors, a threshold below the
    threat model's bound, or a detected attack); it produced nothing."""


class InconsistencyDetected(SecAggAbort):
    """Malicious-server mode: the survivor list a client was shown is not the one at least t
    clients signed (the server showed different lists to different clients)."""


class MsgType(enum.IntEnum):
    ADVERTISE = 1      # client -> server: two X25519 public keys (malicious mode: + Ed25519 signature)
    KEYS = 2           # server -> client: threshold, neighbours' public keys (+ their signatures)
    SHARES = 3         # client -> server: encrypted shares, one per holder
    FORWARD = 4        # server -> client: encrypted shares addressed to it, and U2
    MASKED = 5         # client -> server: masked quantised update
    UNMASK_REQUEST = 6  # server -> client: the survivors U3 (and, malicious mode, >= t signatures on it)
    UNMASK = 7         # client -> server: the shares it reveals
    CHECK_REQUEST = 8  # server -> client: the survivors U3 to sign (malicious-server mode)
    CHECK = 9          # client -> server: Ed25519 signature over (round, U3)


@dataclass(frozen=True)
class Header:
    type: MsgType
    round_id: int
    sender: int
    recipient: int


class Writer:
    """Builds one message; `finish` writes header and fields with a single copy."""

    def __init__(self) -> None:
        self._parts: list[bytes | memoryview] = []

    def u32(self, v: int) -> Writer:
        self._parts.append(struct.pack(">I", v))
        return self

    def blob(self, b: bytes) -> Writer:
        self._parts.append(struct.pack(">Q", len(b)))
        self._parts.append(bytes(b))
        return self

    def ids(self, xs) -> Writer:
        xs = sorted(xs)
        self.u32(len(xs))
        for x in xs:
            self.u32(x)
        return self

    def array(self, a: np.ndarray) -> Writer:
        """A uint32 vector as a little-endian blob; its memory is read once, by `finish`."""
        raw = memoryview(np.ascontiguousarray(a, dtype="<u4")).cast("B")
        self._parts.append(struct.pack(">Q", raw.nbytes))
        self._parts.append(raw)
        return self

    def finish(self, header: Header) -> bytes:
        n = sum(len(p) if isinstance(p, bytes) else p.nbytes for p in self._parts)
        head = _HEADER.pack(MAGIC, VERSION, int(header.type), header.round_id, header.sender,
                            header.recipient, n)
        return b"".join([head, *self._parts])


def masked_bytes(words: int) -> int:
    """Bytes of one client's masked input (`MsgType.MASKED`): the header, the vector's length
    and its `words` uint32 words (mod 2^32 whatever the quantisation bits)."""
    return _HEADER.size + 8 + 4 * int(words)


class Reader:
    def __init__(self, body: bytes | memoryview) -> None:
        self._b = memoryview(body)
        self._o = 0

    def _take(self, n: int) -> memoryview:
        if n < 0 or self._o + n > len(self._b):
            raise MessageError("message truncated: a field runs past the end of the body")
        v = self._b[self._o:self._o + n]
        self._o += n
        return v

    def u32(self) -> int:
        return struct.unpack(">I", self._take(4))[0]

    def blob(self) -> bytes:
        (n,) = struct.unpack(">Q", self._take(8))
        return bytes(self._take(n))

    def ids(self) -> list[int]:
        return [self.u32() for _ in range(self.u32())]

    def array(self, d: int | None = None) -> np.ndarray:
        """A uint32 vector: a read-only view into the message, no copy."""
        (n,) = struct.unpack(">Q", self._take(8))
        if n % 4 or (d is not None and n != 4 * d):
            raise MessageError(f"masked vector has {n} bytes, expected {4 * d if d else 'a multiple of 4'}")
        return np.frombuffer(self._take(n), dtype="<u4")

    def done(self) -> None:
        if self._o != len(self._b):
            raise MessageError(f"message has {len(self._b) - self._o} trailing bytes")


def parse(msg: bytes, *, expect: MsgType, round_id: int, recipient: int | None = None) -> tuple[Header, Reader]:
    """Parse and check a message's header; return it and a reader over the body.

    Raises:
        MessageError: truncated, padded, bad magic or version.
        ReplayError: wrong round id, message type or recipient.
    """
    if len(msg) < _HEADER.size:
        raise MessageError(f"message truncated: {len(msg)} bytes, header needs {_HEADER.size}")
    magic, version, typ, rid, sender, rcpt, n = _HEADER.unpack_from(msg)
    if magic != MAGIC:
        raise MessageError("not a secure-aggregation message (bad magic)")
    if version != VERSION:
        raise MessageError(f"unsupported protocol version {version}; this build speaks {VERSION}")
    if len(msg) != _HEADER.size + n:
        raise MessageError(f"message length {len(msg)} does not match its header ({_HEADER.size + n})")
    if typ != expect:
        raise ReplayError(f"expected a {expect.name} message, got type {typ}")
    if rid != round_id:
        raise ReplayError(f"message from round {rid} replayed into round {round_id}")
    if recipient is not None and rcpt != recipient:
        raise ReplayError(f"message addressed to {rcpt} delivered to {recipient}")
    return Header(MsgType(typ), rid, sender, rcpt), Reader(memoryview(msg)[_HEADER.size:])
