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

Per-user clipping (ULS, `privacy.user_sampling=uls`) opens an accumulator with one entry per
group of g consecutive rows (`collect(batch, group_size=g)`): each layer then reads its (B, T, F)
inputs and output gradients as (B/g, g·T, F), so the same formula gives ||Σ_{i in group} ∇_i||²,
the squared norm of a user's summed gradient, cross terms included. The group size is read off
the accumulator's length, so the layers need no other argument.

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
    def collect(self, batch: int, *, device: torch.device | str = "cpu", group_size: int = 1
                ) -> Iterator[torch.Tensor]:
        """Accumulate squared norms (float64) during one backward: one per example, shape (batch,),
        or one per group of `group_size` consecutive rows, shape (batch / group_size,)."""
        if self._acc is not None:
            raise RuntimeError("ghost norms of this model are already being collected; one call at a time")
        if group_size < 1 or batch % group_size:
            raise ValueError(f"{batch} rows do not split into groups of {group_size}")
        acc = torch.zeros(batch // group_size, dtype=torch.float64, device=device)
        self._acc = acc
        try:
            yield acc
        finally:
            self._acc = None


def current(norms: GhostNorms | None) -> torch.Tensor | None:
    """The accumulator a layer's forward records (None: no collector, or none open)."""
    return None if norms is None else norms.current()


def _units(acc: torch.Tensor, rows: int) -> int:
    """The accumulator's units: its rows, or groups of rows / len(acc) consecutive rows."""
    units = acc.shape[0]
    if (units == 0) != (rows == 0) or (units and rows % units):
        raise ValueError(f"{rows} rows do not split into the accumulator's {units} units")
    return units


def _bt(t: torch.Tensor, units: int) -> torch.Tensor:
    """(units, T', F) view: a unit's rows' tokens one after another (a 2-D input is one token
    per row)."""
    return t.reshape(units, -1 if units else 1, t.shape[-1])


def add_linear(acc: torch.Tensor, a: torch.Tensor, g: torch.Tensor, *, scale: float = 1.0) -> None:
    """Add ||Σ_t g_t a_tᵀ||² per example (input a, output gradient g) to `acc`."""
    u = _units(acc, a.shape[0])
    a3, g3 = _bt(a, u).double(), _bt(g, u).double()  # (B, T, in_l), (B, T, out_l)
    t, fin, fout = a3.shape[1], a3.shape[2], g3.shape[2]
    if t * t <= fin * fout:
        sq = ((a3 @ a3.transpose(1, 2)) * (g3 @ g3.transpose(1, 2))).sum((1, 2))
    else:
        sq = torch.einsum("bto,bti->boi", g3, a3).pow(2).sum((1, 2))
    acc.add_(sq, alpha=scale)


def add_vector(acc: torch.Tensor, g: torch.Tensor, *, scale: float = 1.0) -> None:
    """A parameter whose per-example gradient is the token-sum of g (bias, norm weight)."""
    acc.add_(_bt(g, _units(acc, g.shape[0])).double().sum(1).pow(2).sum(-1), alpha=scale)


def add_embedding(acc: torch.Tensor, local: torch.Tensor, mask: torch.Tensor, gm: torch.Tensor) -> None:
    """Rows of one example's gradient are sums of gm over positions with the same token."""
    u = _units(acc, local.shape[0])
    ids = local.reshape(u, -1)
    keep = mask.reshape(u, -1)
    same = ((ids.unsqueeze(2) == ids.unsqueeze(1)) & keep.unsqueeze(2) & keep.unsqueeze(1)).double()
    g3 = _bt(gm, u).double()
    acc.add_(((g3 @ g3.transpose(1, 2)) * same).sum((1, 2)))
