"""What one federated client does to its own model delta before it leaves: clip, measure, flatten,
encode for a secure sum, add its share of distributed noise.

The bottom of memaudit.federated: it imports no other memaudit module, so that the in-process
wrappers (`memaudit.federated.dp`, `memaudit.federated.secagg.aggregator`,
`memaudit.federated.ddp`, over `memaudit.federated.updates.LocalUpdates`) and a node holding
its users' rows (`memaudit.federated.secagg.remote`) run the same code on the same bits.

Per-client step parameters are frozen dataclasses that also have a wire form (a plain dict, sent
to the nodes): :class:`ClientStep` (the clips an outer aggregator asks for and whether the clip
indicator rides along), :class:`DDGEncoding` (the distributed discrete Gaussian's client side);
secure aggregation's :class:`memaudit.federated.secagg.quantise.SecAggEncoding` has the same
shape (:class:`Encoding`).

References:
    McMahan, Ramage, Talwar, Zhang, ICLR 2018 (per-user clipping); Andrew et al., NeurIPS 2021
    (the clip indicators); Kairouz, Liu, Steinke, ICML 2021 (rotation, conditional rounding,
    the distributed discrete Gaussian); Canonne, Kamath, Steinke, NeurIPS 2020 (the sampler).

>>> import jax.numpy as jnp
>>> clipped, norms = clip_deltas(jnp.array([[3.0, 4.0], [0.3, 0.4]]), jnp.float32(1.0))
>>> [round(float(v), 3) for v in norms], [round(float(v), 3) for v in clipped[0]]
([5.0, 0.5], [0.6, 0.8])
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
import os
import struct
from collections.abc import Sequence
from typing import Any, Protocol

import jax
import jax.numpy as jnp
import numpy as np

PyTree = Any
SLOT_SALT = b"memaudit-secagg-slot-v1"


# ------------------------------------------------------------------ norms and clipping
def tree_norm(delta: PyTree) -> jax.Array:
    """() float32 L2 norm of one client's whole delta pytree, its squares summed in float32: the
    loop computes it once a client, for the round's delta-norm metric and DP-FedAvg's clip."""
    return jnp.sqrt(sum(jnp.sum(jnp.square(x.astype(jnp.float32))) for x in jax.tree.leaves(delta)))


def global_norms(deltas: PyTree) -> jax.Array:
    """(n,) L2 norm of each client's whole delta pytree.

    Concrete rows (secure aggregation's clips, in this process or on the node that holds the
    rows) are normed one row at a time (`row_norms`), so a client's norm, and so its clipped and
    encoded row, is the same whichever rows share its array: XLA's reduction of a (k, d) array
    sums in an order that depends on k, and one ulp of a norm changed the quantised rows of a
    client a node held with 0-2 others, and the secure sum of a DP run on 4 SuperNodes. Traced
    rows (inside a jitted program) keep XLA's reduction."""
    leaves = jax.tree.leaves(deltas)
    if _concrete(leaves):
        return jnp.asarray(row_norms(leaves))
    sq = [jnp.sum(jnp.reshape(x, (x.shape[0], -1)).astype(jnp.float32) ** 2, axis=1) for x in leaves]
    return jnp.sqrt(sum(sq))


def _concrete(values: Sequence[Any]) -> bool:
    """No value is traced (all can be read on the host, as numpy)."""
    return not any(isinstance(x, jax.core.Tracer) for x in values)


def row_norms(leaves: Sequence[Any]) -> np.ndarray:
    """(k,) float32 L2 norm of each row's leaves together, each row summed on its own in float64
    (``einsum`` accumulates in float64 without a float64 copy of the row): the same value for a
    row whatever its neighbours.

    >>> a = np.array([[3.0, 0.0], [0.3, 0.0]], np.float32)
    >>> [round(float(v), 3) for v in row_norms([a, np.array([[4.0], [0.4]], np.float32)])]
    [5.0, 0.5]
    """
    arrs = [np.asarray(x) for x in leaves]
    k = arrs[0].shape[0]
    sq = np.zeros(k, np.float64)
    for a in arrs:
        rows = a.reshape(k, -1)
        for i in range(k):
            sq[i] += np.einsum("j,j->", rows[i], rows[i], dtype=np.float64)
    return np.sqrt(sq).astype(np.float32)


