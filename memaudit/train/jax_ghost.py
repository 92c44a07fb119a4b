"""DP-SGD's clipped sum by book-keeping ghost clipping: one forward, one backward, no per-example
gradient tree.

The clipped sum of `memaudit.train.jax_dp` (Σ_i min(1, C/||∇ℓ_i||) ∇ℓ_i over the step's units:
examples, or under ULS users of k rows) computed from what one backward pass of the Flax Llama
already holds. Every trained parameter of the model is the weight of a layer whose per-unit
gradient is a product of the layer's input and its output gradient:

- a Dense kernel (in, out): ∇_i = a_iᵀ g_i, a_i (kT, in) the unit's inputs, g_i (kT, out) the
  loss's gradient w.r.t. the layer's output over the unit's k rows of T tokens;
- the embedding (V, H): the output gradients g_t scattered to the rows of the token ids x_t;
  and, tied, the LM head's h_sᵀ-weighted logits gradients (`Embed.attend`, a Dense with the
  kernel transposed), the two crossed in the norm;
- an RMSNorm scale (H,): Σ_t g_t ⊙ x̂_t, x̂ the normalised input (`flax_llama.rms_normalize`).

The layers' inputs are captured by ``sow`` and their output gradients as the gradients of zero
``perturb``-ations (`flax.linen.intercept_methods` around the unchanged model, so the federated
backend's forward is untouched), all in one `jax.vjp` w.r.t. the perturbations only (autodiff
computes no weight gradient). Then per layer:

1. the units' squared gradient norms: by the ghost identity ||a_iᵀ g_i||²_F = <a_i a_iᵀ, g_i g_iᵀ>
   (two (kT, kT) Gram matrices; for the embedding Σ_{t,s} [x_t = x_s] g_t·g_s) when (kT)² < in·out,
   else by materialising a_iᵀ g_i (Bu et al.'s mixed rule, `use_ghost`); summed over layers;
2. the clip factors w_i = min(1, C/||∇ℓ_i||) (jax-privacy's `clip_pytree`: 0 for a zero norm);
3. the clipped sum per parameter Σ_i w_i a_iᵀ g_i, one einsum with g scaled by w (the embedding's
   a scatter-add), the cost of the non-private backward's weight gradient.

A unit of k rows (ULS, `group`) is one example of length kT: its gradient is the sum over its
rows, so its norm has the rows' cross terms, which the (kT, kT) Gram matrices contain. Products
accumulate in float32 (``preferred_element_type``) whatever the compute dtype.

LoRA (`flax_lora.LoraModel`, the adapters trained): the merged kernel W + s A B has ∇W = aᵀ g,
so ∇A = s aᵀ (g Bᵀ) and ∇B = s (a A)ᵀ g, two more linear maps' gradients from the same captures.

Supported: the Flax Llama, its decoder layers unrolled or scanned (`FlaxLlamaConfig.scan_layers`:
the captures carry the layer axis, each layer's terms by `jax.vmap`), tied or untied head, full
fine-tuning and LoRA. Not supported (`train.clipping: vmap`; ghost refused at config time):
LoRA's adapter dropout, whose masks the captured inputs do not carry.

References:
    Li et al., "Large Language Models Can Be Strong Differentially Private Learners", ICLR 2022
    (ghost norm).
    Bu et al., "Differentially Private Optimization on Large Model at Small Cost", ICML 2023
    (book-keeping: the clipped sum from the same backward; the mixed ghost / materialised rule).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
from flax import traverse_util

from memaudit.models.flax_llama import RMSNorm, rms_normalize
from memaudit.models.flax_lora import LORA_A, LORA_B, adapter_paths, merge
from memaudit.train.jax_engine import token_losses

INPUTS = "intermediates"  # sown layer inputs (the collection `flax_llama.Layers` scans over)
PERTURB = "perturbations"  # zero perturbations of the layer outputs
F32 = jnp.float32
STACKED_MARK = "stacked"


def use_ghost(length: int, fan_in: int, fan_out: int) -> bool:
    """Ghost norm (two (length, length) Gram matrices) rather than the materialised (in, out)
    per-unit gradient: the smaller of the two (Bu et al. 2023's mixed rule).

    >>> use_ghost(512, 768, 768), use_ghost(2048, 768, 768), use_ghost(2048, 768, 32000)
    (True, False, True)
    """
    return length * length < fan_in * fan_out


def _capture(next_fun: Callable, args: tuple, kwargs: dict, context: Any) -> Any:
    """Interceptor: sow each trained layer's input, perturb its output."""
    m, name = context.module, context.method_name
    if isinstance(m, nn.Dense) and name == "__call__":
        m.sow(INPUTS, "dense_in", args[0])
        return m.perturb("dense_out", next_fun(*args, **kwargs))
    if isinstance(m, nn.Embed) and name == "__call__":
        m.sow(INPUTS, "embed_ids", args[0])
        return m.perturb("embed_out", next_fun(*args, **kwargs))
    if isinstance(m, nn.Embed) and name == "attend":
        m.sow(INPUTS, "attend_in", args[0])
        return m.perturb("attend_out", next_fun(*args, **kwargs))
    if isinstance(m, RMSNorm) and name == "__call__":
        m.sow(INPUTS, "norm_in", rms_normalize(args[0], m.eps, m.dtype))
        return m.perturb("norm_out", next_fun(*args, **kwargs))
    return next_fun(*args, **kwargs)


def _units(x: jax.Array, k: int) -> jax.Array:
    """(rows, T, ...) -> (rows / k, k T, ...): a unit's k rows as one sequence."""
    return x.reshape(x.shape[0] // k, k * x.shape[1], *x.shape[2:])


def _dot(spec: str, x: jax.Array, y: jax.Array) -> jax.Array:
    return jnp.einsum(spec, x, y, preferred_element_type=F32)


# --------------------------------------------------------------------------- per layer, one layer
def _linear_sq(a: jax.Array, g: jax.Array, k: int) -> jax.Array:
    """Per-unit ||a_iᵀ g_i||²_F (units,) of a linear map with inputs a (rows, T, in) and output
    gradients g (rows, T, out)."""
    a, g = _units(a, k), _units(g, k)
    if use_ghost(a.shape[1], a.shape[-1], g.shape[-1]):
        return jnp.sum(_dot("uti,usi->uts", a, a) * _dot("uto,uso->uts", g, g), axis=(1, 2))
    return jnp.sum(jnp.square(_dot("uti,uto->uio", a, g)), axis=(1, 2))


def _linear_sum(a: jax.Array, g: jax.Array, w_rows: jax.Array) -> jax.Array:
    """Σ_rows w_r a_rᵀ g_r (in, out)."""
    return _dot("bti,bto->io", a, g * w_rows.astype(g.dtype)[:, None, None])


def _embed_sq(ids: jax.Array, g: jax.Array, k: int) -> jax.Array:
    """Per-unit squared norm of the lookup's gradient (rows of `g` scattered to the ids):
    Σ_{t,s} [x_t = x_s] g_t·g_s."""
    ids, g = _units(ids, k), _units(g, k)
    same = ids[:, :, None] == ids[:, None, :]
    return jnp.sum(jnp.where(same, _dot("utd,usd->uts", g, g), 0.0), axis=(1, 2))


def _embed_cross(ids: jax.Array, g_embed: jax.Array, h: jax.Array, g_logits: jax.Array, k: int) -> jax.Array:
    """Per-unit <lookup gradient, attend gradient> of a tied embedding: the lookup's is
    Σ_t e_{x_t} ⊗ g_t, the attend's Σ_s gl_s ⊗ h_s (V, H), so the product is
    Σ_{t,s} gl_s[x_t] (g_t·h_s)."""
    ids, g_embed, h, g_logits = (_units(x, k) for x in (ids, g_embed, h, g_logits))
    n = ids.shape[1]
    picked = jnp.take_along_axis(g_logits, jnp.broadcast_to(ids[:, None, :], (ids.shape[0], n, n)), axis=2)
    return jnp.sum(picked.astype(F32) * _dot("utd,usd->ust", g_embed, h), axis=(1, 2))  # [u, s, t]


def _embed_sum(ids: jax.Array, g: jax.Array, w_rows: jax.Array, vocab: int) -> jax.Array:
    rows = (g.astype(F32) * w_rows[:, None, None]).reshape(-1, g.shape[-1])
    return jnp.zeros((vocab, g.shape[-1]), F32).at[ids.reshape(-1)].add(rows)


def _norm_per_row(xhat: jax.Array, g: jax.Array) -> jax.Array:
    """(rows, H): each row's RMSNorm-scale gradient Σ_t g_t ⊙ x̂_t."""
    return jnp.sum(g.astype(F32) * xhat.astype(F32), axis=1)


def _layer_sq(kind: str, act: dict[str, Any], grad: dict[str, Any], k: int) -> jax.Array:
    """Per-unit squared gradient norm of one module's parameter (kind: dense, embed, norm)."""
    if kind == "dense":
        return _linear_sq(act["dense_in"], grad["dense_out"], k)
    if kind == "norm":
        per = _norm_per_row(act["norm_in"], grad["norm_out"])
        per = per.reshape(per.shape[0] // k, k, -1).sum(1)
        return jnp.sum(per * per, axis=-1)
    sq = _embed_sq(act["embed_ids"], grad["embed_out"], k)
    if "attend_in" in act:  # tied head: ||G_e + G_h||² = ||G_e||² + ||G_h||² + 2 <G_e, G_h>
        sq = sq + _linear_sq(act["attend_in"], grad["attend_out"], k)
        sq = sq + 2.0 * _embed_cross(act["embed_ids"], grad["embed_out"], act["attend_in"], grad["attend_out"], k)
    return sq


def _layer_sum(kind: str, act: dict[str, Any], grad: dict[str, Any], w_rows: jax.Array,
               shape: tuple[int, ...]) -> jax.Array:
    """Σ_i w_i ∇_i of one module's parameter (of `shape`)."""
    if kind == "dense":
        return _linear_sum(act["dense_in"], grad["dense_out"], w_rows)
    if kind == "norm":
        return jnp.sum(_norm_per_row(act["norm_in"], grad["norm_out"]) * w_rows[:, None], axis=0)
    out = _embed_sum(act["embed_ids"], grad["embed_out"], w_rows, shape[0])
    if "attend_in" in act:  # logits = h Eᵀ: E's gradient is gᵀ h
        out = out + _dot("btv,bth->vh", grad["attend_out"] * w_rows.astype(grad["attend_out"].dtype)[:, None, None],
                         act["attend_in"])
    return out


_PARAM = {"dense": "kernel", "embed": "embedding", "norm": "weight"}


def _kind(act: dict[str, Any]) -> str:
    if "dense_in" in act:
        return "dense"
    if "norm_in" in act:
        return "norm"
    return "embed"


def _modules(acts: Any, grads: Any) -> list[tuple[tuple[str, ...], str, dict, dict]]:
    """(module path, kind, its captured inputs, its output gradients) for every trained layer."""
    flat_a = traverse_util.flatten_dict(acts)
    flat_g = traverse_util.flatten_dict(grads)
    by: dict[tuple[str, ...], tuple[dict, dict]] = {}
    for path, v in flat_a.items():
        by.setdefault(path[:-1], ({}, {}))[0][path[-1]] = v[0]  # sow keeps a tuple of one
    for path, v in flat_g.items():
        by[path[:-1]][1][path[-1]] = v
    return [(p, _kind(a), a, g) for p, (a, g) in sorted(by.items())]


def _stacked(path: tuple[str, ...]) -> bool:
    return STACKED_MARK in path


# --------------------------------------------------------------------------- the clipped sum
def clipped_sum_fn(model: nn.Module, *, clip: float, group: bool, microbatch: int | None = None) -> Callable:
    """fn(params, ids, am, lmask[, rng]) -> (Σ clipped unit gradients, (unit losses, unit gradient
    norms)) by book-keeping ghost clipping, the values of `jax_dp.clipped_sum_fn`'s jax-privacy
    path: rows (B, L), or under `group` (users, k, L). `microbatch` units at a time (their sums
    added; units are clipped independently), default all at once."""
    one = _clipped_sum_once(model, clip=clip)

    def fn(params, ids, am, lm, rng=None):
        k = ids.shape[1] if group else 1
        units = ids.shape[0]
        size = units if microbatch is None else min(microbatch, units)
        length = ids.shape[-1]
        grads, values, norms = None, [], []
        for s in range(0, units, size):  # unrolled, as `jax_engine.plain_step`'s chunks
            rows = (x[s:s + size].reshape(-1, length) for x in (ids, am, lm))
            g, (v, n) = one(params, *rows, k)
            grads = g if grads is None else jax.tree.map(jnp.add, grads, g)
            values.append(v)
            norms.append(n)
        return grads, (jnp.concatenate(values), jnp.concatenate(norms))

    return fn


def _lora_sq(a: jax.Array, g: jax.Array, la: jax.Array, lb: jax.Array, scale: float, k: int) -> jax.Array:
    """Per-unit ||∇A||² + ||∇B||² of an adapter on a Dense with inputs a and output gradients g:
    the merged kernel W + s A B has ∇W = aᵀ g, so ∇A = s aᵀ (g Bᵀ) and ∇B = s (a A)ᵀ g, each a
    linear map's gradient."""
    gb, aa = _lora_sides(a, g, la, lb, scale)
    return _linear_sq(a, gb, k) + _linear_sq(aa, g, k)


def _lora_sides(a: jax.Array, g: jax.Array, la: jax.Array, lb: jax.Array, scale: float) -> tuple[jax.Array, jax.Array]:
    gb = (scale * _dot("bto,ro->btr", g, lb.astype(g.dtype))).astype(g.dtype)  # s g Bᵀ (b, T, r)
    aa = (scale * _dot("bti,ir->btr", a, la.astype(a.dtype))).astype(a.dtype)  # s a A (b, T, r)
    return gb, aa


def _lora_sums(a: jax.Array, g: jax.Array, la: jax.Array, lb: jax.Array, scale: float,
               w_rows: jax.Array) -> tuple[jax.Array, jax.Array]:
    gb, aa = _lora_sides(a, g, la, lb, scale)
    return _linear_sum(a, gb, w_rows), _linear_sum(aa, g, w_rows)


def _clipped_sum_once(model: Any, *, clip: float) -> Callable:
    """fn(params, ids, am, lm, k) over rows (B, L) in units of k consecutive rows. `model`: the
    Flax Llama (its parameters trained), or a `flax_lora.LoraModel` without adapter dropout (the
    adapters trained, the base frozen)."""
    lora = hasattr(model, "base") and hasattr(model, "scale")
    if lora and model.dropout > 0:
        raise ValueError("ghost clipping does not cover LoRA's adapter dropout; use train.clipping=vmap")
    if lora:
        return _lora_clipped_sum_once(model, clip=clip)

    def fn(params, ids, am, lm, k):
        per_row, acts, grads = _captured(model, params, ids, am, lm)
        modules = _modules(acts, grads)
        sq = jnp.zeros((ids.shape[0] // k,), F32)
        for path, kind, a, g in modules:
            if _stacked(path):  # a scanned layer: its captures carry the layer axis first
                sq = sq + jnp.sum(jax.vmap(lambda a, g, kind=kind: _layer_sq(kind, a, g, k))(a, g), axis=0)
            else:
                sq = sq + _layer_sq(kind, a, g, k)
        norms, scale = _norms_and_scale(sq, clip)
        w_rows = jnp.repeat(scale, k)
        flat_p = traverse_util.flatten_dict(params)
        out = {}
        for path, kind, a, g in modules:
            name = (*path, _PARAM[kind])
            shape = flat_p[name].shape
            if _stacked(path):
                s = jax.vmap(lambda a, g, kind=kind, shape=shape: _layer_sum(kind, a, g, w_rows, shape[1:]))(a, g)
            else:
                s = _layer_sum(kind, a, g, w_rows, shape)
            out[name] = s.astype(flat_p[name].dtype)
        missing = set(flat_p) - set(out)
        if missing:
            raise ValueError(f"ghost clipping has no gradient for {min(missing)}; use train.clipping=vmap")
        values = per_row.reshape(-1, k).sum(1)
        return traverse_util.unflatten_dict(out), (values, norms)

    return fn


def _norms_and_scale(sq: jax.Array, clip: float) -> tuple[jax.Array, jax.Array]:
    norms = jnp.sqrt(sq)
    return norms, jnp.nan_to_num(jnp.minimum(1.0, clip / norms), nan=0.0, posinf=0.0)  # as clip_pytree


def _lora_clipped_sum_once(lora: Any, *, clip: float) -> Callable:
    """`_clipped_sum_once` of LoRA's adapters: the base model run with the adapters merged
    (`flax_lora.merge`), the adapted Dense layers' inputs and output gradients captured."""

    model, scale = lora.model, lora.scale

    def fn(adapters, ids, am, lm, k):
        merged = merge(lora.base, adapters, scale)
        per_row, acts, grads = _captured(model, merged, ids, am, lm)
        by = {p: (kind, a, g) for p, kind, a, g in _modules(acts, grads)}
        sq = jnp.zeros((ids.shape[0] // k,), F32)
        nodes = {}
        for path in adapter_paths(adapters):
            _, a, g = by[path]
            node = adapters
            for key in path:
                node = node[key]
            nodes[path] = node
            la, lb = node[LORA_A], node[LORA_B]
            if _stacked(path):
                sq = sq + jnp.sum(jax.vmap(lambda a, g, la, lb: _lora_sq(
                    a["dense_in"], g["dense_out"], la, lb, scale, k))(a, g, la, lb), axis=0)
            else:
                sq = sq + _lora_sq(a["dense_in"], g["dense_out"], la, lb, scale, k)
        norms, w = _norms_and_scale(sq, clip)
        w_rows = jnp.repeat(w, k)
        out = {}
        for path, node in nodes.items():
            _, a, g = by[path]
            la, lb = node[LORA_A], node[LORA_B]
            f = functools.partial(_lora_sums, scale=scale, w_rows=w_rows)
            ga, gb = (jax.vmap(f) if _stacked(path) else f)(a["dense_in"], g["dense_out"], la, lb)
            out[(*path, LORA_A)], out[(*path, LORA_B)] = ga.astype(la.dtype), gb.astype(lb.dtype)
        return traverse_util.unflatten_dict(out), (per_row.reshape(-1, k).sum(1), norms)

    return fn


def _captured(model: nn.Module, params: Any, ids: jax.Array, am: jax.Array, lm: jax.Array) -> tuple:
    """One forward and one backward of the summed per-row mean token losses w.r.t. zero
    perturbations of the layer outputs: (per-row losses, sown inputs, output gradients)."""

    def apply(perts: Any) -> tuple[jax.Array, Any]:
        variables = {"params": params} if perts is None else {"params": params, PERTURB: perts}
        mutable = [INPUTS] if perts is not None else [INPUTS, PERTURB]
        with nn.intercept_methods(_capture):
            return model.apply(variables, ids, am, mutable=mutable)

    shapes = jax.eval_shape(lambda: apply(None)[1][PERTURB])
    perts = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes)

    def loss(perts):
        logits, state = apply(perts)
        tok, m = token_losses(logits, ids, lm)
        per_row = tok.sum(1) / jnp.maximum(m.sum(1), 1.0)
        return jnp.sum(per_row), (per_row, state[INPUTS])

    (_, (per_row, acts)), grads = jax.value_and_grad(loss, has_aux=True)(perts)
    return per_row, acts, grads
