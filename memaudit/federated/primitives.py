"""Federated primitives as JAX primitives, closed under differentiation.

``federated_broadcast``, ``federated_sum`` and ``federated_mean`` are
``jax.extend.core.Primitive`` s with abstract evaluation, an MLIR lowering, batching rules,
linear JVPs and transposes that bind the primitives themselves:

    transpose(broadcast) = sum,   transpose(sum) = broadcast,   transpose(mean) = broadcast / n

so ``jax.grad`` / ``jax.jacfwd`` of a federated program is again a federated program whose
only communication is these three primitives (federated AD). ``federated_map`` maps a
per-client function over the clients dim, batched (``vmap``) or sequentially inside the
program (``lax.map``, a ``shard_map`` over a ``clients`` mesh axis; the faster choice on CPU
for matmul-heavy client work; `memaudit.federated.client_loop`), see its ``strategy``;
``federated_weighted_mean`` is built from map and sum. `memaudit.federated.closure` checks
that a jaxpr (a program or its derivative) communicates only through these primitives.

On a ``clients`` x ``model`` mesh a dim split over ``model`` (a tensor-parallel weight, see
`memaudit.federated.sharding.server_shardings`) stays split through broadcast, map and the
aggregations: only the clients dim is constrained, the rest follows the input.

Every primitive carries static params ``n`` (real clients), ``n_pad`` (clients dim as laid
out, see `memaudit.federated.sharding.padded_clients`), ``axis`` and ``mesh``. Rows at or beyond
``n`` are padding: aggregations mask them, broadcast fills them, and they never reach a result.

References:
    Rush, Charles, Garrett, Ingerman, Sharma, Sreenivasan, 2024, "FAX: Scalable and
    Differentiable Federated Primitives in JAX" (arXiv:2403.07128), section 3 (federated AD).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax.extend.core import Primitive
from jax.interpreters import ad, batching, mlir

from memaudit.federated import sharding as shd
from memaudit.federated.program import ProgramContext, current_context

federated_broadcast_p = Primitive("federated_broadcast")
federated_sum_p = Primitive("federated_sum")
federated_mean_p = Primitive("federated_mean")
PRIMITIVES = (federated_broadcast_p, federated_sum_p, federated_mean_p)
PRIMITIVE_NAMES = frozenset(p.name for p in PRIMITIVES)

_LOW_PRECISION = (jnp.bfloat16, jnp.float16)


def _acc_dtype(dtype):
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
    return _sum_leading(_masked(x, n), _acc_dtype(x.dtype), mesh).astype(x.dtype)  # (*x.shape[1:])


def _mean_impl(x, *, n, n_pad, axis, mesh):
    del n_pad, axis
    total = _sum_leading(_masked(x, n), _acc_dtype(x.dtype), mesh)
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


# ---------------------------------------------------------------- public functions


def _params(ctx: ProgramContext) -> dict[str, Any]:
    return {"n": ctx.n, "n_pad": ctx.n_pad, "axis": ctx.axis, "mesh": ctx.mesh}


def _check_placed(x, ctx: ProgramContext, what: str) -> None:
    shape = jnp.shape(x)
    if not shape or shape[0] != ctx.n_pad:
        raise ValueError(
            f"{what} got shape {tuple(shape)}; a clients-placed value needs leading size "
            f"{ctx.n_pad} (clients={ctx.n}); pass one row per client"
        )


def _check_args(args: tuple, ctx: ProgramContext, what: str) -> None:
    """Every leaf of every argument of a map is clients-placed."""
    for i, a in enumerate(args):
        for leaf in jax.tree.leaves(a):
            _check_placed(leaf, ctx, f"{what} argument {i}")


def federated_broadcast(tree: Any) -> Any:
    """Server -> clients: every leaf x becomes a clients-placed (n, *x.shape) value.

    With a ``clients`` mesh axis the clients dim is sharded over it and the other dims keep
    the input's sharding. The program remembers which value each result was broadcast from,
    so that ``federated_map(..., strategy="scan")`` can read x itself instead of n copies.
    """
    ctx = current_context("federated_broadcast")
    params = _params(ctx)

    def one(x):
        x = jnp.asarray(x)
        y = federated_broadcast_p.bind(x, **params)
        ctx.broadcasts[id(y)] = (y, x)
        return y

    return jax.tree.map(one, tree)


def _broadcast_source(ctx: ProgramContext, y: Any) -> Any:
    """The server value that ``y`` was broadcast from in this program, or None."""
    hit = ctx.broadcasts.get(id(y))
    return hit[1] if hit is not None and hit[0] is y else None


def federated_sum(tree: Any) -> Any:
    """Clients -> server: sum over the clients dim of every leaf (padding excluded)."""
    ctx = current_context("federated_sum")
    params = _params(ctx)

    def one(x):
        x = jnp.asarray(x)
        _check_placed(x, ctx, "federated_sum")
        return federated_sum_p.bind(x, **params)

    return jax.tree.map(one, tree)


def federated_mean(tree: Any) -> Any:
    """Clients -> server: mean over the n real clients; keeps the input dtype (bf16 -> bf16)."""
    ctx = current_context("federated_mean")
    params = _params(ctx)

    def one(x):
        x = jnp.asarray(x)
        _check_placed(x, ctx, "federated_mean")
        if not jnp.issubdtype(x.dtype, jnp.inexact):
            raise ValueError(
                f"federated_mean needs a floating dtype, got {x.dtype}; cast with "
                ".astype(jnp.float32) or use federated_sum"
            )
        return federated_mean_p.bind(x, **params)

    return jax.tree.map(one, tree)


MAP_STRATEGIES = ("vmap", "scan", "auto")
# primitives whose batched (per-client weights) form is slow on XLA CPU: a batched dot_general
# over the clients dim runs as a loop of small GEMMs, slower than one client at a time
_HEAVY = frozenset({"dot_general", "conv_general_dilated"})


def _has_heavy_op(jaxpr) -> bool:
    jaxpr = getattr(jaxpr, "jaxpr", jaxpr)
    for eqn in jaxpr.eqns:
        if eqn.primitive.name in _HEAVY:
            return True
        for v in eqn.params.values():
            for s in v if isinstance(v, (tuple, list)) else (v,):
                if isinstance(s, (jax.extend.core.ClosedJaxpr, jax.extend.core.Jaxpr)) \
                        and _has_heavy_op(s):
                    return True
    return False


def _client_struct(x) -> jax.ShapeDtypeStruct:
    """The abstract value of one client's row of a clients-placed leaf."""
    return jax.ShapeDtypeStruct(jnp.shape(x)[1:], jnp.result_type(x))


