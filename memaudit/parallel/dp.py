"""DP-SGD under tensor parallelism: the grid's `PerExampleClipping` for `memaudit.train.dpsgd.DPSGD`.

Per-example squared gradient norms are gathered per local shard during backward (ghost
norms: `per_example_grad_norms` opens the model's `GhostNorms` for one call and gets them
back from it) and summed over x and y, so every rank sees each of its examples'
full-gradient norm; a second, reweighted backward gives the clipped sum; the Gaussian noise
of each logical parameter is defined in fixed tiles keyed by the run's secret randomness at
(step, parameter index, tile) (`memaudit.train.noise`; HKDF, `memaudit.privacy.randomness`;
the secret is broadcast from rank 0 once), and each rank draws the tiles of its own elements:
identical on every replica, and the same for any grid and for one process.

Per-user clipping (ULS) passes `group_size` g: the rows are consecutive groups of g (one
user's capped sequences, padded with rows without targets), the batch is padded with whole
empty groups to a multiple of g x data x z so every shard holds whole groups (a user's
sequences never straddle two ranks), and the ghost norms are taken per group
(`memaudit.parallel.ghost`): each group's summed gradient is the clipped unit.

References: Abadi et al., "Deep Learning with Differential Privacy", CCS 2016; Li et al.,
ghost clipping, ICLR 2022; Charles et al., "Fine-Tuning Large Language Models with User-Level
Differential Privacy", SaTML 2025 (ULS).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import torch

from memaudit.models.keyed_dropout import dropout_rows
from memaudit.parallel.dims import MeshAxis
from memaudit.parallel.parallelize import ParallelLlama, sync_grads
from memaudit.train.dpsgd import ClipStats
from memaudit.train.noise import Apply, added, for_each_draw, noise_block, parameter_key


def per_example_grad_norms(model: ParallelLlama, input_ids: torch.Tensor, loss_mask: torch.Tensor,
                           attention_mask: torch.Tensor | None = None, *, group_size: int = 1) -> torch.Tensor:
    """Full-gradient L2 norm of each local example's mean token loss, shape (B_local,); with
    `group_size` g, of each group of g consecutive rows' summed gradient, shape (B_local / g,).

    The model's layers add their partial squared norms into the accumulator this call opens
    (`GhostNorms.collect`); the all-reduce over x and y completes them. Gradients are discarded.
    """
    for p in model.hf.parameters():
        p.grad = None
    with model.ghost.collect(input_ids.shape[0], device=input_ids.device, group_size=group_size) as acc:
        model.per_example_losses(input_ids, loss_mask, attention_mask).sum().backward()
    for axis in (MeshAxis.X, MeshAxis.Y):
        model.comm.all_reduce(acc, axis)
    for p in model.hf.parameters():
        p.grad = None
    return acc.clamp(min=0).sqrt()


def add_noise_(model: ParallelLlama, *, std: float, randomness: Any, step: int) -> None:
    """Add N(0, std^2) to every logical gradient element, identically on every replica.

    ``randomness`` must be the same `DPRandomness` on every rank (`DPRandomness.broadcast`).
    Only trained parameters get noise (under LoRA the adapters), keyed by their index among the
    trained ones, as `memaudit.train.dpsgd.SerialClipping` keys them.

    Each rank draws on its CPU only the noise tiles (`memaudit.train.noise`) that hold its own
    elements (`ShardSpec.local_of`), spread over torch's threads (`for_each_draw`): about 1/G
    of the trained parameters on a grid of G tensor-parallel ranks, plus the tiles its share
    cuts. The noise is the one-process run's, bit for bit, for any grid. Measured
    (`benchmarks/dp_noise.py`, one core): a rank of x=y=z=2 drew 0.1251 of 350m's noise in
    0.19 s, where drawing every logical tensor and cutting it took 1.83 s.
    """
    params = [p for p in model.hf.parameters() if p.requires_grad]

    def draw(i: int) -> Apply | None:  # this rank's block of the logical tensor, from its tiles
        p = params[i]
        spec, key = p.shard_spec, parameter_key(randomness, step, i)
        noise = spec.local_of(lambda rows, cols: noise_block(key, spec.full_shape, rows, cols, std), model.comm)
        return added(p.grad, noise)

    for_each_draw(draw, [p.grad for p in params])


def pad_rows(input_ids: torch.Tensor, attention_mask: torch.Tensor, loss_mask: torch.Tensor, multiple: int
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Append masked rows (no targets, full attention) so the rows divide by `multiple` (and
    at least one row per shard when there are none)."""
    b = input_ids.shape[0]
    extra = (-b) % multiple if b else multiple
    if extra == 0:
        return input_ids, attention_mask, loss_mask
    return (torch.cat([input_ids, input_ids.new_zeros(extra, input_ids.shape[1])]),
            torch.cat([attention_mask, attention_mask.new_ones(extra, attention_mask.shape[1])]),
            torch.cat([loss_mask, loss_mask.new_zeros(extra, loss_mask.shape[1])]))


