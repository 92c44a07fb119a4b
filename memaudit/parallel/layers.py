"""AxoNN's 3D tensor-parallel Linear and the vocabulary-parallel embedding and cross-entropy.

For a weight W (out x in), a *normal* layer splits in-features over x and out-features over
y; a *transposed* layer swaps the roles. z shards the remaining (out_l x in_l) block as a flat,
zero-padded vector (FSDP-like). Forward: all-gather W over z, local matmul, all-reduce the
partial outputs over the in-feature axis. Backward: all-gather W over z again (the full block
is not kept), all-reduce the input gradient over the out-feature axis (optionally overlapped
with the weight-gradient matmul), reduce-scatter the weight gradient over z.

AxoNN's three overlaps, each switchable (`parallelize_llama`): OAR, the input-gradient
all-reduce runs during the weight-gradient matmul; ORS, the z reduce-scatter of the weight
gradient is asynchronous and handed to the model's `GradSync`, which waits for it at the end
of backward (and may all-reduce it over data in DDP-style buckets there and then); OAG, each
layer issues the next layer's z all-gather (the previous layer's in backward) before its own
matmuls.

References:
  Singh et al., "A 4D Hybrid Algorithm to Scale Parallel Training to Thousands of GPUs",
  SC'24 (AxoNN), Algorithm 1. Shoeybi et al., "Megatron-LM", 2019 (vocab-parallel loss).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from memaudit.parallel import ghost
from memaudit.parallel.comm import Comm, GradSync, reduce_partial
from memaudit.parallel.dims import MeshAxis, ParallelDims
from memaudit.parallel.ghost import GhostNorms
from memaudit.train.noise import matrix_shape


# ----------------------------------------------------------------------------- sharding
@dataclass(frozen=True)
class ShardSpec:
    """How one logical parameter maps to this rank's local tensor.

    `row`/`col` name the axis splitting dim 0 / dim 1 (or None); `z_flat` says the block is
    flattened, padded and split over z. `replicated` lists the axes (of x, y, z) that hold
    identical copies; gradients are summed over `sync_axes` after backward.
    """

    full_shape: tuple[int, ...]
    row: str | None
    col: str | None
    z_flat: bool
    replicated: tuple[str, ...]
    sync_axes: tuple[str, ...]

    def local(self, full: torch.Tensor, comm: Comm, *, pad: float = 0.0) -> torch.Tensor:
        t = full
        for dim, axis in ((0, self.row), (1, self.col)):
            if axis is not None:
                n, i = comm.size(axis), comm.index(axis)
                k = t.shape[dim] // n
                t = t.narrow(dim, i * k, k)
        if not self.z_flat:
            return t.contiguous()
        return z_piece(t.reshape(-1), comm, pad=pad)

    def local_of(self, block: Callable[[tuple[int, int], tuple[int, int]], torch.Tensor], comm: Comm, *,
                 pad: float = 0.0) -> torch.Tensor:
        """What `local` cuts from the whole tensor, from blocks of it alone.

        ``block(rows, cols)`` returns those [start, stop) spans of the tensor read as a matrix
        (`matrix_shape`: the first dimension by the rest). It is called
        once, for the rows and columns of this rank's elements: its row and column share, and
        under z only the rows its piece of the flattened block meets (at most two of them in part).
        """
        shape = self.full_shape
        if len(shape) > 2 and self.col is not None:
            raise ValueError(f"a {len(shape)}-d parameter split along dim 1 has no block of its own")
        spans = [(0, n) for n in matrix_shape(shape)]
        for dim, axis in ((0, self.row), (1, self.col)):
            if axis is not None:
                n, i = comm.size(axis), comm.index(axis)
                k = (spans[dim][1] - spans[dim][0]) // n
                spans[dim] = (i * k, i * k + k)
        (r0, r1), (c0, c1) = spans
        if not self.z_flat:
            own = (r1 - r0, c1 - c0)[:len(shape)] if len(shape) <= 2 else (r1 - r0, *shape[1:])
            return block((r0, r1), (c0, c1)).reshape(own).contiguous()
        width, numel = c1 - c0, (r1 - r0) * (c1 - c0)
        per = math.ceil(numel / comm.size(MeshAxis.Z))
        f0 = min(comm.index(MeshAxis.Z) * per, numel)
        f1 = min(f0 + per, numel)
        first, stop = (f0 // width, -(-f1 // width)) if f1 > f0 else (0, 0)  # a piece of padding only: no rows
        got = block((r0 + first, r0 + stop), (c0, c1)).reshape(-1)
        out = got.new_full((per,), pad)
        out[: f1 - f0] = got[f0 - first * width:f1 - first * width]
        return out

    def flat_index(self, dims: ParallelDims, rank: int, *, device: Any = None) -> torch.Tensor:
        """Where each element of rank `rank`'s shard sits in the flattened full tensor (-1 for
        z padding): this layout applied to `arange`, for any grid, without process groups."""
        numel = math.prod(self.full_shape)
        ar = torch.arange(numel, dtype=torch.int64, device=device).view(self.full_shape)
        return self.local(ar, RankOnGrid(dims, rank), pad=-1).reshape(-1)

    def to_json(self) -> dict[str, Any]:
        return {"full_shape": list(self.full_shape), "row": self.row, "col": self.col, "z_flat": self.z_flat}

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> ShardSpec:
        """The slicing of a saved layout (enough to place and cut shards; no gradient axes)."""
        return cls(tuple(int(n) for n in d["full_shape"]), d["row"], d["col"], bool(d["z_flat"]), (), ())


class RankOnGrid:
    """The sizes of a grid and the coordinates of one of its ranks, as `Comm` reports them: a
    rank's shard of any grid (`ShardSpec.local`, `ShardSpec.local_of`) without process groups."""

    def __init__(self, dims: ParallelDims, rank: int) -> None:
        self.dims, self.coords = dims, dims.coords(rank)

    def size(self, axis: str) -> int:
        return self.dims.size(axis)

    def index(self, axis: str) -> int:
        return self.coords[str(axis)]


