"""Per-example squared gradient norms of local parameter shards, gathered during backward.

Within `collect(batch)`, every tensor-parallel layer adds each example's squared norm of its
local weight-block gradient (ghost norm: ||a_b^T g_b||^2 = sum_{t,t'} (a_t.a_t')(g_t.g_t')),
scaled by 1/(copies over x and y) for replicated parameters, so that an all-reduce over x
and y gives the squared norm of each example's full gradient.

References: Goodfellow, "Efficient per-example gradient computations", 2015; Li et al.,
"Large language models can be strong differentially private learners" (ghost clipping), 2022.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch

_SINK: list[torch.Tensor] = []


def active() -> bool:
    return bool(_SINK)


@contextmanager
def collect(batch: int, *, device: torch.device | str = "cpu") -> Iterator[torch.Tensor]:
    """Accumulate per-example squared norms (float64, shape (batch,)) during backward."""
    acc = torch.zeros(batch, dtype=torch.float64, device=device)
    _SINK.append(acc)
    try:
        yield acc
    finally:
        _SINK.pop()


def _bt(t: torch.Tensor) -> torch.Tensor:
    """(B, T, F) view; a 2-D input is one token per example."""
    return t.unsqueeze(1) if t.dim() == 2 else t.reshape(t.shape[0], -1, t.shape[-1])


def add_linear(a: torch.Tensor, g: torch.Tensor, *, scale: float = 1.0) -> None:
    a3, g3 = _bt(a).double(), _bt(g).double()  # (B, T, in_l), (B, T, out_l)
    t, fin, fout = a3.shape[1], a3.shape[2], g3.shape[2]
    if t * t <= fin * fout:
        sq = ((a3 @ a3.transpose(1, 2)) * (g3 @ g3.transpose(1, 2))).sum((1, 2))
    else:
        sq = torch.einsum("bto,bti->boi", g3, a3).pow(2).sum((1, 2))
    _SINK[-1].add_(sq, alpha=scale)


def add_vector(g: torch.Tensor, *, scale: float = 1.0) -> None:
    """A parameter whose per-example gradient is the token-sum of g (bias, norm weight)."""
    _SINK[-1].add_(_bt(g).double().sum(1).pow(2).sum(-1), alpha=scale)


def add_embedding(local: torch.Tensor, mask: torch.Tensor, gm: torch.Tensor) -> None:
    """Rows of one example's gradient are sums of gm over positions with the same token."""
    ids = local.reshape(local.shape[0], -1)
    keep = mask.reshape(mask.shape[0], -1)
    same = ((ids.unsqueeze(2) == ids.unsqueeze(1)) & keep.unsqueeze(2) & keep.unsqueeze(1)).double()
    g3 = _bt(gm).double()
    _SINK[-1].add_(((g3 @ g3.transpose(1, 2)) * same).sum((1, 2)))
