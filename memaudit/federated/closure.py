"""The federated closure check: a program (or its derivative) communicates only through the
federated primitives.

A dataflow analysis over the jaxpr tracks, for every value, which of its dims is the clients dim:

- sources: the clients-placed inputs (the clients dim leading) and the outputs of
  ``federated_broadcast`` (dim 0); every other value is server-placed, whatever its shape (a
  model dim that happens to equal the number of clients is not theirs);
- each equation maps its inputs' clients dim onto its outputs' (an elementwise equation keeps
  it, a ``transpose`` permutes it, a ``reduce_sum`` over other axes shifts it, a ``dot_general``
  carries it as a batch or free dim, a ``reshape`` keeps it when it neither splits nor merges
  it, ...: one rule per kind of equation, `_RULES`, read from the equation's params);
- an equation that reduces, contracts, cumulates, sorts, reverses, slices, indexes, concatenates,
  pads or reshapes across the clients dim, or that pairs every client with every other (an
  outer product ``h @ h.T``), is communication outside the federated primitives: `ClosureError`.
  So are ``federated_sum`` / ``federated_mean`` of a value whose clients dim is not leading, and
  a collective (``psum``, ``all_gather``, ...) over the clients mesh axis.

A server value may meet a clients-placed one (a server value read by every client, or read row
by row: row i by client i, as the per-client keys a round splits on the server): that moves
nothing the program did not send. Its derivative is where the communication shows: a gradient
with respect to a server value read by the clients without ``federated_broadcast`` sums over
the clients dim, which is refused.

A loop (``scan``) over the clients (one of its ``xs`` has the clients dim leading) runs one
client per iteration: in its body a value computed from the client's slice is *that client's*
(`ROW`). Such a value may not reach the loop's carry (a sum over the clients accumulated in the
loop: what reverse mode makes of a server value the clients read from a loop constant rather
than from ``federated_broadcast``), nor meet a clients-placed value read whole (client i would
read every client's rows). A loop over anything else (rounds, local steps) moves nothing by
itself; its carry keeps the clients dim where its body keeps it.

The loop of the scan strategy of `memaudit.federated.federated_map` reads the value sent with
``federated_broadcast`` as a loop constant: a broadcast. Its JVP reads the value through
``broadcast_row`` (`memaudit.federated.primitives_impl`), whose derivative is the broadcast's, so
the gradient of rounds that each take a gradient passes under either strategy. A ``pjit`` named
in `FUSED_NAMES` is one of memaudit's fused federated loops (`memaudit.federated.federated_map_sum`):
its derivatives are federated by construction, so it counts as that communication (its outputs
are server-placed).

`communication_of` reads which inputs are clients-placed from ``placed``; without it, every
input whose leading dim is the clients count is, except one the program reads as a server value
(it broadcasts it, or a loop over the clients reads it whole): a parameter whose leading dim
equals the clients count. `placements` is the same analysis, one equation at a time, for the
partitioner (`memaudit.federated.flower.partition`), which knows its placed inputs.

References:
    Rush et al. 2024, "FAX: Scalable and Differentiable Federated Primitives in JAX",
    section 3 (federated AD: the derivative of a federated program is a federated program).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.extend.core

from memaudit.federated.primitives_impl import PRIMITIVE_NAMES
from memaudit.federated.sharding import MeshAxis

FUSED_NAMES = frozenset({"federated_map_sum"})
_COLLECTIVES = frozenset({"psum", "psum_invariant", "pmax", "pmin", "all_gather", "all_to_all",
                          "ppermute", "reduce_scatter", "psum_scatter", "pbroadcast"})

ROW = "row"
"""The placement of one client's value inside a loop over the clients."""
KNOWN = -1
"""The source of a clients dim that is certain (a declared input, a broadcast's output)."""


class ClosureError(AssertionError):
    """A jaxpr moves data between placements outside the federated primitives."""


