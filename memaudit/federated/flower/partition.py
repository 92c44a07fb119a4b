"""Partition a traced federated program at its federated primitives into client and server stages.

A round of a federated algorithm (`memaudit.federated.algorithms`, its ``program``) is
traced once per cohort capacity with ``jax.make_jaxpr``; top-level ``jit`` calls are inlined,
and every equation is placed by data flow:

- a value is *clients-placed* when its clients dim is known: the dataflow of the federated
  closure check (`memaudit.federated.closure.placements`) follows it from the clients-placed
  inputs (the cohort's data, leading) and the outputs of `federated_broadcast` (leading)
  through every equation, whatever the shapes: a model dim equal to the capacity (LoRA's rank 4
  in a cohort of 4), or an aggregate with a dim of size n (``federated_sum`` of per-client
  one-hots), is never read as per-client rows, and a program declared with
  ``federated_program(clients=N)`` is traced once. An equation that moves data across the
  clients dim outside the federated primitives (a hand-written ``jnp.sum(v, 0)``,
  ``ones((n, n)) / n @ v``, a ``cumsum`` over the clients, ``h @ h.T``: what the closure check
  refuses) is a server equation, its outputs server-placed: on the nodes each would mix only
  the clients a node hosts; the server, which gathers the rows, mixes them all, as in JAX;
- an equation with a clients-placed input whose outputs all keep the clients dim leading is a
  *client* equation (the computation between a broadcast and the next aggregation);
- a fused map-and-sum (`memaudit.federated.federated_map_sum`, a ``jit`` named
  ``federated_map_sum``, possibly inside its ``custom_jvp``) is a client equation whose outputs
  are *partial sums*: each node sums the clients it hosts, the server adds the nodes' sums;
- every other equation is a *server* equation: `federated_sum` / `federated_mean`, the
  aggregators, the server optimizer. A clients-placed input it reads is gathered from the
  nodes row by row (each node sends the rows of the clients it hosts), so the server runs the
  very equation the in-JAX program runs.

Equations are then scheduled into alternating stages (server stage 0, client stage 1, server
stage 2, ...): each equation goes to the earliest stage of its kind after its inputs exist
where they are needed (a server value reaches the clients one stage after it is computed, a
clients-placed value reaches the server one stage after). A client stage is exported with
``jax.export`` (StableHLO, serialised), so a node runs it without the algorithm's code; a
server stage is jitted where the server runs it. ``jax.grad`` of a federated loss (FedSGD) has
two client stages (the forward pass, then the backward pass over the forward's residuals,
which stay on the nodes between them).

A server stage never reads the clients' data, nor a copy of it that equations which only move
elements made (`MOVES`): such a program is refused (`PlanError`). A node runs the client stages
shaped for the slots it hosts (`node_stages`: the same stages traced with its own clients count)
and lowered for its platform (`modules_for`).

No per-algorithm code: FedAvg, FedAdam, DP-FedAvg (its clipping is client equations on the
clients' deltas, its noise a server equation) and FedSGD partition by the same rules. Outputs
named ``resident`` (a host aggregator's deltas: secure aggregation) stay on the nodes: they are
kept like values a later client stage reads, and never gathered.

References:
    Rush et al. 2024, "FAX: Scalable and Differentiable Federated Primitives in JAX"
    (interpretation of a federated program into a production federated system).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jax.extend.core as jcore
import jax.numpy as jnp
import numpy as np
from jax import export

from memaudit.errors import MemauditError
from memaudit.federated.closure import Clients, ClosureError, placements
from memaudit.federated.primitives_impl import PRIMITIVE_NAMES, federated_broadcast_p
from memaudit.federated.program import ClientsCountError

SERVER, CLIENT = "server", "client"
FUSED_NAMES = frozenset({"federated_map_sum"})


class PlanError(MemauditError):
    """The program cannot be run across processes as written (one line, with the fix)."""


@dataclasses.dataclass(frozen=True)
class Stage:
    """One stage of a round: equations of one kind, with the values crossing its boundary.

    ``inputs`` / ``outputs`` are var ids. For a client stage, ``sums`` are the outputs that are
    partial sums over each node's clients; ``keep`` the clients-placed outputs later client
    stages read (they stay on the nodes); ``rows`` those the server reads (gathered by rows).
    """

    index: int
    kind: str
    ops: tuple
    inputs: tuple[int, ...]
    outputs: tuple[int, ...]
    sums: frozenset[int] = frozenset()
    keep: frozenset[int] = frozenset()
    rows: frozenset[int] = frozenset()


@dataclasses.dataclass
class Plan:
    """A partitioned round: its stages, how the jaxpr's inputs map to var ids, and the client
    stages exported for the nodes (``modules[i]``: serialised ``jax.export`` bytes)."""

    capacity: int
    stages: list[Stage]
    invars: list[int]  # var id of each flat input (after the closed jaxpr's consts)
    consts: dict[int, Any]  # var id -> constant value
    outvars: list[Any]  # var id, or a `Lit`
    out_tree: Any
    data_leaves: dict[int, str]  # var id of each clients-placed input -> its leaf name
    avals: dict[int, Any]  # var id -> ShapedArray
    modules: dict[int, bytes] = dataclasses.field(default_factory=dict)
    server_fns: dict[int, Callable] = dataclasses.field(default_factory=dict)
    resident_out: frozenset[int] = frozenset()  # positions of outputs that stay on the nodes
    ops: tuple = ()  # every equation of the inlined round, in trace order (`node_stages`)
    platform_modules: dict[str, dict[int, bytes]] = dataclasses.field(default_factory=dict)  # `modules_for`

    @property
    def client_stages(self) -> list[Stage]:
        return [s for s in self.stages if s.kind == CLIENT]


# ------------------------------------------------------------------ tracing and placement
@dataclasses.dataclass(frozen=True)
class Op:
    """One equation of the inlined round: its inputs (var ids, or ``Lit`` constants) and
    outputs (var ids). Ids are fresh per inlining, so a ``jit`` called twice is two sets."""

    eqn: Any
    ins: tuple
    outs: tuple[int, ...]


@dataclasses.dataclass(frozen=True)
class Lit:
    value: Any


class _Numbering:
    def __init__(self) -> None:
        self.avals: dict[int, Any] = {}

    def new(self, aval: Any) -> int:
        i = len(self.avals)
        self.avals[i] = aval
        return i


class Stacked:
    """The ``ys`` of an unrolled scan: one value (var id or `Lit`) per iteration, stacked into
    one array only when an equation other than a later unrolled scan reads it (the forward
    pass's per-round residuals reach the backward scan round by round, never stacked)."""

    def __init__(self, parts: list, aval: Any) -> None:
        self.parts, self.aval, self.id = parts, aval, None


def _helper(fn: Callable, ins: list, avals: list, num: _Numbering, ops: list) -> Any:
    """Inline the equations of ``fn`` (traced at ``avals``) on ``ins``; its one output."""
    closed = jax.make_jaxpr(fn)(*[jax.ShapeDtypeStruct(a.shape, a.dtype) for a in avals])
    sub = {cv: Lit(c) for cv, c in zip(closed.jaxpr.constvars, closed.consts, strict=True)}
    sub.update(zip(closed.jaxpr.invars, ins, strict=True))
    _inline(closed.jaxpr, sub, num, ops)
    (out,) = closed.jaxpr.outvars
    return _read(out, sub)


def _value(x: Any, num: _Numbering, ops: list) -> Any:
    """A var id or `Lit` for ``x``, stacking a `Stacked` (once) where it is read as a whole."""
    if not isinstance(x, Stacked):
        return x
    if x.id is None:
        parts = [_value(p, num, ops) for p in x.parts]
        avals = [num.avals[p] if isinstance(p, int) else _lit_aval(p) for p in parts]
        x.id = _helper(lambda *ys: jnp.stack(ys), parts, avals, num, ops)
    return x.id


def _lit_aval(lit: Lit) -> Any:
    return jax.ShapeDtypeStruct(np.shape(lit.value), jax.numpy.result_type(lit.value))


def _communicates(jaxpr: Any) -> bool:
    """Whether ``jaxpr`` (or a sub-jaxpr) calls a federated primitive or a fused map-sum."""
    for eqn in getattr(jaxpr, "jaxpr", jaxpr).eqns:
        if eqn.primitive.name in PRIMITIVE_NAMES or _is_fused_sum(eqn):
            return True
        for v in eqn.params.values():
            for sub in v if isinstance(v, (tuple, list)) else (v,):
                if isinstance(sub, (jcore.ClosedJaxpr, jcore.Jaxpr)) and _communicates(sub):
                    return True
    return False


def _unroll_scan(eqn: Any, ins: list, env: dict, num: _Numbering, ops: list) -> None:
    """Inline a scan whose body communicates (a loop over rounds, or its derivative) once per
    iteration, so that each round's equations are placed and scheduled as when unrolled."""
    p = eqn.params
    body, nc, ncar, length = p["jaxpr"], p["num_consts"], p["num_carry"], p["length"]
    consts = [_value(x, num, ops) for x in ins[:nc]]
    carry = [_value(x, num, ops) for x in ins[nc:nc + ncar]]
    xs = ins[nc + ncar:]
    ys: list[list] = [[None] * length for _ in eqn.outvars[ncar:]]
    for t in range(length):
        i = length - 1 - t if p["reverse"] else t
        row = [x.parts[i] if isinstance(x, Stacked) else _row(x, i, num, ops) for x in xs]
        sub = {cv: Lit(c) for cv, c in zip(body.jaxpr.constvars, body.consts, strict=True)}
        sub.update(zip(body.jaxpr.invars, [*consts, *carry, *row], strict=True))
        _inline(body.jaxpr, sub, num, ops)
        outs = [_read(v, sub) for v in body.jaxpr.outvars]
        carry = [_value(x, num, ops) for x in outs[:ncar]]
        for k, y in enumerate(outs[ncar:]):
            ys[k][i] = y
    for v, c in zip(eqn.outvars[:ncar], carry, strict=True):
        env[v] = c
    for v, parts in zip(eqn.outvars[ncar:], ys, strict=True):
        env[v] = Stacked(parts, v.aval)


def _row(x: Any, i: int, num: _Numbering, ops: list) -> Any:
    """Iteration ``i``'s slice of a scan's ``xs`` (a var id or `Lit`)."""
    if isinstance(x, Lit):
        return Lit(x.value[i])
    return _helper(lambda a: a[i], [x], [num.avals[x]], num, ops)


def _read(v: Any, env: dict) -> Any:
    return Lit(v.val) if isinstance(v, jcore.Literal) else env[v]


def _inline(jaxpr: Any, env: dict, num: _Numbering, ops: list) -> None:
    """Append the equations of ``jaxpr`` to ``ops`` with top-level ``jit`` calls inlined
    (recursively), except the fused map-sums; a ``scan`` or ``remat`` whose body communicates
    is inlined too (a scan once per iteration); ``env`` maps its vars to ids or `Lit` s."""
    for eqn in jaxpr.eqns:
        name = eqn.primitive.name
        ins = [_read(v, env) for v in eqn.invars]
        if name == "scan" and _communicates(eqn.params["jaxpr"]):
            _unroll_scan(eqn, ins, env, num, ops)
            continue
        if name == "while" and _communicates(eqn.params["body_jaxpr"]):
            raise PlanError("a while loop over federated rounds cannot be partitioned (its trip "
                            "count is not static); write it as a lax.scan or a Python loop")
        ins = [_value(x, num, ops) for x in ins]
        inner = _inlined_body(eqn)
        if inner is not None:
            sub = {cv: Lit(c) for cv, c in zip(inner.jaxpr.constvars, inner.consts, strict=True)}
            sub.update(zip(inner.jaxpr.invars, ins, strict=True))
            _inline(inner.jaxpr, sub, num, ops)
            for outer, inner_out in zip(eqn.outvars, inner.jaxpr.outvars, strict=True):
                env[outer] = _read(inner_out, sub)
            continue
        outs = []
        for v in eqn.outvars:
            env[v] = num.new(v.aval)
            outs.append(env[v])
        ops.append(Op(eqn, tuple(ins), tuple(outs)))


def _inlined_body(eqn: Any) -> Any:
    """The closed body of a ``jit`` (not a fused map-sum), or of a ``remat`` / ``closed_call``
    whose body communicates, which `_inline` inlines; None for any other equation."""
    name = eqn.primitive.name
    if name in ("pjit", "jit") and eqn.params.get("name") not in FUSED_NAMES:
        return eqn.params["jaxpr"]
    key = {"checkpoint": "jaxpr", "remat2": "jaxpr", "closed_call": "call_jaxpr"}.get(name)
    if key is None or not _communicates(eqn.params[key]):
        return None
    inner = eqn.params[key]
    return inner if isinstance(inner, jcore.ClosedJaxpr) else jcore.ClosedJaxpr(inner, ())


def _is_fused_sum(eqn: Any) -> bool:
    name = eqn.primitive.name
    if name in ("pjit", "jit"):
        return eqn.params.get("name") in FUSED_NAMES
    if name in ("custom_jvp_call", "custom_vjp_call"):
        inner = eqn.params.get("call_jaxpr") or eqn.params.get("fun_jaxpr")
        inner = getattr(inner, "jaxpr", inner)
        return inner is not None and any(_is_fused_sum(e) for e in inner.eqns)
    return False


def _leading(aval: Any, n: int) -> bool:
    shape = tuple(getattr(aval, "shape", ()))
    return len(shape) > 0 and shape[0] == n


def trace(program: Callable, args: Sequence[Any], placed: Mapping[str, str], capacity: int,
          resident: Sequence[str] = ()) -> Plan:
    """Trace ``program(*args)`` and partition it into stages.

    Args:
        program: the round, ``(state, data, key) -> (state, metrics)`` (jittable).
        args: example arguments (arrays or ``jax.ShapeDtypeStruct`` s) of the round's shapes.
        placed: the clients-placed inputs (the cohort data's leaves): ``jax.tree_util.keystr``
            of each one's path in ``args`` -> the name of its array on the nodes.
        capacity: the clients dim n of the placed inputs.
        resident: ``jax.tree_util.keystr`` prefixes of outputs that stay on the nodes (the
            deltas a host aggregator encodes there): clients-placed values the server never
            gathers; `memaudit.federated.flower.execute.run_plan` returns a `Resident` for each.
    """
    paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_leaves_with_path(tuple(args))]
    missing = set(placed) - set(paths)
    if missing:
        raise PlanError(f"no argument leaf named {min(missing)!r}; pass the leaf paths of "
                        "the clients-placed arguments")
    t = _inline_program(program, args, capacity)
    num, consts, invars, ops, outvars = t.num, t.consts, t.invars, t.ops, t.outvars
    data_leaves = {i: placed[p] for i, p in zip(invars, paths, strict=True) if p in placed}
    out_paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_leaves_with_path(t.out_shape)]
    res_out = frozenset(k for k, p in enumerate(out_paths) if any(p.startswith(r) for r in resident))

    kinds, sums = _placement(ops, set(data_leaves))
    for k in sorted(res_out):
        o = outvars[k]
        if not isinstance(o, int) or not any(o in op.outs for op, kd in zip(ops, kinds, strict=True)
                                             if kd == CLIENT):
            raise PlanError(f"output {out_paths[k]} is not computed by the clients; only "
                            "clients-placed outputs can stay on the nodes")
    start = {i: 0 for i in [*consts, *invars]}
    start.update({i: 1 for i in data_leaves})
    stages = _schedule(ops, kinds, start, sums, outvars, {outvars[k] for k in res_out})
    if any(outvars[k] in s.rows or outvars[k] in s.sums for s in stages for k in res_out):
        raise PlanError("an output meant to stay on the nodes is also read by the server; "
                        "aggregate it inside the program instead")
    copies = _copies(ops, data_leaves)
    for s in stages:  # nor a copy of it a client stage would send
        if s.kind != SERVER:
            continue
        leak = next((i for i in s.inputs if i in copies and i not in data_leaves), None)
        if leak is not None:
            raise PlanError(f"the program reads the client data {copies[leak]} on the server (a copy of it "
                            "that a client stage would send); compute what it needs inside federated_map "
                            "and aggregate it (a round with vmap's local training: use map_strategy='scan')")
    gathered = []
    for i, name in data_leaves.items():  # raw client data must not be read on the server
        if any(i in s.inputs for s in stages if s.kind == SERVER):
            if not name.endswith("mask"):
                raise PlanError(f"the program reads the client data {name} on the server; "
                                "compute what it needs inside federated_map and aggregate it")
            gathered.append(i)  # an example mask: the nodes send its rows (counts, no text)
    if gathered:
        stages = _gather_inputs(stages, gathered)
    return Plan(capacity, stages, invars, consts, outvars, jax.tree.structure(t.out_shape),
                data_leaves, num.avals, resident_out=res_out, ops=tuple(ops))