def clip_deltas(deltas: PyTree, clip: jax.Array) -> tuple[PyTree, jax.Array]:
    """Scale each client's delta to global norm <= clip; returns (clipped, norms).

    Concrete rows (secure aggregation's clips, in this process or on the node that holds the
    rows) are clipped in numpy: the same float32 operations, and no XLA program for each count
    of rows. Eager ``jnp`` compiled each of its operations for every new count a node held:
    0.25-0.35 s for the tiny model's 21 leaves (0.75-0.9 s on 4 SuperNodes sharing 2 cores), in
    the masked-input step of a DP round whenever the draw first gave a node that many users."""
    leaves = jax.tree.leaves(deltas)
    if _concrete([*leaves, clip]):
        norms = row_norms(leaves)
        factor = np.minimum(np.float32(1.0), np.float32(clip) / np.maximum(norms, np.float32(1e-30)))

        def scaled(x: Any) -> np.ndarray:
            x = np.asarray(x)
            return x * factor.reshape((-1,) + (1,) * (x.ndim - 1)).astype(x.dtype)

        return jax.tree.map(scaled, deltas), norms
    norms = global_norms(deltas)
    factor = jnp.minimum(1.0, clip / jnp.maximum(norms, 1e-30))  # clip = inf -> 1
    clipped = jax.tree.map(
        lambda x: x * factor.reshape((-1,) + (1,) * (x.ndim - 1)).astype(x.dtype), deltas)
    return clipped, norms


def within(leaves: Sequence[Any], clip: float) -> np.ndarray:
    """1[global L2 norm <= clip] per client row, as DP-FedAvg computes it (float32), in numpy
    (`row_norms`: no XLA program for each count of rows)."""
    return row_norms(list(leaves)) <= np.float32(clip)


def with_bits(q: np.ndarray, bits: Any) -> np.ndarray:
    """Encoded rows (k, d) uint32 with each client's indicator appended: (k, d + 1)."""
    return np.concatenate([q, np.asarray(bits).astype(np.uint32).reshape(-1, 1)], axis=1)


def flatten_clients(deltas: PyTree) -> tuple[np.ndarray, Any]:
    """(n, d) float rows (float32 kept as is) and a map from a (d,) vector back to one pytree."""
    leaves, tdef = jax.tree.flatten(deltas)
    arrs = [np.asarray(x) for x in leaves]
    arrs = [a if a.dtype in (np.float32, np.float64) else a.astype(np.float64) for a in arrs]
    n = arrs[0].shape[0]
    rows = np.concatenate([a.reshape(n, -1) for a in arrs], axis=1)
    shapes = [(a.shape[1:], np.asarray(x).dtype) for a, x in zip(arrs, leaves, strict=True)]

    def unflatten(v: np.ndarray) -> PyTree:
        out, o = [], 0
        for shape, dtype in shapes:
            size = int(np.prod(shape))
            out.append(jnp.asarray(v[o:o + size].reshape(shape), dtype=dtype))
            o += size
        return jax.tree.unflatten(tdef, out)

    return rows, unflatten


@dataclasses.dataclass(frozen=True)
class ClientStep:
    """What each client does to its delta before encoding: scale to global L2 norm <= each of
    ``clips`` in turn, and (``count`` not None) append 1[‖Δ‖ <= count] of the delta before
    the clips to its encoded row, for the secure sum to count."""

    clips: tuple[float, ...] = ()
    count: float | None = None

    def then_clip(self, clip: Any, *, count: bool = False) -> ClientStep:
        return ClientStep((*self.clips, float(clip)), float(clip) if count else self.count)

    def apply(self, leaves: Sequence[Any]) -> list[Any]:
        """The clips, on a list of (k, ...) leaves."""
        return self._clip(leaves)[0]

    def apply_counted(self, leaves: Sequence[Any]) -> tuple[list[Any], np.ndarray | None]:
        """The clips on concrete (k, ...) leaves and, with ``count``, each row's bit
        1[‖Δ‖ <= count] of the delta before them (None without): `apply` and `within`, with the
        rows normed once. The first clip's norms are those of the rows before the clips, the
        same `row_norms` that `within` took again (1.7-1.9 ms a row of the `tiny` model's 1.79M
        parameters, 2 cores)."""
        clipped, first = self._clip(leaves)
        if self.count is None:
            return clipped, None
        norms = row_norms(list(leaves)) if first is None else np.asarray(first)
        return clipped, norms <= np.float32(self.count)

    def _clip(self, leaves: Sequence[Any]) -> tuple[list[Any], Any]:
        """The clipped leaves, and the first clip's norms (None without clips)."""
        leaves, first = list(leaves), None
        for c in self.clips:
            leaves, norms = clip_deltas(leaves, jnp.asarray(c, jnp.float32))
            first = norms if first is None else first
        return list(leaves), first

    def to_wire(self) -> dict[str, Any]:
        return {"pre": [["clip", c] for c in self.clips], "count": self.count}

    @classmethod
    def from_wire(cls, d: dict[str, Any]) -> ClientStep:
        ops = [str(op) for op, _ in d.get("pre") or ()]
        if any(op != "clip" for op in ops):
            raise ValueError(f"unknown per-client transform {next(op for op in ops if op != 'clip')!r}")
        count = d.get("count")
        return cls(tuple(float(v) for _, v in d.get("pre") or ()), None if count is None else float(count))


