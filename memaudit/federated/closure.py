"""The federated closure check: a program (or its derivative) communicates only through the
federated primitives.

A value is *clients-placed* when one of its dims has the clients size (under ``jacfwd`` or
``vmap`` the clients dim need not lead); the check walks a jaxpr and fails on any equation that
moves data between placements without a federated primitive:

- a first-order equation with a clients-placed input and no clients-placed output, or the
  other way round (``jnp.sum(v, axis=0)``, ``jnp.broadcast_to``);
- a ``scan`` or ``while`` loop over the clients (a scan slicing the clients dim off its
  ``xs``; a while loop carrying a clients-placed value) whose carry holds a server-placed
  floating value: a sum over the clients accumulated in the loop (what reverse mode of a
  loop over the clients makes of a server value read by every client);
- a collective (``psum``, ``all_gather``, ...) over the clients mesh axis.

A loop over anything else (a ``lax.scan`` over rounds, its derivative, a ``remat`` of it) moves
nothing by itself: only its body's equations are checked, as when the rounds are unrolled.
(Placement is read from shapes: give the rounds a count other than the clients'.)

A loop over the clients may read server values as loop constants: that is a broadcast (the
scan strategy of `memaudit.federated.federated_map` reads the value sent with
``federated_broadcast`` so). What reverse mode makes of such a constant is the refused carry
above, so the scan strategy keeps its derivatives free of it: its loop's JVP reads the value
through ``broadcast_row`` (`memaudit.federated.primitives_impl`), whose derivative is the
broadcast's, and the gradient of rounds that each take a gradient passes under either strategy.
A client function that captures a traced server value from its closure gets the carry in its
gradient, and is refused.

It recurses into every sub-jaxpr (``scan``, ``cond``, ``while``, ``pjit``, ``custom_jvp_call``,
``remat``); inside a ``shard_map`` manual over the clients axis the clients size is the
per-device one. A ``pjit`` named in `FUSED_NAMES` is one of memaudit's fused federated loops
(`memaudit.federated.federated_map_sum`): its derivatives are federated by construction
(a ``custom_jvp`` over federated primitives), so it counts as that communication.

References:
    Rush et al. 2024, "FAX: Scalable and Differentiable Federated Primitives in JAX",
    section 3 (federated AD: the derivative of a federated program is a federated program).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.extend.core
import jax.numpy as jnp

from memaudit.federated.primitives_impl import PRIMITIVE_NAMES
from memaudit.federated.sharding import MeshAxis

FUSED_NAMES = frozenset({"federated_map_sum"})
_COLLECTIVES = frozenset({"psum", "psum_invariant", "pmax", "pmin", "all_gather", "all_to_all",
                          "ppermute", "reduce_scatter", "psum_scatter", "pbroadcast"})


class ClosureError(AssertionError):
    """A jaxpr moves data between placements outside the federated primitives."""


def _subjaxprs(eqn) -> list:
    out = []
    for v in eqn.params.values():
        for s in v if isinstance(v, (tuple, list)) else (v,):
            if isinstance(s, jax.extend.core.ClosedJaxpr):
                out.append(s.jaxpr)
            elif isinstance(s, jax.extend.core.Jaxpr):
                out.append(s)
    return out


def _placed(var, n: int) -> bool:
    return n in tuple(getattr(getattr(var, "aval", None), "shape", ()))


def _inexact(var) -> bool:
    dtype = getattr(getattr(var, "aval", None), "dtype", None)
    return dtype is not None and jnp.issubdtype(dtype, jnp.inexact)


def _loop_carry(eqn) -> tuple[list, list]:
    """(loop inputs over which it iterates or carries, carry outputs) of a scan / while."""
    p = eqn.params
    if eqn.primitive.name == "scan":
        nc, ncarry = p["num_consts"], p["num_carry"]
        return eqn.invars[nc:], eqn.outvars[:ncarry]
    nc = p["cond_nconsts"] + p["body_nconsts"]  # while: every output is carry
    return eqn.invars[nc:], eqn.outvars


def _over_clients(eqn, n: int) -> bool:
    """Whether a scan / while loops over the clients rather than, say, over rounds.

    A scan iterates over the leading dim of its ``xs``: it runs over the clients when one of
    them is clients-placed and its slice in the body is not (the loop strips the clients dim).
    A scan over rounds slices ``(rounds, n, ...)`` residuals into clients-placed ``(n, ...)``
    values, or reads the clients' data as a loop constant. A while loop has no ``xs``: it is
    over the clients when its carry holds a clients-placed value (it indexes into it).
    """
    if eqn.primitive.name == "while":
        return any(_placed(v, n) for v in _loop_carry(eqn)[0])
    p = eqn.params
    first = p["num_consts"] + p["num_carry"]
    body = p["jaxpr"].jaxpr.invars[first:]
    return any(_placed(v, n) and not _placed(b, n)
               for v, b in zip(eqn.invars[first:], body, strict=True))


def _check_eqn(eqn, n: int, axis: str | None) -> None:
    name = eqn.primitive.name
    if name in _COLLECTIVES:
        axes = eqn.params.get("axes", eqn.params.get("axis_name", ()))
        axes = axes if isinstance(axes, (tuple, list, frozenset, set)) else (axes,)
        if axis is not None and axis in axes:
            raise ClosureError(f"non-federated communication: {name} over {axis!r}: {eqn}")
    if name in ("scan", "while"):
        if not _over_clients(eqn, n):
            return  # a loop over rounds: its body's equations are checked one by one
        if any(_inexact(v) and not _placed(v, n) for v in _loop_carry(eqn)[1]):
            raise ClosureError(
                f"non-federated communication: a {name} over the clients carries a server value: "
                f"{eqn}")
    placed_in = any(_placed(v, n) for v in eqn.invars)
    placed_out = any(_placed(v, n) for v in eqn.outvars)
    from_server = any(not isinstance(v, jax.extend.core.Literal) for v in eqn.invars)
    if placed_in and not placed_out or placed_out and not placed_in and from_server:
        # (a clients-placed value built from constants alone, iota or zeros, moves nothing)
        raise ClosureError(f"non-federated communication: {eqn}")


def communication_of(jaxpr: Any, clients: int, *, axis: str | None = MeshAxis.CLIENTS) -> set[str]:
    """Names of the federated primitives (and fused loops) in ``jaxpr``; raises `ClosureError`
    on any other equation that moves data between placements (see the module docstring).

    Args:
        jaxpr: a ``ClosedJaxpr`` or ``Jaxpr`` (``jax.make_jaxpr(program)(...)``).
        clients: the clients dim as laid out (n, or the padded n of a mesh).
        axis: the clients mesh axis name, for collectives and ``shard_map``.
    """
    names: set[str] = set()

    def walk(jaxpr, n):
        for eqn in getattr(jaxpr, "jaxpr", jaxpr).eqns:
            name = eqn.primitive.name
            if name in PRIMITIVE_NAMES:
                names.add(name)
                continue
            if name in ("pjit", "jit") and eqn.params.get("name") in FUSED_NAMES:
                names.add(eqn.params["name"])
                continue
            subs = _subjaxprs(eqn)
            if name == "shard_map" and axis in eqn.params.get("newly_manual_axes", ()):
                k = dict(zip(eqn.params["mesh"].axis_names, eqn.params["mesh"].axis_sizes))[axis]
                for sub in subs:
                    walk(sub, n // k)
                continue
            if subs and name not in ("scan", "while"):
                # pjit / cond / custom_jvp_call / remat: the body holds the communication
                for sub in subs:
                    walk(sub, n)
                continue
            _check_eqn(eqn, n, axis)
            for sub in subs:
                walk(sub, n)

    walk(jaxpr, clients)
    return names
