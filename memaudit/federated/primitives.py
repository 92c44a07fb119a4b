"""Federated primitives as JAX primitives, closed under differentiation: the public functions.

``federated_broadcast``, ``federated_sum`` and ``federated_mean`` are
``jax.extend.core.Primitive`` s with abstract evaluation, an MLIR lowering, batching rules,
linear JVPs and transposes that bind the primitives themselves:

    transpose(broadcast) = sum,   transpose(sum) = broadcast,   transpose(mean) = broadcast / n

(the Primitive objects and their rules: `memaudit.federated.primitives_impl`),
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

from memaudit.federated import sharding as shd
from memaudit.federated.client_loop import federated_loop
from memaudit.federated.primitives_impl import (
    PRIMITIVE_NAMES,
    PRIMITIVES,
    cond_or_zeros,
    federated_broadcast_p,
    federated_mean_p,
    federated_sum_p,
    primitive_params,
)
from memaudit.federated.program import ClientsCountError, ProgramContext, current_context

# ---------------------------------------------------------------- public functions


def _check_placed(x, ctx: ProgramContext, what: str) -> None:
    shape = jnp.shape(x)
    if not shape or shape[0] != ctx.n_pad:
        raise ClientsCountError(
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
    params = primitive_params(ctx)

    def one(x):
        x = jnp.asarray(x)
        y = federated_broadcast_p.bind(x, **params)
        ctx.broadcasts[id(y)] = (y, x)
        return y

    return jax.tree.map(one, tree)


def federated_sum(tree: Any) -> Any:
    """Clients -> server: sum over the clients dim of every leaf (padding excluded)."""
    ctx = current_context("federated_sum")
    params = primitive_params(ctx)

    def one(x):
        x = jnp.asarray(x)
        _check_placed(x, ctx, "federated_sum")
        return federated_sum_p.bind(x, **params)

    return jax.tree.map(one, tree)


def federated_mean(tree: Any) -> Any:
    """Clients -> server: mean over the n real clients; keeps the input dtype (bf16 -> bf16)."""
    ctx = current_context("federated_mean")
    params = primitive_params(ctx)

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
# primitives whose batched (per-client weights) form loses to one client at a time: on XLA CPU a
# batched dot_general over the clients dim runs as a loop of small GEMMs; on a TPU v5e (125m,
# 8 clients, f32) vmap's round took 1.31x scan's and 5x its memory, and from 350m it does not fit
# (20.3 GiB of temporaries; issue 63), while scan's per-client time is flat from 8 to 128 clients
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
    try:  # trace one client's computation (abstractly, no FLOPs) and look for matmuls
        jaxpr = jax.make_jaxpr(fn)(*jax.tree.map(_client_struct, args))
    except Exception:  # noqa: BLE001 - anything fn cannot trace unbatched: keep vmap
        return "vmap"
    return "scan" if _has_heavy_op(jaxpr) else "vmap"


def federated_map(
    fn: Callable, *args: Any, strategy: str | None = None, batch_size: int | None = None
) -> Any:
    """Apply ``fn`` on every client, over the leading clients dim of all arguments.

    Inputs and outputs are pinned to the ``clients`` mesh axis (``spmd_axis_name``), so
    per-client work runs where the client's data lives. Pass server values through
    `federated_broadcast` first, so their derivatives stay federated.

    Execution strategies (same values, same derivatives, same federated jaxpr closure):

    - ``"vmap"``: one batched computation over all clients (best for elementwise work);
    - ``"scan"``: clients one after the other inside the compiled program (``lax.map``; with a
      ``clients`` mesh axis, a ``shard_map`` over it, each device looping over its own
      clients). A batched matmul with per-client weights is slower than plain matmuls (on XLA
      CPU, and on a TPU where it also holds every client's activations at once), so local
      training runs faster this way, and a ``lax.cond`` in ``fn`` (an absent
      client skipping its work) stays a branch; ``batch_size`` > 1 runs that many clients
      vmapped per loop iteration (default: the program's ``clients_per_step`` for the values;
      a derivative's loop runs one client per step unless ``batch_size`` is given). An
      argument straight from `federated_broadcast` is read as the one server value inside
      the loop, not as n copies; the derivative keeps the broadcast (a ``custom_jvp``), so
      reverse mode sums the server cotangent with `federated_sum`, jitted or not, and to any
      order (a gradient of FedSGD rounds);
    - ``"auto"``: ``"scan"`` when one client's computation contains a matmul or convolution,
      on any backend, else ``"vmap"``.

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


def federated_map_sum(fn: Callable, *args: Any, strategy: str | None = None,
                      when: Callable | None = None) -> Any:
    """``federated_sum(federated_map(fn, *args))``, without the clients-placed intermediate.

    Under the ``"scan"`` strategy the sum accumulates inside the loop over the clients (with a
    ``clients`` mesh axis: inside each device's loop, then a ``psum``): the per-client outputs
    (in FedAvg, one model delta per client) are never stacked, which spares zero-filling,
    writing and reading back an (n, *model) array every round. With the program's
    ``clients_per_step`` k > 1 each loop step runs k clients vmapped and adds their k outputs
    to the sum: a (k, *model) buffer per step, never (n, *model). Low precision leaves
    accumulate in float32. Its derivative is the map followed by `federated_sum` (a
    ``custom_jvp``), so federated AD holds; under ``"vmap"`` it is exactly the map followed by `federated_sum`.

    ``when(*args) -> bool scalar`` (optional): the clients that count. A client where it is
    False adds zeros, and under ``"scan"`` runs no part of ``fn``; one client a loop step, the
    client's work and its addition to the sum are one branch (`lax.cond`), so that XLA fuses
    the end of the client's work (FedAvg: the last local update, the delta, its weighting) with
    the addition into the running sum rather than writing each client's output and reading it
    back. The same values as ``fn`` returning zeros where ``when`` fails.

    The values equal the map-then-sum up to float rounding (a sequential sum over the clients
    instead of a pairwise one).
    """
    ctx = current_context("federated_map_sum")
    _check_args(args, ctx, "federated_map_sum")
    how = resolve_map_strategy(fn, args, strategy or ctx.map_strategy)
    if how != "scan":
        if when is not None:
            fn = _where(fn, when)
        return federated_sum(federated_map(fn, *args, strategy=how))
    return federated_loop(fn, args, ctx, None, reduce=True, when=when)


def _where(fn: Callable, when: Callable) -> Callable:
    """``fn`` where ``when`` holds, zeros of its output elsewhere (a select once vmapped)."""

    def guarded(*args):
        return cond_or_zeros(when(*args), lambda: fn(*args), jax.eval_shape(fn, *args))

    return guarded


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


__all__ = ["MAP_STRATEGIES", "PRIMITIVES", "PRIMITIVE_NAMES", "federated_broadcast", "federated_broadcast_p",
           "federated_map", "federated_map_sum", "federated_mean", "federated_mean_p", "federated_sum",
           "federated_sum_p", "federated_weighted_mean", "resolve_map_strategy"]
