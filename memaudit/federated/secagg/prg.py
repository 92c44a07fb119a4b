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


def expand(seed: bytes, d: int) -> np.ndarray:
    """Expand a 32-byte seed into ``d`` uniform uint32 words (AES-256-CTR keystream).

    >>> m = expand(bytes(32), 4); m.dtype, m.shape
    (dtype('uint32'), (4,))
    """
    if len(seed) != SEED_BYTES:
        raise ValueError(f"PRG seed must be {SEED_BYTES} bytes, got {len(seed)}")
    enc = Cipher(algorithms.AES(seed), modes.CTR(_NONCE)).encryptor()
    buf = bytearray(4 * d + 15)  # update_into needs block_size - 1 bytes of slack
    n = enc.update_into(bytes(4 * d), buf)
    assert n == 4 * d
    return np.frombuffer(buf, dtype=np.uint32, count=d)


def add_mask(acc: np.ndarray, seed: bytes, sign: int) -> None:
    """acc += sign * PRG(seed) (mod 2^32), in place."""
    mask = expand(seed, acc.shape[0])
    if sign > 0:
        np.add(acc, mask, out=acc)
    else:
        np.subtract(acc, mask, out=acc)


def raw_aes_ctr_throughput(nbytes: int = 1 << 26, repeats: int = 3) -> float:
    """Bytes per second of AES-256-CTR on a zero buffer (the PRG's upper limit)."""
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
