"""Exposure's candidates scored over the trie of their tokens: each distinct token prefix once.

Candidates drawn from a small alphabet share their leading secret tokens as well as the canary's
text: 10^5 8-digit secrets (one token a digit, memaudit's tokenizer) have 10, 100, 1,000, 10^4 and
about 63,000 distinct prefixes of 1..5 digits, so most of the forward pass of the plain path
(`JaxLM.shared_prefix_nll`: every candidate's every token) recomputes the same keys and values.
Here the canary's common prefix runs once (as there), then the candidates' own tokens level by
level: depth d runs one row per distinct d-token prefix (a single token attending to the common
prefix, its d - 1 ancestors' cached keys and values, and itself) and scores every child token of
that prefix from the same logits. A level is run while its distinct prefixes are at most
`SHARE` of the distinct candidates still that deep and the cached keys and values fit
`max_cache_bytes`; below the last level each distinct candidate runs its remaining tokens as one
row over [common prefix | its ancestors | its own causal tokens]. With no sharing there are no
levels and this is the plain path. The sums are the same as the plain path's (the same
log-probabilities, added in float64 on the host).

References:
    Carlini et al. 2019, "The Secret Sharer" (exposure over a candidate space).
    Pope et al. 2022, "Efficiently Scaling Transformer Inference" (KV cache, prefix sharing).
    Miao et al. 2024, "SpecInfer" (a token tree scored with ancestor-only attention).

>>> import numpy as np
>>> s = np.array([[1, 2, 3], [1, 2, 4], [1, 5, 6]])
>>> plan = plan_trie(s, np.array([3, 3, 3]))
>>> [len(lv.tokens) for lv in plan.levels], plan.forward_tokens, plan.plain_forward_tokens
([1, 2], 3, 6)
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from memaudit.probes import jax_scoring as js

SHARE = 0.9  # run a level while its distinct prefixes are at most this share of the rows it saves
MAX_CACHE_BYTES = 4 << 30  # the levels' cached keys and values, all layers


def pow2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


@dataclasses.dataclass(frozen=True)
class Level:
    """Depth d of the trie: one row per distinct d-token prefix (a node).

    tokens (nodes,): each node's last token (the one it runs); anc (nodes, d - 1): its ancestors'
    node indices at depths 1..d-1; targets (nodes, C): its child tokens, padded (C a power of 2).
    """

    tokens: np.ndarray
    anc: np.ndarray
    targets: np.ndarray
    keep: bool  # a deeper level or a row reads this level's keys and values


@dataclasses.dataclass(frozen=True)
class TriePlan:
    """The levels, the rows below them, and where each candidate's log-probabilities land.

    rows: the distinct candidates deeper than the last level: anc (r, k), ids (r, t) their
    remaining input tokens, targets (r, t, 1). edges: for each candidate, the flat index of each of
    its scored tokens' log-probability in the concatenation of every level's (nodes x C) output
    and then the rows' (r x t) output; -1 where it has fewer tokens.
    """

    levels: list[Level]
    row_anc: np.ndarray
    row_ids: np.ndarray
    row_targets: np.ndarray
    first: np.ndarray  # (n,) each candidate's first own token (scored by the prefix's last logits)
    edges: np.ndarray  # (n, max inputs)
    forward_tokens: int  # tokens through the model after the common prefix: this plan
    plain_forward_tokens: int  # the same for the plain path (every candidate, every input token)


def plan_trie(suffix: np.ndarray, n_tok: np.ndarray, *, share: float = SHARE,
              max_nodes: int | None = None) -> TriePlan:
    """The trie of candidates' tokens after their common prefix.

    suffix: (n, w) right-padded tokens s_0..s_{m-1} after the common prefix; n_tok (n,): m >= 1.
    A candidate's inputs are s_0..s_{m-2} (its last token is only a target); a node at depth d is
    a distinct (s_0..s_{d-1}) among candidates with at least d inputs. `max_nodes` caps the
    nodes whose keys and values are cached. One lexicographic sort: rows sharing a d-token prefix
    are then contiguous, so every level's nodes and children are running counts.
    """
    n, w = suffix.shape
    n_tok = np.asarray(n_tok, np.int64)
    key = np.where(np.arange(w) < n_tok[:, None], suffix, -1).astype(np.int64)  # -1: no token
    order = np.argsort(packed_rows(key), kind="stable")  # lexicographic (np.lexsort: 4x slower)
    srt = key[order]
    step = np.zeros((n, w), bool)  # the row's first d + 1 tokens differ from the previous row's
    step[1:] = np.logical_or.accumulate(srt[1:] != srt[:-1], axis=1)
    group = np.cumsum(step, axis=0)  # (n, w): rows equal in their first d + 1 tokens share one
    first_rows = np.flatnonzero(np.r_[True, step[1:, -1]])  # one row of each distinct candidate
    inv = np.empty(n, np.int64)
    inv[order] = group[:, -1]
    s, g = srt[first_rows], group[first_rows]  # the distinct candidates, sorted
    m_in = n_tok[order][first_rows] - 1
    node = np.zeros(len(s), np.int64)  # each distinct candidate's node at the current depth
    levels: list[Level] = []
    edge_cols: list[np.ndarray] = []  # per depth: flat output index per distinct candidate, or -1
    offset, d = 0, 1
    while (m_in >= d).any():
        act = np.flatnonzero(m_in >= d)
        new = np.r_[True, g[act[1:], d - 1] != g[act[:-1], d - 1]]
        node_a = np.cumsum(new) - 1
        first = np.flatnonzero(new)
        if len(first) > share * len(act) or (max_nodes is not None
                                             and _cached_nodes(levels) + len(first) > max_nodes):
            break
        pnew = np.r_[True, g[act[1:], d] != g[act[:-1], d]]  # children: distinct (node, s_d)
        pair = np.cumsum(pnew) - 1
        slot = pair - pair[first][node_a]
        width = pow2(int(slot.max()) + 1)
        targets = np.zeros((len(first), width), np.int32)
        targets[node_a, slot] = s[act, d]
        e = np.full(len(s), -1, np.int64)
        e[act] = offset + node_a * width + slot
        edge_cols.append(e)
        offset += len(first) * width
        levels.append(Level(tokens=s[act[first], d - 1].astype(np.int32),
                            anc=_anc_after(levels, node[act[first]], d), targets=targets,
                            keep=True))
        node = np.full(len(s), -1, np.int64)
        node[act] = node_a
        d += 1
    k = len(levels)
    deep = np.flatnonzero(m_in > k)
    if levels:
        levels[-1] = dataclasses.replace(levels[-1], keep=bool(len(deep)))
    t = int((m_in[deep] - k).max()) if len(deep) else 0
    tw = t  # exact: a power of two would pad 3 own tokens to 4
    row_anc = (np.concatenate([levels[-1].anc[node[deep]], node[deep, None]], axis=1)
               if k else np.zeros((len(deep), 0), np.int64))
    row_ids = np.zeros((len(deep), tw), np.int32)
    row_targets = np.zeros((len(deep), tw, 1), np.int32)
    edges = np.full((len(s), int(m_in.max(initial=0))), -1, np.int64)
    for j, e in enumerate(edge_cols):
        edges[:, j] = e
    for j in range(t):
        ok = m_in[deep] - k > j
        row_ids[ok, j] = s[deep[ok], k + j]
        row_targets[ok, j, 0] = s[deep[ok], k + j + 1]
        edges[deep[ok], k + j] = offset + np.flatnonzero(ok) * tw + j
    fwd = sum(len(lv.tokens) for lv in levels) + int(np.maximum(m_in - k, 0).sum())
    return TriePlan(levels=levels, row_anc=row_anc.astype(np.int32), row_ids=row_ids,
                    row_targets=row_targets, first=suffix[:, 0].astype(np.int32),
                    edges=edges[inv], forward_tokens=fwd,
                    plain_forward_tokens=int(np.maximum(n_tok - 1, 0).sum()))


def packed_rows(key: np.ndarray) -> np.ndarray:
    """One int64 per row ordered as the rows are lexicographically: each column's offset from
    its minimum in a mixed radix, the running key re-ranked whenever the next radix would
    overflow (digit tokens pack 17 columns without one)."""
    out = np.zeros(len(key), np.int64)
    span = 1
    for col in key.T:
        lo = int(col.min())
        base = int(col.max()) - lo + 1
        if span * base >= 1 << 62:
            _, out = np.unique(out, return_inverse=True)
            out = out.reshape(-1).astype(np.int64)
            span = int(out.max()) + 1
        out = out * base + (col - lo)
        span *= base
    return out


def _cached_nodes(levels: list[Level]) -> int:
    """The nodes of the levels so far (their keys and values are cached)."""
    return sum(len(lv.tokens) for lv in levels)


def _anc_after(levels: list[Level], parent: np.ndarray, d: int) -> np.ndarray:
    """(nodes, d - 1) ancestors of depth-d nodes: their parent's ancestors, then the parent."""
    if d == 1:
        return np.zeros((len(parent), 0), np.int64)
    return np.concatenate([levels[-1].anc[parent], parent[:, None]], axis=1)


