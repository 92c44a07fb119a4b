"""Llama-style presets built from config with `transformers` (no download).

One seeded initialisation: `init_state_dict(preset, vocab_size, seed)` gives the
Hugging Face-named fp32 weights both backends start from.

>>> cfg = llama_config("tiny")
>>> cfg.hidden_size, cfg.num_hidden_layers, cfg.vocab_size
(128, 4, 4096)
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # heavy imports stay out of module import time
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM


@dataclass(frozen=True, kw_only=True)
class LlamaPreset:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    max_position_embeddings: int = 2048
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-5
    tie_word_embeddings: bool = False


PRESETS: dict[str, LlamaPreset] = {
    "tiny": LlamaPreset(vocab_size=4096, hidden_size=128, intermediate_size=352,
                        num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                        max_position_embeddings=1024),
    # twice tiny's width, same vocabulary: the second size of the reduced scale study
    "tiny2x": LlamaPreset(vocab_size=4096, hidden_size=256, intermediate_size=704,
                          num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                          max_position_embeddings=1024),
    "small": LlamaPreset(vocab_size=8192, hidden_size=384, intermediate_size=1024,
                         num_hidden_layers=6, num_attention_heads=6, num_key_value_heads=2,
                         max_position_embeddings=1024),
    "125m": LlamaPreset(vocab_size=32000, hidden_size=768, intermediate_size=2048,
                        num_hidden_layers=12, num_attention_heads=12, num_key_value_heads=4),
    "350m": LlamaPreset(vocab_size=32000, hidden_size=1024, intermediate_size=2816,
                        num_hidden_layers=24, num_attention_heads=16, num_key_value_heads=8),
    "1b": LlamaPreset(vocab_size=32000, hidden_size=2048, intermediate_size=5632,
                      num_hidden_layers=22, num_attention_heads=32, num_key_value_heads=4,
                      rope_theta=10000.0),
    "8b": LlamaPreset(vocab_size=128256, hidden_size=4096, intermediate_size=14336,
                      num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                      max_position_embeddings=8192, rope_theta=500000.0),
}

LARGE_PRESETS = frozenset({"350m", "1b", "8b"})  # bf16 autocast + activation checkpointing on GPU


def get_preset(name: str) -> LlamaPreset:
    try:
        return PRESETS[name]
    except KeyError:
        raise ValueError(f"unknown model preset '{name}'; choose one of {', '.join(PRESETS)}") from None


def llama_config(name: str, *, vocab_size: int | None = None) -> LlamaConfig:
    # lazy: transformers (~1.3 s) only when called; this module imports without it
    from transformers import LlamaConfig

    p = asdict(get_preset(name))
    if vocab_size is not None:
        p["vocab_size"] = vocab_size
    return LlamaConfig(
        **p,
        hidden_act="silu",
        attention_bias=False,
        mlp_bias=False,
        initializer_range=0.02,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
    )


def param_count(name: str, *, vocab_size: int | None = None, include_embedding: bool = True) -> int:
    """Parameter count from the preset alone (no model is built)."""
    return shape_param_count(get_preset(name), vocab_size=vocab_size, include_embedding=include_embedding)


def shape_param_count(p: LlamaPreset, *, vocab_size: int | None = None, include_embedding: bool = True) -> int:
    """Parameter count of a model shape (a preset's, or a checkpoint's: `memaudit.models.init.model_shape`)."""
    v = vocab_size or p.vocab_size
    h, i, n = p.hidden_size, p.intermediate_size, p.num_hidden_layers
    head_dim = h // p.num_attention_heads
    kv = p.num_key_value_heads * head_dim
    per_layer = h * h * 2 + 2 * h * kv + 3 * h * i + 2 * h
    total = n * per_layer + h + (0 if p.tie_word_embeddings else v * h)
    return total + (v * h if include_embedding else 0)


def build_model(name: str, *, vocab_size: int | None = None, seed: int = 0) -> LlamaForCausalLM:
    """A freshly initialised fp32 `LlamaForCausalLM`, identical for the same (name, vocab, seed)."""
    # lazy: torch (~2 s) and transformers (~1.3 s) only when called; this module imports without it
    import torch
    from transformers import LlamaForCausalLM

    cfg = llama_config(name, vocab_size=vocab_size)
    cfg._attn_implementation = "sdpa"
    devnull = torch.random.fork_rng(devices=[])
    with devnull:
        torch.manual_seed(seed)
        model = LlamaForCausalLM(cfg)
    return model.float()


def init_state_dict(name: str, *, vocab_size: int | None = None, seed: int = 0) -> dict[str, torch.Tensor]:
    """The seeded initial weights under their Hugging Face names (shared by both backends)."""
    return {k: v.detach().clone() for k, v in build_model(name, vocab_size=vocab_size, seed=seed).state_dict().items()}
