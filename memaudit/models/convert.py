"""Hugging Face `LlamaForCausalLM` <-> `memaudit.models.flax_llama.FlaxLlama` weights.

The mapping is one-to-one on names: the HF name split on "." is the Flax path, with the last
component renamed (`weight` -> `kernel` for Linear layers, transposed from torch's (out, in) to
Flax's (in, out); `weight` -> `embedding` for `embed_tokens`; norm scales keep `weight`).
Arrays are copied, never cast, so HF -> Flax -> HF returns bit-identical arrays.

A model with scanned decoder layers (`FlaxLlamaConfig.scan_layers`) keeps them stacked:
`params["model"]["layers"]["stacked"][...]` holds every layer's array on a leading layer dim,
row i being `model.layers.<i>`; `stack_layers` / `unstack_layers` move between the two trees
(one-to-one, bit-identical) and `flax_to_hf` takes either.

>>> import numpy as np
>>> sd = {"model.layers.0.mlp.up_proj.weight": np.ones((3, 2), np.float32),
...       "model.norm.weight": np.ones(2, np.float32)}
>>> p = hf_to_flax(sd)
>>> p["model"]["layers"]["0"]["mlp"]["up_proj"]["kernel"].shape
(2, 3)
>>> sorted(flax_to_hf(p))
['model.layers.0.mlp.up_proj.weight', 'model.norm.weight']
"""

from __future__ import annotations

import copy
import json
import os
import shutil
from pathlib import Path
from typing import Any

import numpy as np
from safetensors.numpy import load_file

from memaudit.models.presets import llama_config

STACKED = "stacked"  # the scanned decoder layer under `model/layers`
_IGNORED = ("rotary_emb.inv_freq",)  # buffers older checkpoints carry; recomputed from rope_theta


def _to_numpy(v: Any) -> np.ndarray:
    if hasattr(v, "detach"):  # torch tensor
        return v.detach().cpu().numpy()
    return np.asarray(v)


def _layers_node(params: dict[str, Any]) -> dict[str, Any] | None:
    model = params.get("model") if hasattr(params, "get") else None
    return model.get("layers") if model is not None and hasattr(model, "get") else None


def stack_layers(params: dict[str, Any]) -> dict[str, Any]:
    """Per-layer params (`model/layers/<i>/...`) -> one stacked layer (`model/layers/stacked/...`,
    each array with a leading layer dim, row i = layer i), as `nn.scan` over the layers reads them.

    >>> p = {"model": {"layers": {str(i): {"mlp": {"up_proj": {"kernel": np.full((2, 3), i)}}}
    ...                           for i in range(2)}}}
    >>> stack_layers(p)["model"]["layers"]["stacked"]["mlp"]["up_proj"]["kernel"].shape
    (2, 2, 3)
    """
    layers = _layers_node(params)
    if layers is None or STACKED in layers:
        return params
    order = sorted(layers, key=int)
    if order != [str(i) for i in range(len(order))]:
        raise ValueError(f"decoder layers {order} are not numbered 0..{len(order) - 1}; cannot stack them")

    def stack(*xs):
        return np.stack([np.asarray(x) for x in xs])

    first = layers[order[0]]
    stacked = _map_leaves(stack, first, *(layers[k] for k in order[1:]))
    return {**params, "model": {**params["model"], "layers": {STACKED: stacked}}}


def unstack_layers(params: dict[str, Any]) -> dict[str, Any]:
    """The inverse of `stack_layers`: row i of every stacked array back at `model/layers/<i>`."""
    layers = _layers_node(params)
    if layers is None or STACKED not in layers:
        return params
    stacked = layers[STACKED]
    depth = int(np.shape(_flatten(dict(stacked))[0][1])[0])
    out = {str(i): _map_leaves(lambda x, i=i: np.asarray(x)[i].copy(), stacked) for i in range(depth)}
    return {**params, "model": {**params["model"], "layers": out}}


def _map_leaves(fn: Any, tree: Any, *rest: Any) -> Any:
    if hasattr(tree, "items") and not hasattr(tree, "shape"):
        return {k: _map_leaves(fn, v, *(r[k] for r in rest)) for k, v in tree.items()}
    return fn(tree, *rest)