class Clients(tuple):
    """A clients-placed value's placement: ``(dim, sources)``, ``sources`` the inputs its
    clients dim comes from (`KNOWN` for a certain one)."""

    __slots__ = ()

    def __new__(cls, dim: int, src: frozenset = frozenset({KNOWN})):
        return super().__new__(cls, (dim, src))

    @property
    def dim(self) -> int:
        return self[0]

    @property
    def src(self) -> frozenset:
        return self[1]


Placement = Any  # None (server) | Clients | ROW


class _Refused(Exception):
    """A rule's refusal: why, without the equation (the walker adds it)."""


class _Demote(Exception):  # not an error: the inference retries without these inputs
    """An inferred clients-placed input read as a server value: ``src`` are those inputs."""

    def __init__(self, src: frozenset) -> None:
        super().__init__(src)
        self.src = src


def _shape(v) -> tuple:
    return tuple(getattr(getattr(v, "aval", None), "shape", ()) or ())


def _describe(eqn) -> str:
    text = str(eqn)
    if "\n" in text or len(text) > 240:
        ins = ", ".join(str(_shape(v)) for v in eqn.invars)
        outs = ", ".join(str(_shape(v)) for v in eqn.outvars)
        text = f"{eqn.primitive.name} ({ins}) -> ({outs})"
    return text


def _refuse(eqn, why: str) -> ClosureError:
    return ClosureError(f"non-federated communication: {eqn.primitive.name} {why}: {_describe(eqn)}")


# ------------------------------------------------------------------ rules: clients dim in -> out
# A rule gets the clients dim of each input (None: server) and returns each output's; it raises
# `_Refused` when the equation moves data across the clients dim.


def _agree(dims: Sequence[int | None]) -> int:
    found = {d for d in dims if d is not None}
    if len(found) > 1:
        raise _Refused(f"lines up different dims of clients-placed inputs {sorted(found)}")
    return found.pop()


def _axes(value) -> tuple[int, ...]:
    if value is None:
        return ()
    return tuple(int(a) for a in (value if isinstance(value, (tuple, list)) else (value,)))


def _reduce(key: str) -> Callable:
    def rule(eqn, dims):
        c = _agree(dims)
        axes = _axes(eqn.params[key])
        if c in axes:
            raise _Refused("reduces over the clients dim")
        return [c - sum(a < c for a in axes)] * len(eqn.outvars)

    return rule


def _along(key: str) -> Callable:
    """Equations that keep their operands' shape and mix elements along ``params[key]``."""
    def rule(eqn, dims):
        c = _agree(dims)
        if c in _axes(eqn.params[key]):
            raise _Refused("mixes values along the clients dim")
        return [c] * len(eqn.outvars)

    return rule


def _along_last(eqn, dims):
    c = _agree(dims)
    if c == len(_shape(eqn.invars[0])) - 1:
        raise _Refused("mixes values along the clients dim")
    return [c] * len(eqn.outvars)


def _batched_matrix(eqn, dims):
    """Linear algebra over the two trailing dims, batched over the leading ones."""
    c = _agree(dims)
    if c >= len(_shape(eqn.invars[0])) - 2:
        raise _Refused("mixes values along the clients dim")
    return [c] * len(eqn.outvars)


def _leading(eqn, dims):
    """Random-key equations: the operand's leading dims lead the output."""
    c = _agree(dims)
    rank = min(len(_shape(v)) for v in [*eqn.invars, *eqn.outvars] if _shape(v))
    if c >= rank:
        raise _Refused("mixes values along the clients dim")
    return [c] * len(eqn.outvars)


def _dot(eqn, dims):
    (lc, rc), (lb, rb) = eqn.params["dimension_numbers"]
    lc, rc, lb, rb = (_axes(x) for x in (lc, rc, lb, rb))
    lhs, rhs = (len(_shape(v)) for v in eqn.invars[:2])
    lfree = [d for d in range(lhs) if d not in lc and d not in lb]
    rfree = [d for d in range(rhs) if d not in rc and d not in rb]
    out = []
    for c, contract, batch, free, offset in ((dims[0], lc, lb, lfree, len(lb)),
                                             (dims[1], rc, rb, rfree, len(lb) + len(lfree))):
        if c is None:
            continue
        if c in contract:
            raise _Refused("contracts over the clients dim")
        out.append(batch.index(c) if c in batch else offset + free.index(c))
    if len(out) == 2 and out[0] != out[1]:
        raise _Refused("pairs every client's value with every other client's")
    return [out[0]]


