"""The centralized backend's JAX engine: the mechanics of one step, without torch.

The federated side's Flax Llama (`memaudit.models.flax_llama`, or its LoRA wrapper
`memaudit.models.flax_lora.LoraModel`) trained as the torch engine trains the Hugging Face one:

- the loss is the token mean of the next-token cross entropy over the step's counted targets
  (`loss_mask`: real tokens after position 0, and Goldfish's kept ones), computed in float32
  whatever the compute dtype;
- AdamW (`adamw`: optax's `scale_by_adam` and decoupled weight decay, the learning rate of
  `memaudit.train.schedule.lr_at` passed to every step) after global-norm clipping at
  `train.grad_clip` (non-private; DP-SGD's update is `memaudit.train.jax_dp`'s);
- the model's parameters, the optimizer's moments and the batch live on a device mesh with two
  named axes (`MeshAxis`): the batch dim over ``data``; the attention and MLP kernels over
  ``model`` in the Megatron-LM column / row split of `flax_llama.kernel_axes`;
- compute in `compute_dtype` (float32 on the CPU, bfloat16 on an accelerator; parameters,
  the loss, the log-softmax and every norm stay float32).

Nothing here imports torch: a TPU host without it runs these functions (`benchmarks/
centralized_jax.py`). The run's backend is `memaudit.train.jax_trainer.JaxTrainer`.

References:
    Loshchilov & Hutter, "Decoupled Weight Decay Regularization" (AdamW), ICLR 2019.
    Shoeybi et al., "Megatron-LM", 2019 (the column / row split of the kernels).
    Hans et al., "Be like a Goldfish, Don't Memorize!", NeurIPS 2024 (`goldfish_mask`).

>>> str(compute_dtype("auto", "cpu")), str(compute_dtype("auto", "tpu"))
('float32', 'bfloat16')
"""

from __future__ import annotations

import enum
import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from memaudit.models.flax_llama import kernel_axes
from memaudit.models.precision import resolve_policy

P = PartitionSpec
Forward = Callable[..., jax.Array]  # forward(params, ids, attention_mask, rng) -> logits (b, L, V)


class MeshAxis(enum.StrEnum):
    """The jax engine's named mesh axes (``model`` is `flax_llama.PARTITION_RULES`' axis)."""

    DATA = "data"
    MODEL = "model"


def compute_dtype(train_dtype: str, platform: str) -> Any:
    """`train.dtype` resolved for the jax engine by the one compute policy both JAX backends follow
    (`memaudit.models.precision.resolve_policy`): auto is float32 on the CPU and bfloat16 on an
    accelerator (TPU, GPU). Parameters stay float32; this is the matmuls' dtype."""
    return resolve_policy(train_dtype, platform).compute