@dataclasses.dataclass
class _Traced:
    out_shape: Any
    num: _Numbering
    consts: dict
    invars: list
    ops: list
    outvars: list


def _inline_program(program: Callable, args: Sequence[Any], capacity: int) -> _Traced:
    """``program(*args)`` traced and inlined into `Op` s (top-level jits, and scans and remats
    that communicate, unrolled), with its constants', inputs' and outputs' ids.

    Raises:
        PlanError: the program declares another number of clients than ``capacity``.
    """
    try:
        closed, out_shape = jax.make_jaxpr(program, return_shape=True)(*args)
    except ClientsCountError as e:
        raise PlanError(f"the round cannot be traced for {capacity} clients ({e}); a program declared "
                        "with a fixed federated_program(clients=N) runs only N: read n from the data "
                        "instead (clients=data.mask.shape[0])") from None
    jaxpr = closed.jaxpr
    num = _Numbering()
    env: dict = {}
    consts = {}
    for v, c in zip(jaxpr.constvars, closed.consts, strict=True):
        env[v] = num.new(v.aval)
        consts[env[v]] = c
    invars = []
    for v in jaxpr.invars:
        env[v] = num.new(v.aval)
        invars.append(env[v])
    ops: list[Op] = []
    _inline(jaxpr, env, num, ops)
    outvars = [_value(Lit(v.val) if isinstance(v, jcore.Literal) else env[v], num, ops)
               for v in jaxpr.outvars]
    return _Traced(out_shape, num, consts, invars, ops, outvars)