def assemble(spec: ShardSpec, dims: ParallelDims, pieces: dict[int, torch.Tensor]) -> torch.Tensor:
    """The full tensor from the shards of `dims`' tensor-parallel ranks 0..x*y*z-1 (`pieces`
    maps rank -> its local tensor; data replicas hold copies and are not needed)."""
    first = next(iter(pieces.values()))
    full = torch.zeros(math.prod(spec.full_shape), dtype=first.dtype, device=first.device)
    for r in range(dims.tp_size):
        idx = spec.flat_index(dims, r, device=first.device)
        keep = idx >= 0
        full[idx[keep]] = pieces[r].reshape(-1)[keep]
    return full.view(spec.full_shape)


def z_piece(flat: torch.Tensor, comm: Comm, *, pad: float = 0.0) -> torch.Tensor:
    n = comm.size(MeshAxis.Z)
    per = math.ceil(flat.numel() / n)
    if per * n != flat.numel():
        flat = torch.cat([flat, flat.new_full((per * n - flat.numel(),), pad)])
    i = comm.index(MeshAxis.Z)
    return flat[i * per:(i + 1) * per].clone()


def _pad_to(flat: torch.Tensor, n: int) -> torch.Tensor:
    extra = (-flat.numel()) % n
    return flat if extra == 0 else torch.cat([flat, flat.new_zeros(extra)])


def gather_block(shard: torch.Tensor, comm: Comm, shape: tuple[int, int]) -> torch.Tensor:
    """All-gather a z-flat shard and view it as the (rows x cols) block."""
    full = comm.all_gather(shard, MeshAxis.Z)
    return full[: shape[0] * shape[1]].view(shape)


# ----------------------------------------------------------------------------- prefetch
def _in_backward() -> bool:
    return torch._C._current_graph_task_id() != -1