def trie_nll(lm: js.JaxLM, seqs, *, share: float = SHARE,
             max_cache_bytes: int = MAX_CACHE_BYTES, progress: js.Progress = None) -> np.ndarray:
    """`lm.shared_prefix_nll(seqs)` over the trie of the candidates' tokens: the same sums.

    seqs: lists of token ids or an (n, length) integer array. Returns the summed NLL (nats) of
    every token after the first of each sequence.
    """
    arr, lengths, lcp = js.scored_candidates(seqs)
    n = len(lengths)
    if n == 0:
        return np.zeros(0)
    if lcp < 1:
        return lm.shared_prefix_nll(seqs, progress=progress)
    sh = lm.shape
    plan = plan_trie(arr[:, lcp:], lengths - lcp, share=share,
                     max_nodes=max_cache_bytes // lm.kv_bytes_per_token)
    pids = np.zeros((1, js.bucket_width(lcp)), np.int32)
    pids[0, :lcp] = arr[0, :lcp]
    pre_nll, pk, pv, last = js.prefix_forward(lm.params, pids, np.int32(lcp), shape=sh)
    outs, cache_k, cache_v = [], [], []
    total, done = max(1, plan.forward_tokens), 0
    for lv in plan.levels:  # depth d = len(cache_k) + 1
        parts = _run(lm, pk, pv, cache_k, cache_v, lv.anc, lv.tokens[:, None],
                     lv.targets[:, None, :], lcp, keep=lv.keep)
        outs += [(o, r) for o, _, _, r in parts]
        if lv.keep:
            cache_k.append(jnp.concatenate([k for _, k, _, _ in parts], axis=1))
            cache_v.append(jnp.concatenate([v for _, _, v, _ in parts], axis=1))
        done = _report(progress, parts, done + len(lv.tokens), total, n)
    if len(plan.row_ids):
        parts = _run(lm, pk, pv, cache_k, cache_v, plan.row_anc, plan.row_ids, plan.row_targets,
                     lcp, keep=False)
        outs += [(o, r) for o, _, _, r in parts]
        _report(progress, parts, total, total, n)
    # every level's (nodes x C) log-probs, then the rows' (rows x t): plan.edges index this
    flat = np.concatenate([np.asarray(o, np.float64).reshape(len(o), -1)[:r].reshape(-1)
                           for o, r in outs] or [np.zeros(0)])
    lp = np.where(plan.edges >= 0, flat[np.maximum(plan.edges, 0)], 0.0).sum(axis=1)
    return float(pre_nll) - np.asarray(last, np.float64)[plan.first] - lp


def _batches(n: int, t: int, max_tokens: int):
    rows = max(1, min(pow2(n), max_tokens // max(1, t)))
    for i in range(0, n, rows):
        yield rows, np.arange(i, min(i + rows, n))


def _run(lm, pk, pv, cache_k, cache_v, anc, ids, targets, lcp, *, keep: bool):
    """Dispatch `_step` over batches of rows: (logp, keys, values, real rows) per batch, not
    waited on (the host prepares the next batch while the device runs this one)."""
    parts = []
    for rows, idx in _batches(len(ids), ids.shape[1], lm.max_tokens):
        a = np.zeros((rows, anc.shape[1]), np.int32)
        a[: len(idx)] = anc[idx]
        b = np.zeros((rows, ids.shape[1]), np.int32)
        b[: len(idx)] = ids[idx]
        c = np.zeros((rows, *targets.shape[1:]), np.int32)
        c[: len(idx)] = targets[idx]
        parts.append((*_step(lm.params, pk, pv, tuple(cache_k), tuple(cache_v), a, b, c,
                             np.int32(lcp), shape=lm.shape, keep=keep), len(idx)))
    return parts


def _report(progress, parts, done, total, n) -> int:
    if progress:
        js.wait(parts[-1][0])
        progress(min(n, n * done // total), n, {})
    return done


@functools.partial(jax.jit, static_argnames=("shape", "keep"))
def _step(p, pk, pv, ck, cv, anc, ids, targets, n, *, shape: js.Shape, keep: bool):
    """Rows of t tokens at depth a (= anc's width) after a common prefix of n tokens.

    pk, pv (layers, pwidth, kv, hd): the common prefix's keys and values; ck, cv: one array per
    depth 1..a (layers, nodes, kv, hd), the levels' cached keys and values; anc (rows, a): each
    row's ancestor at each depth; ids (rows, t): its tokens, at positions n + a + 0..t-1;
    targets (rows, t, C): the tokens to score after each. Returns log p of the targets
    (rows, t, C) fp32 and, with keep, the rows' keys and values (layers, rows, kv, hd) of t = 1.
    """
    b, t = ids.shape
    a = anc.shape[1]
    pwidth = pk.shape[1]
    pos = jnp.broadcast_to(n + a + jnp.arange(t), (b, t))
    allowed = jnp.concatenate([
        jnp.broadcast_to(jnp.arange(pwidth) < n, (b, t, pwidth)),
        jnp.ones((b, t, a), bool),
        jnp.broadcast_to(jnp.tril(jnp.ones((t, t), bool)), (b, t, t))], axis=-1)
    x = p["embed"][ids]

    def layer(x, xs):
        lp, kp, vp, lk, lv = xs
        h = js.rms_norm(x, lp["in_norm"], shape.eps)
        q, k, v = js.qkv(lp, h, pos, shape)
        # keys: the common prefix's for every row, each row's ancestors' (gathered), its own
        keys = [jnp.broadcast_to(kp, (b, *kp.shape))]
        vals = [jnp.broadcast_to(vp, (b, *vp.shape))]
        if a:
            keys.append(jnp.stack([c[anc[:, j]] for j, c in enumerate(lk)], axis=1))
            vals.append(jnp.stack([c[anc[:, j]] for j, c in enumerate(lv)], axis=1))
        keys.append(k)
        vals.append(v)
        x = js.attend(lp, x, q, jnp.concatenate(keys, axis=1), jnp.concatenate(vals, axis=1),
                       allowed, shape)
        own = (k[:, 0], v[:, 0]) if keep else None  # (rows, kv, hd)
        return js.mlp_block(lp, x, shape), own

    x, own = jax.lax.scan(layer, x, (p["layers"], pk, pv, ck, cv))
    logits = js.lm_logits(p, x, shape)  # (rows, t, vocab) fp32
    tok = jnp.take_along_axis(logits, targets, axis=-1)
    logp = tok - jax.nn.logsumexp(logits, axis=-1, keepdims=True)
    return logp, *(own if keep else (None, None))
