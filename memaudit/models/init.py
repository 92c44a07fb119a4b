"""The weights a training run starts from: one entry point for both backends.

A run starts either from the seeded initialisation of a preset (`model.preset`,
`model.init_seed`: the same weights on both backends) or from a Hugging Face Llama checkpoint
(`model.name_or_path`). Trainers never build their starting model any other way, so a new
source of initial weights (a public base model) is added here once for every backend.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch
    from transformers import LlamaForCausalLM


def initial_model(model_cfg: Any, vocab_size: int) -> LlamaForCausalLM:
    """The fp32 `LlamaForCausalLM` a run starts from (on the CPU, in train mode not yet set)."""
    if model_cfg.name_or_path is not None:
        from transformers import AutoModelForCausalLM

        return AutoModelForCausalLM.from_pretrained(model_cfg.name_or_path).float()
    from memaudit.models.presets import build_model

    return build_model(model_cfg.preset, vocab_size=vocab_size, seed=model_cfg.init_seed)


def initial_state_dict(model_cfg: Any, vocab_size: int) -> dict[str, torch.Tensor]:
    """The starting weights under their Hugging Face names (what the JAX side converts)."""
    model = initial_model(model_cfg, vocab_size)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}