class _Gathered:
    """A weight's full block, gathered on demand or prefetched one layer ahead (OAG).

    `chain` links the tensor-parallel weights in forward order (`prev`/`next`, set by
    `parallelize_llama`); with `prefetch`, a layer issues the asynchronous z all-gather of the
    next layer's weights in forward (of the previous one in backward) before its own matmuls.
    Prefetching is skipped while activations are recomputed inside backward, where the
    forward order does not predict the next layer to run. In backward the previous layers whose
    backward does not run are passed over (`backward`: set by the owner's forward; under LoRA a
    frozen layer whose input needs no gradient has none), so no gathered block is left unused.
    """

    def __init__(self, comm: Comm, shape: tuple[int, int], prefetch: bool) -> None:
        self.comm, self.shape, self.prefetch = comm, shape, prefetch
        self.prev: _Gathered | None = None
        self.next: _Gathered | None = None
        self.shard: torch.Tensor | None = None  # the parameter, set by the owner
        self.ahead: dict[str, tuple[torch.Tensor, Any, int]] = {}
        self.hits = 0  # prefetched blocks used (for tests and benchmarks)
        self.backward = True  # whether the owner's last forward (with grad enabled) left it a backward

    def issue(self, phase: str) -> None:
        if phase not in self.ahead and self.shard is not None:
            full, work = self.comm.all_gather(self.shard.detach(), MeshAxis.Z, async_op=True)
            self.ahead[phase] = (full, work, self.shard._version)

    def block(self, phase: str) -> torch.Tensor:
        """This weight's (rows x cols) block; then prefetch the neighbour that runs next."""
        full = None
        if phase in self.ahead:
            full, work, version = self.ahead.pop(phase)
            if work is not None:
                work.wait()
            if version != self.shard._version:  # updated since the prefetch: never use stale weights
                full = None
            else:
                self.hits += 1
        if full is None:
            full = self.comm.all_gather(self.shard.detach(), MeshAxis.Z)
        if self.prefetch:
            if phase == "fwd":
                nxt = None if _in_backward() else self.next
            else:
                nxt = self.prev
                while nxt is not None and not nxt.backward:
                    nxt = nxt.prev
            if nxt is not None:
                nxt.issue(phase)
        return full[: self.shape[0] * self.shape[1]].view(self.shape)


# ----------------------------------------------------------------------------- linear
def _weight_grad(ctx: Any, grad_w: torch.Tensor) -> torch.Tensor | None:
    """The z reduce-scatter of a weight gradient: returned to autograd (blocking), or handed to
    the model's `GradSync` (ORS and/or DDP-style data buckets)."""
    comm, sync = ctx.comm, ctx.sync
    padded = _pad_to(grad_w.reshape(-1), comm.size(MeshAxis.Z))
    if sync is None or not sync.active:
        return comm.reduce_scatter(padded, MeshAxis.Z)
    if sync.async_rs:
        piece, work = comm.reduce_scatter(padded, MeshAxis.Z, async_op=True)
    else:
        piece, work = comm.reduce_scatter(padded, MeshAxis.Z), None
    sync.weight_grad(ctx.param, piece, work)
    return None


def _linear_backward(ctx: Any, g: torch.Tensor) -> tuple[Any, ...]:
    (a,) = ctx.saved_tensors
    comm = ctx.comm
    w = ctx.gathered.block("bwd")  # re-gathered (or prefetched): the full block is not kept
    grad_a = g @ w  # (..., in_l) partial over out_axis
    work = comm.all_reduce(grad_a, ctx.out_axis, async_op=ctx.overlap)
    g2 = g.reshape(-1, g.shape[-1])
    a2 = a.reshape(-1, a.shape[-1])
    grad_shard = None
    if ctx.needs_input_grad[1]:  # a frozen weight (LoRA's base) gets no gradient and no ghost norm
        grad_w = g2.t() @ a2  # (out_l, in_l), overlapped with the all-reduce above
        if ctx.norms is not None:  # the accumulator of the ghost-norm call that ran this forward
            ghost.add_linear(ctx.norms, a, g)
        grad_shard = _weight_grad(ctx, grad_w)
    if work is not None and ctx.overlap:
        work.wait()
    return grad_a, grad_shard, None


def _linear_forward(ctx: Any, a: torch.Tensor, w_shard: torch.Tensor, mod: TPLinear) -> torch.Tensor:
    comm = mod.comm
    w = mod.gathered.block("fwd")  # (out_l, in_l)
    y = a @ w.t()  # (..., out_l), partial over in_axis
    comm.all_reduce(y, mod.in_axis)
    ctx.save_for_backward(a)
    ctx.comm, ctx.out_axis, ctx.overlap, ctx.gathered = comm, mod.out_axis, mod.overlap, mod.gathered
    ctx.sync, ctx.param = mod.sync, w_shard
    ctx.norms = ghost.current(mod.ghost)
    return y


class TPLinearFn(torch.autograd.Function):
    """y = all_reduce_in(a @ gather_z(W)^T); see the module docstring."""

    forward = staticmethod(_linear_forward)
    backward = staticmethod(_linear_backward)


