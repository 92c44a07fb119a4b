"""LoRA adapters on the 3D tensor-parallel grid: A and B follow the frozen base weight's split.

For a peft `LoraLayer` on W (out x in), a *normal* layer (in-features over x, out-features
over y) holds A_l = A[:, x-slice] (r x in/x, replicated over y and z) and B_l = B[y-slice, :]
(out/y x r, replicated over x and z); a *transposed* layer swaps x and y. The frozen base is a
`TPLinear` whose weight has no gradient, no optimizer state and no ghost norm.

    forward:  h = all_reduce_in(a @ A_l^T)            (..., r): full r on every rank
              y = base(a) + s * h @ B_l^T             (..., out_l), s = alpha / r
    backward: grad_B_l = s * g^T h                    complete for the out slice
              grad_h   = all_reduce_out(s * g @ B_l)  partial over the out axis until summed
              grad_A_l = grad_h^T a,   grad_a += grad_h @ A_l

The adapters' gradient is added to the input gradient as a separate autograd branch, after
the base path's own all-reduce over the out axis. Under DP-SGD each example's ||grad_A_l||^2
and ||grad_B_l||^2 enter the model's ghost norms scaled by 1/copies over x and y, so the x, y
all-reduce of `memaudit.parallel.dp.per_example_grad_norms` gives each example's full
adapter-gradient norm. Adapter dropout (`memaudit.models.keyed_dropout.KeyedDropout`) drops
the input of A before the projection, keyed by each element's global row and feature: every
replicated copy of the input (over the out axis) draws the same mask and each shard its slice of
the one-process mask, and the ghost norms see the dropped input, as the gradient does.

References: Hu et al., "LoRA: Low-Rank Adaptation of Large Language Models", ICLR 2022;
Singh et al., AxoNN (SC'24); Li et al., ghost clipping, ICLR 2022.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from memaudit.models.keyed_dropout import KeyedDropout
from memaudit.parallel import ghost
from memaudit.parallel.comm import Comm, GradSync
from memaudit.parallel.dims import MeshAxis
from memaudit.parallel.ghost import GhostNorms
from memaudit.parallel.layers import ShardSpec, TPLinear

ADAPTER = "default"  # peft's adapter name: the one adapter memaudit trains


def is_lora_layer(m: nn.Module) -> bool:
    """A peft `LoraLayer` (duck-typed: importing peft costs seconds, the grid needs none of it)."""
    return hasattr(m, "base_layer") and hasattr(m, "lora_A") and hasattr(m, "lora_B") and hasattr(m, "scaling")


class _LoraFn(torch.autograd.Function):
    """s * all_reduce_in(a @ A_l^T) @ B_l^T; see the module docstring."""

    @staticmethod
    def forward(ctx: Any, a: torch.Tensor, a_w: torch.Tensor, b_w: torch.Tensor, mod: TPLoraLinear) -> torch.Tensor:
        comm = mod.comm
        h = a @ a_w.t()  # (..., r), partial over in_axis
        comm.all_reduce(h, mod.in_axis)
        ctx.save_for_backward(a, a_w, b_w, h)
        ctx.mod, ctx.norms = mod, ghost.current(mod.ghost)
        return (h @ b_w.t()) * mod.scaling  # (..., out_l)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[Any, ...]:
        a, a_w, b_w, h = ctx.saved_tensors
        mod = ctx.mod
        gs = g * mod.scaling  # (..., out_l)
        grad_h = gs @ b_w  # (..., r), partial over out_axis
        mod.comm.all_reduce(grad_h, mod.out_axis)
        grad_b = gs.reshape(-1, gs.shape[-1]).t() @ h.reshape(-1, h.shape[-1])  # (out_l, r)
        grad_a_w = grad_h.reshape(-1, grad_h.shape[-1]).t() @ a.reshape(-1, a.shape[-1])  # (r, in_l)
        if ctx.norms is not None:  # B_l has copies over the in axis, A_l over the out axis
            ghost.add_linear(ctx.norms, h, gs, scale=1.0 / mod.comm.size(mod.in_axis))
            ghost.add_linear(ctx.norms, a, grad_h, scale=1.0 / mod.comm.size(mod.out_axis))
        grad_a = grad_h @ a_w if ctx.needs_input_grad[0] else None  # (..., in_l), complete
        return grad_a, grad_a_w, grad_b, None


class _Weight(nn.Module):
    """Holds one adapter matrix as `.weight`, so parameter names stay peft's (`lora_A.default.weight`)."""

    def __init__(self, w: nn.Parameter) -> None:
        super().__init__()
        self.weight = w