def _transpose(eqn, dims):
    return [list(_axes(eqn.params["permutation"])).index(dims[0])]


def _broadcast_in_dim(eqn, dims):
    c = dims[0]
    out = _axes(eqn.params["broadcast_dimensions"])[c]
    if _shape(eqn.invars[0])[c] != _shape(eqn.outvars[0])[out]:
        raise _Refused("copies clients across the clients dim")
    return [out]


def _reshape(eqn, dims):
    """A reshape keeps the clients dim when the dims before it hold as many elements in and out
    and it stays one dim of the same size: then element (..., i, ...) stays client i's."""
    c = dims[0]
    src, dst = _shape(eqn.invars[0]), _shape(eqn.outvars[0])
    before = math.prod(src[:c])
    for k in range(len(dst)):
        if math.prod(dst[:k]) == before and dst[k] == src[c]:
            return [k]
    raise _Refused("merges or splits the clients dim")


def _squeeze(eqn, dims):
    c, gone = dims[0], _axes(eqn.params["dimensions"])
    if c in gone:
        raise _Refused("drops the clients dim")
    return [c - sum(d < c for d in gone)]


def _concatenate(eqn, dims):
    c = _agree(dims)
    if c == eqn.params["dimension"]:
        raise _Refused("concatenates along the clients dim")
    return [c]


def _pad(eqn, dims):
    if dims[1] is not None:
        raise _Refused("pads with a clients-placed value")
    c = dims[0]
    if tuple(eqn.params["padding_config"][c]) != (0, 0, 0):
        raise _Refused("pads the clients dim")
    return [c]


def _slice(eqn, dims):
    c, n = dims[0], _shape(eqn.invars[0])[dims[0]]
    p = eqn.params
    stride = 1 if p["strides"] is None else p["strides"][c]
    if (p["start_indices"][c], p["limit_indices"][c], stride) != (0, n, 1):
        raise _Refused("selects some of the clients")
    return [c]


def _dynamic_slice(eqn, dims):
    if any(d is not None for d in dims[1:]):
        raise _Refused("indexes with a clients-placed index")
    c = dims[0]
    if eqn.params["slice_sizes"][c] != _shape(eqn.invars[0])[c]:
        raise _Refused("selects some of the clients")
    return [c]


def _dynamic_update_slice(eqn, dims):
    if any(d is not None for d in dims[2:]):
        raise _Refused("indexes with a clients-placed index")
    c = _agree(dims[:2])
    if _shape(eqn.invars[1])[c] != _shape(eqn.invars[0])[c]:
        raise _Refused("writes into some of the clients' rows")
    return [c]


def _gather(eqn, dims):
    """The clients dim of a gather's output: the operand's (a batching dim, or a dim sliced
    whole) or the indices' (a batch dim of the indices); never one indexed into."""
    dn = eqn.params["dimension_numbers"]
    operand, indices = _shape(eqn.invars[0]), _shape(eqn.invars[1])
    offset_dims = _axes(dn.offset_dims)
    rank = len(indices) - 1 + len(offset_dims)
    batch_out = [d for d in range(rank) if d not in offset_dims]  # the indices' batch dims
    obd, ibd = _axes(dn.operand_batching_dims), _axes(dn.start_indices_batching_dims)
    windows = [d for d in range(len(operand)) if d not in _axes(dn.collapsed_slice_dims) and d not in obd]
    out = []
    c = dims[0]
    if c is not None:
        if c in obd:
            out.append(batch_out[ibd[obd.index(c)]])
        elif c in _axes(dn.start_index_map) or c not in windows:
            raise _Refused("indexes into the clients dim")
        elif eqn.params["slice_sizes"][c] != operand[c]:
            raise _Refused("selects some of the clients")
        else:
            out.append(offset_dims[windows.index(c)])
    c = dims[1]
    if c is not None:
        if c == len(indices) - 1:
            raise _Refused("indexes with the clients dim as the index vector")
        out.append(batch_out[c])
    if len(out) == 2 and out[0] != out[1]:
        raise _Refused("pairs every client's value with every other client's")
    return [out[0]]