class _BiasFn(torch.autograd.Function):
    """y + b with per-example bias-gradient norms for DP (b is replicated over `rep` copies)."""

    @staticmethod
    def forward(ctx: Any, y: torch.Tensor, b: torch.Tensor, rep: int, norms: torch.Tensor | None) -> torch.Tensor:
        ctx.rep, ctx.norms = rep, norms
        return y + b

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[Any, ...]:
        if not ctx.needs_input_grad[1]:  # frozen bias
            return g, None, None, None
        if ctx.norms is not None:
            ghost.add_vector(ctx.norms, g, scale=1.0 / ctx.rep)
        return g, g.reshape(-1, g.shape[-1]).sum(0), None, None


class TPLinear(nn.Module):
    """3D tensor-parallel replacement for `nn.Linear(in_features, out_features)`.

    Normal: input (..., in/x) split over x, output (..., out/y) split over y (replicated over
    x). Transposed: input (..., in/y), output (..., out/x). `weight` is this rank's flat
    z-shard of the (out_l x in_l) block; `bias` is the out-feature slice, replicated over the
    in-feature axis and z.
    """

    def __init__(self, linear: nn.Linear, comm: Comm, *, transpose: bool = False, overlap: bool = True,
                 prefetch: bool = False, sync: GradSync | None = None, norms: GhostNorms | None = None) -> None:
        super().__init__()
        self.comm, self.transpose, self.overlap = comm, transpose, overlap
        self.in_axis, self.out_axis = (MeshAxis.Y, MeshAxis.X) if transpose else (MeshAxis.X, MeshAxis.Y)
        out_f, in_f = linear.weight.shape
        for name, n, axis in (("out_features", out_f, self.out_axis), ("in_features", in_f, self.in_axis)):
            if n % comm.size(axis):
                raise ValueError(f"{name}={n} is not divisible by parallel.{axis}={comm.size(axis)}; "
                                 f"choose parallel.{axis} dividing {n}")
        self.in_features, self.out_features = in_f, out_f
        self.shape = (out_f // comm.size(self.out_axis), in_f // comm.size(self.in_axis))
        self.wspec = ShardSpec((out_f, in_f), self.out_axis, self.in_axis, True, (), (MeshAxis.DATA,))
        self.weight = nn.Parameter(self.wspec.local(linear.weight.detach(), comm),
                                   requires_grad=linear.weight.requires_grad)  # frozen stays frozen (LoRA)
        self.weight.shard_spec = self.wspec  # type: ignore[attr-defined]
        self.__dict__["gathered"] = _Gathered(comm, self.shape, prefetch)  # not a submodule
        self.gathered.shard = self.weight
        self.__dict__["sync"] = sync
        self.__dict__["ghost"] = norms  # the model's ghost-norm collector (DP-SGD), not a submodule
        if linear.bias is not None:
            self.bspec = ShardSpec((out_f,), self.out_axis, None, False, (self.in_axis, MeshAxis.Z), (MeshAxis.Z, MeshAxis.DATA))
            self.bias = nn.Parameter(self.bspec.local(linear.bias.detach(), comm),
                                     requires_grad=linear.bias.requires_grad)
            self.bias.shard_spec = self.bspec  # type: ignore[attr-defined]
        else:
            self.register_parameter("bias", None)

    def forward(self, a: torch.Tensor) -> torch.Tensor:
        self.gathered.shard = self.weight  # the parameter may have been replaced (load, .to())
        if torch.is_grad_enabled():  # a frozen layer whose input needs no gradient has no backward
            self.gathered.backward = a.requires_grad or self.weight.requires_grad
        y = TPLinearFn.apply(a, self.weight, self)
        if self.bias is not None:
            y = _BiasFn.apply(y, self.bias, self.comm.size(self.in_axis), ghost.current(self.ghost))
        return y

    def extra_repr(self) -> str:
        return f"{self.in_features}->{self.out_features}, local={self.shape}, transpose={self.transpose}"


# ----------------------------------------------------------------------------- embedding
class _EmbeddingFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, ids: torch.Tensor, w_shard: torch.Tensor, mod: ParallelEmbedding) -> torch.Tensor:
        w = mod.gathered.block("fwd")  # (V_l, H_l); prefetches the first layer's weights
        vstart, shape = mod.vstart, mod.shape
        mask = (ids >= vstart) & (ids < vstart + shape[0])
        local = torch.where(mask, ids - vstart, torch.zeros_like(ids))
        out = w[local] * mask.unsqueeze(-1).to(w.dtype)  # (B, S, H_l), partial over y
        ctx.save_for_backward(local, mask)
        ctx.comm, ctx.shape, ctx.sync, ctx.param = mod.comm, shape, mod.sync, w_shard
        ctx.norms = ghost.current(mod.ghost)
        return out

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[Any, ...]:
        if not ctx.needs_input_grad[1]:  # frozen embedding (LoRA)
            return None, None, None
        local, mask = ctx.saved_tensors
        gm = g * mask.unsqueeze(-1).to(g.dtype)
        grad_w = torch.zeros(ctx.shape, dtype=g.dtype, device=g.device)
        grad_w.index_add_(0, local.reshape(-1), gm.reshape(-1, g.shape[-1]))
        if ctx.norms is not None:
            ghost.add_embedding(ctx.norms, local, mask, gm)
        return None, _weight_grad(ctx, grad_w), None