def _resized(args: Sequence[Any], placed: Mapping[str, str], size: Callable[[int], int]) -> tuple:
    """``args`` with each clients-placed leaf's leading dim n replaced by ``size(n)``."""
    def resize(path, x):
        if jax.tree_util.keystr(path) not in placed:
            return x
        shape = np.shape(x)
        return jax.ShapeDtypeStruct((size(shape[0]), *shape[1:]), jax.numpy.result_type(x))

    return jax.tree_util.tree_map_with_path(resize, tuple(args))


MOVES = frozenset({
    "select_n", "slice", "dynamic_slice", "gather", "squeeze", "reshape", "transpose", "broadcast_in_dim",
    "convert_element_type", "copy", "copy_p", "concatenate", "pad", "rev", "expand_dims",
    "dynamic_update_slice", "bitcast_convert_type", "reduce_precision", "optimization_barrier",
    "stop_gradient", "device_put", "sharding_constraint"})
"""Equations that move or relabel their inputs' elements without computing on them: what they
make from the clients' data is that data."""


def _copies(ops: list[Op], data: Mapping[int, str]) -> dict[int, str]:
    """Var ids holding the clients' data (not their example masks) or a copy of it made by
    `MOVES` equations (a slot's tokens selected, sliced, looked up, cast), with the leaf's name."""
    out = {i: name for i, name in data.items() if not name.endswith("mask")}
    for op in ops:
        if op.eqn.primitive.name in MOVES:
            src = next((out[i] for i in op.ins if isinstance(i, int) and i in out), None)
            if src is not None:
                out.update(dict.fromkeys(op.outs, src))
    return out


