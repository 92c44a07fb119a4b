"""Collectives over one mesh axis; each one records its kind, axis, group size, payload and wire bytes.

Payload = bytes of the tensor a rank hands to the collective: the whole tensor for
all-reduce, its shard for all-gather, the full input for reduce-scatter. Wire = bytes each
rank sends under the bandwidth-optimal (ring) algorithm for a group of n ranks:

    all-reduce       2(n-1)/n x payload
    all-gather       (n-1)    x payload (the shard)
    reduce-scatter   (n-1)/n  x payload (the input)

Wire bytes are exact fractions (`fractions.Fraction`), so a prediction can be compared with
the count without rounding. Collectives over an axis of size 1 are skipped and count
nothing, so the 1x1x1x1 grid costs nothing.

References: Thakur et al., "Optimization of Collective Communication Operations in MPICH",
IJHPCA 2005 (ring costs); Singh et al., AxoNN (SC'24), Section V.

>>> wire_factor("all_gather", 4), wire_factor("all_reduce", 4), wire_factor("reduce_scatter", 4)
(Fraction(3, 1), Fraction(3, 2), Fraction(3, 4))
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterator
from contextlib import contextmanager
from fractions import Fraction
from typing import Any

import torch
import torch.distributed as dist
from torch.autograd import Variable

from memaudit.parallel.dims import MeshAxis, ProcessGroups

all_gather_into_tensor = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor

KINDS = ("all_reduce", "all_gather", "reduce_scatter")


def wire_factor(kind: str, n: int) -> Fraction:
    """Bytes each rank sends per payload byte for collective `kind` over `n` ranks (ring)."""
    if n <= 1:
        return Fraction(0)
    if kind == "all_reduce":
        return Fraction(2 * (n - 1), n)
    if kind == "all_gather":
        return Fraction(n - 1)
    if kind == "reduce_scatter":
        return Fraction(n - 1, n)
    raise ValueError(f"unknown collective kind {kind!r}; choose one of {', '.join(KINDS)}")


class Comm:
    """Axis-named collectives for one rank, with per-(axis, kind) payload, wire and call counters."""

    def __init__(self, pg: ProcessGroups) -> None:
        self.pg = pg
        self.bytes: dict[tuple[str, str], int] = defaultdict(int)
        self.wire: dict[tuple[str, str], Fraction] = defaultdict(Fraction)
        self.calls: dict[tuple[str, str], int] = defaultdict(int)
        self.group_size: dict[str, int] = {}

    def size(self, axis: MeshAxis | str) -> int:
        return self.pg.size(axis)

    def index(self, axis: MeshAxis | str) -> int:
        return self.pg.index(axis)

    def _count(self, axis: MeshAxis | str, op: str, t: torch.Tensor) -> None:
        a = MeshAxis(axis).value
        n = self.size(a)
        nbytes = t.numel() * t.element_size()
        key = (a, op)
        self.bytes[key] += nbytes
        self.wire[key] += wire_factor(op, n) * nbytes
        self.calls[key] += 1
        self.group_size[a] = n

    def reset(self) -> None:
        self.bytes.clear()
        self.wire.clear()
        self.calls.clear()
        self.group_size.clear()

    def per_axis(self) -> dict[str, int]:
        """Payload bytes per axis (all kinds)."""
        out: dict[str, int] = {a.value: 0 for a in MeshAxis}
        for (axis, _), b in self.bytes.items():
            out[axis] += b
        return out

    def records(self) -> list[dict[str, Any]]:
        """One row per (axis, kind) seen: group size, calls, payload and wire bytes."""
        return [{"axis": a, "kind": k, "n": self.group_size[a], "calls": self.calls[(a, k)],
                 "payload_bytes": b, "wire_bytes": float(self.wire[(a, k)])}
                for (a, k), b in sorted(self.bytes.items())]

    @contextmanager
    def counting(self) -> Iterator[dict[tuple[str, str], int]]:
        """Reset the counters, run the block, and leave its counts in `self.bytes` / `self.wire`."""
        self.reset()
        yield self.bytes

    # ------------------------------------------------------------------ collectives
    def all_reduce(self, t: torch.Tensor, axis: MeshAxis | str, *, op: Any = dist.ReduceOp.SUM,
                   async_op: bool = False) -> Any:
        """In place. Returns a work handle when `async_op` (None on a size-1 axis)."""
        if self.size(axis) == 1:
            return None
        self._count(axis, "all_reduce", t)
        return dist.all_reduce(t, op=op, group=self.pg.group(axis), async_op=async_op)

    def all_gather(self, shard: torch.Tensor, axis: MeshAxis | str, *, async_op: bool = False) -> Any:
        """Concatenate the flat shards of the axis in rank order (1-D result).

        With `async_op`, returns (result, work handle or None); the result is valid after `wait()`.
        """
        n = self.size(axis)
        shard = shard.contiguous().view(-1)
        if n == 1:
            return (shard, None) if async_op else shard
        self._count(axis, "all_gather", shard)
        out = torch.empty(shard.numel() * n, dtype=shard.dtype, device=shard.device)
        work = all_gather_into_tensor(out, shard, group=self.pg.group(axis), async_op=async_op)
        return (out, work) if async_op else out

    def reduce_scatter(self, full: torch.Tensor, axis: MeshAxis | str, *, async_op: bool = False) -> Any:
        """Sum the flat tensors over the axis; return this rank's 1/n piece.

        With `async_op`, returns (piece, work handle or None); the piece is valid after `wait()`.
        """
        n = self.size(axis)
        full = full.contiguous().view(-1)
        if n == 1:
            return (full, None) if async_op else full
        self._count(axis, "reduce_scatter", full)
        out = torch.empty(full.numel() // n, dtype=full.dtype, device=full.device)
        work = dist.reduce_scatter_tensor(out, full, group=self.pg.group(axis), async_op=async_op)
        return (out, work) if async_op else out


class _AllReduceFwd(torch.autograd.Function):
    """Sum partial values over an axis; backward passes the (replicated, full) gradient through."""

    @staticmethod
    def forward(ctx: Any, t: torch.Tensor, comm: Comm, axis: str) -> torch.Tensor:
        t = t.clone()
        comm.all_reduce(t, axis)
        return t

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[Any, ...]:
        return g, None, None


class _AllReduceBoth(torch.autograd.Function):
    """Sum over an axis in forward and in backward (the consumers of the sum are split)."""

    @staticmethod
    def forward(ctx: Any, t: torch.Tensor, comm: Comm, axis: str) -> torch.Tensor:
        ctx.comm, ctx.axis = comm, axis
        t = t.clone()
        comm.all_reduce(t, axis)
        return t

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[Any, ...]:
        g = g.clone()
        ctx.comm.all_reduce(g, ctx.axis)
        return g, None, None


def reduce_partial(t: torch.Tensor, comm: Comm, axis: MeshAxis | str) -> torch.Tensor:
    """Megatron's `g` operator: all-reduce in forward, identity in backward."""
    return t if comm.size(axis) == 1 else _AllReduceFwd.apply(t, comm, MeshAxis(axis).value)


