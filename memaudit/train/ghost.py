"""Per-example gradient norms and the clipped gradient sum from one backward pass.

For a linear layer y_t = W a_t, example i's weight gradient is G_i = Σ_t g_t a_tᵀ, with a the
layer's input activations (B, T, d_in) and g the gradients of the output (B, T, d_out). Its
squared norm needs no G_i (ghost norm, Li et al. 2022):

    ||G_i||² = Σ_{s,t} (a_s·a_t)(g_s·g_t)          (two (T, T) Gram matrices)

Book-keeping (Bu et al. 2023) keeps a and g from the single backward pass and forms the
clipped sum Σ_i c_i G_i = einsum(g·c, a) directly, so no second backward pass is needed.
Per layer this module either uses the Gram form, or materialises the per-example gradients
G (B, d_out, d_in) with one batched matmul, whichever the cost model prefers: materialising
costs the same FLOPs as the ordinary weight gradient and, while the kept per-example
gradients fit `keep_budget`, gives the clipped sum almost for free (a weighted sum over B);
so it is used whenever one layer's B·d_in·d_out fits `materialize_budget`. Otherwise, when
T² < d_in·d_out, the Gram form. Layers whose per-example gradients are not kept form the
clipped sum with one (B·T)-deep matmul, the cost of an ordinary weight gradient.

Embeddings are exact: example i's gradient has one row per distinct token id, the sum of g
over that id's positions, so norms come from a scatter-add over (example, token) pairs.
RMSNorm weights are exact: G_i = Σ_t g_t ⊙ â_t with â the normalised input.

Backpropagation runs only to the embedding output, so autograd computes activation
gradients and no weight gradients at all; weight gradients come from the stored a and g.

References:
  Li, Tramèr, Liang, Hashimoto, "Large Language Models Can Be Strong Differentially Private
  Learners", ICLR 2022 (ghost clipping).
  Bu, Wang, Zha, Karypis, "Differentially Private Optimization on Large Model at Small Cost",
  ICML 2023 (book-keeping).
"""

from __future__ import annotations

import contextlib
import math
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Literal

import torch
from torch import nn
from torch.func import functional_call, grad, vmap

from memaudit.train.losses import causal_lm_loss_per_example

NormMode = Literal["auto", "gram", "materialize"]
# elements of one layer's B·d_out·d_in formed at once (128 MiB fp32). At 2**26 the `small`
# preset's output layer (16 x 8192 x 384, 200 MB at batch 16) was formed, and writing and twice
# reading it cost more than its Gram form: a DP-SGD step 1.336x the non-private one against
# 1.296x here (benchmarks/dp_overhead.py's set-up, 2 CPU cores, medians of 11 interleaved steps)
MATERIALIZE_BUDGET = 2**25
KEEP_BUDGET = 2**28  # elements of per-example gradients kept for the clipped sum (1 GiB fp32)


@dataclass
class ClippedGrads:
    """Output of one clipped backward pass over a batch."""

    grads: dict[str, torch.Tensor]  # parameter name -> Σ_i c_i ∇_i, same shape as the parameter
    norms: torch.Tensor  # (B,) per-example gradient norms before clipping
    losses: torch.Tensor  # (B,) per-example losses (detached)
    param_sq_norms: dict[str, torch.Tensor] | None = None  # name -> (B,) squared norms


def clip_factors(norms: torch.Tensor, clip: float) -> torch.Tensor:
    """c_i = min(1, C / ||∇_i||); C = inf gives 1 (no clipping)."""
    if math.isinf(clip):
        return torch.ones_like(norms)
    return (clip / (norms + 1e-6)).clamp(max=1.0)


def _is_rmsnorm(m: nn.Module) -> bool:
    return type(m).__name__.endswith("RMSNorm") and hasattr(m, "variance_epsilon")


