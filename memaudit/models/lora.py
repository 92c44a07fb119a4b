"""LoRA on the torch side: peft adapters on a Llama, what they train, and both exports.

A `model.lora` run freezes every base weight and trains low-rank adapters A (r, d_in) and
B (d_out, r) on the targeted linear layers, whose output becomes W a + (alpha / r) B A a. The
adapters' initialisation is seeded (`model.init_seed`), so a run and its oracle start alike.
A run exports both ways: the merged Hugging Face model (W + (alpha / r) B A, what probes score
by default) and the PEFT adapter folder (`adapter_config.json`, `adapter_model.safetensors`)
with its frozen base beside it when the base is a preset's initialisation.

References:
    Hu et al., "LoRA: Low-Rank Adaptation of Large Language Models", ICLR 2022.
    Yu et al., "Differentially Private Fine-tuning of Language Models", ICLR 2022.

>>> from memaudit.config import LoraConfig
>>> from memaudit.models.presets import get_preset
>>> layer_dims(get_preset("tiny"))["k_proj"]
(128, 64)
>>> trained_label(LoraConfig(rank=4, target_modules=("q_proj", "v_proj")))
'lora(r=4, q_proj,v_proj)'
"""

from __future__ import annotations

import copy
import json
import math
from pathlib import Path
from typing import TYPE_CHECKING, Any

from memaudit.errors import ConfigError
from memaudit.io import atomic_dir
from memaudit.models.hf_export import save_pretrained_quietly

if TYPE_CHECKING:  # torch and peft cost seconds; a config check needs neither
    import torch

    from memaudit.config import LoraConfig
    from memaudit.models.presets import LlamaPreset

ADAPTER_DIR = "adapter"  # RUN_DIR/adapter: the PEFT adapter folder of a LoRA run
BASE_DIR = "base"  # RUN_DIR/adapter/base: the frozen base when it is a preset's initialisation


def layer_dims(shape: LlamaPreset) -> dict[str, tuple[int, int]]:
    """(d_in, d_out) of each Llama linear layer LoRA may target."""
    hd = shape.hidden_size // shape.num_attention_heads
    h, q, kv, f = shape.hidden_size, shape.num_attention_heads * hd, shape.num_key_value_heads * hd, \
        shape.intermediate_size
    return {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h),
            "gate_proj": (h, f), "up_proj": (h, f), "down_proj": (f, h)}


def check_lora(lora: LoraConfig | None, shape: LlamaPreset) -> None:
    """One line for a rank above a targeted layer's smaller dimension (nothing to check without LoRA)."""
    if lora is None:
        return
    dims = layer_dims(shape)
    for t in lora.target_modules:
        d_in, d_out = dims[t]
        if lora.rank > min(d_in, d_out):
            raise ConfigError(f"model.lora.rank={lora.rank} exceeds {t}'s smaller dimension "
                              f"{min(d_in, d_out)} ({d_in} -> {d_out}); set model.lora.rank <= "
                              f"{min(d_in, d_out)} or drop {t} from target_modules")


_TRANSPOSED = ("o_proj", "down_proj")  # their in-features split over y, out-features over x on the grid


def check_lora_grid(lora: LoraConfig | None, shape: LlamaPreset, *, x: int, y: int) -> None:
    """One line for LoRA the tensor-parallel grid cannot run: a targeted layer whose adapter
    dimension (A's columns follow the base's in-features, B's rows its out-features) the grid's
    x or y does not divide."""
    if lora is None:
        return
    dims = layer_dims(shape)
    for t in lora.target_modules:
        d_in, d_out = dims[t]
        ax_in, ax_out = (("y", y), ("x", x)) if t in _TRANSPOSED else (("x", x), ("y", y))
        for what, n, (axis, deg) in (("A's columns (d_in)", d_in, ax_in), ("B's rows (d_out)", d_out, ax_out)):
            if n % deg:
                raise ConfigError(f"model.lora on {t}: parallel.{axis}={deg} does not divide {what}={n} of "
                                  f"its adapters; choose parallel.{axis} dividing {n} or drop {t} from "
                                  "model.lora.target_modules")


def trained_label(lora: LoraConfig | None) -> str:
    """What a run trained, for the manifest and the report: 'full' or 'lora(r=8, q_proj,v_proj)'."""
    if lora is None:
        return "full"
    return f"lora(r={lora.rank}, {','.join(lora.target_modules)})"