# ------------------------------------------------------------------ per-slot randomness
def slot_seed(key: Any, seed: int | None, rnd: int, slot: int) -> str:
    """The seed (hex) of cohort slot ``slot``'s rounding in round ``rnd`` (its noise share comes
    from the client's own secret, :func:`fresh_secret`):
    sha256 over a salt, ``seed``, the round, the slot and the round key's data (one-way: the
    seed does not reveal the key)."""
    data = np.asarray(jax.random.key_data(key)).tobytes() if key is not None else b""
    head = SLOT_SALT + str(seed).encode() + struct.pack(">QQ", int(rnd), int(slot))
    return hashlib.sha256(head + data).hexdigest()


def slot_rng(seed: str) -> np.random.Generator:
    return np.random.default_rng(int(seed, 16))


def fresh_secret() -> bytes:
    """32 bytes of OS entropy: a client's own secret for its noise share, drawn where the
    client runs (in this process, or on the node that holds its rows), never derived from
    anything the server holds or sends."""
    return os.urandom(32)


def secret_rng(secret: bytes) -> np.random.Generator:
    return np.random.default_rng(int.from_bytes(secret, "big"))


class Encoding(Protocol):
    """A client-side encoding for a secure sum (frozen; its wire form goes to the nodes)."""

    def encode(self, rows: np.ndarray, rngs: Sequence[np.random.Generator]) -> np.ndarray:
        """(k, d) float rows -> (k, width(d)) uint32, row i from ``rngs[i]`` only."""

    def width(self, dim: int) -> int:
        """Length of an encoded row for a delta of ``dim`` parameters."""

    def to_wire(self) -> dict[str, Any]: ...


def encode_rows(encoding: Encoding, rows: np.ndarray, seeds: Sequence[str]) -> np.ndarray:
    """The clients' integer inputs to the secure sum, one row per client, each from its own
    slot's generator."""
    return encoding.encode(rows, [slot_rng(s) for s in seeds])


