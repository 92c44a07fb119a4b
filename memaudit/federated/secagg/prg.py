"""Pseudorandom mask expansion: AES-256-CTR keystream read as uint32 words.

The hot loop of secure aggregation. Each seed keys one AES-256-CTR stream (all-zero initial
counter block); its keystream, read as native-endian uint32 words, is the mask. Arithmetic
on the masks is modulo 2^32 (uint32 wraps). `add_masks` adds several masks into an
accumulator in one pass, so no mask ever exists in full.

Two implementations give identical sums:

- **native** (``_maskadd``, a C extension built at install with OpenSSL's libcrypto, the
  library `cryptography` itself runs on): for every 8 KiB piece of the accumulator, each
  mask's keystream for that piece is generated into an L1-resident buffer and added at once,
  with the GIL released. The accumulator's piece stays in L1 for all masks, and a long sum
  is split into slices masked on several threads at once, each slice's keystream starting at
  its own CTR block (``threads``, default `mask_threads`).
- **numpy** (the fallback where the extension could not be built: no C compiler or no
  OpenSSL headers): ``cryptography``'s ``update_into`` writes 256 KiB of keystream into a
  per-thread scratch buffer and numpy adds it in a second pass over L2-resident data; that
  add costs about a quarter of the cipher's time.

Measured on the 2-core AMD EPYC this was tuned on (benchmarks/secagg_overhead.py, 10M words,
one thread): eight masks per pass run at ~0.82-0.87 of raw AES-256-CTR throughput natively
(sixteen at ~0.87), ~0.76-0.78 with numpy; one mask into an accumulator in memory at ~0.67-0.73
and ~0.63-0.67. With both cores, eight masks run at ~1.2-1.5x the one-thread raw cipher.
"""

from __future__ import annotations

import mmap
import os
import threading
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor

import numpy as np
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes

try:  # the fused C path; absent when the install had no C compiler or OpenSSL headers
    from memaudit.federated.secagg import _maskadd as _native
except ImportError:  # pragma: no cover - depends on the build machine
    _native = None

NATIVE = _native is not None

# Native masking splits a call over threads when it expands at least PARALLEL_MIN_WORDS words
# of keystream (all masks together), into slices of at least MIN_SLICE_WORDS words of the sum;
# below either, handing slices to threads costs more than it saves.
PARALLEL_MIN_WORDS = 1 << 20
MIN_SLICE_WORDS = 1 << 13


def mask_threads() -> int:
    """Threads for native masking: ``OMP_NUM_THREADS`` when set (as the sweep sets it for each
    of its concurrent points), else the CPUs this process may run on."""
    env = os.environ.get("OMP_NUM_THREADS", "")
    if env.isdigit() and int(env) > 0:
        return int(env)
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


_pool: ThreadPoolExecutor | None = None
_pool_size = 0
_pool_lock = threading.Lock()


def thread_pool(threads: int) -> ThreadPoolExecutor:
    """A process-wide pool of at least ``threads`` workers (grown, never shrunk) for native
    masking, which releases the GIL."""
    global _pool, _pool_size
    with _pool_lock:
        if _pool is None or _pool_size < threads:
            old = _pool
            _pool, _pool_size = ThreadPoolExecutor(threads, "memaudit-mask"), threads
            if old is not None:
                old.shutdown(wait=False)  # work already handed to it still runs
        return _pool

SEED_BYTES = 32
_NONCE = bytes(16)  # each seed keys exactly one stream, so a fixed counter block is safe
_SLACK_WORDS = 4  # update_into wants block_size - 1 = 15 spare output bytes

CHUNK_WORDS = 1 << 16  # 256 KiB of keystream per update_into, added while still in L2; the two
# Python-level calls per chunk (~1 us) cost ~3% of its AES time. 128 KiB and 512 KiB measured
# the same on a 512 KiB-L2 machine; much smaller chunks pay more in calls


_zero_pt: memoryview = memoryview(b"")


def _zeros(nbytes: int) -> memoryview:
    """A cached all-zero plaintext of at least ``nbytes`` bytes.

    On POSIX it is a read-only private anonymous mapping: never written, every page is the
    kernel's shared zero page, so the cipher reads one physical page whatever ``nbytes``.
    """
    global _zero_pt
    if len(_zero_pt) < nbytes:
        size = max(nbytes, 4 * CHUNK_WORDS)
        if hasattr(mmap, "MAP_PRIVATE"):  # private: a shared anonymous mapping would allocate
            _zero_pt = memoryview(mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ))
        else:
            _zero_pt = memoryview(bytes(size))
    return _zero_pt[:nbytes]


_local = threading.local()  # the scratch buffer is per thread: numpy releases the GIL in add


def _scratch() -> tuple[np.ndarray, memoryview]:
    """This thread's keystream buffer: CHUNK_WORDS + slack uint32 words and a byte view."""
    s = getattr(_local, "scratch", None)
    if s is None:
        buf = np.zeros(CHUNK_WORDS + _SLACK_WORDS, dtype=np.uint32)
        s = _local.scratch = (buf, memoryview(buf).cast("B"))
    return s


def _encryptor(seed: bytes):
    if len(seed) != SEED_BYTES:
        raise ValueError(f"PRG seed must be {SEED_BYTES} bytes, got {len(seed)}")
    return Cipher(algorithms.AES(seed), modes.CTR(_NONCE)).encryptor()