def peft_config(lora: LoraConfig) -> Any:
    """The `peft.LoraConfig` of `model.lora` (causal LM, no bias trained)."""
    # lazy: peft (~10 s) only when called; this module imports without it
    from peft import LoraConfig as PeftLoraConfig

    return PeftLoraConfig(r=lora.rank, lora_alpha=lora.alpha, lora_dropout=lora.dropout,
                          target_modules=list(lora.target_modules), bias="none", task_type="CAUSAL_LM")


def apply_lora(model: torch.nn.Module, lora: LoraConfig, *, seed: int) -> Any:
    """`model` wrapped by peft with adapters on `lora.target_modules`; only the adapters train.

    The adapters' A comes from peft's Kaiming initialisation drawn under `torch.manual_seed(seed)`
    (the global RNG is restored afterwards); B starts at zero, so the wrapped model computes
    exactly what `model` did. Adapter dropout is `memaudit.models.keyed_dropout.KeyedDropout`:
    its masks follow the step and each element's place in the global batch, so any grid and any
    micro-batching draw the same ones.
    """
    # lazy: peft (~10 s) only when called; this module imports without it
    import torch
    from peft import get_peft_model

    from memaudit.models.keyed_dropout import use_keyed_dropout  # lazy: torch, with peft

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        wrapped = get_peft_model(model, peft_config(lora))
    for name, p in wrapped.named_parameters():
        p.requires_grad_("lora_" in name)
    use_keyed_dropout(wrapped)
    return wrapped


def is_lora(model: Any) -> bool:
    return hasattr(model, "peft_config") and hasattr(model, "merge_and_unload")


def parameter_counts(model: torch.nn.Module) -> dict[str, int]:
    """{"trained_parameters", "frozen_parameters"} of `model`'s logical parameters (a grid's
    shards count by their `shard_spec`'s full shape, so every grid reports what one process does)."""
    def size(p: Any) -> int:
        spec = getattr(p, "shard_spec", None)
        return p.numel() if spec is None else math.prod(spec.full_shape)

    trained = sum(size(p) for p in model.parameters() if p.requires_grad)
    return {"trained_parameters": trained,
            "frozen_parameters": sum(size(p) for p in model.parameters()) - trained}


def merged_copy(model: Any) -> torch.nn.Module:
    """A plain `LlamaForCausalLM` with W + (alpha / r) B A; `model` itself is left as it is."""
    return copy.deepcopy(model).merge_and_unload()


def adapter_state(model: Any) -> dict[str, torch.Tensor]:
    """The adapters' weights under peft's saved names (what `adapter_model.safetensors` holds)."""
    # lazy: peft (~10 s) only when called; this module imports without it
    from peft import get_peft_model_state_dict

    return get_peft_model_state_dict(model)


def save_adapter(model: Any, run_path: Path, *, base: str | None) -> Path:
    """The PEFT adapter folder RUN_DIR/adapter (atomically), loadable by `PeftModel.from_pretrained`.

    Args:
        model: the trained peft model.
        run_path: the run directory.
        base: the base model folder the adapter belongs to (`model.init_from`); None writes the
            frozen base (a preset's initialisation) to RUN_DIR/adapter/base and names that.
    """
    final = run_path / ADAPTER_DIR
    with atomic_dir(final) as tmp:
        if base is None:
            plain = copy.deepcopy(model.get_base_model())
            base_model = _unwrap_lora(plain)
            save_pretrained_quietly(base_model, tmp / BASE_DIR)
            base = str((final / BASE_DIR).resolve())
        else:
            base = str(Path(base).expanduser().resolve())
        model.save_pretrained(str(tmp), safe_serialization=True)
        cfg_path = tmp / "adapter_config.json"
        cfg = json.loads(cfg_path.read_text(encoding="utf-8"))
        cfg["base_model_name_or_path"] = base
        if isinstance(cfg.get("target_modules"), list):  # peft writes its set in hash order
            cfg["target_modules"] = sorted(cfg["target_modules"])
        cfg_path.write_text(json.dumps(cfg, indent=2, sort_keys=True), encoding="utf-8")
    return final


def _unwrap_lora(model: torch.nn.Module) -> torch.nn.Module:
    """A copy's LoRA layers replaced by their frozen base layers (the base model as it started)."""
    # lazy: peft (~10 s) only when called; this module imports without it
    from peft.tuners.lora import LoraLayer

    for name, m in list(model.named_modules()):
        if isinstance(m, LoraLayer):
            parent_name, _, child = name.rpartition(".")
            parent = model.get_submodule(parent_name) if parent_name else model
            setattr(parent, child, m.get_base_layer())
    return model