def resolve_map_strategy(fn: Callable, args: tuple, strategy: str) -> str:
    """``"vmap"`` or ``"scan"`` for ``strategy`` (``"auto"``: see `federated_map`)."""
    if strategy not in MAP_STRATEGIES:
        raise ValueError(
            f"federated_map strategy must be one of {MAP_STRATEGIES}, got {strategy!r}"
        )
    if strategy != "auto":
        return strategy
    if jax.default_backend() != "cpu":
        return "vmap"
    try:  # trace one client's computation (abstractly, no FLOPs) and look for matmuls
        jaxpr = jax.make_jaxpr(fn)(*jax.tree.map(_client_struct, args))
    except Exception:  # noqa: BLE001 - anything fn cannot trace unbatched: keep vmap
        return "vmap"
    return "scan" if _has_heavy_op(jaxpr) else "vmap"


def federated_loop(fn: Callable, args: tuple, ctx: ProgramContext, batch_size: int | None,
                   reduce: bool) -> Any:
    """The scan strategy (`memaudit.federated.client_loop`, which builds on this module)."""
    from memaudit.federated.client_loop import federated_loop as loop

    return loop(fn, args, ctx, batch_size, reduce)


def federated_map(
    fn: Callable, *args: Any, strategy: str | None = None, batch_size: int | None = None
) -> Any:
    """Apply ``fn`` on every client, over the leading clients dim of all arguments.

    Inputs and outputs are pinned to the ``clients`` mesh axis (``spmd_axis_name``), so
    per-client work runs where the client's data lives. Pass server values through
    `federated_broadcast` first, so their derivatives stay federated.

    Execution strategies (same values, same derivatives, same federated jaxpr closure):

    - ``"vmap"``: one batched computation over all clients (best on accelerators, and for
      elementwise work);
    - ``"scan"``: clients one after the other inside the compiled program (``lax.map``; with a
      ``clients`` mesh axis, a ``shard_map`` over it, each device looping over its own
      clients). On XLA CPU a batched matmul with per-client weights is slower than plain
      matmuls, so local training runs faster this way, and a ``lax.cond`` in ``fn`` (an absent
      client skipping its work) stays a branch; ``batch_size`` > 1 runs that many clients
      vmapped per loop iteration. An argument straight from `federated_broadcast` is read as
      the one server value inside the loop, not as n copies; the derivative keeps the
      broadcast (a ``custom_jvp``), so reverse mode sums the server cotangent with
      `federated_sum`, jitted or not;
    - ``"auto"``: ``"scan"`` on the CPU backend when one client's computation contains a
      matmul or convolution, else ``"vmap"``.

    ``strategy=None`` takes the program's ``map_strategy`` (`federated_program`, default
    ``"auto"``).
    """
    ctx = current_context("federated_map")
    _check_args(args, ctx, "federated_map")
    if batch_size is not None and (not isinstance(batch_size, int) or batch_size < 1):
        raise ValueError(f"federated_map batch_size must be a positive int, got {batch_size!r}")
    how = resolve_map_strategy(fn, args, strategy or ctx.map_strategy)
    if how == "scan":
        out = federated_loop(fn, args, ctx, batch_size, reduce=False)
    else:
        out = jax.vmap(fn, spmd_axis_name=ctx.axis)(*shd.shard_clients_tree(args, ctx.mesh))
    return shd.shard_clients_tree(out, ctx.mesh)