def _placement(ops: list[Op], data: set[int]) -> tuple[list[str], set[int]]:
    """Each op's kind (CLIENT / SERVER) by data flow (`memaudit.federated.closure.placements`),
    and the var ids that are partial sums. An op that moves data across the clients dim outside
    the federated primitives runs on the server, its outputs server-placed."""
    where: dict[int, Any] = {i: Clients(0) for i in data}
    kinds: list[str] = []
    sums: set[int] = set()
    for op in ops:
        ins = [None if isinstance(i, Lit) else where.get(i) for i in op.ins]
        from_clients = any(isinstance(p, Clients) for p in ins)
        try:
            outs, _ = placements(op.eqn, ins)
        except ClosureError:
            outs = [None] * len(op.outs)  # mixing the clients: only the server has them all
            kinds.append(SERVER)
            where.update(zip(op.outs, outs, strict=True))
            continue
        where.update(zip(op.outs, outs, strict=True))
        if op.eqn.primitive is federated_broadcast_p:
            kind = CLIENT
        elif from_clients and _is_fused_sum(op.eqn):
            kind = CLIENT
            sums.update(op.outs)
        elif from_clients and all(isinstance(p, Clients) and p.dim == 0 for p in outs):
            kind = CLIENT  # per-client work: the clients dim kept leading (rows are independent)
        else:
            kind = SERVER  # an aggregation, server work, or clients-placed work the server runs
        kinds.append(kind)
    return kinds, sums