def hf_to_flax(state_dict: dict[str, Any], *, scan_layers: bool = False) -> dict[str, Any]:
    """HF state dict (torch tensors or numpy arrays) -> nested Flax params of numpy arrays;
    ``scan_layers``: the decoder layers stacked (`stack_layers`)."""
    params: dict[str, Any] = {}
    for name, value in state_dict.items():
        if name.endswith(_IGNORED):
            continue
        parts = name.split(".")
        if parts[-1] != "weight":
            raise ValueError(f"unexpected parameter '{name}' for a Llama model; biases are not supported")
        arr = _to_numpy(value)
        if parts[-2] == "embed_tokens":
            leaf, arr = "embedding", arr.copy()
        elif arr.ndim == 2:
            leaf, arr = "kernel", arr.T.copy()  # (out, in) -> (in, out)
        else:
            leaf, arr = "weight", arr.copy()
        node = params
        for p in parts[:-1]:
            node = node.setdefault(p, {})
        node[leaf] = arr
    return stack_layers(params) if scan_layers else params


def _flatten(tree: dict[str, Any], prefix: tuple[str, ...] = ()) -> list[tuple[tuple[str, ...], Any]]:
    out = []
    for k, v in tree.items():
        if isinstance(v, dict) or hasattr(v, "items") and not hasattr(v, "shape"):
            out.extend(_flatten(dict(v), (*prefix, str(k))))
        else:
            out.append(((*prefix, str(k)), v))
    return out


def flax_to_hf(params: dict[str, Any]) -> dict[str, np.ndarray]:
    """Nested Flax params (per-layer or stacked) -> {HF name: numpy array with the HF shape}."""
    out: dict[str, np.ndarray] = {}
    for path, value in _flatten(unstack_layers(params)):
        arr = np.asarray(value)
        leaf = path[-1]
        if leaf == "kernel":
            arr = arr.T
        elif leaf not in ("embedding", "weight"):
            raise ValueError(f"unexpected Flax parameter '{'/'.join(path)}'")
        out[".".join((*path[:-1], "weight"))] = np.ascontiguousarray(arr)
    return out


def to_hf_model(params: dict[str, Any], *, preset: str | None = None, vocab_size: int | None = None,
                config: Any = None):
    """A `LlamaForCausalLM` holding `params` (checked by `load_state_dict(strict=True)`).

    The shape is `config` (a `LlamaConfig`, e.g. a starting checkpoint's) or the preset's
    with `vocab_size` rows.
    """
    # lazy: torch (~2 s) and transformers (~1.3 s) only when called; this module imports without it
    import torch
    from transformers import LlamaForCausalLM

    cfg = copy.deepcopy(config) if config is not None else llama_config(preset, vocab_size=vocab_size)
    sd = {k: torch.from_numpy(np.array(v, dtype=np.float32)) for k, v in flax_to_hf(params).items()}
    if cfg.tie_word_embeddings and "lm_head.weight" not in sd:
        sd["lm_head.weight"] = sd["model.embed_tokens.weight"]
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg)
    model.load_state_dict(sd, strict=True, assign=True)
    # non-persistent buffers (rotary inv_freq) were created on the meta device: rebuild them
    model.model.rotary_emb.__init__(cfg)
    return model.float().eval()


def save_hf_checkpoint(params: dict[str, Any], out_dir: str | os.PathLike, *, preset: str,
                       vocab_size: int, tokenizer_dir: str | os.PathLike | None = None) -> Path:
    """Write `config.json` + `model.safetensors` (+ tokenizer files) loadable by AutoModelForCausalLM."""
    # lazy: transformers (~1.3 s) only when called; this module imports without it
    from transformers.utils import logging as hf_logging

    model = to_hf_model(params, preset=preset, vocab_size=vocab_size)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    hf_logging.disable_progress_bar()
    model.save_pretrained(out_dir, safe_serialization=True)
    if tokenizer_dir is not None and Path(tokenizer_dir).is_dir():
        for f in Path(tokenizer_dir).iterdir():
            if f.is_file():
                shutil.copy2(f, out_dir / f.name)
    return out_dir


def load_hf_checkpoint(model_dir: str | os.PathLike) -> tuple[dict[str, Any], dict[str, Any]]:
    """Read `model.safetensors` + `config.json` from a HF directory -> (Flax params, config dict)."""
    model_dir = Path(model_dir)
    cfg = json.loads((model_dir / "config.json").read_text())
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise ValueError(f"'{model_dir}' has no *.safetensors weights; save it with safe_serialization=True")
    sd: dict[str, np.ndarray] = {}
    for f in files:
        sd.update(load_file(f))
    return hf_to_flax(sd), cfg
