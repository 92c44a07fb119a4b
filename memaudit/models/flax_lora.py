"""LoRA in Flax: the adapters as their own parameter tree beside a frozen base.

The adapter tree mirrors the base tree down to the targeted layer, where a base
``{"kernel": W (in, out)}`` has an adapter ``{"lora_A": A (in, r), "lora_B": B (r, out)}``
(peft's ``lora_A.weight`` (r, in) and ``lora_B.weight`` (out, r), transposed as every Flax kernel
is). `LoraModel` closes over the base and applies the Flax Llama with W + (alpha / r) A B, the
same function as peft's W x + (alpha / r) B A x; `jax.grad` through the merge gives the adapters'
exact gradients. A federated algorithm built on `LoraModel` sees only the adapters as its
parameters, so the clients' updates, the optimizers, DP-FedAvg's clipping and noise and secure
aggregation all act on the adapters, and a client uploads the adapters' size.

The adapters start from the torch side's seeded initialisation (`memaudit.models.lora.apply_lora`:
A Kaiming-uniform under `model.init_seed`, B zero), so both backends start from the same point.
Adapter dropout is not applied here (the federated backend refuses `model.lora.dropout` > 0).

References:
    Hu et al., "LoRA: Low-Rank Adaptation of Large Language Models", ICLR 2022.
    Sun et al., "Improving LoRA in Privacy-preserving Federated Learning", ICLR 2024.

>>> import numpy as np
>>> base = {"q_proj": {"kernel": np.zeros((3, 2), np.float32)}, "norm": {"weight": np.ones(3)}}
>>> ad = {"q_proj": {"lora_A": np.ones((3, 1), np.float32), "lora_B": np.ones((1, 2), np.float32)}}
>>> merge(base, ad, 2.0)["q_proj"]["kernel"].tolist()
[[2.0, 2.0], [2.0, 2.0], [2.0, 2.0]]
"""

from __future__ import annotations

from typing import Any

import numpy as np

from memaudit.models.init import initial_model
from memaudit.models.lora import adapter_state, apply_lora

LORA_A, LORA_B = "lora_A", "lora_B"
_PEFT_PREFIX = ("base_model", "model")  # peft's names: base_model.model.<HF name>.lora_A.weight


def merge(base: Any, adapters: Any, scale: float) -> Any:
    """The base tree with kernel + scale * A @ B wherever the adapter tree has an adapter."""
    if not isinstance(adapters, dict) or not adapters:
        return base
    if LORA_A in adapters:
        a, b = adapters[LORA_A], adapters[LORA_B]
        return {**base, "kernel": base["kernel"] + scale * (a @ b)}  # (in, r) @ (r, out)
    return {k: merge(v, adapters[k], scale) if k in adapters else v for k, v in base.items()}


def adapters_from_peft(state: dict[str, Any]) -> dict:
    """peft adapter weights (`get_peft_model_state_dict` names, torch tensors or arrays) -> the
    Flax adapter tree (float32 numpy, transposed)."""
    tree: dict = {}
    for name, w in state.items():
        parts = name.split(".")
        which = LORA_A if LORA_A in parts else LORA_B
        path = parts[len(_PEFT_PREFIX):parts.index(which)]
        arr = w.detach().cpu().numpy() if hasattr(w, "detach") else np.asarray(w)
        node = tree
        for p in path:
            node = node.setdefault(p, {})
        node[which] = np.ascontiguousarray(arr.astype(np.float32).T)
    return tree


def adapters_to_peft(tree: Any) -> dict[str, np.ndarray]:
    """The Flax adapter tree -> peft's saved names and (r, in) / (out, r) weights."""
    out: dict[str, np.ndarray] = {}

    def walk(node: Any, path: tuple[str, ...]) -> None:
        if LORA_A in node:
            for which in (LORA_A, LORA_B):
                name = ".".join((*_PEFT_PREFIX, *path, which, "weight"))
                out[name] = np.ascontiguousarray(np.asarray(node[which], np.float32).T)
            return
        for k, v in node.items():
            walk(v, (*path, k))

    walk(tree, ())
    return out


def count(tree: Any) -> int:
    """Parameters in a tree."""
    # lazy: jax (~2 s) only when called; this module imports without it
    import jax

    return int(sum(np.size(x) for x in jax.tree.leaves(tree)))


class LoraModel:
    """A Flax Llama whose ``apply({"params": adapters}, ...)`` runs the frozen `base` with the
    adapters merged in (what the federated trainer's loss and evaluation call)."""

    def __init__(self, model: Any, base: Any, scale: float) -> None:
        self.model, self.base, self.scale = model, base, float(scale)

    def apply(self, variables: dict, *args: Any, **kwargs: Any) -> Any:
        return self.model.apply({"params": merge(self.base, variables["params"], self.scale)}, *args, **kwargs)


def initial_lora(model_cfg: Any, vocab_size: int) -> tuple[dict, dict]:
    """(base HF state dict, Flax adapter tree) of a `model.lora` run: the same seeded start as
    the torch backend's (`memaudit.models.lora.apply_lora`)."""
    model = initial_model(model_cfg, vocab_size)
    base = {k: v.detach().clone() for k, v in model.state_dict().items()}
    if model.config.tie_word_embeddings:
        base.pop("lm_head.weight", None)
    wrapped = apply_lora(model, model_cfg.lora, seed=model_cfg.init_seed)
    return base, adapters_from_peft(adapter_state(wrapped))


def torch_lora_model(model_cfg: Any, vocab_size: int, adapters: Any) -> Any:
    """The torch peft model of the run's base with these (Flax) adapters loaded: what the
    federated backend exports, merged and as an adapter folder, through the torch side's code."""
    # lazy: the federated side pays torch and peft (~10 s) only to export
    import torch
    from peft import set_peft_model_state_dict

    wrapped = apply_lora(initial_model(model_cfg, vocab_size), model_cfg.lora, seed=model_cfg.init_seed)
    state = {k: torch.from_numpy(v) for k, v in adapters_to_peft(adapters).items()}
    res = set_peft_model_state_dict(wrapped, state)
    unexpected = getattr(res, "unexpected_keys", [])
    if unexpected:
        raise ValueError(f"adapter weights {unexpected[:2]} do not fit the model; a memaudit bug")
    return wrapped