def _schedule(ops: list[Op], kinds: list[str], start: dict[int, int], sums: set[int],
              outvars: list, resident: set[int] = frozenset()) -> list[Stage]:
    """Earliest-stage list scheduling: even stages run on the server, odd ones on the clients;
    a value reaches the other side one stage after the stage that made it."""
    made: dict[int, tuple[int, str]] = {
        i: (s, CLIENT if s == 1 else SERVER) for i, s in start.items()}
    stage_of: list[int] = []
    for op, kind in zip(ops, kinds, strict=True):
        need = 0 if kind == SERVER else 1
        for i in op.ins:
            if isinstance(i, int):
                s, where = made[i]
                need = max(need, s if where == kind else s + 1)
        want = 0 if kind == SERVER else 1
        stage = need if need % 2 == want else need + 1
        stage_of.append(stage)
        for o in op.outs:
            made[o] = (stage, kind)

    readers: dict[int, set[int]] = {}  # var id -> stages that read it
    for op, st in zip(ops, stage_of, strict=True):
        for i in op.ins:
            if isinstance(i, int):
                readers.setdefault(i, set()).add(st)
    last = max(stage_of, default=0) + 2  # the round's outputs: read by the server at the end
    for i in outvars:
        if isinstance(i, int):  # (a resident output: "read" by a later client step, kept)
            readers.setdefault(i, set()).add(last + 1 if i in resident else last)
    stages = []
    for st in sorted(set(stage_of)):
        mine = [op for op, s in zip(ops, stage_of, strict=True) if s == st]
        produced = {o for op in mine for o in op.outs}
        read = {i for op in mine for i in op.ins if isinstance(i, int)}
        inputs = tuple(sorted(read - produced))
        outputs = tuple(sorted(i for i in produced if readers.get(i, set()) - {st}))
        if st % 2 == 0:
            stages.append(Stage(st, SERVER, tuple(mine), inputs, outputs))
            continue
        later_client = {i for i in outputs if any(s % 2 for s in readers[i] - {st})}
        later_server = {i for i in outputs if any(s % 2 == 0 for s in readers[i] - {st})}
        sum_out = frozenset(i for i in outputs if i in sums)
        if sum_out & later_client:
            raise PlanError("a client stage reads a partial sum; aggregate it on the server first")
        stages.append(Stage(st, CLIENT, tuple(mine), inputs, outputs, sum_out,
                            frozenset(later_client - sum_out), frozenset(later_server - sum_out)))
    return stages