def _scatter(eqn, dims):
    """A scatter keeps the clients dim only as a batching dim of operand, indices and updates
    alike, or as a window dim written whole; updates of different clients never meet."""
    dn = eqn.params["dimension_numbers"]
    operand, updates = _shape(eqn.invars[0]), _shape(eqn.invars[2])
    uwd, obd, ibd = _axes(dn.update_window_dims), _axes(dn.operand_batching_dims), _axes(
        dn.scatter_indices_batching_dims)
    windows = [d for d in range(len(operand)) if d not in _axes(dn.inserted_window_dims) and d not in obd]
    scatter_dims = [d for d in range(len(updates)) if d not in uwd]  # the indices' batch dims, in order
    co, ci, cu = dims[:3]
    if any(d is not None for d in dims[3:]):
        raise _Refused("scatters with clients-placed operands it cannot place")
    out = set()
    if co is not None:
        if co in obd or (co in windows and uwd and updates[uwd[windows.index(co)]] == operand[co]):
            out.add(co)
        else:
            raise _Refused("writes across the clients dim")
    if ci is not None:
        if ci not in ibd:
            raise _Refused("scatters each client's values to positions other clients share")
        out.add(obd[ibd.index(ci)])
    if cu is not None:
        if cu in uwd:
            d = windows[uwd.index(cu)]
            if updates[cu] != operand[d]:
                raise _Refused("writes into some of the clients' rows")
            out.add(d)
        elif scatter_dims.index(cu) in ibd:
            out.add(obd[ibd.index(scatter_dims.index(cu))])
        else:
            raise _Refused("scatters each client's values to positions other clients share")
    if len(out) > 1:
        raise _Refused("lines up different dims of clients-placed inputs")
    return [out.pop()]


def _window(eqn, dims):
    """Windowed reductions (``reduce_window_*``, ``select_and_*``): the clients dim keeps a
    window of one, stride one and no padding."""
    c = _agree(dims)
    p = eqn.params
    one = all(p.get(k) is None or tuple(p[k])[c] == 1 for k in ("window_dimensions", "window_strides",
                                                                  "base_dilation", "window_dilation"))
    if not one or tuple(p.get("padding", ((0, 0),) * (c + 1))[c]) != (0, 0):
        raise _Refused("mixes values along the clients dim")
    return [c] * len(eqn.outvars)


def _split(eqn, dims):
    c = dims[0]
    if c == eqn.params["axis"]:
        raise _Refused("splits the clients dim")
    return [c] * len(eqn.outvars)


_RULES: dict[str, Callable] = {
    **{name: _reduce("axes") for name in ("reduce_sum", "reduce_max", "reduce_min", "reduce_prod",
                                          "reduce_and", "reduce_or", "reduce_xor", "argmax", "argmin")},
    "reduce": _reduce("dimensions"),
    **{name: _along("axis") for name in ("cumsum", "cumprod", "cummax", "cummin", "cumlogsumexp")},
    "sort": _along("dimension"),
    "rev": _along("dimensions"),
    "top_k": _along_last,
    "fft": _along_last,
    **{name: _batched_matrix for name in ("cholesky", "triangular_solve", "eigh", "lu", "qr", "svd",
                                          "householder_product", "lu_pivots_to_permutation")},
    **{name: _leading for name in ("random_bits", "random_split", "random_wrap", "random_unwrap",
                                   "random_fold_in", "random_seed")},
    "dot_general": _dot,
    "transpose": _transpose,
    "broadcast_in_dim": _broadcast_in_dim,
    "reshape": _reshape,
    "squeeze": _squeeze,
    "concatenate": _concatenate,
    "pad": _pad,
    "slice": _slice,
    "dynamic_slice": _dynamic_slice,
    "dynamic_update_slice": _dynamic_update_slice,
    "gather": _gather,
    **{name: _scatter for name in ("scatter", "scatter-add", "scatter_add", "scatter-mul", "scatter_mul",
                                   "scatter-min", "scatter_min", "scatter-max", "scatter_max")},
    "split": _split,
    **{name: _window for name in ("reduce_window_sum", "reduce_window_max", "reduce_window_min",
                                  "reduce_window", "select_and_scatter_add", "select_and_gather_add")},
}
_AXIS_PARAMS = frozenset({"axis", "axes", "dimension", "dimensions", "dimension_numbers",
                          "window_dimensions"})


