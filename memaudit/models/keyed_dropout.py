"""Adapter dropout whose mask is a function of where an element sits, not of an RNG's state.

`KeyedDropout` keeps element (row r, position t, feature f) of a layer's input when
hash(step key, layer key, r, t, f) >= p * 2^32, and scales what it keeps by 1 / (1 - p). The
step key comes from `train.seed` and the step; r is the row's index in the step's global batch,
f the feature's index in the full hidden dimension. So the mask of a step does not depend on how
the batch is cut into micro-batches or sharded over a grid:

- every replicated copy of a tensor-parallel input draws the same mask, and each shard its own
  slice of it (`memaudit.parallel.lora.TPLoraLinear` passes its feature offset and the grid its
  global row offset), so a LoRA run with dropout trains the same adapters on any grid;
- DP-SGD's passes see the same mask: the grid's norm pass and its clipped-sum pass, and a
  recomputed (activation-checkpointed) forward, even on another thread;
- a resumed run draws the masks the uninterrupted one drew.

The key is public (from `train.seed`, like the initialisation), not DP randomness: the mask does
not depend on the data, so it plays no part in the guarantee.

The hash is the 32-bit integer finaliser of Wang and Mueller (two multiply-xorshift rounds),
applied along the row, position and feature indices in turn. Outside a memaudit step (no step
key set) a model in training mode drops with torch's RNG, as `nn.Dropout` does; the grid refuses
that (its copies would disagree).

>>> import torch
>>> d = KeyedDropout(0.5, layer_key=3).train()
>>> with dropout_step(d, seed=0, step=1):
...     a = d(torch.ones(2, 4, 8))
...     with dropout_rows(d, 1):
...         b = d(torch.ones(1, 4, 8))
>>> bool(torch.equal(a[1:], b)), sorted(a.unique().tolist())
(True, [0.0, 2.0])
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

_M32 = 0xFFFFFFFF
_MUL = 0x45D9F3B


def _mix(x: torch.Tensor) -> torch.Tensor:
    """Wang-Mueller 32-bit finaliser on int64 tensors holding 32-bit values (no overflow)."""
    x = x & _M32
    x = (((x >> 16) ^ x) * _MUL) & _M32
    x = (((x >> 16) ^ x) * _MUL) & _M32
    return (x >> 16) ^ x


def _mix_int(x: int) -> int:
    """`_mix` of one Python integer (its low 32 bits)."""
    x &= _M32
    x = (((x >> 16) ^ x) * _MUL) & _M32
    x = (((x >> 16) ^ x) * _MUL) & _M32
    return (x >> 16) ^ x


def step_key(seed: int, step: int) -> int:
    """The public key of step `step` (0-based) of a run seeded `seed`."""
    return _mix_int(_mix_int(seed) + 0x9E3779B9 * (step + 1))


def layer_key(name: str) -> int:
    """A LoRA layer's key: from its qualified name in the model, the same in every process."""
    return zlib.crc32(name.encode())


def keep_mask(step: int, layer: int, p: float, shape: tuple[int, ...], *, first_row: int = 0,
              first_feature: int = 0, device: torch.device | str | None = None) -> torch.Tensor:
    """The bool mask (True: kept) of a (rows, ..., features) input whose local row 0 is global row
    `first_row` and local feature 0 global feature `first_feature`; positions are the middle dims
    flattened. `step` is `step_key(...)`."""
    rows, feats, mid = shape[0], shape[-1], math.prod(shape[1:-1])
    k = _mix_int(step ^ layer)
    x = _mix(k + torch.arange(first_row, first_row + rows, dtype=torch.int64, device=device).view(rows, 1, 1))
    x = _mix(x + torch.arange(mid, dtype=torch.int64, device=device).view(1, mid, 1))
    x = _mix(x + torch.arange(first_feature, first_feature + feats, dtype=torch.int64, device=device).view(1, 1, feats))
    return (x >= int(p * 2**32)).reshape(shape)


@dataclass
class DropoutKey:
    """What the current forward is: the step's key (None outside a step) and the global index of
    this process's local row 0. One object is shared by every `KeyedDropout` of a model."""

    step: int | None = None
    first_row: int = 0


class KeyedDropout(nn.Module):
    """Dropout with a mask keyed by (step, layer, global row, position, global feature)."""

    def __init__(self, p: float, layer_key: int, key: DropoutKey | None = None) -> None:
        super().__init__()
        if not 0 <= p < 1:
            raise ValueError(f"dropout rate {p} must be in [0, 1)")
        self.p, self.layer_key = float(p), int(layer_key)
        self.key = key if key is not None else DropoutKey()

    def forward(self, x: torch.Tensor, *, first_feature: int = 0, grid: bool = False) -> torch.Tensor:
        if not self.training or self.p == 0:
            return x
        if torch._C._functorch.is_batchedtensor(x):
            raise ValueError("adapter dropout has no per-example vmap form; use ghost clipping (DP-SGD mode 'ghost')")
        if self.key.step is None:
            if grid:
                raise RuntimeError("adapter dropout on a grid needs the step's key (dropout_step): without it "
                                   "the replicated copies of an input would draw different masks")
            return F.dropout(x, self.p, True)
        keep = keep_mask(self.key.step, self.layer_key, self.p, tuple(x.shape), first_row=self.key.first_row,
                         first_feature=first_feature, device=x.device)
        return x * keep.to(x.dtype) * (1.0 / (1.0 - self.p))

    def extra_repr(self) -> str:
        return f"p={self.p}, layer_key={self.layer_key}"


def _keys(model: nn.Module) -> list[DropoutKey]:
    seen: dict[int, DropoutKey] = {}
    for m in model.modules():
        if isinstance(m, KeyedDropout):
            seen.setdefault(id(m.key), m.key)
    return list(seen.values())


@contextmanager
def dropout_step(model: nn.Module, *, seed: int, step: int) -> Iterator[None]:
    """Within: `model`'s adapter dropout draws step `step`'s masks (rows from 0)."""
    keys = _keys(model)
    for k in keys:
        k.step, k.first_row = step_key(seed, step), 0
    try:
        yield
    finally:
        for k in keys:
            k.step, k.first_row = None, 0


@contextmanager
def dropout_rows(model: nn.Module, first_row: int) -> Iterator[None]:
    """Within: the tensor this process forwards starts at global row `first_row` of the step's batch."""
    keys = _keys(model)
    old = [k.first_row for k in keys]
    for k in keys:
        k.first_row = first_row
    try:
        yield
    finally:
        for k, o in zip(keys, old, strict=True):
            k.first_row = o


def use_keyed_dropout(model: nn.Module, adapter: str = "default") -> int:
    """Replace peft's adapter dropout (`lora_dropout[adapter]`, an `nn.Dropout`) by `KeyedDropout`
    sharing one key; returns how many layers were changed (none when the rate is 0)."""
    key, n = DropoutKey(), 0
    for name, m in model.named_modules():
        drops = getattr(m, "lora_dropout", None)
        if isinstance(drops, nn.ModuleDict) and adapter in drops and isinstance(drops[adapter], nn.Dropout):
            drops[adapter] = KeyedDropout(drops[adapter].p, layer_key(name.removeprefix("base_model.model.")), key)
            n += 1
    return n
