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

Adapter dropout (`model.lora.dropout` = p > 0) is peft's: dropout on the input of the adapter path
only, y = x W + (alpha / r) (dropout(x) A) B, with torch's inverted scaling (a kept input is
divided by 1 - p). Its mask cannot be merged into W, so a forward given a dropout key runs the
adapters beside the base instead (`lora_dense`, applied to each targeted Dense of the unchanged
Flax Llama by `flax.linen.intercept_methods`); adapter i (in `adapter_paths` order) draws its
mask under ``fold_in(key, i)``. Without a key (evaluation) or with p = 0 the forward is the merged
one, bit for bit. The federated client's local steps pass one key per step
(`memaudit.federated.algorithms`, ``loss_rng``).

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

from collections.abc import Callable
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


def adapter_paths(adapters: Any) -> list[tuple[str, ...]]:
    """The paths of the adapted layers (``("model", "layers", "0", "self_attn", "q_proj")``), in
    the order that numbers their dropout keys (sorted).

    >>> adapter_paths({"b": {"lora_A": 0, "lora_B": 0}, "a": {"x": {"lora_A": 0, "lora_B": 0}}})
    [('a', 'x'), ('b',)]
    """
    out: list[tuple[str, ...]] = []

    def walk(node: Any, path: tuple[str, ...]) -> None:
        if LORA_A in node:
            out.append(path)
            return
        for k, v in node.items():
            walk(v, (*path, k))

    walk(adapters, ())
    return sorted(out)


def dropout_mask(key: Any, rate: float, shape: tuple[int, ...]) -> Any:
    """The kept entries (bool, ``shape``) of dropout at ``rate``: each kept with probability
    1 - rate, independently (`flax.linen.Dropout`'s draw)."""
    # lazy: jax and flax (~2 s) only when called; this module imports without them
    import jax

    return jax.random.bernoulli(key, 1.0 - rate, shape)


def lora_dense(x: Any, y: Any, a: Any, b: Any, scale: float, rate: float, key: Any) -> Any:
    """``y`` (the frozen layer's x W) plus the adapter path on the dropped-out input:
    y + scale * (dropout(x) A) B, a kept input divided by 1 - rate (peft's, torch's inverted
    dropout). ``x`` (..., in), ``a`` (in, r), ``b`` (r, out), ``y`` (..., out).

    References:
        Srivastava et al., "Dropout: A Simple Way to Prevent Neural Networks from Overfitting",
        JMLR 2014; peft's ``lora.Linear.forward`` (dropout on the adapter input only).
    """
    # lazy: jax and flax (~2 s) only when called; this module imports without them
    import jax.numpy as jnp

    keep = dropout_mask(key, rate, x.shape)
    dropped = jnp.where(keep, x / jnp.asarray(1.0 - rate, x.dtype), jnp.zeros((), x.dtype))
    h = (dropped @ a.astype(x.dtype)) @ b.astype(x.dtype)  # (..., in) @ (in, r) @ (r, out)
    return y + (scale * h).astype(y.dtype)


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
    adapters merged in (what the federated trainer's loss and evaluation call); with
    ``dropout`` > 0 and a ``dropout_rng`` key, with the adapters beside the base and adapter
    dropout on their input (`lora_dense`)."""

    def __init__(self, model: Any, base: Any, scale: float, dropout: float = 0.0) -> None:
        if not 0.0 <= dropout < 1.0:
            raise ValueError(f"LoRA dropout must be in [0, 1), got {dropout}; set model.lora.dropout")
        self.model, self.base, self.scale, self.dropout = model, base, float(scale), float(dropout)

    def apply(self, variables: dict, *args: Any, dropout_rng: Any = None, **kwargs: Any) -> Any:
        adapters = variables["params"]
        if self.dropout == 0.0 or dropout_rng is None:
            return self.model.apply({"params": merge(self.base, adapters, self.scale)}, *args, **kwargs)
        # lazy: jax and flax (~2 s) only when called; this module imports without them
        import flax.linen as nn

        applied: set[tuple[str, ...]] = set()
        with nn.intercept_methods(self._adapted(adapters, dropout_rng, applied)):
            out = self.model.apply({"params": self.base}, *args, **kwargs)
        missed = set(adapter_paths(adapters)) - applied
        if missed:  # an adapter whose layer the model never called would silently train nothing
            raise ValueError(f"adapters {sorted(missed)[:2]} match no Dense of the model; a memaudit bug")
        return out

    def _adapted(self, adapters: Any, rng: Any, applied: set) -> Callable:
        """A method interceptor adding the adapter path (with dropout) to each adapted Dense;
        the paths it adapted go into ``applied``."""
        # lazy: jax and flax (~2 s) only when called; this module imports without them
        import flax.linen as nn
        import jax

        index = {p: i for i, p in enumerate(adapter_paths(adapters))}

        def intercept(next_fun: Callable, args: tuple, kwargs: dict, context: Any) -> Any:
            module = context.module
            i = index.get(tuple(module.path)) if isinstance(module, nn.Dense) else None
            if i is None or context.method_name != "__call__":
                return next_fun(*args, **kwargs)
            node = adapters
            for k in module.path:
                node = node[k]
            (x,) = args
            x = x.astype(module.dtype or x.dtype)  # as Dense promotes its input
            applied.add(tuple(module.path))
            return lora_dense(x, next_fun(x), node[LORA_A], node[LORA_B], self.scale, self.dropout,
                              jax.random.fold_in(rng, i))

        return intercept


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