def _generic(eqn, dims):
    """Elementwise equations (operands of the output's shape, or of size 1 where a server value
    is read by every client; scalars aside) keep the clients dim; so do equations whose i-th
    output is shaped as their i-th operand (``device_put``, ``optimization_barrier``). Any other
    equation is refused: memaudit cannot tell where it moves the clients dim."""
    if not _AXIS_PARAMS & set(eqn.params):
        outs = {_shape(v) for v in eqn.outvars}
        out = outs.pop() if len(outs) == 1 else None
        arrays = [(_shape(v), d) for v, d in zip(eqn.invars, dims, strict=True) if _shape(v)]
        if out is not None and all(len(s) == len(out) and all(a in (b, 1) for a, b in zip(s, out, strict=True))
                                   for s, _ in arrays):
            c = _agree(dims)
            if any(d is not None and s[c] != out[c] for s, d in arrays):
                raise _Refused("copies one client's value to every client")
            return [c] * len(eqn.outvars)
        if len(eqn.invars) == len(eqn.outvars) and all(
                _shape(a) == _shape(b) for a, b in zip(eqn.invars, eqn.outvars, strict=True)):
            return list(dims)
    raise _Refused("has a clients-placed operand and memaudit cannot tell where it moves the clients dim")


# ------------------------------------------------------------------ the walker
class _Walker:
    def __init__(self, axis: str | None) -> None:
        self.axis = axis
        self.names: set[str] = set()

    def jaxpr(self, jaxpr: Any, ins: Sequence[Placement]) -> list[Placement]:
        """The placements of ``jaxpr``'s outputs from its inputs'."""
        jaxpr = getattr(jaxpr, "jaxpr", jaxpr)
        env: dict = dict.fromkeys(jaxpr.constvars)  # constants: server values
        env.update(zip(jaxpr.invars, ins, strict=True))
        for eqn in jaxpr.eqns:
            outs = self.eqn(eqn, [_read(env, v) for v in eqn.invars])
            env.update(zip(eqn.outvars, outs, strict=True))
        return [_read(env, v) for v in jaxpr.outvars]

    def eqn(self, eqn, ins: Sequence[Placement]) -> list[Placement]:
        """The placements of ``eqn``'s outputs, or `ClosureError`."""
        name = eqn.primitive.name
        n_out = len(eqn.outvars)
        if name in PRIMITIVE_NAMES:
            self.names.add(name)
            return self._federated(eqn, ins)
        if name in ("pjit", "jit") and eqn.params.get("name") in FUSED_NAMES:
            self.names.add(eqn.params["name"])
            if ROW in ins:
                raise _refuse(eqn, "runs inside one client's computation")
            return [None] * n_out
        if name in _COLLECTIVES:
            axes = eqn.params.get("axes", eqn.params.get("axis_name", ()))
            axes = axes if isinstance(axes, (tuple, list, frozenset, set)) else (axes,)
            if self.axis is not None and self.axis in axes:
                raise ClosureError(f"non-federated communication: {name} over {self.axis!r}: {_describe(eqn)}")
            if len(ins) == n_out and all(_shape(a) == _shape(b) for a, b in zip(eqn.invars, eqn.outvars,
                                                                             strict=True)):
                return list(ins)  # over another mesh axis: each value keeps its clients dim
        if name not in _RULES and _subjaxprs(eqn):
            return self._higher_order(eqn, ins)
        clients = [p for p in ins if isinstance(p, Clients)]
        if not clients:
            return [ROW if ROW in ins else None] * n_out
        if ROW in ins:
            src = frozenset().union(*(p.src for p in clients))
            if KNOWN not in src:
                raise _Demote(src)
            raise _refuse(eqn, "combines one client's value with every client's (a clients-placed "
                               "value read whole inside a loop over the clients)")
        dims = [p.dim if isinstance(p, Clients) else None for p in ins]
        try:
            out = _RULES.get(name, _generic)(eqn, dims)
        except _Refused as e:
            raise _refuse(eqn, str(e)) from None
        src = frozenset().union(*(p.src for p in clients))
        return [None if d is None else Clients(d, src) for d in out]

    def _federated(self, eqn, ins):
        (p,) = ins
        name = eqn.primitive.name
        if name == "federated_broadcast":
            if isinstance(p, Clients):
                if KNOWN not in p.src:
                    raise _Demote(p.src)
                raise _refuse(eqn, "of a clients-placed value")
            if p == ROW:
                raise _refuse(eqn, "inside one client's computation")
            return [Clients(0)]
        if p == ROW:
            raise _refuse(eqn, "inside one client's computation")
        if isinstance(p, Clients) and p.dim != 0:
            raise _refuse(eqn, f"over dim 0 of a value whose clients dim is {p.dim}")
        return [None]

    def _higher_order(self, eqn, ins):
        name, p = eqn.primitive.name, eqn.params
        if name == "scan":
            return self._scan(eqn, ins)
        if name == "while":
            nc, nb = p["cond_nconsts"], p["body_nconsts"]
            cond_c, body_c, carry = ins[:nc], ins[nc:nc + nb], list(ins[nc + nb:])
            for _ in range(len(carry) + 2):
                new = [_join(a, b, eqn) for a, b in zip(carry, self.jaxpr(p["body_jaxpr"], [*body_c, *carry]),
                                                        strict=True)]
                if new == carry:
                    break
                carry = new
            (pred,) = self.jaxpr(p["cond_jaxpr"], [*cond_c, *carry])
            if pred == ROW:  # a per-client trip count: every output is the client's
                carry = [ROW if c is None else c for c in carry]
            return carry
        if name == "cond":
            index, ops = ins[0], ins[1:]
            outs = [self.jaxpr(b, ops) for b in p["branches"]]
            joined = outs[0]
            for o in outs[1:]:
                joined = [_join(a, b, eqn) for a, b in zip(joined, o, strict=True)]
            if index == ROW:
                joined = [ROW if j is None else j for j in joined]
            return joined
        body = _body(eqn)
        if body is None:
            if any(isinstance(x, Clients) for x in ins):
                raise _refuse(eqn, "has a clients-placed operand and memaudit cannot tell where it "
                                   "moves the clients dim")
            return [ROW if ROW in ins else None] * len(eqn.outvars)
        return self.jaxpr(body, ins)

    def _scan(self, eqn, ins):
        p = eqn.params
        nc, ncar = p["num_consts"], p["num_carry"]
        consts, carry, xs = ins[:nc], list(ins[nc:nc + ncar]), ins[nc + ncar:]
        over_clients = any(isinstance(x, Clients) and x.dim == 0 for x in xs)
        rows = [ROW if isinstance(x, Clients) and x.dim == 0 else
                Clients(x.dim - 1, x.src) if isinstance(x, Clients) else x for x in xs]
        for _ in range(len(carry) + 2):
            outs = self.jaxpr(p["jaxpr"], [*consts, *carry, *rows])
            new = [_join(a, b, eqn) for a, b in zip(carry, outs[:ncar], strict=True)]
            if over_clients and ROW in new:
                raise _refuse(eqn, "over the clients carries a server value computed from each "
                                   "client's (a sum over the clients accumulated in the loop)")
            if new == carry:
                break
            carry = new
        ys = [Clients(0) if over_clients and y in (ROW,) else
              Clients(y.dim + 1, y.src) if isinstance(y, Clients) else y for y in outs[ncar:]]
        return [*carry, *ys]