class TPLoraLinear(nn.Module):
    """The grid's form of a peft `LoraLayer`: `base_layer` (frozen `TPLinear`) plus A_l, B_l.

    Submodule and parameter names are peft's (`base_layer.weight`, `lora_A.default.weight`,
    `lora_B.default.weight`), so the full state dict loads into the one-process peft model.
    """

    def __init__(self, layer: nn.Module, comm: Comm, *, transpose: bool = False, overlap: bool = True,
                 prefetch: bool = False, sync: GradSync | None = None, norms: GhostNorms | None = None) -> None:
        super().__init__()
        if list(layer.lora_A.keys()) != [ADAPTER]:
            raise ValueError(f"the grid trains one LoRA adapter named '{ADAPTER}', not {list(layer.lora_A.keys())}")
        drop = layer.lora_dropout[ADAPTER]  # nn.Identity when the rate is 0
        if float(getattr(drop, "p", 0.0)) > 0 and not isinstance(drop, KeyedDropout):
            raise ValueError("adapter dropout on the grid must be keyed (memaudit.models.lora.apply_lora); "
                             f"got {type(drop).__name__}")
        if getattr(layer, "use_dora", {}).get(ADAPTER, False):
            raise ValueError("DoRA adapters have no tensor-parallel form; use plain LoRA on a grid")
        self.base_layer = TPLinear(layer.base_layer, comm, transpose=transpose, overlap=overlap, prefetch=prefetch,
                                   sync=sync, norms=norms)
        self.comm, self.scaling = comm, float(layer.scaling[ADAPTER])
        self.in_axis, self.out_axis = self.base_layer.in_axis, self.base_layer.out_axis
        a_full = layer.lora_A[ADAPTER].weight  # (r, in)
        b_full = layer.lora_B[ADAPTER].weight  # (out, r)
        self.a_spec = ShardSpec(tuple(a_full.shape), None, self.in_axis, False, (self.out_axis, MeshAxis.Z),
                                (MeshAxis.Z, MeshAxis.DATA))
        self.b_spec = ShardSpec(tuple(b_full.shape), self.out_axis, None, False, (self.in_axis, MeshAxis.Z),
                                (MeshAxis.Z, MeshAxis.DATA))
        self.lora_A = nn.ModuleDict({ADAPTER: _Weight(self._param(a_full, self.a_spec))})
        self.lora_B = nn.ModuleDict({ADAPTER: _Weight(self._param(b_full, self.b_spec))})
        self.lora_dropout = nn.ModuleDict({ADAPTER: drop})
        self.__dict__["ghost"] = norms  # the model's ghost-norm collector (DP-SGD), not a submodule

    def _param(self, full: torch.Tensor, spec: ShardSpec) -> nn.Parameter:
        p = nn.Parameter(spec.local(full.detach(), self.comm), requires_grad=full.requires_grad)
        p.shard_spec = spec  # type: ignore[attr-defined]
        return p

    @property
    def gathered(self) -> Any:
        return self.base_layer.gathered

    def forward(self, a: torch.Tensor) -> torch.Tensor:
        y = self.base_layer(a)
        drop = self.lora_dropout[ADAPTER]
        if isinstance(drop, KeyedDropout):  # this shard's features start at index * in_l
            a = drop(a, first_feature=self.comm.index(self.in_axis) * a.shape[-1], grid=True)
        return y + _LoraFn.apply(a, self.lora_A[ADAPTER].weight, self.lora_B[ADAPTER].weight, self)

    def extra_repr(self) -> str:
        r = self.lora_A[ADAPTER].weight.shape[0]
        return f"r={r}, scaling={self.scaling}, A_local={tuple(self.lora_A[ADAPTER].weight.shape)}, " \
               f"B_local={tuple(self.lora_B[ADAPTER].weight.shape)}"


def gather_peft(model: Any, peft_model: Any, *, dst: int = 0) -> Any:
    """`peft_model` (on rank `dst`: a fresh one-process peft model of the same config; None on
    the others) with the grid's assembled weights, base and adapters. A collective."""
    full = model.full_state_dict(dst=dst)
    if peft_model is None:
        return None
    target = peft_model.get_base_model()
    _, unexpected = target.load_state_dict(full, strict=False)  # buffers (rotary) stay as built
    names = {n for n, _ in target.named_parameters()}
    if unexpected or names - set(full):
        raise ValueError(f"the grid's parameters do not match the peft model ({(unexpected or sorted(names - set(full)))[0]}); "
                         "build it with the run's model.lora")
    return peft_model
