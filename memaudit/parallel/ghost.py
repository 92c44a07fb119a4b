"""Per-example squared gradient norms of local parameter shards, gathered during backward.

Each tensor-parallel layer of a model built by `parallelize_llama` holds that model's
`GhostNorms`. `GhostNorms.collect(batch)` opens one accumulator for the length of one call;
every forward run inside it records that accumulator in its autograd context, and the
matching backward adds each example's squared norm of its local weight-block gradient (ghost
norm: ||a_b^T g_b||^2 = sum_{t,t'} (a_t.a_t')(g_t.g_t')), scaled by 1/(copies over x and y)
for replicated parameters, so that an all-reduce over x and y gives the squared norm of each
example's full gradient. The caller gets the accumulator back from the call that opened it
(`memaudit.parallel.dp.per_example_grad_norms`); nothing is kept at module level, so two
models (or two calls) never write into each other's norms.

References: Goodfellow, "Efficient per-example gradient computations", 2015; Li et al.,
"Large language models can be strong differentially private learners" (ghost clipping), 2022.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch


class GhostNorms:
    """One model's ghost-norm collector: an accumulator only while `collect` runs.

    >>> norms = GhostNorms()
    >>> with norms.collect(2) as acc:
    ...     add_vector(norms.current(), torch.ones(2, 3, 4))
    >>> acc.tolist(), norms.active
    ([36.0, 36.0], False)
    """

    def __init__(self) -> None:
        self._acc: torch.Tensor | None = None

    @property
    def active(self) -> bool:
        return self._acc is not None

    def current(self) -> torch.Tensor | None:
        """The open accumulator (a forward records it in its autograd context), or None."""
        return self._acc

    @contextmanager
    def collect(self, batch: int, *, device: torch.device | str = "cpu") -> Iterator[torch.Tensor]:
        """Accumulate per-example squared norms (float64, shape (batch,)) during one backward."""
        if self._acc is not None:
            raise RuntimeError("ghost norms of this model are already being collected; one call at a time")
        acc = torch.zeros(batch, dtype=torch.float64, device=device)
        self._acc = acc
        try:
            yield acc
        finally:
            self._acc = None


def current(norms: GhostNorms | None) -> torch.Tensor | None:
    """The accumulator a layer's forward records (None: no collector, or none open)."""
    return None if norms is None else norms.current()


def _bt(t: torch.Tensor) -> torch.Tensor:
    """(B, T, F) view; a 2-D input is one token per example."""
    return t.unsqueeze(1) if t.dim() == 2 else t.reshape(t.shape[0], -1, t.shape[-1])


def add_linear(acc: torch.Tensor, a: torch.Tensor, g: torch.Tensor, *, scale: float = 1.0) -> None:
    """Add ||Σ_t g_t a_tᵀ||² per example (input a, output gradient g) to `acc`."""
    a3, g3 = _bt(a).double(), _bt(g).double()  # (B, T, in_l), (B, T, out_l)
    t, fin, fout = a3.shape[1], a3.shape[2], g3.shape[2]
    if t * t <= fin * fout:
        sq = ((a3 @ a3.transpose(1, 2)) * (g3 @ g3.transpose(1, 2))).sum((1, 2))
    else:
        sq = torch.einsum("bto,bti->boi", g3, a3).pow(2).sum((1, 2))
    acc.add_(sq, alpha=scale)


def add_vector(acc: torch.Tensor, g: torch.Tensor, *, scale: float = 1.0) -> None:
    """A parameter whose per-example gradient is the token-sum of g (bias, norm weight)."""
    acc.add_(_bt(g).double().sum(1).pow(2).sum(-1), alpha=scale)


def add_embedding(acc: torch.Tensor, local: torch.Tensor, mask: torch.Tensor, gm: torch.Tensor) -> None:
    """Rows of one example's gradient are sums of gm over positions with the same token."""
    ids = local.reshape(local.shape[0], -1)
    keep = mask.reshape(mask.shape[0], -1)
    same = ((ids.unsqueeze(2) == ids.unsqueeze(1)) & keep.unsqueeze(2) & keep.unsqueeze(1)).double()
    g3 = _bt(gm).double()
    acc.add_(((g3 @ g3.transpose(1, 2)) * same).sum((1, 2)))
