"""The federated primitives' implementation: the ``jax.extend.core.Primitive`` objects and their
rules (implementation, abstract evaluation, MLIR lowering, batching, linear JVP, transpose).

The public functions that bind them (``federated_broadcast``, ``federated_map``, ...) live in
`memaudit.federated.primitives`; the scan strategy (`memaudit.federated.client_loop`) builds on
this module's public names, as drjax splits its ``impls``/``primitives`` from its ``api``.

====================  =====================  ====================  =========================
primitive             abstract eval          batching (vmap)       transpose (federated AD)
====================  =====================  ====================  =========================
federated_broadcast   x -> (n_pad, *x)       batch dim moves +1    federated_sum
federated_sum         (n_pad, *s) -> s       batch dim behind n    federated_broadcast
federated_mean        (n_pad, *s) -> s       batch dim behind n    federated_broadcast / n
====================  =====================  ====================  =========================

Every primitive is linear, so its JVP is the primitive on the tangent (``ad.deflinear2``), and
its lowering is its jnp implementation (``mlir.lower_fun``).

One more primitive moves nothing and is not communication: ``broadcast_row(x, row) -> x``, one
client's row of ``federated_broadcast(x)`` inside the scan strategy's derivative loop
(`memaudit.federated.client_loop`). Its value is the server value ``x`` itself, read as a loop
constant (the row is unused: XLA drops the broadcast), and its JVP is the row's tangent, so a
later derivative reaches ``x`` through ``federated_broadcast`` (transpose: ``federated_sum``)
rather than as a loop constant, whose cotangent reverse mode would sum over the clients in the
transposed loop's carry. Batching keeps ``x``'s batch dim.

References:
    Rush, Charles, Garrett, Ingerman, Sharma, Sreenivasan, 2024, "FAX: Scalable and
    Differentiable Federated Primitives in JAX" (arXiv:2403.07128), section 3 (federated AD).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from jax.extend.core import Primitive
from jax.interpreters import ad, batching, mlir

from memaudit.federated import sharding as shd
from memaudit.federated.program import ProgramContext

federated_broadcast_p = Primitive("federated_broadcast")
federated_sum_p = Primitive("federated_sum")
federated_mean_p = Primitive("federated_mean")
PRIMITIVES = (federated_broadcast_p, federated_sum_p, federated_mean_p)
PRIMITIVE_NAMES = frozenset(p.name for p in PRIMITIVES)

_LOW_PRECISION = (jnp.bfloat16, jnp.float16)


def acc_dtype(dtype):
    """The dtype a sum over the clients accumulates in: float32 for low-precision floats."""
    return jnp.float32 if dtype in _LOW_PRECISION else dtype


# ---------------------------------------------------------------- implementations (jnp)


def _broadcast_impl(x, *, n, n_pad, axis, mesh):
    y = jnp.broadcast_to(x, (n_pad,) + x.shape)  # (n_pad, *x.shape)
    return shd.constrain_leading(y, mesh, axis)


def _masked(x, n):
    if x.shape[0] == n:
        return x
    keep = (jnp.arange(x.shape[0]) < n).reshape((-1,) + (1,) * (x.ndim - 1))
    return jnp.where(keep, x, jnp.zeros((), x.dtype))


def _pairwise(x):
    """``sum(x, axis=0)`` by adding halves, ``x[:h] + x[h:]``, level by level."""
    while x.shape[0] > 1:
        if x.shape[0] % 2:  # odd: a zero row keeps the halves equal
            x = jnp.concatenate([x, jnp.zeros((1,) + x.shape[1:], x.dtype)], axis=0)
        half = x.shape[0] // 2
        x = x[:half] + x[half:]
    if x.shape[0] == 0:
        return jnp.zeros(x.shape[1:], x.dtype)
    return x[0]


def _sum_leading(x, dtype=None, mesh=None):
    """Sum over the leading (clients) dim, ``(n, *s) -> s``, in ``dtype`` (default x's).

    A per-client value of more than one element is summed by adding halves (pairwise
    summation, `_pairwise`). XLA:CPU runs a ``reduce`` over the leading dim of a large array
    as a slow strided loop: for 8 x 295k floats about 80 ms against 0.4 ms for the halves
    (jax 0.10, 2 cores), which made aggregating a round's deltas cost about a quarter of the
    round. The halves are plain elementwise adds, and pairwise summation is at least as
    accurate as a sequential sum. With a ``clients`` mesh axis of k devices each device adds
    the halves of its own clients (a ``shard_map`` manual over the axis, automatic over the
    others) and a ``psum`` over the axis adds the k partial sums.
    """
    if dtype is not None:
        x = x.astype(dtype)
    if x.ndim < 2:
        return jnp.sum(x, axis=0)
    k = shd.clients_axis_size(mesh)
    if k == 1 or x.shape[0] % k:
        return _pairwise(x)
    axis = shd.clients_axis(mesh)
    P = jax.sharding.PartitionSpec
    return jax.shard_map(lambda local: jax.lax.psum(_pairwise(local), axis), mesh=mesh,
                         in_specs=P(axis), out_specs=P(), axis_names=frozenset({axis}),
                         check_vma=False)(x)


def _sum_impl(x, *, n, n_pad, axis, mesh):
    del n_pad, axis
    return _sum_leading(_masked(x, n), acc_dtype(x.dtype), mesh).astype(x.dtype)  # (*x.shape[1:])


def _mean_impl(x, *, n, n_pad, axis, mesh):
    del n_pad, axis
    total = _sum_leading(_masked(x, n), acc_dtype(x.dtype), mesh)
    return (total / n).astype(x.dtype)


# ---------------------------------------------------------------- abstract evaluation


def _aval(shape, x, sharding):
    if sharding is None:
        return jax.core.ShapedArray(shape, x.dtype, weak_type=x.weak_type)
    return jax.core.ShapedArray(shape, x.dtype, weak_type=x.weak_type, sharding=sharding)


def _x_spec(x) -> tuple:
    spec = tuple(getattr(getattr(x, "sharding", None), "spec", ()) or ())
    return spec + (None,) * (len(x.shape) - len(spec))


def _broadcast_abstract(x, *, n, n_pad, axis, mesh):
    if shd.is_explicit(mesh, axis):
        spec = jax.sharding.PartitionSpec(axis, *_x_spec(x))
        sharding = jax.sharding.NamedSharding(shd.abstract(mesh), spec)
    else:  # unsharded clients dim; other dims keep the input's (explicit) sharding
        sharding = _respec(x, (None, *_x_spec(x)))
    return _aval((n_pad,) + tuple(x.shape), x, sharding)


def _respec(x, spec):
    sharding = getattr(x, "sharding", None)
    if sharding is None or not hasattr(sharding, "update"):
        return None
    return sharding.update(spec=jax.sharding.PartitionSpec(*spec))


def _reduce_abstract(x, *, n, n_pad, axis, mesh):
    if not x.shape or x.shape[0] != n_pad:
        raise ValueError(
            f"a clients-placed value needs leading size {n_pad}, got shape {tuple(x.shape)}"
        )
    if shd.is_explicit(mesh, axis):
        spec = jax.sharding.PartitionSpec(*_x_spec(x)[1:])
        sharding = jax.sharding.NamedSharding(shd.abstract(mesh), spec)
    else:
        sharding = _respec(x, _x_spec(x)[1:])
    return _aval(tuple(x.shape[1:]), x, sharding)


# ---------------------------------------------------------------- transposes (federated AD)


def _broadcast_transpose(ct, x, **params):
    assert ad.is_undefined_primal(x)
    return [federated_sum_p.bind(ct, **params)]


def _sum_transpose(ct, x, **params):
    assert ad.is_undefined_primal(x)
    return [federated_broadcast_p.bind(ct, **params)]


def _mean_transpose(ct, x, **params):
    assert ad.is_undefined_primal(x)
    return [federated_broadcast_p.bind(ct, **params) / jnp.asarray(params["n"], ct.dtype)]


# ---------------------------------------------------------------- batching (jax.vmap)


def _broadcast_batch(args, dims, **params):
    (x,), (d,) = args, dims
    # the clients dim is inserted in front, so the batch dim moves down by one
    return federated_broadcast_p.bind(x, **params), d + 1


def _reduce_batch(prim):
    def rule(args, dims, **params):
        (x,), (d,) = args, dims
        # put the batch dim right behind the clients dim: (n_pad, batch, ...)
        x = jnp.moveaxis(x, d, 1)
        return prim.bind(x, **params), 0

    return rule


for _p, _impl, _abs, _tr in (
    (federated_broadcast_p, _broadcast_impl, _broadcast_abstract, _broadcast_transpose),
    (federated_sum_p, _sum_impl, _reduce_abstract, _sum_transpose),
    (federated_mean_p, _mean_impl, _reduce_abstract, _mean_transpose),
):
    _p.def_impl(_impl)
    _p.def_abstract_eval(_abs)
    mlir.register_lowering(_p, mlir.lower_fun(_impl, multiple_results=False))
    ad.deflinear2(_p, _tr)  # JVP: the primitive on the tangent; zero cotangents stay Zero
batching.primitive_batchers[federated_broadcast_p] = _broadcast_batch
batching.primitive_batchers[federated_sum_p] = _reduce_batch(federated_sum_p)
batching.primitive_batchers[federated_mean_p] = _reduce_batch(federated_mean_p)


# ---------------------------------------------------------------- broadcast_row (no communication)

broadcast_row_p = Primitive("broadcast_row")


def _broadcast_row_jvp(primals, tangents):
    x, row = primals
    return broadcast_row_p.bind(x, row), ad.instantiate_zeros(tangents[1])


def _broadcast_row_batch(args, dims):
    return args[0], dims[0]


broadcast_row_p.def_impl(lambda x, row: x)
broadcast_row_p.def_abstract_eval(lambda x, row: x)
mlir.register_lowering(broadcast_row_p, mlir.lower_fun(lambda x, row: x, multiple_results=False))
ad.primitive_jvps[broadcast_row_p] = _broadcast_row_jvp
batching.primitive_batchers[broadcast_row_p] = _broadcast_row_batch


# ---------------------------------------------------------------- binding helpers


def cond_or_zeros(pred, fn, out: Any) -> Any:
    """``fn()`` where ``pred`` holds, zeros of ``out`` (a tree of shapes and dtypes) elsewhere,
    without running ``fn`` there (a select once vmapped): a client that does not count."""
    return jax.lax.cond(pred, fn, lambda: jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), out))


def primitive_params(ctx: ProgramContext) -> dict[str, Any]:
    """The static params every primitive binds with, from the program's context."""
    return {"n": ctx.n, "n_pad": ctx.n_pad, "axis": ctx.axis, "mesh": ctx.mesh}


def broadcast_source(ctx: ProgramContext, y: Any) -> Any:
    """The server value that ``y`` was broadcast from in this program, or None."""
    hit = ctx.broadcasts.get(id(y))
    return hit[1] if hit is not None and hit[0] is y else None


__all__ = ["PRIMITIVES", "PRIMITIVE_NAMES", "acc_dtype", "broadcast_row_p", "broadcast_source",
           "federated_broadcast_p",
           "federated_mean_p", "federated_sum_p", "primitive_params"]
