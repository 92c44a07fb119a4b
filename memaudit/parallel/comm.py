"""Collectives over one mesh axis, counting the payload bytes each rank passes in.

Payload = bytes of the tensor a rank hands to the collective: the whole tensor for
all-reduce, its shard for all-gather, the full input for reduce-scatter. Collectives over
an axis of size 1 are skipped and count nothing, so the 1x1x1x1 grid costs nothing.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist

from memaudit.parallel.dims import MeshAxis, ProcessGroups

_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


class Comm:
    """Axis-named collectives for one rank, with per-(axis, collective) byte counters."""

    def __init__(self, pg: ProcessGroups) -> None:
        self.pg = pg
        self.bytes: dict[tuple[str, str], int] = defaultdict(int)
        self.calls: dict[tuple[str, str], int] = defaultdict(int)

    def size(self, axis: MeshAxis | str) -> int:
        return self.pg.size(axis)

    def index(self, axis: MeshAxis | str) -> int:
        return self.pg.index(axis)

    def _count(self, axis: MeshAxis | str, op: str, t: torch.Tensor) -> None:
        key = (MeshAxis(axis).value, op)
        self.bytes[key] += t.numel() * t.element_size()
        self.calls[key] += 1

    def reset(self) -> None:
        self.bytes.clear()
        self.calls.clear()

    def per_axis(self) -> dict[str, int]:
        out: dict[str, int] = {a.value: 0 for a in MeshAxis}
        for (axis, _), b in self.bytes.items():
            out[axis] += b
        return out

    @contextmanager
    def counting(self) -> Iterator[dict[tuple[str, str], int]]:
        """Reset the counters, run the block, and leave its counts in `self.bytes`."""
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

    def all_gather(self, shard: torch.Tensor, axis: MeshAxis | str) -> torch.Tensor:
        """Concatenate the flat shards of the axis in rank order (1-D result)."""
        n = self.size(axis)
        shard = shard.contiguous().view(-1)
        if n == 1:
            return shard
        self._count(axis, "all_gather", shard)
        out = torch.empty(shard.numel() * n, dtype=shard.dtype, device=shard.device)
        _all_gather(out, shard, group=self.pg.group(axis))
        return out

    def reduce_scatter(self, full: torch.Tensor, axis: MeshAxis | str) -> torch.Tensor:
        """Sum the flat tensors over the axis; return this rank's 1/n piece."""
        n = self.size(axis)
        full = full.contiguous().view(-1)
        if n == 1:
            return full
        self._count(axis, "reduce_scatter", full)
        out = torch.empty(full.numel() // n, dtype=full.dtype, device=full.device)
        dist.reduce_scatter_tensor(out, full, group=self.pg.group(axis))
        return out


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