class GhostClipper:
    """Hooks a `LlamaForCausalLM` (or any model built of the supported layers).

    Supported trainable parameters: `nn.Linear` weight and bias, `nn.Embedding` weight,
    RMSNorm weight. Anything else trainable raises at construction, naming the parameter.
    """

    def __init__(self, model: nn.Module, *, norm_mode: NormMode = "auto",
                 materialize_budget: int = MATERIALIZE_BUDGET, keep_budget: int = KEEP_BUDGET) -> None:
        self.model = model
        self.norm_mode = norm_mode
        self.materialize_budget = materialize_budget
        self.keep_budget = keep_budget
        self._kept = 0
        self.linears: dict[str, nn.Linear] = {}
        self.norms: dict[str, nn.Module] = {}
        self.embedding: tuple[str, nn.Embedding] | None = None
        self._discover()
        self._store: dict[str, dict] = {}

    # ------------------------------------------------------------------ set-up
    def _discover(self) -> None:
        covered: dict[int, str] = {}
        for name, m in self.model.named_modules():
            trains = any(p.requires_grad for p in m.parameters(recurse=False))
            if isinstance(m, nn.Linear):
                if trains:  # a frozen layer (a LoRA base) needs neither norms nor sums
                    self.linears[name] = m
            elif isinstance(m, nn.Embedding):
                if self.embedding is not None and m.weight.requires_grad:
                    raise ValueError(f"more than one trainable embedding ({name}); ghost mode "
                                     "handles one input embedding; use mode='vmap'")
                self.embedding = (name, m)
            elif _is_rmsnorm(m):
                if trains:
                    self.norms[name] = m
            else:
                continue
            for pname, p in m.named_parameters(recurse=False):
                if p.requires_grad:
                    if id(p) in covered:
                        raise ValueError(
                            f"parameter {name}.{pname} is shared with {covered[id(p)]} (tied "
                            "embeddings?); ghost clipping needs untied weights: set "
                            "tie_word_embeddings=False or use mode='vmap'")
                    covered[id(p)] = f"{name}.{pname}"
        for pname, p in self.model.named_parameters():
            if p.requires_grad and id(p) not in covered:
                raise ValueError(f"trainable parameter '{pname}' is in a layer ghost clipping "
                                 "does not support; freeze it or use mode='vmap'")
        if self.embedding is None:
            raise ValueError("the model has no nn.Embedding input layer; ghost mode needs one")
        ckpt = getattr(type(self.model), "is_activation_checkpointing", None)
        if ckpt is None:
            ckpt = getattr(type(self.model), "is_gradient_checkpointing", None)
        if isinstance(ckpt, property) and ckpt.fget(self.model):
            raise ValueError("ghost clipping cannot run with activation checkpointing; turn "
                             "train.activation_checkpointing off or use mode='vmap'")

    @contextlib.contextmanager
    def _hooks(self) -> Iterator[None]:
        store = self._store = {}
        handles = []

        def save_grad(key: str):
            def hook(g: torch.Tensor) -> None:
                store[key]["g"] = g.detach()
            return hook

        def linear_hook(key: str):
            def hook(mod, inputs, output):
                if key in store:
                    raise RuntimeError(f"{key} ran twice in one forward; ghost mode supports one call")
                store[key] = {"a": inputs[0].detach()}
                if output.requires_grad:
                    output.register_hook(save_grad(key))
            return hook

        def embed_hook(mod, inputs, output):
            # cut the graph here: backprop stops at the embedding output, whose gradient
            # we take directly (autograd never forms the dense V x d embedding gradient)
            out = output.detach().requires_grad_(True)
            store["__embed__"] = {"ids": inputs[0].detach(), "out": out}
            return out

        for key, m in {**self.linears, **self.norms}.items():
            handles.append(m.register_forward_hook(linear_hook(key)))
        handles.append(self.embedding[1].register_forward_hook(embed_hook))
        try:
            yield
        finally:
            for h in handles:
                h.remove()

    # ------------------------------------------------------------------ per-layer maths
    def _linear(self, a: torch.Tensor, g: torch.Tensor, m: nn.Linear):
        """Squared norms of weight (+ bias) per example, and closures for the clipped sums."""
        # float32 at least, whatever the autocast: bf16 norms and sums let a clipped
        # per-example gradient reach ~1.0015 C (the clip factor must see the true norm)
        dt = torch.promote_types(torch.promote_types(a.dtype, g.dtype), torch.float32)
        a, g = a.to(dt).flatten(1, -2), g.to(dt).flatten(1, -2)  # (B, T, d)
        b, t, d_in = a.shape
        d_out = g.shape[-1]
        size = b * d_in * d_out
        mode = self.norm_mode
        if mode == "auto":
            mode = "materialize" if size <= self.materialize_budget or t * t >= d_in * d_out else "gram"

        def gemm_sum(c: torch.Tensor) -> torch.Tensor:  # Σ_i c_i G_i as one (B·T)-deep matmul
            return torch.einsum("bto,bti->oi", g * c.to(dt)[:, None, None], a)

        w_sum = gemm_sum
        if mode == "materialize":
            per = torch.bmm(g.transpose(1, 2), a)  # (B, d_out, d_in)
            sq = torch.linalg.vector_norm(per, dim=(1, 2)).pow(2)
            if self._kept + size <= self.keep_budget:  # keep it: the clipped sum is then cheap
                self._kept += size
                w_sum = lambda c, per=per: torch.einsum("b,boi->oi", c.to(dt), per)
            del per  # dropped here unless the closure above keeps it
        else:
            gram_a = torch.bmm(a, a.transpose(1, 2))  # (B, T, T)
            sq = torch.einsum("bst,bst->b", gram_a, torch.bmm(g, g.transpose(1, 2)))
        sums = {"weight": w_sum}
        sqs = {"weight": sq}
        if m.bias is not None and m.bias.requires_grad:
            gb = g.sum(1)  # (B, d_out)
            sqs["bias"] = gb.pow(2).sum(1)
            sums["bias"] = lambda c: c.to(dt) @ gb
        return sqs, sums

    @staticmethod
    def _rmsnorm(x: torch.Tensor, g: torch.Tensor, m: nn.Module):
        xf = x.float()
        xhat = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + m.variance_epsilon)).to(x.dtype)
        per = (g.float() * xhat.float()).flatten(1, -2).sum(1)  # (B, d)
        return {"weight": per.pow(2).sum(1)}, {"weight": lambda c: c @ per}

    @staticmethod
    def _embedding(ids: torch.Tensor, g: torch.Tensor, m: nn.Embedding):
        b = ids.shape[0]
        vocab, dim = m.weight.shape
        ids = ids.reshape(b, -1)
        g = g.reshape(b, -1, dim).float()
        if m.padding_idx is not None:  # that row never receives a gradient
            g = g * (ids != m.padding_idx).unsqueeze(-1)
        rows = torch.arange(b, device=ids.device)[:, None] * vocab + ids  # (B, T) unique per example
        uniq, inv = torch.unique(rows.reshape(-1), return_inverse=True)
        summed = torch.zeros(uniq.numel(), dim, device=g.device, dtype=g.dtype)
        summed.index_add_(0, inv, g.reshape(-1, dim))  # one row per (example, token id)
        sq = torch.zeros(b, device=g.device, dtype=g.dtype)
        sq.index_add_(0, torch.div(uniq, vocab, rounding_mode="floor"), summed.pow(2).sum(1))

        def w_sum(c: torch.Tensor) -> torch.Tensor:
            out = torch.zeros(vocab, dim, device=g.device, dtype=g.dtype)
            return out.index_add_(0, ids.reshape(-1), (g * c[:, None, None]).reshape(-1, dim))

        return {"weight": sq}, {"weight": w_sum}

    # ------------------------------------------------------------------ the pass
    def clipped_sum(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None,
                    loss_mask: torch.Tensor, clip: float, *,
                    return_param_norms: bool = False, group_size: int = 1) -> ClippedGrads:
        """Σ_i min(1, C/||∇_i||) ∇_i over the batch, with ∇_i the gradient of example i's loss.

        With `group_size` g > 1 the rows are consecutive groups of g (one user's sequences,
        padded with rows that have no target), and i runs over groups: ∇_i is the sum of the
        group's per-example gradients. Each layer's stored activations and output gradients
        (B, T, d) are read as (B/g, g·T, d), so a user's sequences are one unit of the same
        ghost-norm and book-keeping maths (their cross terms included); `norms` is then (B/g,)
        and `losses` stays per example (B,).
        """
        if group_size < 1 or input_ids.shape[0] % group_size:
            raise ValueError(f"{input_ids.shape[0]} rows do not split into groups of {group_size}")
        with self._hooks():
            out = self.model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False)
            losses = causal_lm_loss_per_example(out.logits, input_ids, loss_mask)  # (B,)
            embed = self._store["__embed__"]
            (g_embed,) = torch.autograd.grad(losses.sum(), [embed["out"]])
        store = self._store
        self._store = {}
        del out
        # the per-example maths in float32 whatever the caller's autocast (bf16 matmuls here
        # let a clipped per-example gradient reach ~1.0015 C)
        with torch.autocast(input_ids.device.type, enabled=False):
            if group_size > 1:
                store, embed, g_embed = _grouped(store, embed, g_embed, group_size)
            return self._finish(store, embed, g_embed, losses, clip, return_param_norms)

    def _finish(self, store, embed, g_embed, losses, clip, return_param_norms) -> ClippedGrads:

        per_sq: dict[str, torch.Tensor] = {}
        per_sum: dict[str, object] = {}
        self._kept = 0
        for key, m in self.linears.items():
            sqs, sums = self._linear(store[key]["a"], store[key]["g"], m)
            self._collect(key, m, sqs, sums, per_sq, per_sum)
        for key, m in self.norms.items():
            sqs, sums = self._rmsnorm(store[key]["a"], store[key]["g"], m)
            self._collect(key, m, sqs, sums, per_sq, per_sum)
        ekey, emod = self.embedding
        if emod.weight.requires_grad:  # frozen under LoRA: the cut at its output is all it does
            sqs, sums = self._embedding(embed["ids"], g_embed, emod)
            self._collect(ekey, emod, sqs, sums, per_sq, per_sum)

        norms = torch.stack([v.float() for v in per_sq.values()]).sum(0).sqrt()
        c = clip_factors(norms, clip)
        params = dict(self.model.named_parameters())
        grads = {name: fn(c).to(params[name].dtype) for name, fn in per_sum.items()}
        return ClippedGrads(grads=grads, norms=norms.detach(), losses=losses.detach(),
                            param_sq_norms=per_sq if return_param_norms else None)

    @staticmethod
    def _collect(key, m, sqs, sums, per_sq, per_sum) -> None:
        for pname, sq in sqs.items():
            if getattr(m, pname).requires_grad:
                full = f"{key}.{pname}" if key else pname
                per_sq[full] = sq
                per_sum[full] = sums[pname]


