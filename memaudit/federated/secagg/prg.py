"""Pseudorandom mask expansion: AES-256-CTR keystream read as uint32 words.

The hot loop of secure aggregation. One encryptor per seed encrypts a zero
buffer of 4*d bytes in one call; numpy views the result as uint32 with no copy.
Arithmetic on the masks is modulo 2^32 (numpy uint32 wraps).
"""

from __future__ import annotations

import numpy as np
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes

SEED_BYTES = 32
_NONCE = bytes(16)  # each seed keys exactly one stream, so a fixed counter block is safe


_ZEROS = b""
_SCRATCH = np.empty(0, dtype=np.uint32)


def _zeros(nbytes: int) -> memoryview:
    """A cached all-zero plaintext of at least ``nbytes`` (allocated and paged in once)."""
    global _ZEROS
    if len(_ZEROS) < nbytes:
        _ZEROS = bytes(nbytes)
    return memoryview(_ZEROS)[:nbytes]


def _scratch(d: int) -> np.ndarray:
    """A reusable uint32 buffer of d + 4 words (update_into needs 15 bytes of slack)."""
    global _SCRATCH
    if _SCRATCH.shape[0] < d + 4:
        _SCRATCH = np.zeros(d + 4, dtype=np.uint32)
    return _SCRATCH


def _keystream_into(seed: bytes, out: np.ndarray, d: int) -> None:
    if len(seed) != SEED_BYTES:
        raise ValueError(f"PRG seed must be {SEED_BYTES} bytes, got {len(seed)}")
    enc = Cipher(algorithms.AES(seed), modes.CTR(_NONCE)).encryptor()
    n = enc.update_into(_zeros(4 * d), memoryview(out).cast("B"))
    assert n == 4 * d


def expand(seed: bytes, d: int) -> np.ndarray:
    """Expand a 32-byte seed into ``d`` uniform uint32 words (AES-256-CTR keystream), a new array.

    >>> m = expand(bytes(32), 4); m.dtype, m.shape
    (dtype('uint32'), (4,))
    """
    out = np.empty(d + 4, dtype=np.uint32)
    _keystream_into(seed, out, d)
    return out[:d]


CHUNK_WORDS = 1 << 16  # 256 KiB of keystream per call: stays in cache (L2) for the add


def add_mask(acc: np.ndarray, seed: bytes, sign: int) -> None:
    """acc += sign * PRG(seed) (mod 2^32), in place.

    The keystream is produced in cache-sized chunks by one encryptor (CTR state carries
    over between calls) and added while still in cache, so the mask never exists in full.
    """
    if len(seed) != SEED_BYTES:
        raise ValueError(f"PRG seed must be {SEED_BYTES} bytes, got {len(seed)}")
    d = acc.shape[0]
    enc = Cipher(algorithms.AES(seed), modes.CTR(_NONCE)).encryptor()
    buf = _scratch(CHUNK_WORDS)
    view = memoryview(buf).cast("B")
    zeros = _zeros(4 * CHUNK_WORDS)
    op = np.add if sign > 0 else np.subtract
    for start in range(0, d, CHUNK_WORDS):
        w = min(CHUNK_WORDS, d - start)
        enc.update_into(zeros[: 4 * w], view)
        part = acc[start:start + w]
        op(part, buf[:w], out=part)


def raw_aes_ctr_throughput(nbytes: int = 1 << 26, repeats: int = 3) -> float:
    """Bytes per second of one AES-256-CTR call on a zero buffer of ``nbytes`` (best of repeats).

    With a large buffer this is memory-bound; with a cache-sized one it is AES compute."""
    import time

    zeros = bytes(nbytes)
    out = bytearray(nbytes + 15)
    best = float("inf")
    for _ in range(repeats):
        enc = Cipher(algorithms.AES(bytes(32)), modes.CTR(_NONCE)).encryptor()
        t0 = time.perf_counter()
        enc.update_into(zeros, out)
        best = min(best, time.perf_counter() - t0)
    return nbytes / best