def _gather_inputs(stages: list[Stage], ids: list[int]) -> list[Stage]:
    """Client stage 1 also returns the rows of the inputs ``ids`` (read on the server)."""
    first = next((s for s in stages if s.index == 1), None)
    if first is None:
        first = Stage(1, CLIENT, (), (), ())
        stages = sorted([*stages, first], key=lambda s: s.index)
    new = dataclasses.replace(
        first, inputs=tuple(sorted(set(first.inputs) | set(ids))),
        outputs=tuple(sorted(set(first.outputs) | set(ids))), rows=first.rows | set(ids))
    return [new if s is first else s for s in stages]


# ------------------------------------------------------------------ stage functions
def stage_function(stage: Stage) -> Callable:
    """``fn(*inputs) -> outputs`` evaluating ``stage``'s equations (as `jax.core.eval_jaxpr`)."""

    def fn(*ins):
        env = dict(zip(stage.inputs, ins, strict=True))
        for op in stage.ops:
            vals = [i.value if isinstance(i, Lit) else env[i] for i in op.ins]
            params = op.eqn.primitive.get_bind_params(op.eqn.params)
            with op.eqn.ctx.manager:
                out = op.eqn.primitive.bind(*vals, **params)
            out = out if op.eqn.primitive.multiple_results else [out]
            env.update(zip(op.outs, out, strict=True))
        return tuple(env[i] for i in stage.outputs)

    return fn


STAGE_PLATFORMS = ("cpu",)
"""What a client stage is lowered for by default (``Plan.modules``). A module for CPU and CUDA
together (``("cpu", "cuda")``) is not the in-JAX program's bit for bit in its CPU lowering (the
platform dispatch changes XLA's fusion: model weights after two secure-aggregation rounds differed
by up to 1.05e-6, where the CPU-only module matches exactly), so each SuperNode gets its stages
lowered for its own platform alone (`modules_for`): the CPU node the CPU-only module, a CUDA node
(jax[cuda]) a CUDA-only one, a TPU node (jax[tpu]) a TPU-only one. The platforms are part of the module's signature: a node's manifest
lists the platforms its operator writes it for."""

