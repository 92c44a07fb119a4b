"""DP-SGD for the jax engine, by jax-privacy: its clipping (per example, per user) and its noise.

For a Poisson-sampled step S (of examples, or under ULS of users),

    ĝ = ( Σ_{i∈S} min(1, C/||∇ℓ_i||) ∇ℓ_i  +  N(0, σ²C² I) ) / E[|S|]

the update of the torch engine's `memaudit.train.dpsgd.DPSGD`: ℓ_i is example i's mean token
loss (`jax_engine.example_losses`), or under ULS the sum of user i's (≤ k) examples' mean
token losses, clipped as one unit; the denominator is the expected batch size, a constant.

- The clipped sum is `jax_privacy.clipped_grad`: per example with ``keep_batch_dim=True`` (each
  row given to the loss as a batch of one), per user with ``keep_batch_dim=False`` over a
  (users, k, L) batch (each user's k rows given as one batch, the group's gradient clipped).
  Its per-unit gradient norms come back with ``return_grad_norms`` (for the clip fraction,
  a statistic of the private data: `sensitive_metrics.jsonl`), its values with
  ``return_values``; ``microbatch_size`` (`train.micro_batch_size`, in units) bounds the
  per-example gradients held at once. A padding row (a Poisson step padded to a fixed size, a
  user with fewer than k sequences) has no target: its loss is 0, so its gradient is exactly 0.
  Its clip factor is min(1, C/||g||) where the torch engine's is min(1, C/(||g|| + 1e-6)):
  1e-6 relative at unit norms, inside the tested 1e-5.
- The noise is `jax_privacy.noise_addition.gaussian_privatizer` (stddev σC), given for step t
  a state holding the key derived from the run's secret at ("jax-dpsgd-noise", t)
  (`memaudit.privacy.randomness`): jax-privacy's draw, keyed per step as the torch engine's
  noise is, so a resume draws the same noise without carrying the privatizer's state, and the
  draw does not depend on the mesh (JAX's partitionable threefry).
- ``clipping="ghost"`` (`train.clipping`) computes the same clipped sum, per-unit norms and
  values by book-keeping ghost clipping (`memaudit.train.jax_ghost`): one forward and one
  backward of the whole batch, no per-example gradient tree; the noise and the rest as above.
- The ledger's event is the mechanism's (`memaudit.privacy.mechanisms`, set up by
  `memaudit.train.user_dp`): the same `DpEvent` the torch engine records for the same config.

References:
    Abadi et al., "Deep Learning with Differential Privacy", CCS 2016.
    Charles et al., "Fine-Tuning Large Language Models with User-Level Differential Privacy",
    SaTML 2025 (ULS: the user's summed gradient clipped).
    jax-privacy 2.0 (`clipping.clipped_grad`, `noise_addition.gaussian_privatizer`).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax
from jax_privacy import clipped_grad
from jax_privacy.noise_addition import gaussian_privatizer

from memaudit.train import jax_ghost
from memaudit.train.jax_engine import Forward, apply_update, example_losses

NOISE_PURPOSE = "jax-dpsgd-noise"


def unit_loss(forward: Forward) -> Callable:
    """loss(params, ids, am, lmask, rng) of one clipped unit, the sum of its rows' mean token
    losses: one example's (its row given as a batch of one), or a user's k rows'."""

    def loss(params, ids, am, lm, rng=None):
        return jnp.sum(example_losses(forward, params, ids, am, lm, rng))

    return loss


def clipped_sum_fn(forward: Forward, *, clip: float, group: bool, microbatch: int | None,
                   dropout: bool = False) -> Callable:
    """fn(params, ids, am, lmask[, rng]) -> (Σ clipped unit gradients, (values, grad_norms)) by
    `jax_privacy.clipped_grad`; rows (B, L), or under `group` (users, k, L)."""
    loss = unit_loss(forward)
    fn = clipped_grad(
        loss, argnums=0, l2_clip_norm=clip, batch_argnums=(1, 2, 3), keep_batch_dim=not group,
        return_values=True, return_grad_norms=True, microbatch_size=microbatch, dtype=jnp.float32,
        prng_argnum=4 if dropout else None)

    def call(params, ids, am, lm, rng=None):
        args = (params, ids, am, lm) + ((rng,) if dropout else ())
        grads, aux = fn(*args)
        return grads, (aux.values, aux.grad_norms)

    return call


