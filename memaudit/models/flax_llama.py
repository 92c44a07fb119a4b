"""A Llama causal LM in Flax (linen) whose parameters map one-to-one onto Hugging Face names.

RMSNorm, rotary position embeddings (HF's `rotate_half` convention: the head dim is split
into two halves, not interleaved pairs), a SwiGLU MLP and grouped-query attention with a
causal mask combined with a key padding mask. The parameter tree mirrors
`LlamaForCausalLM.state_dict()`: `model.layers.0.self_attn.q_proj.weight` lives at
`params["model"]["layers"]["0"]["self_attn"]["q_proj"]["kernel"]` (transposed: Flax
kernels are (in, out), torch Linear weights are (out, in)); embeddings are `embedding`,
norm scales keep the name `weight`. `memaudit.models.convert` moves weights both ways.

References:
    Touvron et al. 2023, "LLaMA: Open and Efficient Foundation Language Models".
    Su et al. 2021, "RoFormer: Enhanced Transformer with Rotary Position Embedding".
    Ainslie et al. 2023, "GQA: Training Generalized Multi-Query Transformer Models".
    Shoeybi et al. 2019, "Megatron-LM" (the column / row split of `PARTITION_RULES`).

>>> import jax, jax.numpy as jnp
>>> cfg = FlaxLlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=24,
...                       num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1)
>>> model = FlaxLlama(cfg)
>>> params = model.init(jax.random.key(0), jnp.zeros((1, 4), jnp.int32))["params"]
>>> model.apply({"params": params}, jnp.zeros((2, 4), jnp.int32)).shape
(2, 4, 32)
"""

from __future__ import annotations

import dataclasses
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from memaudit.models.convert import STACKED, hf_to_flax
from memaudit.models.precision import ComputePolicy
from memaudit.models.presets import LlamaPreset, get_preset, init_state_dict

ATTENTION = ("xla", "flash")


@dataclasses.dataclass(frozen=True, kw_only=True)
class FlaxLlamaConfig(LlamaPreset):
    """A preset's shape (the same fields as `LlamaPreset`) plus the compute dtype."""

    dtype: Any = jnp.float32  # compute dtype; parameters stay float32
    # the decoder layers as one nn.scan over weights stacked on a leading layer dim (their
    # parameters under `layers/stacked`, `convert.stack_layers`); remat: recomputed in backward
    scan_layers: bool = False
    remat: bool = False
    # "xla": scores as einsums and a softmax (any backend); "flash": the Pallas TPU flash-attention
    # kernel (causal, padding as segment ids; no (q, k) score matrix in memory)
    attention: str = "xla"

    def __post_init__(self) -> None:
        if self.attention not in ATTENTION:
            raise ValueError(f"attention {self.attention!r} is not one of {ATTENTION}; use xla or flash (TPU)")

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @classmethod
    def from_preset(cls, name: str, *, vocab_size: int | None = None, dtype: Any = jnp.float32,
                    policy: ComputePolicy | None = None) -> FlaxLlamaConfig:
        """The preset's shape; ``policy`` (`memaudit.models.precision`) sets the compute dtype and
        the layer scan, else ``dtype`` the compute dtype."""
        p = dataclasses.asdict(get_preset(name))
        if vocab_size is not None:
            p["vocab_size"] = vocab_size
        return cls(**p, **(policy_fields(policy) if policy is not None else {"dtype": dtype}))


def policy_fields(policy: ComputePolicy) -> dict[str, Any]:
    """The `FlaxLlamaConfig` fields a `ComputePolicy` sets."""
    return {"dtype": policy.compute, "scan_layers": policy.scan_layers, "remat": policy.remat}


class RMSNorm(nn.Module):
    eps: float
    dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        w = self.param("weight", nn.initializers.ones, (x.shape[-1],), jnp.float32)
        return (w * rms_normalize(x, self.eps, self.dtype)).astype(self.dtype)


def rms_normalize(x: jax.Array, eps: float, dtype: Any) -> jax.Array:
    """x / RMS(x) over the last dim, computed in float32, cast to `dtype`: what `RMSNorm` scales
    (its weight's gradient is the output gradient times this, `memaudit.train.jax_ghost`)."""
    x32 = x.astype(jnp.float32)
    x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return x32.astype(dtype)


