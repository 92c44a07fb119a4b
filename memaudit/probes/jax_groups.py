"""Exposure's candidates scored in groups that share their first m own tokens: heads and chunks.

Candidates from a small alphabet share their leading secret tokens as well as the canary's text
(10^5 8-digit secrets, one token a digit: 10, 100, 1,000 distinct first 1, 2, 3 digits), so the
plain path (`JaxLM.shared_prefix_nll`: every candidate's every token) recomputes the same keys
and values many times. The trie (`memaudit.probes.jax_trie`) runs each distinct prefix once but
gathers every row's ancestors' keys and values per row and per layer, and on a TPU those gathers
cost what its fewer tokens save. Here the sharing stops at one depth m and the gather is per
chunk of rows, not per row:

1. the canary's common prefix runs once (`jax_scoring.prefix_forward`);
2. the heads, the distinct first m own tokens of the candidates, run as rows after it (attending
   to the prefix and causally to themselves): each head's NLL of its own tokens, its keys and
   values at every layer, and the log-probability of each of its children's token m;
3. the candidates, sorted by head, are cut into chunks of c rows of one head (the last chunk of a
   head padded). A row runs its remaining tokens over [common prefix | its chunk's head | its own
   causal tokens]: the prefix's keys are broadcast over every row, the head's are indexed once
   per chunk, (chunks, m, kv, hd), and broadcast over the chunk's c rows inside the einsum, so
   no key is copied per row.

`plan_groups` picks m and c by the tokens each plan runs (heads x m + chunk slots x remaining
width, against the plain path's rows x its bucket width) and keeps the plain path when no plan
saves `MIN_SAVING`. Candidates with fewer than m + 1 own tokens take the plain path. The sums
are the plain path's (the same log-probabilities, added in float64 on the host).

References:
    Carlini et al. 2019, "The Secret Sharer" (exposure over a candidate space).
    Pope et al. 2022, "Efficiently Scaling Transformer Inference" (KV cache, prefix sharing).
    Juravsky et al. 2024, "Hydragen" (attention over a shared prefix split from the rows' own).

>>> import itertools  # 10^4 4-digit secrets: 1,000 heads of 3 digits score the 4th (no chunks)
>>> own = np.array(list(itertools.product(range(10), repeat=4)))
>>> plan = plan_groups(own, np.full(len(own), 4))
>>> plan.m, plan.heads.shape, plan.forward_tokens, plan.flat_forward_tokens
(3, (1000, 3), 3000, 80000)
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from memaudit.probes import jax_scoring as js
from memaudit.probes.jax_trie import MAX_CACHE_BYTES, packed_rows, pow2

CHUNKS = (64, 32, 16, 8)  # rows per chunk the planner tries (ties go to the larger)
MIN_SAVING = 0.1  # the grouped plan runs when it saves at least this share of the plain tokens


@dataclasses.dataclass(frozen=True)
class GroupPlan:
    """Heads, chunks and where each candidate's log-probabilities land (m = 0: the plain path).

    Candidate arrays are over the distinct candidates (`inv` maps each input row to its distinct
    one). heads (h, m): the head tokens; children (h, C): each head's distinct tokens m, padded;
    head_of, child_of (d,): each distinct candidate's head and the column of its token m in
    children (-1: scored by the plain path); chunk_head (k,): each chunk's head; row_ids
    (k * c, r + 1): each slot's remaining tokens (inputs 0..r-1, targets 1..r), row_n (k * c,):
    its inputs (0: a padded slot); row_of (d,): each distinct candidate's slot (-1: none).
    """

    m: int
    c: int
    heads: np.ndarray
    children: np.ndarray
    chunk_head: np.ndarray
    row_ids: np.ndarray
    row_n: np.ndarray
    inv: np.ndarray
    head_of: np.ndarray
    child_of: np.ndarray
    row_of: np.ndarray
    forward_tokens: int  # padded tokens through the model after the common prefix: this plan
    flat_forward_tokens: int  # the same for the plain path (every row at its bucket width)


def _flat_tokens(n_tok: np.ndarray) -> int:
    """The plain path's forward tokens: every row at the bucket width of the longest."""
    if not len(n_tok):
        return 0
    return len(n_tok) * js.bucket_width(max(1, int(n_tok.max()) - 1))