def add_noise(grads: Any, stddev: float, key_data: jax.Array) -> Any:
    """grads + N(0, stddev²) per element by jax-privacy's Gaussian privatizer, its state the step's
    key (`key_data`: raw threefry key data from the run's secret)."""
    if stddev == 0:
        return grads
    privatizer = gaussian_privatizer(stddev=stddev, prng_key=jax.random.key(0))
    _, inner = privatizer.init(grads)
    noisy, _ = privatizer.update(grads, (jax.random.wrap_key_data(key_data), inner))
    return noisy


def private_step(forward: Forward, tx: optax.GradientTransformation, *, clip: float,
                 noise_multiplier: float, expected: float, group: bool, microbatch: int | None,
                 dropout: bool = False, clipping: str = "vmap", model: Any = None) -> Callable:
    """step(params, opt_state, ids, am, lmask, lr, key_data, rng) -> (params, opt_state, stats):
    the clipped sum, jax-privacy's noise σC, / E[|S|], AdamW. `stats` are sums the trainer
    turns into the torch engine's metrics (`step_metrics`). The clipped sum: ``clipping="vmap"``
    jax-privacy's per-unit gradients; ``"ghost"`` `memaudit.train.jax_ghost`'s book-keeping
    ghost clipping of the Flax Llama ``model`` (`forward`'s module), the same values."""
    if clipping == "ghost":
        if dropout or model is None:
            raise ValueError("ghost clipping needs the Flax Llama itself and no adapter dropout; "
                             "use train.clipping=vmap")
        clipped = jax_ghost.clipped_sum_fn(model, clip=clip, group=group, microbatch=microbatch)
    elif clipping == "vmap":
        clipped = clipped_sum_fn(forward, clip=clip, group=group, microbatch=microbatch, dropout=dropout)
    else:
        raise ValueError(f"clipping={clipping!r} is not one of vmap, ghost")
    stddev = float(noise_multiplier) * float(clip) if noise_multiplier > 0 else 0.0

    def step(params, opt_state, ids, am, lm, lr, key_data, rng=None):
        grads, (values, norms) = clipped(params, ids, am, lm, rng)
        grads = add_noise(grads, stddev, key_data)
        grads = jax.tree.map(lambda g: g / expected, grads)
        params, opt_state = apply_update(tx, params, opt_state, grads, lr)
        real = jnp.any(lm[..., 1:], axis=-1)  # rows with a target (a padding row has none)
        over = norms > clip if not math.isinf(clip) else jnp.zeros_like(norms, bool)
        return params, opt_state, {"loss_sum": jnp.sum(values), "clipped": jnp.sum(over),
                                   "examples": jnp.sum(real), "grad_norm": optax.tree.norm(grads)}

    return step


def step_metrics(stats: dict[str, Any], *, rows: int, units: int, noise_std: float,
                 group: bool) -> dict[str, Any]:
    """The torch engine's DP metrics (`DPSGD.step_gradients`) from a step's sums: loss (mean
    per-example loss), clip fraction, batch size (users under ULS, with `sequences`) and the
    noise std of the mean gradient. `rows`: the step's sampled rows; `units`: its clipped units."""
    examples = int(stats["examples"]) if group else rows
    out = {"loss": float(stats["loss_sum"]) / max(examples, 1) if rows else math.nan,
           "clip_fraction": int(stats["clipped"]) / max(units, 1) if rows else 0.0,
           "batch_size": units, "noise_std": noise_std}
    if group:
        out["sequences"] = examples
    return out


def jax_clipping(cfg: Any, *, group: bool = False, platform: str = "cpu") -> str:
    """`train.clipping` resolved for the jax engine: ghost or vmap. auto is ghost, except vmap under
    LoRA with adapter dropout (which ghost clipping does not cover) and for a user's rows clipped
    as one (``group``, ULS) on an accelerator, where vmap was measured faster (one TPU v5e,
    docs/results.md: ULS by vmap 1.075x the non-private step at 125m and 1.21x at 350m, by ghost
    1.37x and 1.35x; on the CPU ghost 1.19x against vmap 1.83x)."""
    if cfg.train.clipping != "auto":
        return cfg.train.clipping
    lora = cfg.model.lora
    if lora is not None and lora.dropout > 0:
        return "vmap"
    return "vmap" if group and platform != "cpu" else "ghost"