def build_mesh(mesh_model: int = 1, devices: Any = None) -> Mesh:
    """A (data, model) mesh over `devices` (default: all), `mesh_model` of them on the model axis.

    >>> tuple(map(str, build_mesh(1, jax.devices()[:1]).axis_names))
    ('data', 'model')
    """
    devs = list(jax.devices() if devices is None else devices)
    if mesh_model < 1 or len(devs) % mesh_model:
        raise ValueError(f"train.mesh_model={mesh_model} does not divide the {len(devs)} devices; set it to "
                         "a divisor of the device count")
    grid = np.asarray(devs, dtype=object).reshape(len(devs) // mesh_model, mesh_model)
    return Mesh(grid, (MeshAxis.DATA, MeshAxis.MODEL))


def data_axis_size(mesh: Mesh) -> int:
    return int(mesh.shape[MeshAxis.DATA])


def _path_names(path: tuple) -> tuple[str, ...]:
    return tuple(str(getattr(k, "key", getattr(k, "name", getattr(k, "idx", k)))) for k in path)


def tree_shardings(tree: Any, mesh: Mesh) -> Any:
    """A NamedSharding per leaf: a kernel (and an optimizer moment that mirrors it) split over
    the model axis by `kernel_axes`, everything else replicated."""

    def one(path: tuple, leaf: Any) -> NamedSharding:
        axes = kernel_axes(_path_names(path))
        if axes is None or np.ndim(leaf) != len(axes):
            return NamedSharding(mesh, P())
        return NamedSharding(mesh, P(*axes))

    return jax.tree_util.tree_map_with_path(one, tree)


def batch_sharding(mesh: Mesh) -> NamedSharding:
    """Dim 0 (rows, or a ULS step's users) over the data axis."""
    return NamedSharding(mesh, P(MeshAxis.DATA))


def place(tree: Any, shardings: Any) -> Any:
    """Host or device arrays -> device arrays in `shardings`."""
    return jax.tree.map(lambda x, s: jax.device_put(np.asarray(x) if not isinstance(x, jax.Array) else x, s),
                        tree, shardings)


def capacity(n: int, multiple: int) -> int:
    """Rows a step of `n` is padded to: the next power of two (so a Poisson batch reuses a few
    compiled programs), a multiple of the data axis.

    >>> capacity(5, 1), capacity(0, 1), capacity(9, 8)
    (8, 1, 16)
    """
    size = 1 << max(0, math.ceil(math.log2(max(n, 1))))
    return -(-size // multiple) * multiple


# ----------------------------------------------------------------------------- masks
_PRIME = 2**31 - 1
_BASE = 1_000_003
_MIX = 0x9E3779B1


def goldfish_mask(input_ids: np.ndarray, *, k: int, h: int) -> np.ndarray:
    """`memaudit.train.goldfish.goldfish_mask` in numpy (the same integers, so the same mask
    bit for bit; tested against it): (B, L) bool, True = keep the target."""
    ids = np.asarray(input_ids, dtype=np.int64)
    b, length = ids.shape
    keep = np.ones((b, length), dtype=bool)
    if length <= h:
        return keep
    ids = ids[:, :-1] % _PRIME
    powers = [1]
    for _ in range(h - 1):
        powers.append(powers[-1] * _BASE % _PRIME)
    pw = powers[::-1]
    windows = np.lib.stride_tricks.sliding_window_view(ids, h, axis=1)  # (B, L-h, h)
    acc = np.zeros(windows.shape[:2], dtype=np.int64)
    for j in range(h):
        acc = (acc + windows[..., j] * pw[j]) % _PRIME
    x = (acc * _MIX) % (2**32)
    x = x ^ (x >> 16)
    x = (x * 0x45D9F3B) % (2**32)
    keep[:, h:] = (x ^ (x >> 16)) % k != 0
    return keep


def loss_mask(input_ids: np.ndarray, attention_mask: np.ndarray, goldfish: Any = None) -> np.ndarray:
    """(B, L) bool: the targets that count (real tokens after position 0, and with Goldfish
    (`train.goldfish`, enabled) only those it keeps); as the torch engine's `make_batch`."""
    mask = np.asarray(attention_mask).astype(bool).copy()
    mask[:, 0] = False
    if goldfish is not None and goldfish.enabled:
        mask &= goldfish_mask(input_ids, k=goldfish.k, h=goldfish.h)
    return mask


# ----------------------------------------------------------------------------- losses
def token_losses(logits: jax.Array, input_ids: jax.Array, lmask: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(masked next-token losses (b, L-1), float mask (b, L-1)), float32: logits at t predict
    token t+1, counted where `lmask[:, t+1]`; logsumexp - logit[target], no (b, L, V) log-probs."""
    pred = logits[:, :-1].astype(jnp.float32)  # (b, L-1, V)
    tgt = input_ids[:, 1:]
    m = lmask[:, 1:].astype(jnp.float32)
    picked = jnp.take_along_axis(pred, tgt[..., None], axis=-1)[..., 0]
    nll = jax.nn.logsumexp(pred, axis=-1) - picked
    return nll * m, m


def example_losses(forward: Forward, params: Any, ids: jax.Array, am: jax.Array, lmask: jax.Array,
                   rng: Any = None) -> jax.Array:
    """Each row's mean token loss (b,), 0 for a row without a target (a padding row): the unit
    DP-SGD clips, as `memaudit.train.losses.causal_lm_loss_per_example`."""
    tok, m = token_losses(forward(params, ids, am, rng), ids, lmask)
    return tok.sum(1) / jnp.maximum(m.sum(1), 1.0)


def mean_loss(forward: Forward, params: Any, ids: jax.Array, am: jax.Array, lmask: jax.Array,
              rng: Any = None) -> tuple[jax.Array, jax.Array]:
    """(sum of the counted token losses, their count) of a batch: the token mean's two halves."""
    tok, m = token_losses(forward(params, ids, am, rng), ids, lmask)
    return tok.sum(), m.sum()


def make_forward(model: Any) -> Forward:
    """forward(params, ids, attention_mask, rng) for a FlaxLlama or a LoraModel (rng: adapter
    dropout's key, None for none)."""

    def forward(params: Any, ids: jax.Array, am: jax.Array, rng: Any = None) -> jax.Array:
        kw = {} if rng is None else {"dropout_rng": rng}
        return model.apply({"params": params}, ids, am, **kw)

    return forward


# ----------------------------------------------------------------------------- optimizer
def adamw(betas: tuple[float, float], weight_decay: float) -> optax.GradientTransformation:
    """torch's AdamW without the learning rate (eps 1e-8, bias-corrected moments, decoupled decay):
    the update a step scales by -lr (`apply_update`)."""
    return optax.chain(optax.scale_by_adam(b1=betas[0], b2=betas[1], eps=1e-8),
                       optax.add_decayed_weights(weight_decay))


def apply_update(tx: optax.GradientTransformation, params: Any, opt_state: Any, grads: Any,
                 lr: jax.Array) -> tuple[Any, Any]:
    """params - lr * AdamW(grads): one optimizer step."""
    updates, opt_state = tx.update(grads, opt_state, params)
    params = jax.tree.map(lambda p, u: (p - lr * u).astype(p.dtype), params, updates)
    return params, opt_state


def clip_by_global_norm(grads: Any, max_norm: float) -> tuple[Any, jax.Array]:
    """torch's `clip_grad_norm_`: scale by min(1, max_norm / (norm + 1e-6)); returns the norm before."""
    norm = optax.tree.norm(grads)
    if math.isinf(max_norm):
        return grads, norm
    scale = jnp.minimum(1.0, max_norm / (norm + 1e-6))
    return jax.tree.map(lambda g: g * scale.astype(g.dtype), grads), norm


def plain_step(forward: Forward, tx: optax.GradientTransformation, *, grad_clip: float,
               chunks: int = 1) -> Callable:
    """step(params, opt_state, ids, am, lmask, lr, rng) -> (params, opt_state, metrics): the token
    mean loss's gradient (summed over `chunks` micro-batches, each weighted by its targets),
    global-norm clipping, AdamW. Not jitted (the caller jits it with its shardings)."""

    def loss_sum(params, ids, am, lm, rng):
        s, n = mean_loss(forward, params, ids, am, lm, rng)
        return s, n

    grad_fn = jax.value_and_grad(loss_sum, has_aux=True)

    def step(params, opt_state, ids, am, lm, lr, rng):
        b = ids.shape[0]
        size = -(-b // chunks)
        grads, total, count = None, jnp.float32(0.0), jnp.float32(0.0)
        for s in range(0, b, size):  # micro-batches, unrolled: gradients of loss sums
            (ls, n), g = grad_fn(params, ids[s:s + size], am[s:s + size], lm[s:s + size],
                                 None if rng is None else jax.random.fold_in(rng, s))
            grads = g if grads is None else jax.tree.map(jnp.add, grads, g)
            total, count = total + ls, count + n
        denom = jnp.maximum(count, 1.0)
        grads = jax.tree.map(lambda g: g / denom, grads)
        grads, norm = clip_by_global_norm(grads, grad_clip)
        params, opt_state = apply_update(tx, params, opt_state, grads, lr)
        return params, opt_state, {"loss": total / denom, "grad_norm": norm}

    return step


def holdout_sums(forward: Forward) -> Callable:
    """eval(params, ids, am) -> (sum of target losses, targets): targets are the real tokens after
    position 0, as the torch engine's `holdout_loss`."""

    def sums(params, ids, am):
        lm = am.astype(bool).at[:, 0].set(False)
        return mean_loss(forward, params, ids, am, lm)

    return sums
