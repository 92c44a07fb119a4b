"""Where an outside model comes from: a local Hugging Face folder, a hub id already in the local
cache, or a PEFT LoRA adapter folder with its base; and how it is loaded for probing.

Nothing is ever downloaded: a hub id is resolved with `HF_HUB_OFFLINE` semantics
(`snapshot_download(..., local_files_only=True)`) from the cache that `HF_HUB_CACHE` or
`HF_HOME` name at call time. Code shipped with a checkpoint never runs: a model whose
architecture transformers does not know (an `auto_map` to the checkpoint's own code) is refused,
and every `from_pretrained` passes `trust_remote_code=False`.

References:
    Hu et al. 2021, "LoRA: Low-Rank Adaptation of Large Language Models" (the adapters PEFT
    saves: adapter_config.json + adapter_model.safetensors beside a base model).
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from pathlib import Path

from memaudit.errors import MemauditError
from memaudit.probes.context import config_context

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
ADAPTER_PICKLE = "adapter_model.bin"  # PEFT's older format: a pickle, never loaded here
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[\w.-]+)?$")


@dataclass(frozen=True)
class ModelSource:
    """A resolved model: `path` is a local folder (the adapter's for kind "adapter").

    name: what the user passed (a path or hub id). kind: "folder" | "hub" | "adapter".
    base: the adapter's base model (a ModelSource of kind folder or hub), else None.
    """

    name: str
    kind: str
    path: Path
    base: ModelSource | None = None

    @property
    def tokenizer_path(self) -> Path:
        """The adapter's own tokenizer when it saved one, else its base's."""
        if self.base is not None and not has_tokenizer(self.path):
            return self.base.path
        return self.path


def has_tokenizer(d: Path) -> bool:
    return any((d / f).is_file() for f in TOKENIZER_FILES)


def hub_cache_dir() -> Path:
    """The hub cache as huggingface_hub resolves it, read from the environment at call time."""
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"])
    home = os.environ.get("HF_HOME") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "huggingface")
    return Path(home) / "hub"


def from_hub_cache(repo_id: str) -> Path:
    """The cached snapshot folder of `repo_id`; refused in one line (with how to fetch it)."""
    from huggingface_hub import snapshot_download  # lazy: hub download code (~0.1 s)

    cache = hub_cache_dir()
    try:
        return Path(snapshot_download(repo_id, cache_dir=cache, local_files_only=True))
    except Exception:  # noqa: BLE001 - LocalEntryNotFoundError, a bad id, an unreadable cache
        raise MemauditError(
            f"model '{repo_id}' is not a local folder and not in the Hugging Face cache ({cache}); "
            f"memaudit never downloads: fetch it once with `hf download {repo_id}` (or "
            "`huggingface-cli download`) where the network is reachable, with HF_HOME or "
            "HF_HUB_CACHE pointing at this cache, or pass the model folder"
        ) from None


def _read_json(path: Path, what: str) -> dict:
    try:
        obj = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        raise MemauditError(f"{what} '{path}' is not readable JSON; re-save the model") from None
    if not isinstance(obj, dict):
        raise MemauditError(f"{what} '{path}' is not a JSON object; re-save the model")
    return obj


def check_no_remote_code(path: Path) -> None:
    """Refuse a checkpoint that only loads by running its own Python code."""
    # lazy: transformers (~1.3 s) only when a checkpoint is checked
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    cfg = _read_json(path / "config.json", "model config")
    model_type = cfg.get("model_type")
    if model_type in CONFIG_MAPPING:
        return  # transformers' own class; an auto_map beside it is never used
    if cfg.get("auto_map"):
        raise MemauditError(
            f"model '{path}' needs its own code (trust_remote_code) for model_type "
            f"'{model_type}'; memaudit never runs code shipped with a checkpoint: convert it to a "
            "transformers architecture (e.g. Llama, GPT-NeoX) or pass another model"
        )
    raise MemauditError(
        f"model '{path}' has model_type '{model_type}', which this transformers does not know; "
        "upgrade transformers or pass a causal LM it supports (GPT-2, GPT-NeoX, Llama, Mistral)"
    )


def resolve_model(spec: str | os.PathLike, *, base: str | None = None,
                  adapter_of: Path | None = None) -> ModelSource:
    """A `ModelSource` from a folder, an adapter folder or a cached hub id.

    Args:
        spec: a model folder (config.json), a PEFT adapter folder (adapter_config.json) or a hub
            id ("org/name") present in the local cache.
        base: an adapter's base, overriding its adapter_config.json's base_model_name_or_path.
        adapter_of: set when `spec` is the base named by this adapter folder: an adapter is then
            refused at once (never resolved in turn, so two adapters naming each other end).

    Returns:
        The resolved source; bad input raises a one-line `MemauditError`.
    """
    p = Path(spec)
    if p.is_dir() and (p / ADAPTER_CONFIG).is_file():
        if adapter_of is not None:
            raise _base_is_adapter(adapter_of, p)
        return _adapter(p, base)
    if p.is_dir() and (p / "config.json").is_file():
        check_no_remote_code(p)
        return ModelSource(name=str(spec), kind="folder", path=p)
    if p.exists():
        raise MemauditError(
            f"'{p}' is neither a Hugging Face model folder (config.json) nor a PEFT adapter "
            f"folder ({ADAPTER_CONFIG}); pass one of those"
        )
    if not _HUB_ID.match(str(spec)):
        raise MemauditError(f"model '{spec}' does not exist; pass a model folder or a hub id")
    path = from_hub_cache(str(spec))
    if (path / ADAPTER_CONFIG).is_file():
        if adapter_of is not None:
            raise _base_is_adapter(adapter_of, path)
        return _adapter(path, base, name=str(spec))
    if not (path / "config.json").is_file():
        raise MemauditError(f"cached model '{spec}' has no config.json; re-fetch it")
    check_no_remote_code(path)
    return ModelSource(name=str(spec), kind="hub", path=path)


class AdapterBaseError(MemauditError):
    """An adapter's base is an adapter (itself, or another): refused, never resolved in turn."""


def _base_is_adapter(adapter: Path, base: Path) -> MemauditError:
    if base.resolve() == adapter.resolve():
        return AdapterBaseError(f"adapter '{adapter}' names itself as its base (base_model_name_or_path); "
                             "pass the model it was trained on with --base MODEL")
    return AdapterBaseError(f"the base of adapter '{adapter}' is itself an adapter ('{base}'); merge it "
                         "first, or pass the full model it was trained on with --base MODEL")


def check_adapter_weights(path: Path) -> None:
    """An adapter's weights as safetensors; a pickle-only or weightless folder refused in one line
    (before peft would warn, unpickle, or ask the hub for the missing file)."""
    if (path / ADAPTER_WEIGHTS).is_file():
        return
    if (path / ADAPTER_PICKLE).is_file():
        raise MemauditError(
            f"adapter '{path}' holds its weights only as a pickle ({ADAPTER_PICKLE}), which memaudit "
            f"never loads (unpickling can run code); re-save it as {ADAPTER_WEIGHTS} "
            "(PeftModel.save_pretrained(..., safe_serialization=True))")
    raise MemauditError(f"adapter '{path}' has no weights file ({ADAPTER_WEIGHTS}); save the adapter "
                        "with PeftModel.save_pretrained, or pass the adapter folder that holds it")


def _adapter(path: Path, base: str | None, name: str | None = None) -> ModelSource:
    cfg = _read_json(path / ADAPTER_CONFIG, "adapter config")
    named = base or cfg.get("base_model_name_or_path")
    if not named:
        raise MemauditError(
            f"adapter '{path}' names no base model (base_model_name_or_path); pass --base MODEL"
        )
    if not (cfg.get("task_type") in (None, "CAUSAL_LM")):
        raise MemauditError(
            f"adapter '{path}' is for task '{cfg.get('task_type')}', not a causal LM; pass a "
            "CAUSAL_LM adapter"
        )
    check_adapter_weights(path)
    try:
        b = resolve_model(named, adapter_of=path)  # an adapter as its base (itself too): refused
    except AdapterBaseError:
        raise
    except MemauditError as e:
        raise MemauditError(f"the base of adapter '{path}' cannot be found: {e}") from None
    return ModelSource(name=name or str(path), kind="adapter", path=path, base=b)


def config_folder(src: ModelSource) -> Path:
    """The folder whose config.json describes the weights `src` loads (an adapter's: its base's)."""
    return src.base.path if src.base is not None else src.path


def tokenizer_size(tokenizer) -> int:
    """The ids a tokenizer can emit: its largest id + 1 (added tokens included)."""
    return max(tokenizer.get_vocab().values(), default=-1) + 1


def check_tokenizer_fits(tokenizer, folder: Path, what: str) -> None:
    """Refuse a tokenizer whose ids reach past the model's embedding (config.json's vocab_size),
    read without loading the weights: scoring would fail on the first such id, after the load."""
    path = folder / "config.json"
    if not path.is_file():
        return
    cfg = _read_json(path, "model config")
    vocab = cfg.get("vocab_size")
    if not isinstance(vocab, int) and isinstance(cfg.get("text_config"), dict):
        vocab = cfg["text_config"].get("vocab_size")
    if not isinstance(vocab, int) or isinstance(vocab, bool):
        return
    n = tokenizer_size(tokenizer)
    if n > vocab:
        raise MemauditError(
            f"the tokenizer of {what} has {n} tokens but the model's embedding has {vocab} rows "
            f"(vocab_size in '{path}'): ids {vocab} and up have no embedding; pass the tokenizer "
            "the model was trained with")


def source_context(src: ModelSource) -> int | None:
    """The context of `src` as its config.json names it (an adapter's: its base's), read
    without loading the weights."""
    folder = src.base.path if src.base is not None else src.path
    return config_context(_read_json(folder / "config.json", "model config"))


def load_model(src: ModelSource, *, device: str = "cpu", dtype: str = "auto"):
    """The causal LM of `src` in eval mode; an adapter is applied to its base and merged.

    Merging (W + BA) gives the same function as the unmerged PEFT model and scores at the speed
    of a plain forward pass.
    """
    from memaudit.probes.scoring import load_causal_lm  # lazy: torch (~2 s) only to load a model

    if src.base is None:
        return load_causal_lm(str(src.path), device=device, dtype=dtype)
    model = load_causal_lm(str(src.base.path), device="cpu", dtype=dtype)
    try:
        from peft import PeftModel  # lazy: peft (~10 s) only for an adapter
    except ImportError:  # a runtime dependency; only a broken install lacks it
        raise MemauditError("loading a LoRA adapter needs `peft`; pip install peft") from None
    try:
        merged = PeftModel.from_pretrained(model, str(src.path)).merge_and_unload()
    except (RuntimeError, ValueError, KeyError, OSError) as e:
        raise MemauditError(
            f"adapter '{src.path}' does not fit its base '{src.base.name}' ({type(e).__name__}: "
            "shapes or module names differ); pass the base it was trained on with --base"
        ) from None
    return merged.to(device).eval()
