"""The scan strategy of `memaudit.federated.federated_map` / ``federated_map_sum``: the
clients one after the other inside the compiled program, with a federated derivative.

On one device the loop is a ``lax.map`` (or a ``lax.scan`` accumulating a sum); with a
``clients`` mesh axis it is a ``shard_map`` manual over that axis and automatic over the others
(``model``), each device looping over its own clients, so a ``lax.cond`` in the client's work (an
absent cohort slot skipping its training) stays a branch. A server value straight from
`federated_broadcast` is read once per device rather than as n copies; the loop's
``custom_jvp`` puts the broadcast back into the derivative (tangents in through
``federated_broadcast``, a sum's tangents out through ``federated_sum``), so reverse mode of a
program, jitted or not, sums the server cotangent with ``federated_sum`` (federated AD). The
JVP's own loop reads the server value as ``broadcast_row`` (still one copy, its derivative the
broadcast's), so derivatives of any order stay federated: a gradient of rounds that each take a
gradient passes the closure check (`memaudit.federated.closure`).

References:
    Rush et al. 2024, "FAX: Scalable and Differentiable Federated Primitives in JAX",
    section 3 (federated AD) and 4 (sharding the clients axis).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from memaudit.federated import sharding as shd
from memaudit.federated.primitives_impl import (
    acc_dtype,
    broadcast_row_p,
    broadcast_source,
    cond_or_zeros,
    federated_broadcast_p,
    federated_sum_p,
    primitive_params,
)
from memaudit.federated.program import ProgramContext


def _per_client_call(fn: Callable, args: tuple, ctx: ProgramContext, when: Callable | None = None):
    """Split ``args`` for a loop over the clients: ``(call, present, fixed, rows)``, where
    ``fixed`` are the server values of arguments straight from `federated_broadcast`, ``rows``
    the other (clients-placed) leaves, ``call(fixed, row)`` runs ``fn`` for one client and
    ``present(fixed, row)`` runs ``when`` (None without it).

    Reading the server value inside the loop, rather than slicing it from its (n, ...)
    broadcast, spares XLA materialising n copies of the model every round. The derivative
    keeps the broadcast (`federated_loop`), so that its transpose is a federated_sum.
    """
    leaves, treedef = jax.tree.flatten(args)
    servers = [broadcast_source(ctx, x) for x in leaves]  # server value, or None: per client
    if all(s is not None for s in servers):  # a loop needs at least one clients-placed input
        servers = [None] * len(leaves)
    rows = [shd.constrain_leading(x, ctx.mesh, ctx.axis)
            for x, s in zip(leaves, servers, strict=True) if s is None]
    fixed = [s for s in servers if s is not None]

    def bind(f):
        def call(fixed, row):  # one client: fixed = the server values, row = its own values
            fixed_it, row_it = iter(fixed), iter(row)
            merged = [next(row_it) if s is None else next(fixed_it) for s in servers]
            return f(*jax.tree.unflatten(treedef, merged))

        return call

    return bind(fn), None if when is None else bind(when), fixed, rows


def _guarded(call: Callable, present: Callable | None, out: Any) -> Callable:
    """``call`` where ``present`` holds, zeros of ``out`` (without running ``call``) elsewhere;
    ``call`` itself without ``present``."""
    if present is None:
        return call

    def guarded(fixed, row):
        return cond_or_zeros(present(fixed, row), lambda: call(fixed, row), out)

    return guarded


def _row_struct(x) -> jax.ShapeDtypeStruct:
    """One client's row of a clients-placed leaf, keeping an explicit sharding of the rest."""
    sharding = getattr(jax.typeof(x), "sharding", None)
    spec = tuple(getattr(sharding, "spec", ()) or ())
    if not any(s is not None for s in spec[1:]):
        return jax.ShapeDtypeStruct(x.shape[1:], x.dtype)
    return jax.ShapeDtypeStruct(x.shape[1:], x.dtype,
                                sharding=sharding.update(spec=jax.sharding.PartitionSpec(*spec[1:])))


def _inexact(x) -> bool:
    return jnp.issubdtype(jnp.result_type(x), jnp.inexact)