def rope_cos_sin(positions: jax.Array, head_dim: int, theta: float) -> tuple[jax.Array, jax.Array]:
    """cos/sin tables (batch, seq, head_dim) for integer positions (batch, seq), as HF builds them."""
    inv_freq = 1.0 / (theta ** (jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim))
    freqs = positions.astype(jnp.float32)[..., None] * inv_freq  # (batch, seq, head_dim/2)
    emb = jnp.concatenate([freqs, freqs], axis=-1)
    return jnp.cos(emb), jnp.sin(emb)


def rotate_half(x: jax.Array) -> jax.Array:
    half = x.shape[-1] // 2
    return jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    # x: (batch, seq, heads, head_dim); cos/sin: (batch, seq, head_dim)
    cos, sin = cos[:, :, None, :].astype(x.dtype), sin[:, :, None, :].astype(x.dtype)
    return x * cos + rotate_half(x) * sin


def _dense(features: int, name: str, dtype: Any) -> nn.Dense:
    return nn.Dense(
        features, use_bias=False, name=name, dtype=dtype, param_dtype=jnp.float32,
        kernel_init=nn.initializers.normal(0.02),
    )


def flash_attention(q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array) -> jax.Array:
    """Causal attention by the Pallas TPU flash-attention kernel: q (batch, seq, heads, head_dim),
    k and v (batch, seq, kv_heads, head_dim), mask (batch, seq) with 1 for a real token; a real
    query reads the real keys at or before it, as the einsum path does. Returns (batch, seq, heads,
    head_dim). Key/value heads are repeated for grouped-query attention (the kernel wants equal
    head counts). On the CPU it runs under `jax.experimental.pallas.tpu.force_tpu_interpret_mode`."""
    # lazy: Pallas only where the flash path is chosen
    from jax.experimental.pallas.ops.tpu import flash_attention as fa

    _, s, nh, hd = q.shape
    pad = -s % 128  # the kernel tiles keys in 128-lane blocks: pad, as padding, and cut back
    group = nh // k.shape[2]
    k, v = (jnp.repeat(x, group, axis=2) if group > 1 else x for x in (k, v))
    q, k, v = (jnp.pad(x, ((0, 0), (0, pad), (0, 0), (0, 0))).transpose(0, 2, 1, 3) for x in (q, k, v))
    seg = jnp.pad(mask.astype(jnp.int32), ((0, 0), (0, pad)))  # (batch, heads, seq, head_dim) above
    blk = min(512, s + pad)
    sizes = fa.BlockSizes(block_q=blk, block_k_major=blk, block_k=blk, block_b=1,
                          block_q_major_dkv=blk, block_k_major_dkv=blk, block_k_dkv=blk, block_q_dkv=blk,
                          block_k_major_dq=blk, block_k_dq=blk, block_q_dq=blk)
    out = fa.flash_attention(q, k, v, segment_ids=fa.SegmentIds(q=seg, kv=seg), causal=True,
                             sm_scale=float(hd) ** -0.5, block_sizes=sizes)
    return out.transpose(0, 2, 1, 3)[:, :s]


