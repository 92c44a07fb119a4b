"""DP-SGD under tensor parallelism.

Per-example squared gradient norms are gathered per local shard during backward (ghost
norms, `memaudit.parallel.ghost`) and summed over x and y, so every rank sees each of its
examples' full-gradient norm; a second, reweighted backward gives the clipped sum; the
Gaussian noise of each logical parameter is drawn full-size from a generator keyed by the
run's secret randomness at ("dpsgd-noise", step, parameter index) (HKDF,
`memaudit.privacy.randomness`; the secret is broadcast from rank 0 once) and sliced like the
parameter, so it is drawn once per logical parameter, identical on every replica, and the
same for any grid (including one process).

References: Abadi et al., "Deep Learning with Differential Privacy", CCS 2016; Li et al.,
ghost clipping, ICLR 2022.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from memaudit.parallel import ghost
from memaudit.parallel.parallelize import ParallelLlama, sync_grads


@dataclass(frozen=True)
class DPStepStats:
    per_example_norms: torch.Tensor  # (B_local,) this rank's examples, before clipping
    clip_fraction: float  # over the global batch
    noise_std: float  # of the summed gradient (sigma * clip)
    loss: float  # mean per-example loss over the global batch (before clipping)


def per_example_grad_norms(model: ParallelLlama, input_ids: torch.Tensor, loss_mask: torch.Tensor,
                           attention_mask: torch.Tensor | None = None) -> torch.Tensor:
    """Full-gradient L2 norm of each local example's mean token loss, shape (B_local,)."""
    for p in model.hf.parameters():
        p.grad = None
    with ghost.collect(input_ids.shape[0]) as acc:
        model.per_example_losses(input_ids, loss_mask, attention_mask).sum().backward()
    for axis in ("x", "y"):
        model.comm.all_reduce(acc, axis)
    for p in model.hf.parameters():
        p.grad = None
    return acc.clamp(min=0).sqrt()


def add_noise_(model: ParallelLlama, *, std: float, randomness: Any, step: int) -> None:
    """Add N(0, std^2) to every logical gradient element, identically on every replica.

    ``randomness`` must be the same `DPRandomness` on every rank (`DPRandomness.broadcast`).
    """
    for i, p in enumerate(model.hf.parameters()):
        spec = p.shard_spec
        gen = randomness.torch_generator("dpsgd-noise", step, i)
        noise = torch.randn(spec.full_shape, generator=gen, dtype=torch.float32) * std
        p.grad.add_(spec.local(noise, model.comm).to(p.grad.dtype))


def dp_sgd_backward(model: ParallelLlama, input_ids: torch.Tensor, loss_mask: torch.Tensor, *,
                    clip: float, noise_multiplier: float, expected_batch: float, randomness: Any, step: int,
                    attention_mask: torch.Tensor | None = None, micro_batch: int | None = None) -> DPStepStats:
    """Leave in `.grad` the noised, clipped gradient sum over the global batch / expected_batch.

    Args:
      input_ids, loss_mask: this rank's batch shard (B_local, S).
      clip: per-example L2 bound C (math.inf: no clipping).
      noise_multiplier: sigma; the sum gets N(0, (sigma C)^2) per coordinate.
      expected_batch: the divisor (the expected batch size under Poisson sampling).
      randomness, step: select the noise (a `DPRandomness`, the same on every rank).
      micro_batch: local rows per pass (None: all); the clipped sums of the passes are
        accumulated, then synchronised and noised once. Every rank must pass the same value.
    """
    b = int(input_ids.shape[0])
    chunk = micro_batch or max(b, 1)
    parts = [slice(s, s + chunk) for s in range(0, b, chunk)]

    def am(sl: slice) -> torch.Tensor | None:
        return None if attention_mask is None else attention_mask[sl]

    # pass 1: every example's full-gradient norm (gradients are discarded)
    norms = torch.cat([per_example_grad_norms(model, input_ids[sl], loss_mask[sl], am(sl)) for sl in parts])
    factor = torch.clamp(clip / (norms + 1e-6), max=1.0).to(torch.float32)
    real = loss_mask[:, 1:].any(1).to(norms.device)  # padding rows (no targets) are not examples
    loss_sum = torch.zeros((), dtype=torch.float64, device=norms.device)
    # pass 2: the clipped sum, accumulated in .grad over the chunks
    for sl in parts:
        losses = model.per_example_losses(input_ids[sl], loss_mask[sl], am(sl))
        loss_sum += losses.detach().double().sum()
        (losses * factor[sl]).sum().backward()
    stats = torch.stack([((norms > clip) & real).double().sum(), real.double().sum(), loss_sum])
    for axis in ("z", "data"):
        model.comm.all_reduce(stats, axis)
    sync_grads(model)
    std = noise_multiplier * clip if noise_multiplier > 0 else 0.0
    if std > 0:
        add_noise_(model, std=std, randomness=randomness, step=step)
    for p in model.hf.parameters():
        p.grad.div_(expected_batch)
    n = stats[1].clamp(min=1.0)
    return DPStepStats(norms, float(stats[0] / n), std, float(stats[2] / n))