def _join(a: Placement, b: Placement, eqn) -> Placement:
    """The placement of a value that is ``a`` or ``b`` (a loop's carry, a cond's branches)."""
    if a == b or b is None:
        return a
    if a is None:
        return b
    if isinstance(a, Clients) and isinstance(b, Clients) and a.dim == b.dim:
        return Clients(a.dim, a.src | b.src)
    raise _refuse(eqn, "moves the clients dim between iterations or branches")


def _read(env: dict, v) -> Placement:
    return None if isinstance(v, jax.extend.core.Literal) else env[v]


def _subjaxprs(eqn) -> list:
    out = []
    for v in eqn.params.values():
        for s in v if isinstance(v, (tuple, list)) else (v,):
            if isinstance(s, (jax.extend.core.ClosedJaxpr, jax.extend.core.Jaxpr)):
                out.append(s)
    return out


_BODY_PARAMS = {"pjit": "jaxpr", "jit": "jaxpr", "closed_call": "call_jaxpr", "core_call": "call_jaxpr",
                "checkpoint": "jaxpr", "remat2": "jaxpr", "custom_jvp_call": "call_jaxpr",
                "custom_vjp_call": "call_jaxpr", "custom_vjp_call_jaxpr": "fun_jaxpr",
                "shard_map": "jaxpr", "custom_lin": None}