def _keystream_into(seed: bytes, out: np.ndarray, d: int) -> None:
    """Write the first ``d`` keystream words of ``seed`` into ``out`` (>= d + 4 words)."""
    n = _encryptor(seed).update_into(_zeros(4 * d), memoryview(out).cast("B"))
    assert n == 4 * d


def expand(seed: bytes, d: int) -> np.ndarray:
    """Expand a 32-byte seed into ``d`` uniform uint32 words (AES-256-CTR keystream), a new array.

    >>> m = expand(bytes(32), 4); m.dtype, m.shape
    (dtype('uint32'), (4,))
    """
    out = np.empty(d + _SLACK_WORDS, dtype=np.uint32)
    _keystream_into(seed, out, d)
    return out[:d]


def add_masks(acc: np.ndarray, seeds_signs: Iterable[tuple[bytes, int]], *,
              native: bool | None = None, threads: int | None = None) -> None:
    """acc += sum_k sign_k * PRG(seed_k) (mod 2^32), in place, in one pass over ``acc``.

    Each piece of ``acc`` is loaded once and every mask's keystream for that piece is
    generated (one cipher per seed; the CTR state carries over between pieces) and added,
    or subtracted, while both are in cache, so with k masks ``acc`` crosses the memory bus
    once, not k times, and no mask ever exists in full. Equal to k calls of `add_mask`;
    uint32 wrap-around is exactly arithmetic mod 2^32.

    Args:
        acc: contiguous 1-d uint32 accumulator, updated in place.
        seeds_signs: (32-byte seed, sign) pairs; sign > 0 adds the mask, otherwise subtracts.
        native: ``None`` uses the C extension when it was built, else numpy; ``True``
            requires the extension; ``False`` forces the numpy path. The sums are identical.
        threads: the native path splits the sum into this many slices masked at once (each
            slice's keystream starts at its own CTR block) when the call expands at least
            ``PARALLEL_MIN_WORDS`` words of keystream; default `mask_threads`. The numpy path
            always runs in the calling thread.
    """
    if acc.dtype != np.uint32 or acc.ndim != 1 or not acc.flags.c_contiguous:
        raise ValueError(f"masks add into a contiguous 1-d uint32 array, got {acc.dtype} "
                         f"{acc.shape}; use np.ascontiguousarray(x, dtype=np.uint32).ravel()")
    pairs = list(seeds_signs)
    for seed, _ in pairs:
        if len(seed) != SEED_BYTES:
            raise ValueError(f"PRG seed must be {SEED_BYTES} bytes, got {len(seed)}")
    if native is None:
        native = NATIVE
    if native:
        if _native is None:
            raise RuntimeError("memaudit's C mask extension was not built (it needs a C compiler "
                               "and the OpenSSL headers at install); use native=False")
        if not acc.flags.writeable or not acc.flags.aligned:
            raise ValueError("masks add into a writeable, aligned uint32 array")
        if not pairs:
            return
        keys = b"".join(seed for seed, _ in pairs)
        signs = bytes(1 if sign > 0 else 0 for _, sign in pairs)
        d = acc.shape[0]
        t = mask_threads() if threads is None else max(1, int(threads))
        t = min(t, d // MIN_SLICE_WORDS)
        if t <= 1 or d * len(pairs) < PARALLEL_MIN_WORDS:
            _native.add_masks(acc, keys, signs)
            return
        step = -(-d // (4 * t)) * 4  # ceil(d / t) rounded up to whole 16-byte CTR blocks
        for _ in thread_pool(t).map(  # waits for every slice; re-raises a slice's error
                lambda a: _native.add_masks(acc[a:a + step], keys, signs, a // 4),
                range(0, d, step)):
            pass
        return
    _add_masks_numpy(acc, pairs)


def _add_masks_numpy(acc: np.ndarray, pairs: list[tuple[bytes, int]]) -> None:
    """`add_masks` with cryptography's ``update_into`` and numpy: CHUNK_WORDS of keystream
    into this thread's scratch buffer, then a numpy add while it is still in L2."""
    ops = [(_encryptor(seed).update_into, np.add if sign > 0 else np.subtract)
           for seed, sign in pairs]
    if not ops:
        return
    d = acc.shape[0]
    buf, view = _scratch()
    full = buf[:CHUNK_WORDS]  # (CHUNK_WORDS,) keystream words of the current chunk
    zeros = _zeros(4 * CHUNK_WORDS)
    stop = d - d % CHUNK_WORDS
    for start in range(0, stop, CHUNK_WORDS):  # full chunks: no per-chunk slicing of buffers
        part = acc[start:start + CHUNK_WORDS]
        for update_into, op in ops:
            update_into(zeros, view)
            op(part, full, part)
    if stop < d:
        w = d - stop
        part, tail, z = acc[stop:], buf[:w], zeros[: 4 * w]
        for update_into, op in ops:
            update_into(z, view)
            op(part, tail, part)


def add_mask(acc: np.ndarray, seed: bytes, sign: int, *, native: bool | None = None,
             threads: int | None = None) -> None:
    """acc += sign * PRG(seed) (mod 2^32), in place (`add_masks` with one mask)."""
    add_masks(acc, ((seed, sign),), native=native, threads=threads)