class TensorParallelClipping:
    """`PerExampleClipping` of a `ParallelLlama`: two passes per micro-batch of the global batch.

    Pass 1 (`per_example_grad_norms`) gives every local example's (or group's) full norm; pass 2
    backpropagates the losses weighted by min(1, C/norm), accumulating the clipped sum in `.grad`;
    after the last micro-batch the gradients are synchronised over z and data once.
    """

    def __init__(self, model: ParallelLlama) -> None:
        self.model = model
        self.params = [(n, p) for n, p in model.hf.named_parameters() if p.requires_grad]  # LoRA: the adapters

    def clipped_sum_(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, loss_mask: torch.Tensor,
                     clip: float, *, micro_batch_size: int | None, right_padded: bool = False,
                     group_size: int = 1) -> ClipStats:
        """Every rank passes the whole global batch; it keeps its data x z share of the rows
        (whole groups of `group_size` rows: one user's sequences, clipped as one unit)."""
        pg, g = self.model.pg, group_size
        b = int(input_ids.shape[0])
        if g < 1 or b % g:
            raise ValueError(f"{b} rows do not split into groups of {g}")
        ids, am, lm = pad_rows(input_ids, attention_mask, loss_mask, pg.batch_shards * g)
        ids, lm = pg.batch_shard(ids), pg.batch_shard(lm)
        lam = None if right_padded else pg.batch_shard(am)
        micro = None  # global rows per pass -> local rows per pass, whole groups
        if micro_batch_size is not None:
            micro = max(g, math.ceil(micro_batch_size / pg.batch_shards) // g * g)
        st = self._two_passes(ids, lm, lam, clip, micro, g)
        return st if g == 1 else dataclasses.replace(st, units=b // g)

    def _two_passes(self, ids: torch.Tensor, lm: torch.Tensor, am: torch.Tensor | None, clip: float,
                    micro: int | None, g: int) -> ClipStats:
        model = self.model
        b = int(ids.shape[0])
        chunk = micro or max(b, 1)
        parts = [slice(s, s + chunk) for s in range(0, b, chunk)]

        def mask(sl: slice) -> torch.Tensor | None:
            return None if am is None else am[sl]

        first = model.pg.batch_index * b  # the step-batch row of local row 0 (adapter dropout's masks)

        def norms_of(sl: slice) -> torch.Tensor:
            with dropout_rows(model, first + sl.start):
                return per_example_grad_norms(model, ids[sl], lm[sl], mask(sl), group_size=g)

        # pass 1: every example's (group's) full-gradient norm (gradients are discarded)
        norms = torch.cat([norms_of(sl) for sl in parts])
        factor = torch.clamp(clip / (norms + 1e-6), max=1.0).to(torch.float32).repeat_interleave(g)
        real = lm[:, 1:].any(1).to(norms.device)  # padding rows (no targets) are not examples
        real_units = real.reshape(-1, g).any(1)  # a padding group is no user
        loss_sum = torch.zeros((), dtype=torch.float64, device=norms.device)
        # pass 2: the clipped sum, accumulated in .grad over the chunks
        for sl in parts:  # the same masks as pass 1, so each unit's clipped gradient is the one measured
            with dropout_rows(model, first + sl.start):
                losses = model.per_example_losses(ids[sl], lm[sl], mask(sl))
                loss_sum += losses.detach().double().sum()
                (losses * factor[sl]).sum().backward()
        # (clipped units, examples, loss sum): 3 x fp64, as the planner counts them
        stats = torch.stack([((norms > clip) & real_units).double().sum(), real.double().sum(), loss_sum])
        for axis in (MeshAxis.Z, MeshAxis.DATA):
            model.comm.all_reduce(stats, axis)
        sync_grads(model)
        return ClipStats(norms, int(stats[0]), float(stats[2]), int(stats[1]))

    def add_noise_(self, std: float, randomness: Any, step: int) -> None:
        add_noise_(self.model, std=std, randomness=randomness, step=step)

    def share(self, randomness: Any) -> Any:
        return randomness.broadcast()  # rank 0's secret on every rank (a collective)