PLATFORMS = ("cpu", "cuda", "tpu")
"""The platforms memaudit lowers client stages for (a SuperNode's JAX backend, which it declares
when it connects and its manifest lists)."""


def modules_for(plan: Any, platform: str) -> dict[int, bytes]:
    """The client-stage modules of ``plan`` (a `Plan` or `NodeStages`) lowered for ``platform``
    alone: ``plan.modules`` for the CPU, others exported once and kept on the plan.

    Raises:
        PlanError: a platform memaudit does not lower for.
    """
    if platform not in PLATFORMS:
        raise PlanError(f"no client stages for platform {platform!r}; memaudit lowers them for "
                        f"{', '.join(PLATFORMS)}")
    if (platform,) == STAGE_PLATFORMS:
        return plan.modules
    if platform not in plan.platform_modules:
        plan.platform_modules[platform] = {st.index: _export(st, plan.avals, (platform,))
                                           for st in plan.client_stages}
    return plan.platform_modules[platform]


def compile_plan(program: Callable, args: Sequence[Any], placed: Mapping[str, str],
                 capacity: int, resident: Sequence[str] = ()) -> Plan:
    """`trace` the round, export its client stages (``jax.export``, serialised StableHLO a node
    runs without the algorithm's code) and jit its server stages."""
    plan = trace(program, args, placed, capacity, resident)
    for st in plan.stages:
        if st.kind == SERVER:
            plan.server_fns[st.index] = jax.jit(stage_function(st))
        else:
            plan.modules[st.index] = _export(st, plan.avals)
    return plan


def _export(stage: Stage, avals: Mapping[int, Any], platforms: tuple[str, ...] = STAGE_PLATFORMS) -> bytes:
    """Client stage ``stage`` exported at ``avals`` for ``platforms`` (serialised ``jax.export``
    bytes). A module's
    source locations name the innermost frame only, never the caller's: the same program exports
    to the same bytes wherever it is traced from (the server, or the stage manifest the nodes
    check those bytes against)."""
    full = jax.config.jax_include_full_tracebacks_in_locations
    jax.config.update("jax_include_full_tracebacks_in_locations", False)
    try:
        structs = [_struct(avals[i]) for i in stage.inputs]
        return bytes(export.export(jax.jit(stage_function(stage)), platforms=platforms)(*structs).serialize())
    finally:
        jax.config.update("jax_include_full_tracebacks_in_locations", full)


def _struct(aval):
    return jax.ShapeDtypeStruct(aval.shape, aval.dtype)


# ------------------------------------------------------------------ node-shaped client stages
@dataclasses.dataclass(frozen=True)
class NodeStages:
    """A plan's client stages for a node that hosts at most ``capacity`` of the cohort's slots:
    the same equations, wiring and var ids as the plan's, traced with ``capacity`` client rows
    instead of the cohort's, so a node computes its own clients only (not the whole cohort with
    zero rows for the clients of other nodes).

    ``modules[i]``: client stage i's module (`STAGE_PLATFORMS`; `modules_for` others);
    ``rows_in``: the server inputs of client stages that carry one row per client (the round's
    per-client keys), of which the server sends the node its slots' rows only; ``client_stages``
    and ``avals``: the node-shaped stages and their shapes.
    """

    capacity: int
    modules: dict[int, bytes]
    rows_in: frozenset[int]
    client_stages: tuple[Stage, ...] = ()
    avals: Mapping[int, Any] = dataclasses.field(default_factory=dict)
    platform_modules: dict[str, dict[int, bytes]] = dataclasses.field(default_factory=dict)


def retrace(program: Callable, args: Sequence[Any], placed: Mapping[str, str], capacity: int) -> Plan:
    """The round of ``args`` (its clients-placed leaves' leading dim resized to ``capacity``)
    traced once, its equations only (no stages): what `node_stages` takes its equations from
    when no plan of that capacity was compiled."""
    t = _inline_program(program, _resized(args, placed, lambda _n: capacity), capacity)
    return Plan(capacity, [], t.invars, t.consts, t.outvars, None, {}, t.num.avals, ops=tuple(t.ops))


