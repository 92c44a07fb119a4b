"""Global-norm gradient clipping over sharded parameters.

Each rank adds the squared norm of its gradient shards, dividing a replicated parameter's
contribution by its number of copies over x, y and z; all-reducing over x, y and z gives
the squared norm of the full gradient (data replicas are identical after the gradient sync).
Equals `torch.nn.utils.clip_grad_norm_` on the serial model.
"""

from __future__ import annotations

import math

import torch

from memaudit.parallel.dims import MeshAxis
from memaudit.parallel.parallelize import ParallelLlama


def grad_norm(model: ParallelLlama) -> float:
    """The global L2 norm of the (synchronised) gradient of the logical model."""
    comm = model.comm
    sq = torch.zeros((), dtype=torch.float64)
    for p in model.hf.parameters():
        if p.grad is None:
            continue
        copies = math.prod(comm.size(a) for a in p.shard_spec.replicated)
        sq += p.grad.detach().double().pow(2).sum() / copies
    for axis in (MeshAxis.X, MeshAxis.Y, MeshAxis.Z):
        comm.all_reduce(sq, axis)
    return float(sq.sqrt())


def clip_grad_norm_(model: ParallelLlama, max_norm: float) -> float:
    """Scale gradients so their global norm is at most `max_norm`; returns the norm before."""
    total = grad_norm(model)
    coef = min(1.0, max_norm / (total + 1e-6))
    if coef < 1.0:
        for p in model.hf.parameters():
            if p.grad is not None:
                p.grad.mul_(coef)
    return total