# ------------------------------------------------------------------ rotation
def hadamard(x: np.ndarray) -> np.ndarray:
    """Orthonormal fast Walsh-Hadamard transform over the last dim (a power of 2); H H = I."""
    x = np.array(x, dtype=np.float64, copy=True)
    d = x.shape[-1]
    if d & (d - 1):
        raise ValueError(f"Hadamard transform needs a power-of-two length, got {d}")
    lead = x.shape[:-1]
    h = 1
    while h < d:
        y = x.reshape(*lead, d // (2 * h), 2, h)
        a, b = y[..., 0, :], y[..., 1, :]
        x = np.stack([a + b, a - b], axis=-2).reshape(*lead, d)
        h *= 2
    return x / math.sqrt(d)


def padded_dim(d: int) -> int:
    return 1 << max(0, (d - 1).bit_length())


def _signs(seed: int, D: int) -> np.ndarray:
    return np.random.default_rng([7, seed]).choice(np.array([-1.0, 1.0]), size=D)


def rotate(x: np.ndarray, *, seed: int) -> np.ndarray:
    """H D x over the last dim, zero-padded to a power of two (D: random signs from ``seed``)."""
    d = x.shape[-1]
    D = padded_dim(d)
    pad = np.zeros((*x.shape[:-1], D))
    pad[..., :d] = x
    return hadamard(pad * _signs(seed, D))


def unrotate(y: np.ndarray, *, seed: int, dim: int) -> np.ndarray:
    """Inverse of :func:`rotate`: D H y, truncated to the first ``dim`` coordinates."""
    return (hadamard(y) * _signs(seed, y.shape[-1]))[..., :dim]


# ------------------------------------------------------------------ rounding and noise shares
def stochastic_round(x: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """Unbiased rounding to integers: floor(x) + Bernoulli(frac(x)), as int64."""
    f = np.floor(x)
    return (f + (rng.random(x.shape) < (x - f))).astype(np.int64)


def conditional_round(x: np.ndarray, bound: float, rng: np.random.Generator, max_tries: int = 1000) -> np.ndarray:
    """Stochastic rounding of a (D,) vector, repeated until its L2 norm is <= ``bound``."""
    for _ in range(max_tries):
        r = stochastic_round(x, rng)
        if float(np.dot(r, r)) <= bound * bound:
            return r
    raise RuntimeError(f"conditional rounding did not meet the norm bound {bound:.3g} in {max_tries} "
                       "tries; increase beta")


def sample_discrete_gaussian(sigma: float, size: int | tuple, rng: np.random.Generator) -> np.ndarray:
    """Vectorised CKS 2020 Algorithm 3: discrete Laplace proposals with rejection (float64 exp).

    Proposal Y ~ Lap_Z(t), t = floor(σ)+1 (difference of two geometrics), accepted with
    probability exp(-(|Y| - σ²/t)² / (2σ²)).
    """
    if sigma == 0:
        return np.zeros(size, dtype=np.int64)
    if not sigma > 0:
        raise ValueError(f"discrete Gaussian sigma must be >= 0, got {sigma}")
    shape = (size,) if isinstance(size, int) else tuple(size)
    n = int(np.prod(shape))
    out = np.empty(n, dtype=np.int64)
    t = math.floor(sigma) + 1
    p = -math.expm1(-1.0 / t)  # success probability of the geometric
    filled = 0
    while filled < n:
        m = int((n - filled) * 1.6) + 16  # acceptance >= ~0.6 for sigma >= 0.5
        y = (rng.geometric(p, m) - rng.geometric(p, m)).astype(np.int64)
        acc = rng.random(m) < np.exp(-((np.abs(y) - sigma ** 2 / t) ** 2) / (2 * sigma ** 2))
        y = y[acc][: n - filled]
        out[filled:filled + len(y)] = y
        filled += len(y)
    return out.reshape(shape)


@dataclasses.dataclass(frozen=True)
class DDGEncoding:
    """One round's public client parameters of the distributed discrete Gaussian (DDGauss):
    clip norm, scale γ, the rotation seed, the rounded norm bound Δ₂, each client's noise
    share std and the modulus bits."""

    clip: float
    gamma: float
    rot_seed: int
    l2: float
    local_std: float
    bits: int

    def width(self, dim: int) -> int:
        return padded_dim(dim)

    def encode(self, rows: np.ndarray, rngs: Sequence[np.random.Generator],
               noise_rngs: Sequence[np.random.Generator] | None = None) -> np.ndarray:
        """Each client's DDGauss input: clip its row to ``clip``, scale by 1/γ, rotate (the
        round's public ``rot_seed``), round conditionally to norm <= Δ₂, add its discrete-Gaussian
        share of std ``local_std`` and reduce mod 2^bits. Row i rounds with ``rngs[i]`` (its
        slot's generator, reproducible on the node that holds it) and draws its noise share
        from ``noise_rngs[i]``, by default a generator keyed by the client's own fresh secret
        (:func:`fresh_secret`): the server, which can derive the slot seeds, cannot recompute
        the noise and subtract it (issue 29, Found-3)."""
        if noise_rngs is None:
            noise_rngs = [secret_rng(fresh_secret()) for _ in range(len(rows))]
        rows = np.asarray(rows, dtype=np.float64)
        n, _d = rows.shape
        norms = np.linalg.norm(rows, axis=1, keepdims=True)
        scaled = rows * np.minimum(1.0, self.clip / np.maximum(norms, 1e-300)) / self.gamma
        rotated = rotate(scaled, seed=int(self.rot_seed))  # (n, D)
        M, D = 2 ** int(self.bits), rotated.shape[1]
        enc = np.empty((n, D), dtype=np.uint32)
        for i in range(n):
            z = (conditional_round(rotated[i], self.l2, rngs[i])
                 + sample_discrete_gaussian(self.local_std, D, noise_rngs[i]))
            enc[i] = np.mod(z, M).astype(np.uint32)
        return enc

    def to_wire(self) -> dict[str, Any]:
        return {"kind": "ddp", **dataclasses.asdict(self)}

    @classmethod
    def from_wire(cls, d: dict[str, Any]) -> DDGEncoding:
        return cls(clip=float(d["clip"]), gamma=float(d["gamma"]), rot_seed=int(d["rot_seed"]),
                   l2=float(d["l2"]), local_std=float(d["local_std"]), bits=int(d["bits"]))


def ddp_encode(rows: np.ndarray, spec: DDGEncoding | dict, rngs: list[np.random.Generator]) -> np.ndarray:
    """:meth:`DDGEncoding.encode` (``spec`` in its wire form also accepted)."""
    enc = spec if isinstance(spec, DDGEncoding) else DDGEncoding.from_wire(spec)
    return enc.encode(rows, rngs)


__all__ = [
    "SLOT_SALT",
    "ClientStep",
    "DDGEncoding",
    "Encoding",
    "clip_deltas",
    "conditional_round",
    "ddp_encode",
    "encode_rows",
    "flatten_clients",
    "fresh_secret",
    "global_norms",
    "hadamard",
    "padded_dim",
    "rotate",
    "row_norms",
    "sample_discrete_gaussian",
    "secret_rng",
    "slot_rng",
    "slot_seed",
    "stochastic_round",
    "unrotate",
    "with_bits",
    "within",
]
