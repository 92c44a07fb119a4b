"""Batched per-token log-probabilities and KV-cache batched decoding for any HF causal LM.

Sequences are sorted by length before batching so padding is minimal; scoring pads on the right
(causal attention keeps the real tokens exact), decoding pads on the left and carries explicit
position ids so every row continues from its own last token.
"""

from __future__ import annotations

import contextlib
import copy
import inspect
import math
import os
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np
import torch

from memaudit.errors import MemauditError
from memaudit.probes.token_scores import TokenScores

Progress = Callable[[int, int, dict], None] | None


# `batch_size` counts sequences of this many tokens: a scoring batch holds at most
# batch_size * BUDGET_SEQ_LEN tokens, padding included (exposure candidates are ~15 tokens long,
# so they are batched more densely).
BUDGET_SEQ_LEN = 128
# On CPU a batch gets slower per token once its logits and activations fall out of the caches
# (tiny and small presets on a 2-core CPU: fastest at ~1k tokens, 1.2-1.5x slower per token at
# 4-8k), so the CPU budget is capped here whatever the batch size.
CPU_MAX_BATCH_TOKENS = 1024
# The log-softmax runs over this many logits at a time into reused buffers (1 MiB of fp32 on
# CPU), so no (batch, width, vocab) copy is made beyond the model's own logits.
CPU_CHUNK_LOGITS = 1 << 18
ACCEL_CHUNK_LOGITS = 1 << 26
# Greedy decoding on the CPU takes at least this many prompts a batch, as long as a batch's
# prompts and new tokens stay within CPU_DECODE_TOKENS: one decoding step costs about as much for
# 128 rows as for 32 (the tiny preset, 256 prompts of 33 tokens, 50 new, one thread: 2.1 against
# 3.6 CPU seconds, the same tokens). Sampled decoding keeps `batch_size` rows: its draws depend on
# how the prompts are batched, and the same seed gives the same samples.
CPU_DECODE_ROWS = 128
CPU_DECODE_TOKENS = 1 << 14


def _batches(order: np.ndarray, batch_size: int):
    """Consecutive slices of `order` of `batch_size` items."""
    for i in range(0, len(order), batch_size):
        yield order[i : i + batch_size]