def _body(eqn) -> Any:
    """The body whose inputs are ``eqn``'s, in order, for call-like equations; None otherwise."""
    key = _BODY_PARAMS.get(eqn.primitive.name)
    body = eqn.params.get(key) if key else None
    if body is None:
        return None
    n = len(getattr(body, "jaxpr", body).invars)
    return body if n == len(eqn.invars) else None


# ------------------------------------------------------------------ entry points
def placements(eqn: Any, ins: Sequence[Placement], *, axis: str | None = MeshAxis.CLIENTS) -> tuple[
        list[Placement], set[str]]:
    """One equation's output placements from its inputs' (None: server; `Clients` ``(dim,
    src)``), and the federated primitives it calls (``eqn`` may hold sub-jaxprs).

    Raises:
        ClosureError: the equation moves data across the clients dim outside the primitives.
    """
    walker = _Walker(axis)
    try:
        return walker.eqn(eqn, ins), walker.names
    except _Demote as e:  # only inferred inputs are demoted; the caller's are certain
        raise ClosureError(f"non-federated communication: a clients-placed value read as a server "
                           f"value: {_describe(eqn)}") from e


def communication_of(jaxpr: Any, clients: int, *, axis: str | None = MeshAxis.CLIENTS,
                     placed: Sequence[int] | None = None) -> set[str]:
    """Names of the federated primitives (and fused loops) in ``jaxpr``; raises `ClosureError`
    on any other equation that moves data across the clients dim (see the module docstring).

    Args:
        jaxpr: a ``ClosedJaxpr`` or ``Jaxpr`` (``jax.make_jaxpr(program)(...)``).
        clients: the clients dim as laid out (n, or the padded n of a mesh).
        axis: the clients mesh axis name, for collectives.
        placed: indices of the jaxpr's inputs that are clients-placed (the clients dim leading);
            None: every input whose leading dim is ``clients``, except those the program reads
            as server values.
    """
    invars = getattr(jaxpr, "jaxpr", jaxpr).invars
    if placed is not None:
        known = set(placed)
        ins = [Clients(0) if k in known else None for k in range(len(invars))]
        return _run(jaxpr, ins, axis)
    candidates = {k for k, v in enumerate(invars) if _shape(v)[:1] == (clients,)}
    while True:
        ins = [Clients(0, frozenset({k})) if k in candidates else None for k in range(len(invars))]
        try:
            return _run(jaxpr, ins, axis)
        except _Demote as e:
            candidates -= e.src


def _run(jaxpr: Any, ins: list, axis: str | None) -> set[str]:
    walker = _Walker(axis)
    walker.jaxpr(jaxpr, ins)
    return walker.names