def node_stages(plan: Plan, at: Plan) -> NodeStages | None:
    """``plan``'s client stages for a node hosting at most ``at.capacity`` < ``plan.capacity``
    slots, their equations taken from ``at``: the same round traced with that many clients
    (`compile_plan`, whose modules are reused where its stage is the same, or `retrace`).

    The node-shaped stages compute each client's rows as the cohort's stages do only when the
    clients count enters the client stages through their rows alone. So None, and the node runs
    the cohort's modules, when it enters otherwise:
    - the two traces differ in structure;
    - a literal or constant a client stage reads differs (a 1/n inside a client stage);
    - an ``iota`` in a client stage spans the clients (a client's row index);
    - a value crossing a client stage's boundary changes shape other than in its leading
      clients dim (sums none at all).
    """
    cap = at.capacity
    if cap >= plan.capacity or not plan.ops:
        return None
    if (len(at.ops) != len(plan.ops) or at.invars != plan.invars or set(at.consts) != set(plan.consts)
            or any(a.outs != b.outs or a.eqn.primitive is not b.eqn.primitive
                   for a, b in zip(plan.ops, at.ops, strict=True))):
        return None
    index = {id(op): k for k, op in enumerate(plan.ops)}
    kept = {i for st in plan.client_stages for i in st.outputs if i not in st.sums}
    compiled = {st.index: st for st in at.client_stages}
    modules: dict[int, bytes] = {}
    rows_in: set[int] = set()
    mine_stages = []
    for st in plan.client_stages:
        ops = tuple(at.ops[index[id(op)]] for op in st.ops)
        if not all(_same_op(a, b) for a, b in zip(st.ops, ops, strict=True)):
            return None
        for i in (*st.inputs, *st.outputs):
            full, mine = tuple(plan.avals[i].shape), tuple(at.avals[i].shape)
            per_client = full[:1] == (plan.capacity,) and mine == (cap, *full[1:])
            if i in plan.consts and not _same_value(plan.consts[i], at.consts[i]):
                return None
            if i in st.sums or (i in st.inputs and i not in kept and i not in plan.data_leaves):
                if full != mine:  # a server value read by the clients: the same, or one row each
                    if i in st.sums or not per_client:
                        return None
                    rows_in.add(i)
            elif not per_client:  # data, kept and gathered values: one row per client
                return None
        mine_st = dataclasses.replace(st, ops=ops)
        mine_stages.append(mine_st)
        same = compiled.get(st.index)
        if same is not None and same == mine_st and st.index in at.modules:
            modules[st.index] = at.modules[st.index]
        else:
            modules[st.index] = _export(mine_st, at.avals)
    return NodeStages(cap, modules, frozenset(rows_in), tuple(mine_stages), at.avals)


def _same_op(a: Op, b: Op) -> bool:
    """Whether two traces' equation is the same but for the clients count in its shapes."""
    if a.eqn.primitive is not b.eqn.primitive or a.outs != b.outs or len(a.ins) != len(b.ins):
        return False
    for x, y in zip(a.ins, b.ins, strict=True):
        if isinstance(x, Lit) != isinstance(y, Lit):
            return False
        if (x != y) if not isinstance(x, Lit) else not _same_value(x.value, y.value):
            return False
    fa, fb = _fingerprint(a.eqn), _fingerprint(b.eqn)
    return len(fa) == len(fb) and all(_same_value(x, y) for x, y in zip(fa, fb, strict=True))


def _fingerprint(eqn: Any) -> list[Any]:
    """The values in ``eqn`` the clients count could change besides shapes: the literals and
    constants of its sub-jaxprs and the shape of every ``iota`` (its own or a sub-jaxpr's)."""
    out: list[Any] = []
    if eqn.primitive.name == "iota":
        out.append(np.asarray(eqn.params["shape"]))
    for v in eqn.params.values():
        for sub in v if isinstance(v, tuple | list) else (v,):
            if isinstance(sub, jcore.ClosedJaxpr):
                out += list(sub.consts)
                sub = sub.jaxpr
            if isinstance(sub, jcore.Jaxpr):
                for e in sub.eqns:
                    out += [x.val for x in e.invars if isinstance(x, jcore.Literal)]
                    out += _fingerprint(e)
    return out


def _same_value(a: Any, b: Any) -> bool:
    """Equal shapes and elements (typed PRNG keys by their key data)."""
    def data(x: Any) -> Any:
        dtype = getattr(x, "dtype", None)
        return jax.random.key_data(x) if dtype is not None and jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key) else x

    try:
        a, b = data(a), data(b)
        return np.shape(a) == np.shape(b) and bool(np.array_equal(np.asarray(a), np.asarray(b)))
    except (TypeError, ValueError):
        return False