class ParallelEmbedding(nn.Module):
    """Embedding with the vocabulary split over y and the hidden dim over x; output (B, S, H/x)."""

    def __init__(self, emb: nn.Embedding, comm: Comm, *, prefetch: bool = False, sync: GradSync | None = None,
                 norms: GhostNorms | None = None) -> None:
        super().__init__()
        v, h = emb.weight.shape
        self.comm = comm
        self.shape = (v // comm.size(MeshAxis.Y), h // comm.size(MeshAxis.X))
        self.vstart = comm.index(MeshAxis.Y) * self.shape[0]
        self.spec = ShardSpec((v, h), MeshAxis.Y, MeshAxis.X, True, (), (MeshAxis.DATA,))
        self.weight = nn.Parameter(self.spec.local(emb.weight.detach(), comm), requires_grad=emb.weight.requires_grad)
        self.weight.shard_spec = self.spec  # type: ignore[attr-defined]
        self.__dict__["gathered"] = _Gathered(comm, self.shape, prefetch)  # not a submodule
        self.__dict__["sync"] = sync
        self.__dict__["ghost"] = norms

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        self.gathered.shard = self.weight
        out = _EmbeddingFn.apply(ids, self.weight, self)
        return reduce_partial(out, self.comm, MeshAxis.Y)


# ----------------------------------------------------------------------------- loss
class _VocabParallelCE(torch.autograd.Function):
    """Token cross-entropy from logits split over y: max, sum-exp and target logit all-reduced."""

    @staticmethod
    def forward(ctx: Any, logits: torch.Tensor, target: torch.Tensor, vstart: int, comm: Comm) -> torch.Tensor:
        logits = logits.float()  # (N, V_l)
        m = logits.max(-1).values
        comm.all_reduce(m, MeshAxis.Y, op=dist.ReduceOp.MAX)
        e = torch.exp(logits - m.unsqueeze(-1))
        s = e.sum(-1)
        comm.all_reduce(s, MeshAxis.Y)
        in_range = (target >= vstart) & (target < vstart + logits.shape[-1])
        local_t = torch.where(in_range, target - vstart, torch.zeros_like(target))
        t_logit = logits.gather(-1, local_t.unsqueeze(-1)).squeeze(-1) * in_range.to(logits.dtype)
        comm.all_reduce(t_logit, MeshAxis.Y)
        ctx.save_for_backward(e / s.unsqueeze(-1), local_t, in_range)
        return torch.log(s) + m - t_logit  # (N,)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[Any, ...]:
        p, local_t, in_range = ctx.saved_tensors
        grad = p.clone()
        rows = torch.arange(grad.shape[0], device=grad.device)
        grad[rows, local_t] -= in_range.to(grad.dtype)
        return grad * g.unsqueeze(-1), None, None, None


def vocab_parallel_cross_entropy(logits: torch.Tensor, target: torch.Tensor, *, vstart: int,
                                 comm: Comm) -> torch.Tensor:
    """Per-token loss (N,) from local logits (N, V/y); targets are global ids."""
    if comm.size(MeshAxis.Y) == 1:
        return nn.functional.cross_entropy(logits.float(), target, reduction="none")
    return _VocabParallelCE.apply(logits, target, vstart, comm)