def _grouped(store: dict, embed: dict, g_embed: torch.Tensor, g: int) -> tuple[dict, dict, torch.Tensor]:
    """Every (B, T, ...) tensor of one pass read as (B/g, g·T, ...): one unit per group of rows."""

    def grp(t: torch.Tensor) -> torch.Tensor:  # (B, T, d) -> (B/g, g*T, d); (B, T) -> (B/g, g*T)
        return t.reshape(t.shape[0] // g, -1, *t.shape[2:])

    out = {k: {n: grp(v) for n, v in d.items()} for k, d in store.items() if k != "__embed__"}
    return out, {"ids": grp(embed["ids"]), "out": embed["out"]}, grp(g_embed)


# ---------------------------------------------------------------------- reference path
def vmap_clipped_sum(model: nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor | None,
                     loss_mask: torch.Tensor, clip: float, *, chunk_size: int | None = None,
                     return_param_norms: bool = False, group_size: int = 1) -> ClippedGrads:
    """The naive reference: per-example gradients with `torch.func.vmap(grad(...))`.

    Materialises every example's full gradient, so it costs B times the parameter memory.
    With `group_size` g the per-example gradients of each g consecutive rows are summed first
    (one user's gradient) and the groups are clipped.
    """
    params = {k: v.detach() for k, v in model.named_parameters() if v.requires_grad}
    frozen = {k: v.detach() for k, v in model.named_parameters() if not v.requires_grad}
    buffers = dict(model.named_buffers())
    if attention_mask is None:
        attention_mask = torch.ones_like(input_ids)
    # the 4D mask the model would build (causal, padded keys hidden), made outside vmap
    # because transformers' mask builder branches on the data. Additive (0 / dtype min), not
    # boolean: eager attention adds a 4D mask to the scores as is, so a boolean one became
    # +0/+1 (no causal mask at all), while sdpa reads a boolean one as keep/drop.
    length = input_ids.shape[1]
    causal = torch.ones(length, length, dtype=torch.bool, device=input_ids.device).tril()
    keep = (causal[None] & attention_mask.bool()[:, None, :])[:, None]  # (B, 1, L, L)
    mask_dtype = next(iter(params.values())).dtype if params else torch.float32
    mask4d = torch.zeros(keep.shape, dtype=mask_dtype, device=keep.device).masked_fill(
        ~keep, torch.finfo(mask_dtype).min)

    def loss_fn(p, ids, am, lm):
        out = functional_call(model, ({**p, **frozen}, buffers), args=(),
                              kwargs={"input_ids": ids[None], "attention_mask": am[None],
                                      "use_cache": False}, tie_weights=True)
        loss = causal_lm_loss_per_example(out.logits, ids[None], lm[None])[0]
        return loss, loss

    with warnings.catch_warnings():  # sdpa has no batching rule on CPU: a slow loop, by design
        warnings.filterwarnings("ignore", message=".*performance drop.*")
        per, losses = vmap(grad(loss_fn, has_aux=True), in_dims=(None, 0, 0, 0),
                           chunk_size=chunk_size)(params, input_ids, mask4d, loss_mask)
    if group_size > 1:
        per = {k: v.reshape(v.shape[0] // group_size, group_size, *v.shape[1:]).sum(1) for k, v in per.items()}
    with torch.autocast(input_ids.device.type, enabled=False):  # float32 norms and sums
        sq = {k: v.float().pow(2).flatten(1).sum(1) for k, v in per.items()}
        norms = torch.stack(list(sq.values())).sum(0).sqrt()
        c = clip_factors(norms, clip)
        grads = {k: torch.einsum("b,b...->...", c, v.float()).to(v.dtype) for k, v in per.items()}
    return ClippedGrads(grads=grads, norms=norms, losses=losses.detach(),
                        param_sq_norms=sq if return_param_norms else None)
