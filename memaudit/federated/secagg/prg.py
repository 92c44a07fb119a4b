"""Pseudorandom mask expansion: AES-256-CTR keystream read as uint32 words.

The hot loop of secure aggregation. One encryptor per seed; the keystream is
written with ``update_into`` into a preallocated buffer (no allocation per call)
and numpy views it as uint32 with no copy. Arithmetic on the masks is modulo
2^32 (numpy uint32 wraps). `add_masks` adds several masks in one pass over the
accumulator, chunk by chunk, so the accumulator leaves the cache once per chunk
whatever the number of masks.

Where the time goes (one core): AES-256-CTR itself runs at the speed of
encrypting a cache-resident buffer; on top of it the mod-2^32 add reads the
keystream chunk from cache and reads and writes the accumulator chunk, which for
a large accumulator comes from memory. That add is what separates a mask from
raw AES-CTR; `add_masks` amortises its memory part over the masks.
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


CHUNK_WORDS = 1 << 15  # 128 KiB of keystream per call: with its plaintext and the accumulator
# chunk it stays in a 512 KiB L2, so the add reads the keystream from cache


def _encryptor(seed: bytes):
    if len(seed) != SEED_BYTES:
        raise ValueError(f"PRG seed must be {SEED_BYTES} bytes, got {len(seed)}")
    return Cipher(algorithms.AES(seed), modes.CTR(_NONCE)).encryptor()


def add_masks(acc: np.ndarray, seeds_signs) -> None:
    """acc += sum_k sign_k * PRG(seed_k) (mod 2^32), in place, in one pass over ``acc``.

    Each chunk of ``acc`` is loaded once and every mask's keystream for that chunk is
    generated (one encryptor per seed; CTR state carries over between chunks) and added while
    both are in cache, so with k masks ``acc`` crosses the memory bus once, not k times, and
    no mask ever exists in full. Equal to k calls of `add_mask`.
    """
    if acc.dtype != np.uint32 or acc.ndim != 1 or not acc.flags.c_contiguous:
        raise ValueError(f"masks add into a contiguous 1-d uint32 array, got {acc.dtype} "
                         f"{acc.shape}; use np.ascontiguousarray(x, dtype=np.uint32).ravel()")
    ops = [(_encryptor(seed).update_into, np.add if sign > 0 else np.subtract)
           for seed, sign in seeds_signs]
    if not ops:
        return
    d = acc.shape[0]
    buf = _scratch(CHUNK_WORDS)
    view = memoryview(buf).cast("B")
    full = buf[:CHUNK_WORDS]
    zeros = _zeros(4 * CHUNK_WORDS)
    stop = d - d % CHUNK_WORDS
    for start in range(0, stop, CHUNK_WORDS):  # full chunks: no per-chunk slicing of buffers
        part = acc[start:start + CHUNK_WORDS]
        for update_into, op in ops:
            update_into(zeros, view)
            op(part, full, out=part)
    if stop < d:
        w = d - stop
        part, tail, z = acc[stop:], buf[:w], zeros[: 4 * w]
        for update_into, op in ops:
            update_into(z, view)
            op(part, tail, out=part)


def add_mask(acc: np.ndarray, seed: bytes, sign: int) -> None:
    """acc += sign * PRG(seed) (mod 2^32), in place.

    The keystream is produced in cache-sized chunks by one encryptor (CTR state carries
    over between calls) into one preallocated buffer and added while still in cache, so the
    mask never exists in full (see `add_masks` for several masks in one pass).
    """
    add_masks(acc, ((seed, sign),))


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