def _zeros_like_struct(s: jax.ShapeDtypeStruct) -> jax.Array:
    """Zeros of ``s`` in its accumulation dtype, with its explicit sharding (a ``model``-split
    dim stays split in a loop's carry)."""
    spec = getattr(getattr(s, "sharding", None), "spec", None)
    if spec is None or not any(a is not None for a in spec):
        return jnp.zeros(s.shape, acc_dtype(s.dtype))
    return jnp.zeros(s.shape, acc_dtype(s.dtype), out_sharding=spec)


def _grouped(x: jax.Array, groups: int, size: int) -> jax.Array:
    """``x``'s leading dim as (groups, size), zero rows appended to fill the last group."""
    extra = groups * size - x.shape[0]
    if extra:
        x = jnp.concatenate([x, jnp.zeros((extra,) + x.shape[1:], x.dtype)], axis=0)
    return x.reshape((groups, size) + x.shape[1:])


def _local_loop(call: Callable, fixed: list, rows: Any, *, n: int, offset: Any, pad: bool,
                batch_size: int | None, reduce: bool, out: Any, present: Callable | None = None) -> Any:
    """``call(fixed, row)`` for the rows of one device, ``batch_size`` clients per loop step
    (vmapped within the step; default one client after the other).

    ``reduce``: the sum over the clients (row ``offset + i`` at or beyond ``n`` is padding and
    excluded) accumulated in the loop, low precision in float32, instead of stacked outputs;
    ``out`` is one client's output structure. A step then holds the outputs of its own
    ``batch_size`` clients only; rows that do not fill the last step are zero rows, run and
    excluded from the sum like padding.

    ``present(fixed, row)``: whether a client adds to the sum. One client a step, the client's
    work and its addition to the sum are one branch of a ``lax.cond`` taken only where it holds
    (padding rows included): no client output crosses a branch boundary, so XLA fuses the
    client's last computation (FedAvg: its last update, its delta, the weighting) with the
    addition into the carry instead of writing each term out and reading it back.
    """
    if not reduce:
        call = _guarded(call, present, out)
        return jax.lax.map(lambda row: call(fixed, row), rows, batch_size=batch_size)
    length = jax.tree.leaves(rows)[0].shape[0]
    size = max(1, min(batch_size or 1, length))
    groups = -(-length // size)
    filled = groups * size != length  # zero rows fill the last step
    pad = pad or filled
    branch = present is not None and size == 1  # the addition inside the client's branch
    if not branch:
        call = _guarded(call, present, out)

    def body(total, xs):
        i, row = xs if pad else (None, xs)
        if branch:
            keep = present(fixed, row)
            if pad:
                keep = keep & (offset + i < n)

            def add(total):
                return jax.tree.map(lambda t, v: t + v.astype(t.dtype), total, call(fixed, row))

            return jax.lax.cond(keep, add, lambda total: total, total), None
        if size == 1:
            y = call(fixed, row)
        else:  # (size, *out): this step's clients, summed into the carry below
            y = jax.vmap(call, in_axes=(None, 0))(fixed, row)
        if pad:
            keep = (offset + i < n) & (i < length) if filled else offset + i < n

            def mask(v):
                k = keep.reshape(keep.shape + (1,) * (v.ndim - keep.ndim))
                return jnp.where(k, v, jnp.zeros((), v.dtype))

            y = jax.tree.map(mask, y)
        if size == 1:
            return jax.tree.map(lambda t, v: t + v.astype(t.dtype), total, y), None
        return jax.tree.map(lambda t, v: t + jnp.sum(v.astype(t.dtype), axis=0), total, y), None

    init = jax.tree.map(_zeros_like_struct, out)
    # the row index only where padding is masked: without it the loop is the same for any number
    # of rows (a Flower node's stages, shaped for its own clients, need that)
    if size > 1:
        rows = jax.tree.map(lambda x: _grouped(x, groups, size), rows)
    if pad:
        index = jnp.arange(length) if size == 1 else jnp.arange(groups * size).reshape(groups, size)
        rows = (index, rows)
    total, _ = jax.lax.scan(body, init, rows)
    return total


def _loop(call: Callable, fixed: list, rows: Any, ctx: ProgramContext, batch_size: int | None,
          reduce: bool, out: Any = None, present: Callable | None = None) -> Any:
    """The clients' loop inside the program (the scan strategy), in the accumulation dtype.

    With a ``clients`` mesh axis of k devices it is a ``shard_map`` manual over that axis (and
    automatic over the others, e.g. ``model``): each device loops over its own n_pad / k
    clients with its own copy of the server values, so a `lax.cond` in ``call`` (an absent
    cohort slot skipping its training) stays a branch, and a reduction is each device's sum
    followed by a ``psum`` over the axis.
    """
    k = shd.clients_axis_size(ctx.mesh)
    if out is None and (reduce or present is not None):  # one client's output structure
        out = jax.eval_shape(call, fixed, jax.tree.map(_row_struct, rows))  # (outside any shard_map)
    opts = {"n": ctx.n, "pad": ctx.n_pad > ctx.n, "reduce": reduce, "out": out, "present": present}
    if k == 1:
        return _local_loop(call, fixed, rows, offset=0, batch_size=batch_size, **opts)
    m = ctx.n_pad // k
    bs = None if batch_size is None else max(1, min(batch_size, m))

    def per_device(fixed, rows):  # rows: this device's (m, ...) clients
        offset = jax.lax.axis_index(ctx.axis) * m
        out = _local_loop(call, fixed, rows, offset=offset, batch_size=bs, **opts)
        return jax.tree.map(lambda t: jax.lax.psum(t, ctx.axis), out) if reduce else out

    P = jax.sharding.PartitionSpec
    return jax.shard_map(per_device, mesh=ctx.mesh, in_specs=(P(), P(ctx.axis)),
                         out_specs=P() if reduce else P(ctx.axis),
                         axis_names=frozenset({ctx.axis}), check_vma=False)(fixed, rows)


def _trace_client(call: Callable, fixed: list, rows: list) -> tuple[bool, Any]:
    """One client's output structure, and whether its computation reads traced values it was
    not passed (a server value captured by ``fn``'s closure instead of sent with
    `federated_broadcast`)."""
    jaxpr, out = jax.make_jaxpr(call, return_shape=True)(fixed, [_row_struct(r) for r in rows])
    return any(isinstance(c, jax.core.Tracer) for c in jaxpr.consts), out


def federated_loop(fn: Callable, args: tuple, ctx: ProgramContext, batch_size: int | None,
                    reduce: bool, when: Callable | None = None) -> Any:
    """``fn`` over the clients by `_loop`, with a JVP that is federated: the tangents of the
    server values enter through `federated_broadcast` and a reduction leaves through
    `federated_sum`, so reverse mode (also of a jitted program, ``jax.grad(jax.jit(p))``)
    carries the server cotangent through a federated_sum rather than a loop's carry.

    ``when(*args)`` (a reduction only): a client's scalar predicate; where it is False the
    client adds nothing and ``fn`` does not run (`_local_loop`'s ``present``).

    A ``fn`` that closes over traced server values (rather than taking them from
    `federated_broadcast`) runs as a plain loop over the broadcast rows: the values and
    derivatives are right, but the derivative of the captured value is not federated.
    """
    call, present, fixed, rows = _per_client_call(fn, args, ctx, when)
    closes, out = _trace_client(call, fixed, rows)
    if present is not None:
        closes = closes or _trace_client(present, fixed, rows)[0]
    # the values' loop runs the program's clients_per_step clients a step unless batch_size is
    # given; the derivative's loop (below) only batch_size's: a JVP of a `lax.cond` with a
    # per-client predicate (an absent slot skipping its training), batched, cannot be transposed
    step = batch_size if batch_size is not None else (ctx.clients_per_step if ctx.clients_per_step > 1 else None)
    if closes:
        leaves, treedef = jax.tree.flatten(args)
        rows = [shd.constrain_leading(x, ctx.mesh, ctx.axis) for x in leaves]

        def plain(f):
            return None if f is None else (lambda _, row: f(*jax.tree.unflatten(treedef, row)))

        out = jax.eval_shape(lambda *r: fn(*jax.tree.unflatten(treedef, list(r))),
                             *[_row_struct(r) for r in rows])
        total = _loop(plain(fn), [], rows, ctx, step, reduce, out, plain(when))
        return jax.tree.map(lambda t, s: t.astype(s.dtype), total, out)

    def finish(total):  # the accumulation dtype back to each output's own
        return jax.tree.map(lambda t, s: t.astype(s.dtype), total, out)

    def federated_map_sum(fixed, rows):  # the name marks the fused loop for the closure check
        return finish(_loop(call, fixed, rows, ctx, step, reduce=True, out=out, present=present))

    @jax.custom_jvp
    def loop(fixed, rows):
        if reduce:
            return jax.jit(federated_map_sum)(fixed, rows)
        return finish(_loop(call, fixed, rows, ctx, step, reduce=False, out=out, present=present))

    @loop.defjvp
    def loop_jvp(primals, tangents):
        return _loop_jvp(_guarded(call, present, out), ctx, batch_size, reduce, primals, tangents)

    return loop(fixed, rows)


def _loop_jvp(call: Callable, ctx: ProgramContext, batch_size: int | None, reduce: bool,
              primals: tuple, tangents: tuple) -> tuple[Any, Any]:
    """JVP of `federated_loop`: per-client JVPs in the same loop, the server tangents
    broadcast to the clients, a reduction's tangents summed with federated_sum.

    A floating server value is read in this loop as ``broadcast_row(x, row)``, ``row`` its
    client's row of ``federated_broadcast(x)``: the value is ``x`` (a loop constant, no copy
    per client), the derivative the row's. The loop that reverse mode makes of this one (and
    its transpose) is an ordinary scan; a gradient of it (``jax.grad`` of rounds that each take
    a gradient, scanned or unrolled, under ``jit`` or ``remat``) reaches ``x`` through
    ``federated_broadcast``, whose transpose is ``federated_sum``. Read as a plain loop
    constant, its cotangent would be summed over the clients in the transposed loop's carry.
    """
    params = primitive_params(ctx)
    (fixed, rows), (fdot, rdot) = primals, tangents
    f_float, r_float = [_inexact(f) for f in fixed], [_inexact(r) for r in rows]
    fd = [federated_broadcast_p.bind(t, **params) for t, fl in zip(fdot, f_float) if fl]
    fb = [federated_broadcast_p.bind(f, **params) for f, fl in zip(fixed, f_float) if fl]
    rd = [t for t, fl in zip(rdot, r_float) if fl]
    float0 = jax.dtypes.float0

    def one(fixed, xs):  # one client: its primal outputs and float tangents
        row, rdi, fdi, fbi = xs
        rdi, fdi, fbi = iter(rdi), iter(fdi), iter(fbi)
        fixed = [broadcast_row_p.bind(f, next(fbi)) if fl else f for f, fl in zip(fixed, f_float)]
        ft = [next(fdi) if fl else np.zeros(jnp.shape(f), float0) for f, fl in zip(fixed, f_float)]
        rt = [next(rdi) if fl else np.zeros(jnp.shape(r), float0) for r, fl in zip(row, r_float)]
        y, yd = jax.jvp(call, (fixed, row), (ft, rt))
        return y, [t for t in jax.tree.leaves(yd) if t.dtype != float0]

    y, yd = _loop(one, fixed, (list(rows), rd, fd, fb), ctx, batch_size, reduce=False)
    leaves, treedef = jax.tree.flatten(y)
    yd_it = iter(yd)
    outs, touts = [], []
    for v in leaves:
        t = next(yd_it) if _inexact(v) else None
        if reduce:
            v = federated_sum_p.bind(v, **params)
            t = None if t is None else federated_sum_p.bind(t, **params)
        outs.append(v)
        touts.append(np.zeros(v.shape, float0) if t is None else t)
    return jax.tree.unflatten(treedef, outs), jax.tree.unflatten(treedef, touts)
