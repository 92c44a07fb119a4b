"""RMSNorm over a hidden dim split over x: the mean square is all-reduced over x.

References: Zhang & Sennrich, "Root Mean Square Layer Normalization", 2019.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from memaudit.parallel import ghost
from memaudit.parallel.comm import Comm, reduce_both
from memaudit.parallel.dims import MeshAxis
from memaudit.parallel.layers import ShardSpec


class _ScaleFn(torch.autograd.Function):
    """w * h with per-example weight-gradient norms (w replicated over `rep` copies in x, y)."""

    @staticmethod
    def forward(ctx: Any, h: torch.Tensor, w: torch.Tensor, rep: int, norms: torch.Tensor | None) -> torch.Tensor:
        ctx.save_for_backward(h, w)
        ctx.rep, ctx.norms = rep, norms
        return w * h

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[Any, ...]:
        h, w = ctx.saved_tensors
        if not ctx.needs_input_grad[1]:  # frozen norm weight (LoRA)
            return g * w, None, None, None
        gh = g * h
        if ctx.norms is not None:  # the accumulator of the ghost-norm call that ran this forward
            ghost.add_vector(ctx.norms, gh, scale=1.0 / ctx.rep)
        return g * w, gh.reshape(-1, gh.shape[-1]).sum(0), None, None


class ParallelRMSNorm(nn.Module):
    """`LlamaRMSNorm` on (..., H/x) inputs; `weight` is the x-slice, replicated over y and z."""

    def __init__(self, norm: nn.Module, comm: Comm, *, norms: ghost.GhostNorms | None = None) -> None:
        super().__init__()
        h = norm.weight.shape[0]
        if h % comm.size(MeshAxis.X):
            raise ValueError(f"hidden_size={h} is not divisible by parallel.x={comm.size('x')}; "
                             f"choose parallel.x dividing {h}")
        self.comm, self.hidden, self.eps = comm, h, norm.variance_epsilon
        self.spec = ShardSpec((h,), MeshAxis.X, None, False, (MeshAxis.Y, MeshAxis.Z), (MeshAxis.Z, MeshAxis.DATA))
        self.weight = nn.Parameter(self.spec.local(norm.weight.detach(), comm), requires_grad=norm.weight.requires_grad)
        self.weight.shard_spec = self.spec  # type: ignore[attr-defined]
        self.__dict__["ghost"] = norms  # the model's ghost-norm collector (DP-SGD), not a submodule

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        dtype = hidden.dtype
        h = hidden.to(torch.float32)
        ss = h.pow(2).sum(-1, keepdim=True)  # (..., 1), partial over x
        ss = reduce_both(ss, self.comm, MeshAxis.X)
        normed = h * torch.rsqrt(ss / self.hidden + self.eps)
        return _ScaleFn.apply(normed.to(dtype), self.weight, self.comm.size(MeshAxis.Y), ghost.current(self.ghost))

    def extra_repr(self) -> str:
        return f"{self.hidden}, local={tuple(self.weight.shape)}, eps={self.eps}"
