"""Writing a Hugging Face checkpoint, shared by both backends (the JAX side converts to torch
first, `memaudit.models.convert.to_hf_model`); the run lifecycle calls this."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def set_special_tokens(model: Any, tokenizer: Any) -> None:
    """Copy the tokenizer's eos/pad/bos ids into the model's config and generation config."""
    for attr in ("eos_token_id", "pad_token_id", "bos_token_id"):
        v = getattr(tokenizer, attr, None)
        if v is not None:
            setattr(model.config, attr, v)
            if getattr(model, "generation_config", None) is not None:
                setattr(model.generation_config, attr, v)


def save_pretrained_quietly(model: Any, directory: Path) -> None:
    """`save_pretrained` (safetensors, use_cache on) without progress bars: only the CLI prints."""
    # lazy: transformers (~1.3 s) only when called; this module imports without it
    from transformers.utils import logging as hf_logging

    was_enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    use_cache = getattr(model.config, "use_cache", None)
    model.config.use_cache = True
    try:
        model.save_pretrained(directory, safe_serialization=True)
    finally:
        model.config.use_cache = use_cache
        if was_enabled:
            hf_logging.enable_progress_bar()
