"""Which engine scores and generates for `memaudit probe`: torch (`memaudit.probes.scoring`, any
Hugging Face causal LM) or JAX (`memaudit.probes.jax_scoring`, Llama models, the TPU's path).

Deciding imports neither framework unless a TPU may be present (libtpu installed): importing
flax and jax cost 27 s on a loaded 2-core machine (measured), which a CPU probe never pays.

>>> unsupported_reason({"model_type": "gpt2"})
"model_type 'gpt2' is not llama"
>>> unsupported_reason({"model_type": "llama", "rope_scaling": None}) is None
True
"""

from __future__ import annotations

import importlib.util

ENGINES = ("auto", "jax", "torch")


def unsupported_reason(cfg: dict) -> str | None:
    """Why the JAX engine cannot run a model with this config.json, or None when it can."""
    archs = cfg.get("architectures") or []
    if cfg.get("model_type") != "llama" and "LlamaForCausalLM" not in archs:
        return f"model_type '{cfg.get('model_type')}' is not llama"
    if cfg.get("rope_scaling"):
        return "rope_scaling is not supported"
    if cfg.get("attention_bias") or cfg.get("mlp_bias"):
        return "attention or MLP biases are not supported"
    if cfg.get("hidden_act", "silu") != "silu":
        return f"hidden_act '{cfg.get('hidden_act')}' is not silu"
    return None


def model_reason(model) -> str | None:
    """`unsupported_reason` of a loaded model's config (a transformers config or a namespace)."""
    cfg = getattr(model, "config", None)
    cfg = cfg.to_dict() if hasattr(cfg, "to_dict") else dict(vars(cfg)) if cfg is not None else {}
    return unsupported_reason(cfg)


def tpu_present() -> bool:
    """Whether JAX runs on a TPU here; jax is imported only where libtpu is installed."""
    if importlib.util.find_spec("libtpu") is None:
        return False
    import jax  # lazy: only on a host with libtpu

    return jax.default_backend() == "tpu"


def choose_engine(engine: str, model) -> str:
    """`jax` or `torch`: auto is jax when a TPU is present and the model is a Llama the JAX
    engine runs, torch otherwise; jax on a model it cannot run is refused in one line.

    On the CPU auto keeps torch even for a Llama: the tiny quickstart's whole probe stage took
    149 CPU seconds on the JAX engine against 59 on torch (one thread, median of 2 interleaved
    runs, docs/results.md), every probe slower (membership 2.7x, PII 3.4x, extraction 3.4x,
    exposure 1.7x), the model's conversion included."""
    if engine not in ENGINES:
        raise ValueError(f"--engine '{engine}' is not one of {', '.join(ENGINES)}")
    if engine == "torch":
        return engine
    why = model_reason(model)
    if engine == "jax":
        if why:
            raise ValueError(f"--engine jax cannot run this model ({why}); use --engine torch")
        return engine
    return "jax" if why is None and tpu_present() else "torch"