class Attention(nn.Module):
    cfg: FlaxLlamaConfig

    @nn.compact
    def __call__(self, x: jax.Array, cos: jax.Array, sin: jax.Array, bias: jax.Array) -> jax.Array:
        c = self.cfg
        b, s, _ = x.shape
        nh, nkv, hd = c.num_attention_heads, c.num_key_value_heads, c.head_dim
        q = _dense(nh * hd, "q_proj", c.dtype)(x).reshape(b, s, nh, hd)
        k = _dense(nkv * hd, "k_proj", c.dtype)(x).reshape(b, s, nkv, hd)
        v = _dense(nkv * hd, "v_proj", c.dtype)(x).reshape(b, s, nkv, hd)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if c.attention == "flash":  # bias: the (batch, seq) padding mask as segment ids
            out = flash_attention(q, k, v, bias).reshape(b, s, nh * hd)
            return _dense(c.hidden_size, "o_proj", c.dtype)(out)
        # grouped-query attention: query head h reads key/value head h // (nh // nkv)
        q = q.reshape(b, s, nkv, nh // nkv, hd)  # (batch, seq, kv_heads, group, head_dim)
        scores = jnp.einsum("bqkgd,bskd->bkgqs", q, k).astype(jnp.float32) / jnp.sqrt(hd).astype(jnp.float32)
        scores = scores + bias[:, None, None, :, :]  # bias: (batch, q_seq, k_seq)
        probs = jax.nn.softmax(scores, axis=-1).astype(c.dtype)
        out = jnp.einsum("bkgqs,bskd->bqkgd", probs, v).reshape(b, s, nh * hd)
        return _dense(c.hidden_size, "o_proj", c.dtype)(out)


class MLP(nn.Module):
    cfg: FlaxLlamaConfig

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        c = self.cfg
        gate = _dense(c.intermediate_size, "gate_proj", c.dtype)(x)
        up = _dense(c.intermediate_size, "up_proj", c.dtype)(x)
        return _dense(c.hidden_size, "down_proj", c.dtype)(nn.silu(gate) * up)


class DecoderLayer(nn.Module):
    cfg: FlaxLlamaConfig
    scan_step: bool = False  # return (x, None), the step of an nn.scan over the layers

    @nn.compact
    def __call__(self, x: jax.Array, cos: jax.Array, sin: jax.Array, bias: jax.Array) -> Any:
        c = self.cfg
        h = RMSNorm(c.rms_norm_eps, c.dtype, name="input_layernorm")(x)
        x = x + Attention(c, name="self_attn")(h, cos, sin, bias)
        h = RMSNorm(c.rms_norm_eps, c.dtype, name="post_attention_layernorm")(x)
        x = x + MLP(c, name="mlp")(h)
        return (x, None) if self.scan_step else x


class Layers(nn.Module):
    """Container so that layer i lives at `layers/<i>`, as in HF's `model.layers.<i>`; with
    ``scan_layers`` one scanned layer at `layers/stacked` whose weights carry a leading layer
    dim (row i is HF's `model.layers.<i>`), so the program holds one layer whatever the depth."""

    cfg: FlaxLlamaConfig

    @nn.compact
    def __call__(self, x: jax.Array, cos: jax.Array, sin: jax.Array, bias: jax.Array) -> jax.Array:
        c = self.cfg
        if c.scan_layers:
            step = nn.remat(DecoderLayer, prevent_cse=False) if c.remat else DecoderLayer
            # per-layer intermediates and perturbations (ghost clipping's captures, when asked
            # for) stack on the layer dim as the weights do
            stack = nn.scan(step, variable_axes={"params": 0, "intermediates": 0, "perturbations": 0},
                            split_rngs={"params": True},
                            in_axes=(nn.broadcast, nn.broadcast, nn.broadcast),
                            length=c.num_hidden_layers)
            x, _ = stack(c, scan_step=True, name=STACKED)(x, cos, sin, bias)
            return x
        for i in range(c.num_hidden_layers):
            x = DecoderLayer(c, name=str(i))(x, cos, sin, bias)
        return x


class LlamaModel(nn.Module):
    cfg: FlaxLlamaConfig

    @nn.compact
    def __call__(self, input_ids: jax.Array, attention_mask: jax.Array | None,
                 position_ids: jax.Array | None) -> tuple[jax.Array, nn.Embed]:
        c = self.cfg
        b, s = input_ids.shape
        embed = nn.Embed(c.vocab_size, c.hidden_size, name="embed_tokens", dtype=c.dtype,
                         param_dtype=jnp.float32, embedding_init=nn.initializers.normal(0.02))
        x = embed(input_ids)  # (batch, seq, hidden)
        if position_ids is None:
            position_ids = jnp.broadcast_to(jnp.arange(s), (b, s))
        cos, sin = rope_cos_sin(position_ids, c.head_dim, c.rope_theta)
        if c.attention == "flash":  # the kernel masks by segment ids: the padding mask is the bias
            mask = jnp.ones((b, s), jnp.int32) if attention_mask is None else attention_mask
            x = Layers(c, name="layers")(x, cos, sin, mask.astype(jnp.int32))
            return RMSNorm(c.rms_norm_eps, c.dtype, name="norm")(x), embed
        allowed = jnp.tril(jnp.ones((s, s), dtype=bool))[None]  # (1, q, k)
        if attention_mask is not None:
            allowed = allowed & (attention_mask[:, None, :] > 0)  # padded keys are never read
        bias = jnp.where(allowed, 0.0, jnp.finfo(jnp.float32).min).astype(jnp.float32)
        x = Layers(c, name="layers")(x, cos, sin, bias)
        return RMSNorm(c.rms_norm_eps, c.dtype, name="norm")(x), embed


class FlaxLlama(nn.Module):
    """`LlamaForCausalLM` in Flax: `apply({"params": p}, input_ids, attention_mask)` -> logits (fp32)."""

    cfg: FlaxLlamaConfig

    @nn.compact
    def __call__(self, input_ids: jax.Array, attention_mask: jax.Array | None = None,
                 position_ids: jax.Array | None = None) -> jax.Array:
        h, embed = LlamaModel(self.cfg, name="model")(input_ids, attention_mask, position_ids)
        if self.cfg.tie_word_embeddings:
            logits = embed.attend(h)
        else:
            logits = _dense(self.cfg.vocab_size, "lm_head", self.cfg.dtype)(h)
        return logits.astype(jnp.float32)  # (batch, seq, vocab)


# Tensor-parallel layout of one model over a mesh axis (Megatron-LM): the projections into
# heads / the intermediate size split their output dim (column), the projections back to
# the hidden size their input dim (row), so attention and the MLP each need one all-reduce.
# Flax kernels are (in, out). Everything else (embeddings, norms, lm_head) is replicated.
COLUMN = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")
ROW = ("o_proj", "down_proj")
PARTITION_RULES: dict[str, tuple[str | None, str | None]] = {
    **dict.fromkeys(COLUMN, (None, "model")), **dict.fromkeys(ROW, ("model", None)),
}


def kernel_axes(path: tuple[str, ...]) -> tuple[str | None, ...] | None:
    """The mesh axis of each dim of the kernel at ``path`` (names of the parameter tree, as
    in ``(..., "self_attn", "q_proj", "kernel")``), or None for a replicated parameter. An
    optimizer state that mirrors the parameter tree (Adam's moments) matches the same paths.

    >>> kernel_axes(("model", "layers", "0", "mlp", "down_proj", "kernel"))
    ('model', None)
    >>> kernel_axes(("model", "norm", "weight")) is None
    True
    >>> kernel_axes(("model", "layers", "stacked", "mlp", "down_proj", "kernel"))  # (layer, in, out)
    (None, 'model', None)
    """
    if len(path) >= 2 and path[-1] == "kernel":
        rule = PARTITION_RULES.get(path[-2])
        if rule is not None and STACKED in path:
            return (None, *rule)
        return rule
    return None


def check_model_axis(cfg: LlamaPreset, size: int) -> None:
    """A one-line ``ValueError`` unless a ``model`` mesh axis of ``size`` devices divides the
    query heads, the key/value heads and the intermediate size (so each device holds whole
    heads and an equal slice of the MLP)."""
    if size < 1:
        raise ValueError(f"federated.mesh_model={size} must be >= 1")
    for what, value in (("num_attention_heads", cfg.num_attention_heads),
                        ("num_key_value_heads", cfg.num_key_value_heads),
                        ("intermediate_size", cfg.intermediate_size)):
        if value % size:
            raise ValueError(
                f"federated.mesh_model={size} does not divide the model's {what}={value}; "
                f"set federated.mesh_model to a divisor of {value}")


def causal_lm_loss(logits: jax.Array, input_ids: jax.Array, attention_mask: jax.Array,
                   example_weight: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
    """Summed next-token cross entropy and the number of predicted tokens.

    Position t predicts token t+1 wherever token t+1 is real (attention_mask 1), the same
    targets as HF's `labels=input_ids` with -100 on padding. `example_weight` (batch,) scales or masks out
    whole sequences (padding examples get 0). Returns (sum of losses, token count), so callers
    can form token means across batches and clients.
    """
    logp = jax.nn.log_softmax(logits[:, :-1].astype(jnp.float32), axis=-1)
    tgt = input_ids[:, 1:]
    nll = -jnp.take_along_axis(logp, tgt[..., None], axis=-1)[..., 0]  # (batch, seq-1)
    m = attention_mask[:, 1:] > 0  # as HF labels with -100 on padding
    w = m.astype(jnp.float32)
    if example_weight is not None:
        w = w * example_weight[:, None].astype(jnp.float32)
    return jnp.sum(nll * w), jnp.sum(w)


def init_params(cfg: FlaxLlamaConfig, *, preset: str | None = None, seed: int = 0) -> dict:
    """Initial parameters: the shared seeded HF initialisation when `preset` is given."""
    if preset is not None:
        return hf_to_flax(init_state_dict(preset, vocab_size=cfg.vocab_size, seed=seed),
                          scan_layers=cfg.scan_layers)
    model = FlaxLlama(cfg)
    return model.init(jax.random.key(seed), jnp.zeros((1, 2), jnp.int32))["params"]