def _sorted_distinct(suffix: np.ndarray, n_tok: np.ndarray):
    """Distinct candidates in lexicographic order: (tokens with -1 past the end, own-token
    counts, group (d, w): rows equal in their first j + 1 tokens share group[:, j], inv)."""
    w = suffix.shape[1]
    key = np.where(np.arange(w) < n_tok[:, None], suffix, -1).astype(np.int64)
    _, first, inv = np.unique(packed_rows(key), return_index=True, return_inverse=True)
    s = key[first]
    step = np.zeros(s.shape, bool)
    step[1:] = np.logical_or.accumulate(s[1:] != s[:-1], axis=1)
    return s, n_tok[first], np.cumsum(step, axis=0), inv.reshape(-1)


def _heads(group: np.ndarray, n_d: np.ndarray, m: int):
    """Distinct candidates with more than m own tokens (act) and each one's head index."""
    act = np.flatnonzero(n_d > m)
    new = np.r_[True, group[act[1:], m - 1] != group[act[:-1], m - 1]] if len(act) else act
    return act, np.cumsum(new) - 1


def _costs(group, n_d, n_tok, m: int, chunks, max_head_tokens: int | None) -> dict[int, int]:
    """Forward tokens of plan (m, c) for each c of `chunks` (none: no candidate is deeper than
    m, or its heads' keys and values do not fit)."""
    act, head = _heads(group, n_d, m)
    if not len(act):
        return {}
    rem = n_d[act] - 1 - m  # inputs after the head
    r = int(rem.max())
    h = int(head[-1]) + 1
    if r and max_head_tokens is not None and h * m > max_head_tokens:
        return {}
    fixed = h * m + _flat_tokens(n_tok[n_tok <= m])
    if not r:
        return dict.fromkeys(chunks, fixed)
    rows = np.bincount(head[rem > 0], minlength=h)  # each head's rows below it
    return {c: fixed + int(np.sum(-(-rows // c))) * c * r for c in chunks}


def plan_groups(suffix: np.ndarray, n_tok: np.ndarray, *, depths=None, chunks=CHUNKS,
                min_saving: float = MIN_SAVING, max_head_tokens: int | None = None) -> GroupPlan:
    """The cheapest (m, c) for candidates' own tokens after their common prefix.

    suffix: (n, w) right-padded own tokens; n_tok (n,): how many (>= 1). depths: the head
    depths to try (default every one some candidate can take); chunks: the chunk heights;
    max_head_tokens: heads x m whose keys and values fit the cache. m = 0 when no plan saves
    `min_saving` of the plain path's tokens.
    """
    n_tok = np.asarray(n_tok, np.int64)
    flat = _flat_tokens(n_tok)
    s, n_d, group, inv = _sorted_distinct(np.asarray(suffix), n_tok)
    depths = range(1, int(n_d.max(initial=1))) if depths is None else depths
    best, pick = (1 - min_saving) * flat, (0, 0)
    for m in depths:
        for c, cost in _costs(group, n_d, n_tok, m, chunks, max_head_tokens).items():
            if cost < best - 1e-9:
                best, pick = cost, (m, c)
    return _build(s, n_d, group, inv, *pick, n_tok=n_tok, flat=flat)


def _build(s, n_d, group, inv, m: int, c: int, *, n_tok, flat: int) -> GroupPlan:
    d = len(s)
    none = np.full(d, -1, np.int64)
    if m == 0:
        z = np.zeros((0, 0), np.int32)
        return GroupPlan(m=0, c=0, heads=z, children=z, chunk_head=np.zeros(0, np.int32),
                         row_ids=z, row_n=np.zeros(0, np.int32), inv=inv, head_of=none,
                         child_of=none, row_of=none, forward_tokens=flat,
                         flat_forward_tokens=flat)
    act, head = _heads(group, n_d, m)
    first = np.flatnonzero(np.r_[True, head[1:] != head[:-1]])
    pnew = np.r_[True, group[act[1:], m] != group[act[:-1], m]]  # children: distinct token m
    pair = np.cumsum(pnew) - 1
    slot = pair - pair[first][head]
    children = np.zeros((len(first), pow2(int(slot.max()) + 1)), np.int32)
    children[head, slot] = s[act, m]
    head_of, child_of, row_of = none.copy(), none.copy(), none.copy()
    head_of[act], child_of[act] = head, slot
    rem = n_d[act] - 1 - m
    r = int(rem.max())
    deep = act[rem > 0]  # sorted by head: a head's rows are contiguous
    dh = head[rem > 0]
    count = np.bincount(dh, minlength=len(first))
    per = -(-count // c)  # chunks per head
    start = np.cumsum(per) - per  # each head's first chunk
    rank = np.arange(len(deep)) - (np.cumsum(count) - count)[dh]
    row_of[deep] = start[dh] * c + rank
    row_ids = np.zeros((int(per.sum()) * c, r + 1), np.int32)
    row_n = np.zeros(len(row_ids), np.int32)
    if r:
        row_ids[row_of[deep]] = np.maximum(s[deep, m : m + r + 1], 0)
        row_n[row_of[deep]] = n_d[deep] - 1 - m
    fwd = len(first) * m + len(row_ids) * r + _flat_tokens(n_tok[n_tok <= m])
    return GroupPlan(m=m, c=c, heads=s[act[first], :m].astype(np.int32), children=children,
                     chunk_head=np.repeat(np.arange(len(first)), per).astype(np.int32),
                     row_ids=row_ids, row_n=row_n, inv=inv, head_of=head_of, child_of=child_of,
                     row_of=row_of, forward_tokens=fwd, flat_forward_tokens=flat)


def grouped_nll(lm: js.JaxLM, seqs, *, plan: GroupPlan | None = None,
                max_cache_bytes: int = MAX_CACHE_BYTES, progress: js.Progress = None) -> np.ndarray:
    """`lm.shared_prefix_nll(seqs)` over heads and chunks (see the module): the same sums.

    seqs: lists of token ids or an (n, length) integer array. Returns the summed NLL (nats) of
    every token after the first of each sequence. plan: `plan_groups` of the candidates' own
    tokens after their common prefix (default: planned here).
    """
    arr, lengths, lcp = js.scored_candidates(seqs)
    n = len(lengths)
    if n == 0:
        return np.zeros(0)
    sh = lm.shape
    if lcp >= 1 and plan is None:
        plan = plan_groups(arr[:, lcp:], lengths - lcp,
                           max_head_tokens=max_cache_bytes // lm.kv_bytes_per_token)
    if lcp < 1 or plan.m == 0:
        return lm.shared_prefix_nll(seqs, progress=progress)
    out = np.empty(n)
    short = np.flatnonzero(lengths - lcp <= plan.m)  # too few own tokens for a head: plain
    total = max(1, plan.forward_tokens)
    done = _flat_tokens(lengths[short] - lcp)
    if len(short):
        out[short] = lm.shared_prefix_nll([arr[i, : lengths[i]] for i in short])
        _report(progress, done, total, n)
    pids = np.zeros((1, js.bucket_width(lcp)), np.int32)
    pids[0, :lcp] = arr[0, :lcp]
    pre_nll, pk, pv, last = js.prefix_forward(lm.params, pids, np.int32(lcp), shape=sh)
    head_nll, child, hk, hv = _run_heads(lm, pk, pv, last, lcp, plan, keep=len(plan.row_ids) > 0)
    done = _report(progress, done + plan.heads.size, total, n)
    row_nll = _run_chunks(lm, pk, pv, hk, hv, lcp, plan, progress, done, total, n)
    row_nll = np.r_[row_nll, 0.0]  # row_of -1 (no tokens after the head's) reads this 0
    grouped = plan.head_of >= 0
    h, k, r = plan.head_of[grouped], plan.child_of[grouped], plan.row_of[grouped]
    dist = np.zeros(len(plan.head_of))
    dist[grouped] = float(pre_nll) + head_nll[h] - child[h, k] + row_nll[r]
    long = np.ones(n, bool)
    long[short] = False
    out[long] = dist[plan.inv[long]]
    if progress:
        progress(n, n, {})
    return out


def _report(progress, done: int, total: int, n: int) -> int:
    """Progress in candidates, as the share of the plan's forward tokens run so far."""
    if progress:
        progress(min(n, n * done // total), n, {})
    return done


def _run_heads(lm, pk, pv, last, lcp: int, plan: GroupPlan, *, keep: bool):
    """The heads in batches: NLL (h,) and children's log p (h, C) on the host (float64), keys
    and values (layers, h_padded, m, kv, hd) on the device (None without keep)."""
    h, m = plan.heads.shape
    rows = max(1, min(pow2(h), lm.max_tokens // m))
    parts = []
    for i in range(0, h, rows):
        ids = np.zeros((rows, m), np.int32)
        tg = np.zeros((rows, plan.children.shape[1]), np.int32)
        ids[: min(rows, h - i)] = plan.heads[i : i + rows]
        tg[: min(rows, h - i)] = plan.children[i : i + rows]
        parts.append(_head_step(lm.params, pk, pv, last, np.int32(lcp), ids, tg,
                                shape=lm.shape, keep=keep))
    nll = np.concatenate([np.asarray(p[0], np.float64) for p in parts])[:h]
    child = np.concatenate([np.asarray(p[1], np.float64) for p in parts])[:h]
    if not keep:
        return nll, child, None, None
    return (nll, child, jnp.concatenate([p[2] for p in parts], axis=1),
            jnp.concatenate([p[3] for p in parts], axis=1))


def _run_chunks(lm, pk, pv, hk, hv, lcp, plan: GroupPlan, progress, done, total, n) -> np.ndarray:
    """Every chunk slot's NLL of its remaining tokens (k * c,), float64; batches of B chunks,
    each batch dispatched before the previous one is read back."""
    k, c = len(plan.chunk_head), plan.c
    if not k:
        return np.zeros(0)
    r = plan.row_ids.shape[1] - 1
    per = max(1, min(pow2(k), lm.max_tokens // (c * r)))  # chunks a batch
    out = np.empty(k * c)
    pending = []

    def collect(item, done):
        first, count, nll = item
        out[first * c : (first + count) * c] = np.asarray(nll, np.float64)[: count * c]
        return _report(progress, done + count * c * r, total, n)

    for i in range(0, k, per):
        count = min(per, k - i)
        heads = np.zeros(per, np.int32)
        heads[:count] = plan.chunk_head[i : i + count]
        ids = np.zeros((per * c, r + 1), np.int32)
        n_in = np.zeros(per * c, np.int32)
        ids[: count * c] = plan.row_ids[i * c : (i + count) * c]
        n_in[: count * c] = plan.row_n[i * c : (i + count) * c]
        pending.append((i, count, _chunk_step(lm.params, pk, pv, hk, hv, np.int32(lcp), heads,
                                              ids, n_in, shape=lm.shape, c=c)))
        if len(pending) > 1:
            done = collect(pending.pop(0), done)
    for item in pending:
        done = collect(item, done)
    return out


@functools.partial(jax.jit, static_argnames=("shape", "keep"))
def _head_step(p, pk, pv, last, n, ids, children, *, shape: js.Shape, keep: bool):
    """Heads (rows, m) after a common prefix of n tokens (keys and values pk, pv (layers,
    pwidth, kv, hd), last log-softmax `last` (vocab,)).

    Returns each head's NLL of its m tokens (rows,), log p of each of children (rows, C) after
    it, and with keep its keys and values (layers, rows, m, kv, hd).
    """
    x, kv = js.after_prefix(p, pk, pv, n, ids, shape=shape, keep=keep)
    logits = js.lm_logits(p, x, shape)  # (rows, m, vocab) fp32
    lse = jax.nn.logsumexp(logits, axis=-1)
    own = jnp.take_along_axis(logits[:, :-1], ids[:, 1:, None], axis=-1)[..., 0] - lse[:, :-1]
    nll = -(last[ids[:, 0]] + jnp.sum(own, axis=-1))
    child = jnp.take_along_axis(logits[:, -1], children, axis=-1) - lse[:, -1:]
    return nll, child, *(kv if keep else (None, None))


@functools.partial(jax.jit, static_argnames=("shape", "c"))
def _chunk_step(p, pk, pv, hk, hv, n, chunk_head, ids, n_in, *, shape: js.Shape, c: int):
    """Chunks of c rows after a common prefix of n tokens and a head of m.

    hk, hv (layers, heads, m, kv, hd): the heads' keys and values; chunk_head (B,): each chunk's
    head; ids (B * c, r + 1): each row's remaining tokens (inputs 0..r-1 at positions
    n + m + 0..r-1, targets 1..r); n_in (B * c,): its inputs. Returns each row's NLL (B * c,).
    """
    inputs, targets = ids[:, :-1], ids[:, 1:]
    rows, s = inputs.shape
    m = hk.shape[2]
    pos = jnp.broadcast_to(n + m + jnp.arange(s), (rows, s))
    allowed = js.prefix_then_causal(pk.shape[1], n, s)  # the head's m keys: always allowed
    allowed = jnp.concatenate([allowed[:, : pk.shape[1]], jnp.ones((s, m), bool),
                               allowed[:, pk.shape[1] :]], axis=-1)
    x = p["embed"][inputs]

    def layer(x, xs):
        lp, kp, vp, lk, lv = xs
        h = js.rms_norm(x, lp["in_norm"], shape.eps)
        q, k, v = js.qkv(lp, h, pos, shape)
        x = _attend_chunks(lp, x, q, (kp, lk[chunk_head], k), (vp, lv[chunk_head], v), allowed,
                           shape, c)
        return js.mlp_block(lp, x, shape), None

    x, _ = jax.lax.scan(layer, x, (p["layers"], pk, pv, hk, hv))
    tok = js.token_logp(js.lm_logits(p, x, shape), targets)  # (rows, s)
    return -jnp.sum(jnp.where(jnp.arange(s)[None] < n_in[:, None], tok, 0.0), axis=-1)


# einsum specs per key part: b chunk, c row in it, s query, k kv head, g group, d head dim,
# t key. The prefix is shared by every row, the head by the rows of a chunk, the own per row.
_SCORE = ("bcskgd,tkd->bckgst", "bcskgd,btkd->bckgst", "bcskgd,bctkd->bckgst")
_VALUE = ("bckgst,tkd->bcskgd", "bckgst,btkd->bcskgd", "bckgst,bctkd->bcskgd")


def _attend_chunks(lp, x, q, keys, values, allowed, shape: js.Shape, c: int):
    """x + o_proj(attention) over [prefix | chunk's head | own causal] keys, one softmax.

    q (B * c, s, heads, hd); keys, values: prefix (t, kv, hd), head (B, m, kv, hd), own
    (B * c, s, kv, hd); allowed (s, t + m + s). Each part keeps its broadcast (no copy per row).
    """
    rows, s = q.shape[:2]
    b, nkv, hd = rows // c, shape.kv_heads, shape.head_dim
    q = q.reshape(b, c, s, nkv, shape.heads // nkv, hd)  # (chunks, rows, seq, kv, group, hd)
    own_k, own_v = (a.reshape(b, c, s, nkv, hd) for a in (keys[2], values[2]))
    parts = [jnp.einsum(spec, q, k, preferred_element_type=jnp.float32)
             for spec, k in zip(_SCORE, (keys[0], keys[1], own_k), strict=True)]
    widths = [a.shape[-1] for a in parts]
    scores = jnp.concatenate(parts, axis=-1) / np.float32(np.sqrt(hd))  # (b, c, kv, g, s, T)
    probs = jax.nn.softmax(jnp.where(allowed, scores, js.NEG), axis=-1).astype(q.dtype)
    cuts = np.cumsum(widths)[:-1].tolist()
    out = sum(jnp.einsum(spec, pr, v, preferred_element_type=jnp.float32)
              for spec, pr, v in zip(_VALUE, jnp.split(probs, cuts, axis=-1),
                                     (values[0], values[1], own_v), strict=True))
    return x + out.astype(x.dtype).reshape(rows, s, shape.heads * hd) @ lp["o"]