def federated_map_sum(fn: Callable, *args: Any, strategy: str | None = None) -> Any:
    """``federated_sum(federated_map(fn, *args))``, without the clients-placed intermediate.

    Under the ``"scan"`` strategy the sum accumulates inside the loop over the clients (with a
    ``clients`` mesh axis: inside each device's loop, then a ``psum``): the per-client outputs
    (in FedAvg, one model delta per client) are never stacked, which spares zero-filling,
    writing and reading back an (n, *model) array every round. Low precision leaves accumulate
    in float32. Its derivative is the map followed by `federated_sum` (a ``custom_jvp``), so
    federated AD holds; under ``"vmap"`` it is exactly the map followed by `federated_sum`.

    The values equal the map-then-sum up to float rounding (a sequential sum over the clients
    instead of a pairwise one).
    """
    ctx = current_context("federated_map_sum")
    _check_args(args, ctx, "federated_map_sum")
    how = resolve_map_strategy(fn, args, strategy or ctx.map_strategy)
    if how != "scan":
        return federated_sum(federated_map(fn, *args, strategy=how))
    return federated_loop(fn, args, ctx, None, reduce=True)


def federated_weighted_mean(values: Any, weights: jax.Array) -> Any:
    """Clients -> server: sum_i w_i v_i / sum_i w_i for every leaf; 0 when all weights are 0.

    ``weights`` is clients-placed, shape (n,). The result keeps each leaf's dtype; the
    division happens in at least float32.
    """
    ctx = current_context("federated_weighted_mean")
    weights = jnp.asarray(weights)
    _check_placed(weights, ctx, "federated_weighted_mean weights")
    if weights.ndim != 1:
        raise ValueError(f"weights must have shape ({ctx.n},), got {weights.shape}")
    total = federated_sum(weights)
    safe = jnp.where(total > 0, total, jnp.ones((), total.dtype))

    def one(v):
        v = jnp.asarray(v)
        acc = jnp.promote_types(v.dtype, jnp.float32)
        scaled = federated_map(lambda vi, wi: vi.astype(acc) * wi.astype(acc), v, weights)
        mean = federated_sum(scaled) / safe.astype(acc)
        return jnp.where(total > 0, mean, jnp.zeros((), acc)).astype(v.dtype)

    return jax.tree.map(one, values)
