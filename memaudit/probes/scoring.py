"""Batched per-token log-probabilities and KV-cache batched decoding for any HF causal LM.

Sequences are sorted by length before batching so padding is minimal; scoring pads on the right
(causal attention keeps the real tokens exact), decoding pads on the left and carries explicit
position ids so every row continues from its own last token.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

Progress = Callable[[int, int, dict], None] | None


@dataclass(frozen=True)
class TokenScores:
    """Per sequence of n tokens, arrays of n-1 entries for positions 1..n-1.

    logp: log p(x_t | x_<t). mu, sigma: mean and std of log p(v | x_<t) under v ~ p(. | x_<t)
    (present when requested; Min-K%++ needs them).
    """

    logp: list[np.ndarray]
    mu: list[np.ndarray] | None = None
    sigma: list[np.ndarray] | None = None


# `batch_size` counts sequences of this many tokens; shorter sequences are batched more
# densely under the same token budget (exposure candidates are ~15 tokens long).
BUDGET_SEQ_LEN = 128


def _batches(order: np.ndarray, batch_size: int, lengths: np.ndarray | None = None):
    """Consecutive slices of `order` (sorted by decreasing length) under a token budget."""
    if lengths is None:
        for i in range(0, len(order), batch_size):
            yield order[i : i + batch_size]
        return
    budget = batch_size * BUDGET_SEQ_LEN
    i = 0
    while i < len(order):
        width = max(int(lengths[order[i]]), 1)  # the longest in this batch (sorted order)
        rows = max(batch_size, budget // width)
        yield order[i : i + rows]
        i += rows


@torch.no_grad()
def token_logprobs(
    model,
    seqs: Sequence[Sequence[int]],
    *,
    batch_size: int = 32,
    with_stats: bool = False,
    progress: Progress = None,
) -> TokenScores:
    """Score many token sequences in length-sorted, right-padded batches."""
    device = next(model.parameters()).device
    n = len(seqs)
    lengths = np.array([len(s) for s in seqs])
    if n and lengths.min() < 2:
        raise ValueError("every scored sequence needs at least 2 tokens")
    order = np.argsort(-lengths, kind="stable")
    logp: list[np.ndarray | None] = [None] * n
    mus: list[np.ndarray | None] = [None] * n
    sigmas: list[np.ndarray | None] = [None] * n
    done = 0
    for idx in _batches(order, batch_size, lengths):
        width = int(lengths[idx].max())
        ids = torch.zeros((len(idx), width), dtype=torch.long)
        mask = torch.zeros((len(idx), width), dtype=torch.long)
        for row, i in enumerate(idx):
            ids[row, : lengths[i]] = torch.as_tensor(seqs[i], dtype=torch.long)
            mask[row, : lengths[i]] = 1
        ids, mask = ids.to(device), mask.to(device)
        logits = model(input_ids=ids, attention_mask=mask, use_cache=False).logits[:, :-1].float()
        if with_stats:
            lsm = torch.log_softmax(logits, dim=-1)  # (batch, width-1, vocab)
            tok = lsm.gather(-1, ids[:, 1:, None]).squeeze(-1)
            p = lsm.exp()
            mu = (p * lsm).sum(-1)
            var = (p * lsm.square()).sum(-1) - mu.square()
            sd = var.clamp_min(1e-12).sqrt()
            mu_np, sd_np = mu.cpu().numpy(), sd.cpu().numpy()
        else:  # no (batch, width, vocab) log-softmax: gather the logit, subtract the logsumexp
            tok = logits.gather(-1, ids[:, 1:, None]).squeeze(-1) - logits.logsumexp(-1)
        tok_np = tok.cpu().numpy()
        for row, i in enumerate(idx):
            k = lengths[i] - 1
            logp[i] = tok_np[row, :k].astype(np.float64)
            if with_stats:
                mus[i] = mu_np[row, :k].astype(np.float64)
                sigmas[i] = sd_np[row, :k].astype(np.float64)
        done += len(idx)
        if progress:
            progress(done, n, {})
    return TokenScores(
        logp=logp, mu=mus if with_stats else None, sigma=sigmas if with_stats else None
    )


def _left_pad(
    prompts: Sequence[Sequence[int]], pad_id: int, device
) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for row, p in enumerate(prompts):
        if len(p):
            ids[row, width - len(p) :] = torch.as_tensor(p, dtype=torch.long)
            mask[row, width - len(p) :] = 1
    return ids.to(device), mask.to(device)


def _cache_api(model) -> tuple[str, bool]:
    """The KV-cache keyword of this transformers ('cache' in 5.x, else 'past_key_values')."""
    import inspect

    params = inspect.signature(model.forward).parameters
    return ("cache" if "cache" in params else "past_key_values"), "logits_to_keep" in params


def _cache_of(out):
    cache = out.get("cache") if hasattr(out, "get") else None
    return cache if cache is not None else out.past_key_values


@torch.no_grad()
def _decode_batch(
    model, prompts, max_new_tokens, pad_id, top_k, temperature, generator
) -> np.ndarray:
    device = next(model.parameters()).device
    cache_kw, keep = _cache_api(model)
    extra = {"logits_to_keep": 1} if keep else {}
    ids, mask = _left_pad(prompts, pad_id, device)
    pos = (mask.cumsum(-1) - 1).clamp_min(0)  # left padding: each row counts from its first token
    out = model(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=True, **extra)
    cache, logits = _cache_of(out), out.logits[:, -1]
    next_pos = pos[:, -1:] + 1
    new = torch.empty((len(prompts), max_new_tokens), dtype=torch.long, device=device)
    for t in range(max_new_tokens):
        if top_k is None:
            tok = logits.argmax(-1)
        else:
            vals, cand = torch.topk(
                logits.float() / temperature, min(top_k, logits.shape[-1]), dim=-1
            )
            choice = torch.multinomial(torch.softmax(vals, -1).cpu(), 1, generator=generator).to(
                device
            )
            tok = cand.gather(-1, choice).squeeze(-1)
        new[:, t] = tok
        if t + 1 == max_new_tokens:
            break
        mask = torch.cat([mask, torch.ones_like(tok[:, None])], dim=1)
        out = model(
            input_ids=tok[:, None],
            attention_mask=mask,
            position_ids=next_pos,
            use_cache=True,
            **{cache_kw: cache},
            **extra,
        )
        cache, logits = _cache_of(out), out.logits[:, -1]
        next_pos = next_pos + 1
    return new.cpu().numpy()


def decode(
    model,
    prompts: Sequence[Sequence[int]],
    max_new_tokens: int,
    *,
    batch_size: int = 32,
    pad_id: int = 0,
    top_k: int | None = None,
    temperature: float = 1.0,
    seed: int = 0,
    progress: Progress = None,
) -> np.ndarray:
    """Greedy (top_k=None) or top-k sampled continuations, (n, max_new_tokens) int64.

    Prompts of similar length share a batch (length-sorted), left-padded, with the KV cache.
    """
    if not prompts:
        return np.zeros((0, max_new_tokens), dtype=np.int64)
    if any(len(p) == 0 for p in prompts):
        raise ValueError("every prompt needs at least one token (use the BOS/EOS token)")
    gen = torch.Generator().manual_seed(seed)
    lengths = np.array([len(p) for p in prompts])
    order = np.argsort(-lengths, kind="stable")
    out = np.zeros((len(prompts), max_new_tokens), dtype=np.int64)
    done = 0
    for idx in _batches(order, batch_size):
        out[idx] = _decode_batch(
            model, [prompts[i] for i in idx], max_new_tokens, pad_id, top_k, temperature, gen
        )
        done += len(idx)
        if progress:
            progress(done, len(prompts), {})
    return out


def load_causal_lm(path: str, *, device: str = "cpu", dtype: str = "auto"):
    """AutoModelForCausalLM in eval mode on `device`; dtype auto = bf16 on CUDA, fp32 on CPU."""
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # the CLI shows its own progress
    if dtype == "auto":
        dtype = "bfloat16" if str(device).startswith("cuda") else "float32"
    torch_dtype = {
        "float32": torch.float32,
        "bfloat16": torch.bfloat16,
        "float16": torch.float16,
    }.get(dtype)
    if torch_dtype is None:
        raise ValueError(f"--dtype '{dtype}' is not one of auto, float32, bfloat16, float16")
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch_dtype)
    return model.to(device).eval()


def resolve_device(device: str) -> str:
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(
            f"--device '{device}' asked for CUDA but none is available; use --device cpu"
        )
    return device