def reduce_both(t: torch.Tensor, comm: Comm, axis: MeshAxis | str) -> torch.Tensor:
    """All-reduce in forward and backward (a statistic whose consumers hold different shards)."""
    return t if comm.size(axis) == 1 else _AllReduceBoth.apply(t, comm, MeshAxis(axis).value)


# ----------------------------------------------------------------------------- overlapped gradient sync
class GradSync:
    """The weight-gradient collectives of a backward pass that run asynchronously (AxoNN's ORS,
    DDP-style buckets), completed by a callback queued on the autograd engine, so `.grad` is
    final when `backward()` returns, before any optimizer step.

    Each sharded weight's gradient piece enters `weight_grad` in the order the backward
    produces it (the same on every rank), with the work handle of its z reduce-scatter when
    that is asynchronous. With `bucket_bytes`, pieces whose z reduction is done are packed in
    that order into buckets of about `bucket_bytes`; a full bucket's data all-reduce is issued
    at once, during the backward (Li et al., "PyTorch Distributed", VLDB 2020). Pieces are
    never bucketed while ghost norms are collected (DP-SGD's norm pass, whose gradients are
    discarded). Parameters synchronised here are listed in `synced` so the blocking sync
    after backward skips them (see `parallelize.sync_grads`).

    References: Singh et al., AxoNN (SC'24), Section IV-B (overlapping reduce-scatters).
    """

    def __init__(self, comm: Comm, *, async_reduce_scatter: bool, bucket_bytes: int | None,
                 norms: Any = None) -> None:
        self.comm, self.async_rs, self.bucket_bytes = comm, async_reduce_scatter, bucket_bytes
        self.norms = norms  # the model's `GhostNorms`: no buckets while it collects
        self.pending: list[tuple[torch.nn.Parameter, torch.Tensor, Any]] = []  # z reduce-scatters in flight
        self.bucket: list[tuple[torch.nn.Parameter, torch.Tensor]] = []
        self.bucket_size = 0
        self.in_flight: list[tuple[list[torch.nn.Parameter], torch.Tensor, Any]] = []
        self.synced: set[int] = set()
        self.queued = False
        self.bucketing = False
        self.async_pieces = self.buckets_issued = 0  # counters for tests and benchmarks

    @property
    def active(self) -> bool:
        return self.async_rs or self.bucket_bytes is not None

    def weight_grad(self, p: torch.nn.Parameter, piece: torch.Tensor, work: Any) -> None:
        """Take over this backward's gradient of `p` (its z-reduced piece, valid after `work`)."""
        if not self.queued:
            self.bucketing = (self.bucket_bytes is not None and self.comm.size(MeshAxis.DATA) > 1
                              and not (self.norms is not None and self.norms.active))
            Variable._execution_engine.queue_callback(self._finish)
            self.queued = True
        self.pending.append((p, piece, work))
        self.async_pieces += work is not None
        while self.pending and (self.pending[0][2] is None or self.pending[0][2].is_completed()):
            self._reduced(*self.pending.pop(0)[:2])

    def _reduced(self, p: torch.nn.Parameter, piece: torch.Tensor) -> None:
        if not self.bucketing:
            _accumulate(p, piece)
            return
        self.bucket.append((p, piece))
        self.bucket_size += piece.numel() * piece.element_size()
        if self.bucket_size >= self.bucket_bytes:
            self._flush()

    def _flush(self) -> None:
        if not self.bucket:
            return
        params = [p for p, _ in self.bucket]
        flat = torch.cat([g.reshape(-1) for _, g in self.bucket])
        self.in_flight.append((params, flat, self.comm.all_reduce(flat, MeshAxis.DATA, async_op=True)))
        self.buckets_issued += 1
        self.bucket, self.bucket_size = [], 0

    def _finish(self) -> None:
        for p, piece, work in self.pending:
            if work is not None:
                work.wait()
            self._reduced(p, piece)
        self.pending = []
        self._flush()
        for params, flat, work in self.in_flight:
            if work is not None:
                work.wait()
            off = 0
            for p in params:
                _accumulate(p, flat[off:off + p.numel()])
                off += p.numel()
                self.synced.add(id(p))
        self.in_flight, self.queued = [], False

    def take_synced(self) -> set[int]:
        """Ids of the parameters whose data all-reduce is done; forgets them."""
        out, self.synced = self.synced, set()
        return out


def _accumulate(p: torch.nn.Parameter, g: torch.Tensor) -> None:
    g = g.view_as(p)
    if p.grad is None:
        p.grad = g.clone() if g._base is not None else g
    else:
        p.grad.add_(g)
