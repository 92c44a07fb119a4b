"""The weights a training run starts from: one entry point for both backends.

A run starts either from the seeded initialisation of a preset (`model.preset`,
`model.init_seed`: the same weights on both backends) or from a Hugging Face Llama checkpoint
(`model.init_from`, e.g. the public base model a sweep pretrains). Trainers never build their
starting model any other way: the torch trainers call `initial_model`, the federated trainer
converts `initial_state_dict` to Flax and takes its shape from `model_shape`, so both backends
start from the same weights.

`check_init_from` is what `memaudit.run.checks.check_before_disk` runs on a checkpoint before
anything is written: a directory that is not a model, another architecture, a shape the
backends cannot take, a tokenizer that does not fit, or a `model.preset` that disagrees with the
checkpoint is one line naming the value and the fix.

References:
    Li et al., "Large Language Models Can Be Strong Differentially Private Learners", ICLR 2022
    (private fine-tuning of a publicly pretrained model).
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

from memaudit.errors import ConfigError, DataError
from memaudit.models.presets import LlamaPreset, build_model, get_preset, llama_config

if TYPE_CHECKING:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM


ARCHITECTURE = "LlamaForCausalLM"
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json")


# ----------------------------------------------------------------------------- checkpoint checks
def _config_json(path: str) -> dict[str, Any]:
    """`config.json` of the checkpoint at `path`, or a one-line ConfigError."""
    p = Path(path).expanduser()
    where = f"model.init_from='{path}'"
    if not p.is_dir():
        raise ConfigError(f"{where} is not a directory; point it at a Hugging Face model directory "
                          "(config.json, model.safetensors, tokenizer files)")
    f = p / "config.json"
    if not f.is_file() and (p / "adapter_config.json").is_file():
        raise ConfigError(f"{where} is a PEFT adapter, not a model; merge it into its base first "
                          "(memaudit's run writes the merged model to model/) or set init_from to "
                          "its base model (base_model_name_or_path in adapter_config.json)")
    if not f.is_file():
        raise ConfigError(f"{where} is not a Hugging Face model directory (no config.json); "
                          "save the model with save_pretrained or point at another directory")
    try:
        cfg = json.loads(f.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError):
        raise ConfigError(f"{where}: config.json is not valid JSON; save the model again") from None
    if not isinstance(cfg, dict):
        raise ConfigError(f"{where}: config.json does not hold a model config; save the model again")
    return cfg


def _rope(cfg: dict[str, Any]) -> tuple[float, str]:
    params = cfg.get("rope_parameters") or {}
    theta = cfg.get("rope_theta", params.get("rope_theta", 10000.0))
    scaling = cfg.get("rope_scaling") or {}
    kind = params.get("rope_type") or scaling.get("rope_type") or scaling.get("type") or "default"
    return float(theta), str(kind)


def shape_of_checkpoint(path: str) -> LlamaPreset:
    """The model shape of the checkpoint at `path`, checked to be one both backends train.

    Raises ConfigError for another architecture or a Llama variant memaudit's models do not
    implement (biases, scaled RoPE, an activation other than SiLU, a head dim other than
    hidden / heads).
    """

    cfg = _config_json(path)
    where = f"model.init_from='{path}'"
    arch = cfg.get("architectures") or [cfg.get("model_type", "unknown")]
    if ARCHITECTURE not in arch or cfg.get("model_type", "llama") != "llama":
        raise ConfigError(f"{where} is a {'/'.join(map(str, arch))} checkpoint; memaudit trains "
                          f"{ARCHITECTURE} only: give a Llama checkpoint or a model.preset")
    try:
        shape = LlamaPreset(
            vocab_size=int(cfg["vocab_size"]), hidden_size=int(cfg["hidden_size"]),
            intermediate_size=int(cfg["intermediate_size"]),
            num_hidden_layers=int(cfg["num_hidden_layers"]),
            num_attention_heads=int(cfg["num_attention_heads"]),
            num_key_value_heads=int(cfg.get("num_key_value_heads") or cfg["num_attention_heads"]),
            max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
            rope_theta=_rope(cfg)[0], rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        )
    except (KeyError, TypeError, ValueError) as e:
        raise ConfigError(f"{where}: config.json lacks a valid {e.args[0] if e.args else 'field'}; "
                          "save the model again with save_pretrained") from None
    unsupported = []
    if cfg.get("hidden_act", "silu") != "silu":
        unsupported.append(f"hidden_act={cfg.get('hidden_act')}")
    for key in ("attention_bias", "mlp_bias"):
        if cfg.get(key):
            unsupported.append(f"{key}=true")
    if _rope(cfg)[1] != "default":
        unsupported.append(f"rope_type={_rope(cfg)[1]}")
    heads = shape.num_attention_heads
    if heads < 1 or shape.hidden_size % heads or heads % max(shape.num_key_value_heads, 1):
        unsupported.append(f"{heads} heads with hidden_size={shape.hidden_size} and "
                           f"{shape.num_key_value_heads} kv heads")
    elif cfg.get("head_dim") not in (None, shape.hidden_size // heads):
        unsupported.append(f"head_dim={cfg.get('head_dim')}")
    if unsupported:
        raise ConfigError(f"{where} has {', '.join(unsupported)}, which memaudit's Llama does not "
                          "implement; give a plain Llama checkpoint (SiLU, no biases, default RoPE)")
    if not sorted(Path(path).expanduser().glob("*.safetensors")):
        raise ConfigError(f"{where} has no *.safetensors weights; save it with "
                          "save_pretrained(safe_serialization=True)")
    return shape


_SHAPE_FIELDS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                 "num_attention_heads", "num_key_value_heads")


def check_init_from(cfg: Any) -> LlamaPreset | None:
    """One-line errors for a run config's `model.init_from`, before anything is written.

    Checks the checkpoint (`shape_of_checkpoint`), its tokenizer (present, loadable, with an
    eos token, no larger than the model's vocabulary), that the config does not also name a
    tokenizer (`data.tokenizer`, `data.tokenizer_corpus`: the run adopts the checkpoint's),
    and that a `model.preset` given with it has the checkpoint's shape. Returns the shape, or
    None without `init_from`.
    """
    path = cfg.model.init_from
    if path is None:
        return None
    shape = shape_of_checkpoint(path)
    where = f"model.init_from='{path}'"
    for key in ("tokenizer", "tokenizer_corpus"):
        if getattr(cfg.data, key) is not None:
            raise ConfigError(f"data.{key}='{getattr(cfg.data, key)}' conflicts with {where}: the run "
                              f"adopts the checkpoint's tokenizer; drop data.{key}")
    preset = cfg.model.preset
    if preset is not None:
        want = get_preset(preset)
        diff = [f"{k} {getattr(want, k)} vs {getattr(shape, k)}" for k in _SHAPE_FIELDS
                if getattr(want, k) != getattr(shape, k)]
        if diff:
            raise ConfigError(f"model.preset={preset} disagrees with the checkpoint of {where} "
                              f"({diff[0]}); drop model.preset (the checkpoint sets the shape)")
    _check_tokenizer(path, shape.vocab_size)
    return shape


def _check_tokenizer(path: str, vocab_size: int) -> None:
    # lazy: the data package (above the models) loads numpy (~0.4 s), which this module does not
    from memaudit.models.tokenizer import load_tokenizer

    p = Path(path).expanduser()
    where = f"model.init_from='{path}'"
    if not any((p / f).is_file() for f in _TOKENIZER_FILES):
        raise ConfigError(f"{where} has no tokenizer files (tokenizer.json); save the tokenizer "
                          "into the model directory with save_pretrained")
    try:
        load_tokenizer(p, vocab_size=vocab_size)
    except DataError as e:
        raise ConfigError(f"{where}: {e}") from None


# ----------------------------------------------------------------------------- shape and weights
def model_shape(model_cfg: Any) -> LlamaPreset:
    """The shape of the run's model: the checkpoint's with `init_from`, else the preset's."""

    if model_cfg.init_from is not None:
        return shape_of_checkpoint(model_cfg.init_from)
    return get_preset(model_cfg.preset)


def model_vocab_size(model_cfg: Any) -> int:
    """The vocabulary of the run's model (what its prepared data is tokenized for)."""
    return model_shape(model_cfg).vocab_size


def hf_config(model_cfg: Any, *, vocab_size: int | None = None) -> LlamaConfig:
    """The `transformers.LlamaConfig` of the run's model."""
    if model_cfg.init_from is not None:
        # lazy: transformers (~1.3 s) only when called; this module imports without it
        from transformers import AutoConfig

        return AutoConfig.from_pretrained(str(Path(model_cfg.init_from).expanduser()))

    return llama_config(model_cfg.preset, vocab_size=vocab_size)


def initial_model(model_cfg: Any, vocab_size: int) -> LlamaForCausalLM:
    """The fp32 `LlamaForCausalLM` a run starts from (on the CPU; train mode not yet set).

    With `init_from` the checkpoint's weights (its own vocabulary; `vocab_size` is ignored),
    else the preset's seeded initialisation with `vocab_size` rows.
    """
    if model_cfg.init_from is not None:
        # lazy: transformers (~1.3 s) only when called; this module imports without it
        from transformers import AutoModelForCausalLM
        from transformers.utils import logging as hf_logging

        was = hf_logging.is_progress_bar_enabled()
        hf_logging.disable_progress_bar()  # only the CLI prints
        try:
            model = AutoModelForCausalLM.from_pretrained(
                str(Path(model_cfg.init_from).expanduser()), attn_implementation="sdpa")
        finally:
            if was:
                hf_logging.enable_progress_bar()
        return model.float()

    return build_model(model_cfg.preset, vocab_size=vocab_size, seed=model_cfg.init_seed)


def initial_state_dict(model_cfg: Any, vocab_size: int) -> dict[str, torch.Tensor]:
    """The starting weights under their Hugging Face names (what the JAX side converts)."""
    model = initial_model(model_cfg, vocab_size)
    sd = {k: v.detach().clone() for k, v in model.state_dict().items()}
    if model.config.tie_word_embeddings:
        sd.pop("lm_head.weight", None)  # the embedding itself; the Flax model attends with it
    return sd


def flax_config(model_cfg: Any, vocab_size: int | None = None, **kw: Any) -> Any:
    """The `FlaxLlamaConfig` of the run's model (the checkpoint's shape with `init_from`)."""
    # lazy: flax (~2.5 s) and numpy (~0.4 s) only when called; this module imports without it
    from memaudit.models.flax_llama import (
        FlaxLlamaConfig,  # jax and flax: only the federated backend
    )

    shape = dataclasses.asdict(model_shape(model_cfg))
    if vocab_size is not None and model_cfg.init_from is None:
        shape["vocab_size"] = vocab_size
    return FlaxLlamaConfig(**shape, **kw)


# ----------------------------------------------------------------------------- provenance
@functools.lru_cache(maxsize=8)
def _weights_sha256(files: tuple[tuple[str, int, int], ...]) -> str:
    h = hashlib.sha256()
    for name, _, _ in files:
        h.update(Path(name).name.encode() + b"\0")
        with open(name, "rb") as f:
            for chunk in iter(lambda: f.read(1 << 20), b""):
                h.update(chunk)
    return h.hexdigest()


def base_model_record(path: str) -> dict[str, Any]:
    """{"path", "weights_sha256"} of a starting checkpoint: sha256 over its safetensors files
    (name and content, in name order), what run.json and the data's meta.json record."""
    p = Path(path).expanduser().resolve()
    files = tuple((str(f), f.stat().st_size, f.stat().st_mtime_ns) for f in sorted(p.glob("*.safetensors")))
    return {"path": str(p), "weights_sha256": _weights_sha256(files)}