def _token_batches(order: np.ndarray, lengths: np.ndarray, max_tokens: int):
    """Consecutive slices of `order` (sorted by decreasing length), rows * width <= max_tokens.

    A sequence longer than max_tokens gets a batch of its own.
    """
    i = 0
    while i < len(order):
        width = int(lengths[order[i]])  # the longest in this batch (sorted order)
        rows = max(1, max_tokens // width)
        yield order[i : i + rows]
        i += rows


def _next_token_stats(
    logits: torch.Tensor, targets: torch.Tensor, *, with_stats: bool, chunk: int
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """log p(target), and the mean and std of log p(v) under v ~ p, for each row of logits.

    logits: (rows, vocab) in any float dtype; targets: (rows,). Returns fp32 (rows,) tensors.
    Rows are processed about `chunk` logits at a time in reused (step, vocab) buffers.
    Without stats only log p(target) = logit - logsumexp is needed, but torch's CPU logsumexp
    writes two temporaries of the row's size where its fused log_softmax writes one (measured
    1.6x slower at vocabulary 4,096), so both go through log_softmax.
    """
    n, vocab = logits.shape
    step = max(1, chunk // vocab)
    buf = torch.empty((min(step, n), vocab), dtype=torch.float32, device=logits.device)
    pbuf, prod = (torch.empty_like(buf), torch.empty_like(buf)) if with_stats else (None, None)
    tok = torch.empty(n, dtype=torch.float32, device=logits.device)
    mu = torch.empty_like(tok) if with_stats else None
    sd = torch.empty_like(tok) if with_stats else None
    for j in range(0, n, step):
        k = min(step, n - j)
        lsm = torch.log_softmax(logits[j : j + k].float(), -1, out=buf[:k])
        tok[j : j + k] = lsm.gather(-1, targets[j : j + k, None]).squeeze(-1)
        if with_stats:
            p = torch.exp(lsm, out=pbuf[:k])
            m = torch.mul(p, lsm, out=prod[:k]).sum(-1)
            mu[j : j + k] = m
            # centred second moment: E[(l - mu)^2] keeps fp32 precision where E[l^2] - mu^2 doesn't
            lsm.sub_(m[:, None]).square_()
            sd[j : j + k] = torch.mul(p, lsm, out=prod[:k]).sum(-1).clamp_min_(1e-12).sqrt_()
    return tok, mu, sd


def _score_batch(
    model, seqs: list, lengths: np.ndarray, *, device: torch.device, with_stats: bool, chunk: int
):
    """Per-token log p (and mu, sigma) of one right-padded batch, as lists of float64 arrays."""
    rows, width = len(seqs), int(lengths.max())
    real = np.arange(width) < lengths[:, None]  # (rows, width)
    ids = np.zeros((rows, width), dtype=np.int64)
    ids[real] = np.concatenate([np.asarray(s, dtype=np.int64) for s in seqs])
    ids_t = torch.from_numpy(ids).to(device)
    mask = torch.from_numpy(real.astype(np.int64)).to(device)
    logits = model(input_ids=ids_t, attention_mask=mask, use_cache=False).logits
    # position t predicts token t+1; the last column's target (wrapped round) is never kept
    targets = torch.roll(ids_t, -1, dims=1).reshape(-1)
    stats = _next_token_stats(
        logits.reshape(rows * width, -1), targets, with_stats=with_stats, chunk=chunk
    )
    scored = (np.arange(width) < (lengths - 1)[:, None]).reshape(-1)
    cuts = np.cumsum(lengths - 1)[:-1]
    return [
        None if x is None else np.split(x.cpu().numpy()[scored].astype(np.float64), cuts)
        for x in stats
    ]


@torch.inference_mode()
def token_logprobs(
    model,
    seqs: Sequence[Sequence[int]],
    *,
    batch_size: int = 32,
    with_stats: bool = False,
    progress: Progress = None,
) -> TokenScores:
    """Score many token sequences in length-sorted, right-padded batches under a token budget.

    Results come back in the input order. Batches hold at most batch_size * BUDGET_SEQ_LEN
    tokens (CPU_MAX_BATCH_TOKENS on CPU); mu and sigma are only computed when with_stats.
    A `memaudit.probes.jax_scoring.JaxLM` scores with its own (JAX) engine.
    """
    if getattr(model, "is_jax", False):
        return model.token_logprobs(seqs, batch_size=batch_size, with_stats=with_stats,
                                    progress=progress)
    device = next(model.parameters()).device
    n = len(seqs)
    lengths = np.array([len(s) for s in seqs], dtype=np.int64)
    if n and lengths.min() < 2:
        raise ValueError("every scored sequence needs at least 2 tokens")
    max_tokens = batch_size * BUDGET_SEQ_LEN
    chunk = ACCEL_CHUNK_LOGITS
    if device.type == "cpu":
        max_tokens, chunk = min(max_tokens, CPU_MAX_BATCH_TOKENS), CPU_CHUNK_LOGITS
    order = np.argsort(-lengths, kind="stable")
    out: list[list] = [[None] * n for _ in range(3)]  # logp, mu, sigma
    done = 0
    for idx in _token_batches(order, lengths, max_tokens):
        parts = _score_batch(
            model, [seqs[i] for i in idx], lengths[idx], device=device, with_stats=with_stats,
            chunk=chunk,
        )
        for dest, part in zip(out, parts, strict=True):
            if part is not None:
                for i, x in zip(idx, part, strict=True):
                    dest[i] = x
        done += len(idx)
        if progress:
            progress(done, n, {})
    logp, mu, sigma = out
    return TokenScores(
        logp=logp, mu=mu if with_stats else None, sigma=sigma if with_stats else None
    )


def strided_windows(n: int, window: int, stride: int) -> list[tuple[int, int, int]]:
    """The windows that score a sequence of n tokens, every token once (Hugging Face's strided
    perplexity).

    Windows of `window` tokens start every `stride` tokens; each scores only the tokens no earlier
    window reached, which sit at its end, so each token is scored with the most left context the
    windows give (at least window - stride tokens once past the first window).

    Returns:
        (begin, end, kept) per window: ids[begin:end] is scored and the last `kept` of its
        end - begin - 1 log-probabilities are kept; the kept counts add up to n - 1.

    References:
        Hugging Face Transformers docs, "Perplexity of fixed-length models" (sliding window).

    >>> strided_windows(10, 4, 2)
    [(0, 4, 3), (2, 6, 2), (4, 8, 2), (6, 10, 2)]
    >>> strided_windows(3, 4, 2)
    [(0, 3, 2)]
    """
    if not 0 < stride < window:
        raise ValueError(f"the window stride must lie in 1..{window - 1} (the window is {window} "
                         f"tokens), got {stride}; pass a smaller --window-stride")
    out, prev = [], 0
    for begin in range(0, max(n, 1), stride):
        end = min(begin + window, n)
        out.append((begin, end, end - prev - (begin == 0)))
        prev = end
        if end >= n:
            break
    return out


def windowed_logprobs(
    model,
    seqs: Sequence[Sequence[int]],
    *,
    window: int,
    stride: int | None = None,
    batch_size: int = 32,
    with_stats: bool = False,
    progress: Progress = None,
) -> TokenScores:
    """`token_logprobs` for sequences of any length: those longer than `window` are scored in
    strided windows (`strided_windows`, stride default window // 2), so every token after the
    first is scored once and the arrays have len(seq) - 1 entries as for a short sequence.

    All windows of all sequences share the length-sorted batches of one `token_logprobs` call.
    """
    stride = max(1, window // 2) if stride is None else stride
    pieces: list[Sequence[int]] = []
    plan: list[tuple[int, list[int]]] = []  # per sequence: its first window, kept counts
    for s in seqs:
        wins = strided_windows(len(s), window, stride)
        plan.append((len(pieces), [k for _b, _e, k in wins]))
        pieces += [s[b:e] for b, e, _k in wins]
    ts = token_logprobs(model, pieces, batch_size=batch_size, with_stats=with_stats,
                        progress=progress)

    def stitch(parts: list[np.ndarray] | None) -> list[np.ndarray] | None:
        if parts is None:
            return None
        return [np.concatenate([parts[i0 + j][len(parts[i0 + j]) - k:]
                                for j, k in enumerate(kept)]) for i0, kept in plan]

    return TokenScores(logp=stitch(ts.logp), mu=stitch(ts.mu), sigma=stitch(ts.sigma))


def _common_prefix(seqs: Sequence[Sequence[int]], cap: int) -> int:
    """How many leading ids every sequence shares, at most `cap`.

    >>> _common_prefix([[1, 2, 3], [1, 2, 4, 5]], 9), _common_prefix([[1, 2, 3], [1, 2, 3]], 2)
    (2, 2)
    """
    first = np.asarray(seqs[0][:cap])
    n = len(first)
    for s in seqs[1:]:
        head = np.asarray(s[:n])
        diff = np.flatnonzero(head != first[: len(head)])
        n = min(n, len(head), int(diff[0]) if len(diff) else n)
        if n == 0:
            break
    return n


@torch.inference_mode()
def shared_prefix_nll(
    model,
    seqs: Sequence[Sequence[int]],
    *,
    start: int = 1,
    batch_size: int = 32,
    progress: Progress = None,
) -> np.ndarray:
    """Summed NLL (nats) of each sequence's tokens at positions >= `start`, their longest common
    token prefix run once: -token_logprobs(seqs).logp[i][start - 1:].sum(), to float rounding.

    Exposure's candidates (one template, other secrets) and PII's decoys (one context, other
    values) differ only after a shared prefix; its keys and values are computed once and copied to
    every row of a batch of suffixes, so only the suffixes go through the model (a suffix's last
    token is only a target). A model whose cache cannot be copied across rows, or sequences with
    fewer than 2 shared tokens, are scored whole by `token_logprobs`.
    A `memaudit.probes.jax_scoring.JaxLM` (start 1) runs its own shared-prefix kernel.
    """
    if getattr(model, "is_jax", False) and start == 1:
        return model.shared_prefix_nll(seqs, progress=progress)
    if len(seqs) == 0:
        return np.zeros(0)
    return grouped_prefix_nll(model, [seqs], [start], batch_size=batch_size, progress=progress)[0]


def _check_group(seqs: Sequence[Sequence[int]], start: int) -> int:
    """The longest common prefix of one group that leaves a token after it, refused in one line
    when a sequence is shorter than 2 tokens or `start` lies outside 1..shortest - 1."""
    lengths = [len(s) for s in seqs]
    if min(lengths) < 2:
        raise ValueError("every scored sequence needs at least 2 tokens")
    if not 1 <= start < min(lengths):
        raise ValueError(f"start must lie in 1..{min(lengths) - 1}, got {start}")
    return _common_prefix(seqs, min(lengths) - 1)


@torch.inference_mode()
def grouped_prefix_nll(
    model,
    groups: Sequence[Sequence[Sequence[int]]],
    starts: Sequence[int],
    *,
    batch_size: int = 32,
    progress: Progress = None,
) -> list[np.ndarray]:
    """`shared_prefix_nll(model, groups[g], start=starts[g])` of every group, many groups a
    forward pass: PII's items (one context and ten values each) share batches instead of paying
    two forward passes an item.

    The prefixes of several groups run as one right-padded batch (a causal model's real tokens
    never see the padding after them); each suffix row then gets its own group's keys and values
    (the cache's rows selected per row) with an attention mask that hides the padding between its
    prefix and its suffix, and position ids that continue its own prefix. Groups whose sequences
    share fewer than 2 tokens, every group on a model whose cache cannot be selected by rows, and
    a JaxLM, are scored whole by `token_logprobs`. `progress(done, total, {})` counts sequences.
    """
    lcp = [_check_group(g, s) if len(g) else 0 for g, s in zip(groups, starts, strict=True)]
    out: list[np.ndarray] = [np.zeros(len(g)) for g in groups]
    total = sum(len(g) for g in groups)
    done = [0]

    def tick(k: int):
        done[0] += k
        if progress:
            progress(done[0], total, {})

    is_jax = getattr(model, "is_jax", False)
    whole = [k for k, g in enumerate(groups) if len(g) and (lcp[k] < 2 or is_jax)]
    skip = set(whole)
    todo = sorted((k for k, g in enumerate(groups) if len(g) and k not in skip), key=lambda k: -lcp[k])
    device = None if is_jax else next(model.parameters()).device
    max_tokens = batch_size * BUDGET_SEQ_LEN
    chunk = ACCEL_CHUNK_LOGITS
    if device is not None and device.type == "cpu":
        max_tokens, chunk = min(max_tokens, CPU_MAX_BATCH_TOKENS), CPU_CHUNK_LOGITS
    i = 0
    while i < len(todo):  # the longest prefixes first: each batch of prefixes is padded little
        part = todo[i : i + max(1, max_tokens // lcp[todo[i]])]
        if not _prefix_batch(model, [groups[k] for k in part], [starts[k] for k in part],
                             [lcp[k] for k in part], [out[k] for k in part], device=device,
                             max_tokens=max_tokens, chunk=chunk, tick=tick):
            whole += todo[i:]  # no cache to select rows of: every sequence scored whole
            break
        i += len(part)
    if whole:
        flat = [s for k in whole for s in groups[k]]
        lp = token_logprobs(model, flat, batch_size=batch_size).logp
        j = 0
        for k in whole:
            out[k] = np.array([-x[starts[k] - 1 :].sum() for x in lp[j : j + len(groups[k])]])
            j += len(groups[k])
        tick(len(flat))
    return out


def _prefix_batch(model, groups, starts, lcp, outs, *, device, max_tokens, chunk, tick) -> bool:
    """`grouped_prefix_nll` of a few groups whose prefixes share one forward pass; fills `outs`
    (one array per group), or returns False (nothing scored) when the model's cache cannot be
    selected by rows."""
    n_groups, width_pre = len(groups), max(lcp)
    pre_real = np.arange(width_pre) < np.array(lcp)[:, None]  # (groups, width_pre)
    pre_ids = np.zeros((n_groups, width_pre), dtype=np.int64)
    for g, s in enumerate(groups):
        pre_ids[g, : lcp[g]] = s[0][: lcp[g]]
    pre = torch.from_numpy(pre_ids).to(device)
    pre_mask = torch.from_numpy(pre_real.astype(np.int64)).to(device)
    res = model(input_ids=pre, attention_mask=pre_mask, use_cache=True)
    cache = _cache_of(res)
    if cache is None or not hasattr(cache, "batch_select_indices"):
        return False
    cache_kw, _keep = _cache_api(model)
    logits = res.logits  # (groups, width_pre, vocab)
    tok, _mu, _sd = _next_token_stats(logits.reshape(n_groups * width_pre, -1),
                                      torch.roll(pre, -1, dims=1).reshape(-1), with_stats=False,
                                      chunk=chunk)
    tok = tok.double().cpu().numpy().reshape(n_groups, width_pre)
    ends = torch.as_tensor(lcp, device=logits.device) - 1
    # log p of the first token after each prefix: the row at its last real position
    last = torch.log_softmax(logits[torch.arange(n_groups), ends].float(), -1).double().cpu().numpy()
    rows = []  # (group, sequence) of every suffix that enters the forward pass
    for g, (seqs, st, n) in enumerate(zip(groups, starts, lcp, strict=True)):
        # positions start..lcp-1 (position p's log p at index p - 1), then the first suffix token
        pre_nll = -tok[g, st - 1 : n - 1].sum()
        first = np.array([s[n] for s in seqs], dtype=np.int64)
        outs[g][:] = pre_nll - (last[g, first] if n >= st else 0.0)
        rows += [(g, r) for r, s in enumerate(seqs) if len(s) - n - 1 > 0]
    tick(sum(len(s) for s in groups) - len(rows))
    n_in = np.array([len(groups[g][r]) - lcp[g] - 1 for g, r in rows], dtype=np.int64)
    order = np.argsort(-n_in, kind="stable")
    j = 0
    while j < len(order):
        width = int(n_in[order[j]])
        idx = order[j : j + max(1, max_tokens // width)]
        j += len(idx)
        grp = np.array([rows[k][0] for k in idx])
        real = np.arange(width) < n_in[idx][:, None]  # (rows, width)
        ids = np.zeros((len(idx), width + 1), dtype=np.int64)  # inputs, then one more target
        for r, k in enumerate(idx):
            g, q = rows[k]
            ids[r, : n_in[k] + 1] = groups[g][q][lcp[g] :]
        ids_t = torch.from_numpy(ids).to(device)
        mask = torch.from_numpy(np.concatenate([pre_real[grp], real], 1).astype(np.int64)).to(device)
        starts_at = np.array(lcp)[grp][:, None]
        pos = torch.from_numpy(starts_at + np.arange(width)).to(device)
        rows_cache = copy.deepcopy(cache)
        rows_cache.batch_select_indices(torch.from_numpy(grp).to(device))
        logits = model(input_ids=ids_t[:, :width], attention_mask=mask, position_ids=pos,
                       use_cache=True, **{cache_kw: rows_cache}).logits  # (rows, width, vocab)
        lp, _mu, _sd = _next_token_stats(logits.reshape(len(idx) * width, -1),
                                         ids_t[:, 1:].reshape(-1), with_stats=False, chunk=chunk)
        # the input at column c sits at position lcp + c and predicts the token at lcp + c + 1
        keep = real & (starts_at + 1 + np.arange(width) >= np.array(starts)[grp][:, None])
        lp = np.where(keep, lp.double().cpu().numpy().reshape(len(idx), width), 0.0).sum(1)
        for r, k in enumerate(idx):
            g, q = rows[k]
            outs[g][q] -= lp[r]
        tick(len(idx))
    return True


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

    Prompts of similar length share a batch (length-sorted), left-padded, with the KV cache;
    greedy decoding on the CPU batches at least CPU_DECODE_ROWS prompts (within CPU_DECODE_TOKENS).
    A `memaudit.probes.jax_scoring.JaxLM` decodes with its own (JAX) engine (its sampled tokens
    come from JAX's generator: the same distribution, other draws).
    """
    if getattr(model, "is_jax", False):
        return model.decode(prompts, max_new_tokens, batch_size=batch_size, pad_id=pad_id,
                            top_k=top_k, temperature=temperature, seed=seed, progress=progress)
    if not prompts:
        return np.zeros((0, max_new_tokens), dtype=np.int64)
    if any(len(p) == 0 for p in prompts):
        raise ValueError("every prompt needs at least one token (use the BOS/EOS token)")
    gen = torch.Generator().manual_seed(seed)
    lengths = np.array([len(p) for p in prompts])
    order = np.argsort(-lengths, kind="stable")
    if top_k is None and next(model.parameters()).device.type == "cpu":
        fits = CPU_DECODE_TOKENS // (int(lengths.max()) + max_new_tokens)
        batch_size = max(batch_size, min(CPU_DECODE_ROWS, fits))
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


THREAD_ENV = ("OMP_NUM_THREADS", "MKL_NUM_THREADS")


def machine_threads() -> int:
    """The CPU cores this process may run on: its affinity mask, capped by a cgroup v2 CPU quota
    (a container limited to 2 CPUs on a 64-core host gets 2, where torch's default would be 64)."""
    try:
        n = len(os.sched_getaffinity(0))
    except AttributeError:  # macOS, Windows: no affinity mask
        n = os.cpu_count() or 1
    try:
        quota, period = Path("/sys/fs/cgroup/cpu.max").read_text().split()[:2]
        if quota != "max":
            n = min(n, max(1, math.ceil(int(quota) / int(period))))
    except (OSError, ValueError):
        pass
    return max(1, n)


@contextlib.contextmanager
def probe_threads():
    """torch's intra-op CPU threads set to `machine_threads()` for the block, unless the user set
    a count (OMP_NUM_THREADS or MKL_NUM_THREADS, as a sweep's workers do); restored after."""
    before = torch.get_num_threads()
    want = None if any(os.environ.get(k) for k in THREAD_ENV) else machine_threads()
    if want is not None and want != before:
        torch.set_num_threads(want)
    try:
        yield
    finally:
        if torch.get_num_threads() != before:
            torch.set_num_threads(before)


def load_causal_lm(path: str, *, device: str = "cpu", dtype: str = "auto"):
    """AutoModelForCausalLM in eval mode on `device`; dtype auto = bf16 on CUDA, fp32 on CPU."""
    # lazy: transformers (~1.3 s) only when called; this module imports without it
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
    try:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch_dtype)
    except (OSError, ValueError, RuntimeError, KeyError) as e:
        raise MemauditError(f"the model in '{path}' cannot be loaded ({type(e).__name__}: its "
                            "config or weights are damaged or not a causal LM); re-run training or "
                            "pass a Hugging Face causal LM directory") from None
    except Exception as e:  # noqa: BLE001 - safetensors' SafetensorError and friends

        raise MemauditError(f"the model weights in '{path}' are damaged ({type(e).__name__}); "
                            "re-run training or restore model/") from None
    return model.to(device).eval()


def resolve_device(device: str) -> str:
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(
            f"--device '{device}' asked for CUDA but none is available; use --device cpu"
        )
    return device
