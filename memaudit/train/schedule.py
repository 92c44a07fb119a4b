"""Learning-rate schedule: linear warm-up, then cosine decay to `min_lr_ratio * lr`.

The schedule is a pure function of the step, so it has no state to checkpoint and a
resumed run sees exactly the learning rates of an uninterrupted one.

References:
    Loshchilov & Hutter, "SGDR: Stochastic Gradient Descent with Warm Restarts", ICLR 2017
    (cosine decay); Goyal et al., "Accurate, Large Minibatch SGD", 2017 (linear warm-up).

>>> lr_at(0, lr=1.0, warmup_steps=10, total_steps=110, min_lr_ratio=0.1)
0.1
>>> lr_at(10, lr=1.0, warmup_steps=10, total_steps=110, min_lr_ratio=0.1)
1.0
>>> round(lr_at(109, lr=1.0, warmup_steps=10, total_steps=110, min_lr_ratio=0.1), 4)
0.1
"""

from __future__ import annotations

import math


def lr_at(step: int, *, lr: float, warmup_steps: int, total_steps: int, min_lr_ratio: float) -> float:
    """Learning rate of optimizer update `step` (0-based: the first update is step 0).

    Warm-up ramps linearly over `warmup_steps` updates (update i uses (i+1)/warmup of the
    peak), then a half cosine goes from the peak at update `warmup_steps` to
    `min_lr_ratio * lr` at the last update `total_steps - 1`.
    """
    if step < warmup_steps:
        return lr * (step + 1) / warmup_steps
    decay_steps = total_steps - 1 - warmup_steps
    if decay_steps <= 0:
        return lr
    progress = min(1.0, (step - warmup_steps) / decay_steps)
    cosine = 0.5 * (1.0 + math.cos(math.pi * progress))
    return lr * (min_lr_ratio + (1.0 - min_lr_ratio) * cosine)
