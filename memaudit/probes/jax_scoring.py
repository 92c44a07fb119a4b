"""Scoring and generation in JAX for Llama-architecture models: the probes' engine on a TPU.

The same quantities as `memaudit.probes.scoring` (per-token log p with Min-K%++'s mu and sigma,
greedy or top-k sampled continuations with a KV cache), computed by one jitted Llama forward
pass over the Hugging Face weights (`LlamaForCausalLM` names; `memaudit.models.convert` holds
the name mapping). Layers are stacked and run under `lax.scan`, so one compilation serves any
depth. Sequences are length-sorted and padded to a few bucket widths (powers of two), and every
batch of a bucket has the same number of rows, so jit compiles a handful of shapes whatever the
data. Weights and activations are bf16 on an accelerator and fp32 on the CPU (where the scores
equal the torch path's to 1e-4); softmax, log-softmax and the statistics are fp32 everywhere.

Exposure's candidates share the canary's prefix: `shared_prefix_nll` runs the prefix once, keeps
its keys and values per layer, and scores only each candidate's suffix against them, in batches
(attention over [prefix keys | causal suffix keys] without copying the prefix per row).

References:
    Touvron et al. 2023, "LLaMA: Open and Efficient Foundation Language Models".
    Pope et al. 2022, "Efficiently Scaling Transformer Inference" (KV cache, prefix sharing).

>>> import numpy as np
>>> sd, cfg = random_llama(vocab_size=16, hidden=8, layers=1, heads=2, kv_heads=1)
>>> lm = JaxLM.from_state_dict(sd, cfg, dtype="float32")
>>> [x.shape for x in lm.token_logprobs([[1, 2, 3], [4, 5]]).logp]
[(2,), (1,)]
"""

from __future__ import annotations

import dataclasses
import functools
import json
import time
import types
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from memaudit.models.flax_llama import apply_rope, rope_cos_sin
from memaudit.probes.engines import unsupported_reason
from memaudit.probes.token_scores import TokenScores

Progress = Callable[[int, int, dict], None] | None

MIN_WIDTH = 8  # the narrowest bucket; widths are powers of two from here
NEG = -1e30  # masked attention scores (finite: a row with every key masked stays finite)


@dataclasses.dataclass(frozen=True)
class Shape:
    """The architecture fields the forward pass needs (from a config.json)."""

    vocab: int
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    eps: float
    theta: float

    @classmethod
    def from_config(cls, cfg: dict) -> Shape:
        unsupported = unsupported_reason(cfg)
        if unsupported:
            raise ValueError(f"the JAX engine does not run this model ({unsupported}); "
                             "use --engine torch")
        heads = cfg["num_attention_heads"]
        return cls(vocab=cfg["vocab_size"], hidden=cfg["hidden_size"],
                   layers=cfg["num_hidden_layers"], heads=heads,
                   kv_heads=cfg.get("num_key_value_heads") or heads,
                   head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
                   eps=float(cfg.get("rms_norm_eps", 1e-6)),
                   theta=float(cfg.get("rope_theta", 10000.0)))


_LAYER = {  # stacked name -> HF name inside model.layers.<i>
    "in_norm": "input_layernorm.weight", "post_norm": "post_attention_layernorm.weight",
    "q": "self_attn.q_proj.weight", "k": "self_attn.k_proj.weight",
    "v": "self_attn.v_proj.weight", "o": "self_attn.o_proj.weight",
    "gate": "mlp.gate_proj.weight", "up": "mlp.up_proj.weight", "down": "mlp.down_proj.weight",
}


def stack_params(sd: dict[str, np.ndarray], shape: Shape, *, tie: bool, dtype) -> dict:
    """HF state dict -> {embed, norm, head, layers: {name: (layers, ...)}}; kernels (in, out)."""
    def get(name):
        if name not in sd:
            raise ValueError(f"the checkpoint has no '{name}'; is it a LlamaForCausalLM?")
        return np.asarray(sd[name], dtype=np.float32)

    layers = {}
    for key, hf in _LAYER.items():
        arrs = [get(f"model.layers.{i}.{hf}") for i in range(shape.layers)]
        arr = np.stack([a.T if a.ndim == 2 else a for a in arrs])  # Linear: (out, in) -> (in, out)
        layers[key] = jnp.asarray(arr, dtype=jnp.float32 if arrs[0].ndim == 1 else dtype)
    embed = get("model.embed_tokens.weight")
    head = embed if tie or "lm_head.weight" not in sd else get("lm_head.weight")
    return {"embed": jnp.asarray(embed, dtype), "norm": jnp.asarray(get("model.norm.weight")),
            "head": jnp.asarray(head.T, dtype), "layers": layers}


def rms_norm(x, w, eps):
    x32 = x.astype(jnp.float32)
    x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return (w * x32).astype(x.dtype)


def qkv(lp, h, pos, shape: Shape):
    b, s, _ = h.shape
    nh, nkv, hd = shape.heads, shape.kv_heads, shape.head_dim
    q = (h @ lp["q"]).reshape(b, s, nh, hd)
    k = (h @ lp["k"]).reshape(b, s, nkv, hd)
    v = (h @ lp["v"]).reshape(b, s, nkv, hd)
    cos, sin = rope_cos_sin(pos, hd, shape.theta)
    return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v


def mlp_block(lp, x, shape: Shape):
    h = rms_norm(x, lp["post_norm"], shape.eps)
    return x + (jax.nn.silu(h @ lp["gate"]) * (h @ lp["up"])) @ lp["down"]


def attend(lp, x, q, keys, values, allowed, shape: Shape):
    """x + o_proj(attention). q (b, s, heads, hd); keys/values (b, t, kv, hd) (or (t, kv, hd),
    shared by every row); allowed (b, s, t) bool."""
    b, s = q.shape[:2]
    nkv, hd = shape.kv_heads, shape.head_dim
    q = q.reshape(b, s, nkv, shape.heads // nkv, hd)  # (batch, seq, kv_heads, group, head_dim)
    spec = "bqkgd,tkd->bkgqt" if keys.ndim == 3 else "bqkgd,btkd->bkgqt"
    scores = jnp.einsum(spec, q, keys).astype(jnp.float32) / np.float32(np.sqrt(hd))
    scores = jnp.where(allowed[:, None, None], scores, NEG)
    probs = jax.nn.softmax(scores, axis=-1).astype(q.dtype)
    spec = "bkgqt,tkd->bqkgd" if values.ndim == 3 else "bkgqt,btkd->bqkgd"
    out = jnp.einsum(spec, probs, values).reshape(b, s, shape.heads * hd)
    return x + out @ lp["o"]


def lm_logits(p, x, shape: Shape):
    # fp32 accumulation and output: bf16 logits would round log p to ~3 digits
    return jnp.matmul(rms_norm(x, p["norm"], shape.eps), p["head"], preferred_element_type=jnp.float32)


def forward(p, ids, pos, allowed, shape: Shape, cache=None, start=0):
    """Logits (b, s, vocab) fp32 and the updated cache.

    ids, pos: (b, s); allowed: (b, s, t) which keys each query reads, t = s without a cache and
    the cache's length with one; cache: (k, v), each (layers, b, t, kv, hd), the new keys written
    at slots start..start+s-1.
    """
    x = p["embed"][ids]

    def layer(x, xs):
        lp, ck, cv = xs
        h = rms_norm(x, lp["in_norm"], shape.eps)
        q, k, v = qkv(lp, h, pos, shape)
        if ck is not None:
            ck = jax.lax.dynamic_update_slice(ck, k.astype(ck.dtype), (0, start, 0, 0))
            cv = jax.lax.dynamic_update_slice(cv, v.astype(cv.dtype), (0, start, 0, 0))
            k, v = ck, cv
        x = attend(lp, x, q, k, v, allowed, shape)
        return mlp_block(lp, x, shape), (ck, cv)

    ck, cv = (None, None) if cache is None else cache
    x, new = jax.lax.scan(layer, x, (p["layers"], ck, cv))
    return lm_logits(p, x, shape), (None if cache is None else new)


def token_logp(logits, targets):
    """log p(target) without materialising the log-softmax: logit - logsumexp (fp32)."""
    tgt = jnp.take_along_axis(logits, targets[..., None], axis=-1)[..., 0]
    return tgt - jax.nn.logsumexp(logits, axis=-1)


def _token_stats(logits, targets):
    """log p(target), mean and std of log p(v) under v ~ p; all fp32 of logits' leading shape."""
    lsm = jax.nn.log_softmax(logits, axis=-1)
    tok = jnp.take_along_axis(lsm, targets[..., None], axis=-1)[..., 0]
    prob = jnp.exp(lsm)
    mu = jnp.sum(prob * lsm, axis=-1)
    sd = jnp.sqrt(jnp.maximum(jnp.sum(prob * jnp.square(lsm - mu[..., None]), axis=-1), 1e-12))
    return tok, mu, sd


@functools.partial(jax.jit, static_argnames=("shape", "with_stats"))
def _score(p, ids, lengths, *, shape: Shape, with_stats: bool):
    """Right-padded (rows, width) -> log p of tokens 1..width-1 (rows, width - 1) (+ mu, sigma)."""
    b, s = ids.shape
    real = jnp.arange(s)[None] < lengths[:, None]
    allowed = jnp.tril(jnp.ones((s, s), bool))[None] & real[:, None, :]
    pos = jnp.broadcast_to(jnp.arange(s), (b, s))
    logits, _ = forward(p, ids, pos, allowed, shape)
    if not with_stats:
        return (token_logp(logits[:, :-1], ids[:, 1:]),)
    return _token_stats(logits[:, :-1], ids[:, 1:])


def bucket_width(n: int) -> int:
    """The padded width of a sequence of n tokens: the next power of two, at least MIN_WIDTH.

    >>> [bucket_width(n) for n in (2, 16, 17, 300)]
    [8, 16, 32, 512]
    """
    return max(MIN_WIDTH, 1 << max(0, int(n) - 1).bit_length())


# Decoding on an accelerator: a batch takes up to this many prompts while its KV cache stays
# under the byte budget (125m, 114 positions: 4 MiB of bf16 cache a row, so 512 rows), on the
# premise that a small model's decoding step is latency-bound on a chip, so that more rows cost
# little. Not yet measured apart: the one chip run since (docs/results.md, the tiny study's
# second machine) spent its extraction time in the host's n-gram test, not in decoding.
ACCEL_DECODE_ROWS = 1024
ACCEL_DECODE_CACHE_BYTES = 2 << 30


def _pad_rows(rows: int) -> int:
    return 1 << max(0, rows - 1).bit_length()


def _plan(lengths: np.ndarray, max_tokens: int):
    """(width, rows per batch, indices) per batch: length-sorted, one width per bucket, every
    batch of a bucket `rows` high (the last one padded with empty rows)."""
    order = np.argsort(-lengths, kind="stable")
    widths = np.array([bucket_width(n) for n in lengths[order]])
    for w in sorted(set(widths.tolist()), reverse=True):
        idx = order[widths == w]
        rows = max(1, min(_pad_rows(len(idx)), max_tokens // w))
        for i in range(0, len(idx), rows):
            yield w, rows, idx[i : i + rows]


def _fill(seqs, idx, rows: int, width: int) -> tuple[np.ndarray, np.ndarray]:
    ids = np.zeros((rows, width), np.int32)
    lengths = np.zeros(rows, np.int32)
    for r, i in enumerate(idx):
        ids[r, : len(seqs[i])] = seqs[i]
        lengths[r] = len(seqs[i])
    return ids, lengths


@dataclasses.dataclass
class JaxLM:
    """A Llama causal LM as stacked JAX arrays, with the probes' scoring and decoding.

    `config` is the model's config (what `memaudit.probes.context.model_context` reads);
    `max_tokens` caps the padded tokens of one scoring batch.
    """

    params: dict
    shape: Shape
    config: Any = None
    max_tokens: int = 8192
    is_jax: bool = True

    @property
    def kv_bytes_per_token(self) -> int:
        """Bytes of one token's keys and values over every layer, as a cache holds them."""
        s = self.shape
        return 2 * s.layers * s.kv_heads * s.head_dim * self.params["embed"].dtype.itemsize

    @classmethod
    def from_state_dict(cls, sd: dict, cfg: dict, *, dtype: str = "auto", config: Any = None,
                        max_tokens: int | None = None) -> JaxLM:
        shape = Shape.from_config(cfg)
        accel = jax.default_backend() != "cpu"
        if dtype == "auto":
            dtype = "bfloat16" if accel else "float32"
        if max_tokens is None:
            max_tokens = 8192 if accel else 1024  # TPU v5e, 125m: the fastest of 4k-32k (measured)
        params = stack_params(sd, shape, tie=bool(cfg.get("tie_word_embeddings")),
                              dtype=jnp.dtype(dtype))
        return cls(params=params, shape=shape, config=config, max_tokens=max_tokens)

    @classmethod
    def from_torch(cls, model, *, dtype: str = "auto", max_tokens: int | None = None) -> JaxLM:
        """From a loaded transformers LlamaForCausalLM (weights copied to the JAX device)."""
        sd = {k: v.detach().float().cpu().numpy() for k, v in model.state_dict().items()}
        return cls.from_state_dict(sd, model.config.to_dict(), dtype=dtype, config=model.config,
                                   max_tokens=max_tokens)

    @classmethod
    def from_pretrained(cls, path: str | Path, *, dtype: str = "auto",
                        max_tokens: int | None = None) -> JaxLM:
        """From a Hugging Face directory (config.json + *.safetensors); no torch needed."""
        # lazy: safetensors' numpy loader only when reading a checkpoint
        from safetensors.numpy import load_file

        path = Path(path)
        cfg = json.loads((path / "config.json").read_text())
        files = sorted(path.glob("*.safetensors"))
        if not files:
            raise ValueError(f"'{path}' has no *.safetensors weights; the JAX engine reads "
                             "safetensors only (use --engine torch)")
        sd: dict[str, np.ndarray] = {}
        for f in files:
            sd.update(load_file(f))
        return cls.from_state_dict(sd, cfg, dtype=dtype, config=types.SimpleNamespace(**cfg),
                                   max_tokens=max_tokens)

    # --- scoring -----------------------------------------------------------------------------

    def token_logprobs(self, seqs: Sequence[Sequence[int]], *, batch_size: int = 32,
                       with_stats: bool = False, progress: Progress = None) -> TokenScores:
        """`memaudit.probes.scoring.token_logprobs` in JAX: same arrays, input order.

        `batch_size` is accepted for the same call; batches are sized by `max_tokens`.
        """
        del batch_size
        n = len(seqs)
        lengths = np.array([len(s) for s in seqs], dtype=np.int64)
        if n and lengths.min() < 2:
            raise ValueError("every scored sequence needs at least 2 tokens")
        out: list[list] = [[None] * n for _ in range(3)]
        done = 0
        pending = []  # dispatch ahead: the host prepares batch i+1 while the chip runs batch i
        for w, rows, idx in _plan(lengths, self.max_tokens):
            ids, lens = _fill(seqs, idx, rows, w)
            pending.append((idx, _score(self.params, ids, lens, shape=self.shape,
                                        with_stats=with_stats)))
            if len(pending) > 1:
                done = self._collect(pending.pop(0), lengths, out, done, n, progress)
        for item in pending:
            done = self._collect(item, lengths, out, done, n, progress)
        logp, mu, sigma = out
        return TokenScores(logp=logp, mu=mu if with_stats else None,
                           sigma=sigma if with_stats else None)

    @staticmethod
    def _collect(item, lengths, out, done, n, progress) -> int:
        idx, parts = item
        for dest, part in zip(out, parts, strict=False):
            arr = np.asarray(part, dtype=np.float64)
            for r, i in enumerate(idx):
                dest[i] = arr[r, : lengths[i] - 1]
        done += len(idx)
        if progress:
            progress(done, n, {})
        return done

    def shared_prefix_nll(self, seqs, *, rows: int | None = None,
                          progress: Progress = None) -> np.ndarray:
        """Summed NLL (nats) of every token after the first of each sequence: the same numbers
        as -token_logprobs(seqs).logp[i].sum(), with their longest common token prefix run once.

        `seqs`: lists of token ids, or an (n, length) integer array of equal-length sequences.
        The prefix's keys and values are computed once per layer; each batch of suffixes attends
        to them (shared across rows) and causally to itself. A suffix's last token is only a
        target, so it never enters the forward pass.
        """
        arr, lengths, lcp = scored_candidates(seqs)
        n = len(lengths)
        if n == 0:
            return np.zeros(0)
        if lcp < 1:
            ts = self.token_logprobs([a[:k] for a, k in zip(arr, lengths, strict=True)],
                                     progress=progress)
            return np.array([-x.sum() for x in ts.logp])
        pids = np.zeros((1, bucket_width(lcp)), np.int32)
        pids[0, :lcp] = arr[0, :lcp]
        pre_nll, keys, values, last = prefix_forward(self.params, pids, np.int32(lcp), shape=self.shape)
        n_in = lengths - lcp - 1  # suffix tokens that enter the forward pass
        width = bucket_width(max(1, int(n_in.max())))
        ids = np.zeros((n, width + 1), np.int32)
        span = min(width + 1, arr.shape[1] - lcp)
        ids[:, :span] = arr[:, lcp : lcp + span]
        rows = rows or max(1, self.max_tokens // width)
        out = np.empty(n)
        done, pending = 0, []
        for i in range(0, n, rows):
            idx = np.arange(i, min(i + rows, n))
            batch = np.zeros((rows, width + 1), np.int32)
            batch[: len(idx)] = ids[idx]
            lens = np.zeros(rows, np.int32)
            lens[: len(idx)] = n_in[idx]
            pending.append((idx, _suffix_nll(self.params, keys, values, last, np.int32(lcp),
                                             batch, lens, shape=self.shape)))
            if len(pending) > 1:
                done = _put(pending.pop(0), out, done, n, progress)
        for item in pending:
            done = _put(item, out, done, n, progress)
        return out + float(pre_nll)

    # --- generation --------------------------------------------------------------------------

    def decode(self, prompts: Sequence[Sequence[int]], max_new_tokens: int, *,
               batch_size: int = 32, pad_id: int = 0, top_k: int | None = None,
               temperature: float = 1.0, seed: int = 0, progress: Progress = None) -> np.ndarray:
        """`memaudit.probes.scoring.decode` in JAX: greedy (top_k None) or top-k sampled
        continuations, (n, max_new_tokens) int64, with a KV cache; prompts left-padded to a
        bucket width, the whole generation one jitted call per batch.

        Prompt j's draws come from `fold_in(key(seed), j)`, so they do not depend on how the
        prompts are batched. On an accelerator a batch holds at least `batch_size` prompts and
        up to ACCEL_DECODE_ROWS, as long as its KV cache stays within ACCEL_DECODE_CACHE_BYTES
        (see there)."""
        del pad_id  # padded keys are masked: the pad value never matters
        if not prompts:
            return np.zeros((0, max_new_tokens), dtype=np.int64)
        if any(len(p) == 0 for p in prompts):
            raise ValueError("every prompt needs at least one token (use the BOS/EOS token)")
        lengths = np.array([len(p) for p in prompts])
        order = np.argsort(-lengths, kind="stable")
        out = np.zeros((len(prompts), max_new_tokens), dtype=np.int64)
        key = jax.random.key(seed)
        rows = batch_size
        if jax.default_backend() != "cpu":
            rows = max(rows, min(ACCEL_DECODE_ROWS, self._cache_rows(
                bucket_width(int(lengths.max())) + max_new_tokens)))
        rows = _pad_rows(min(rows, len(prompts)))
        done = 0
        for i in range(0, len(order), rows):
            idx = order[i : i + rows]
            width = bucket_width(int(lengths[idx].max()))
            ids = np.zeros((rows, width), np.int32)
            mask = np.zeros((rows, width), bool)
            for r, j in enumerate(idx):
                ids[r, width - len(prompts[j]):] = prompts[j]
                mask[r, width - len(prompts[j]):] = True
            which = np.zeros(rows, np.int32)
            which[: len(idx)] = idx
            new = _generate(self.params, ids, mask, key, which, np.float32(temperature),
                            shape=self.shape, steps=max_new_tokens, top_k=top_k)
            out[idx] = np.asarray(new)[: len(idx)]
            done += len(idx)
            if progress:
                progress(done, len(prompts), {})
        return out

    def _cache_rows(self, t: int) -> int:
        """Rows whose KV cache of t positions fits ACCEL_DECODE_CACHE_BYTES."""
        return max(1, ACCEL_DECODE_CACHE_BYTES // (t * self.kv_bytes_per_token))


@functools.partial(jax.jit, static_argnames=("shape",))
def prefix_forward(p, ids, n, *, shape: Shape):
    """One prefix (1, width) with n real tokens -> (NLL of tokens 1..n-1, keys and values per
    layer (layers, width, kv, hd), log-softmax at token n-1 (vocab,))."""
    s = ids.shape[1]
    real = jnp.arange(s) < n
    allowed = (jnp.tril(jnp.ones((s, s), bool)) & real[None])[None]
    cache = tuple(jnp.zeros((shape.layers, 1, s, shape.kv_heads, shape.head_dim),
                            p["embed"].dtype) for _ in range(2))
    logits, (k, v) = forward(p, ids, jnp.arange(s)[None], allowed, shape, cache=cache)
    lsm = jax.nn.log_softmax(logits[0], axis=-1)  # (width, vocab)
    tok = jnp.take_along_axis(lsm[:-1], ids[0, 1:, None], axis=-1)[:, 0]
    nll = -jnp.sum(jnp.where(jnp.arange(1, s) < n, tok, 0.0))
    return nll, k[:, 0], v[:, 0], lsm[n - 1]


def scored_candidates(seqs) -> tuple[np.ndarray, np.ndarray, int]:
    """Sequences whose summed NLLs the prefix-sharing paths score: (n, longest) right-padded
    tokens, their lengths and their longest common prefix (0 when there are none); ValueError
    when one has fewer than 2 tokens."""
    arr, lengths = as_padded(seqs)
    if not len(lengths):
        return arr, lengths, 0
    if lengths.min() < 2:
        raise ValueError("every scored sequence needs at least 2 tokens")
    return arr, lengths, common_prefix_len(arr, lengths)


def common_prefix_len(arr: np.ndarray, lengths: np.ndarray) -> int:
    """The longest common token prefix of the rows, leaving every row at least one token."""
    m = int(lengths.min()) - 1
    same = np.all(arr[:, :m] == arr[:1, :m], axis=0)
    return int(np.argmin(same)) if not same.all() else m


def as_padded(seqs) -> tuple[np.ndarray, np.ndarray]:
    """(n, longest) int32 array right-padded with 0, and the lengths."""
    if isinstance(seqs, np.ndarray) and seqs.ndim == 2:
        return seqs.astype(np.int32, copy=False), np.full(len(seqs), seqs.shape[1])
    lengths = np.array([len(s) for s in seqs], dtype=np.int64)
    arr = np.zeros((len(seqs), int(lengths.max(initial=0))), np.int32)
    for r, s in enumerate(seqs):
        arr[r, : len(s)] = s
    return arr, lengths


def _put(item, out, done, n, progress) -> int:
    idx, nll = item
    out[idx] = np.asarray(nll, np.float64)[: len(idx)]
    done += len(idx)
    if progress:
        progress(done, n, {})
    return done


def prefix_then_causal(pwidth: int, n, s: int):
    """(s, pwidth + s): the keys each of a row's s tokens reads after a shared prefix of n real
    tokens (of pwidth slots): the prefix's, then its own row's causally."""
    return jnp.concatenate([jnp.broadcast_to(jnp.arange(pwidth) < n, (s, pwidth)),
                            jnp.tril(jnp.ones((s, s), bool))], axis=-1)


def after_prefix(p, pk, pv, n, inputs, *, shape: Shape, keep: bool = False):
    """Rows (b, s) of tokens that follow a shared prefix of n tokens, whose keys and values are
    pk, pv (layers, pwidth, kv, hd): each reads the prefix (broadcast, not copied per row) and its
    own row causally. Returns the final hidden states (b, s, hidden) and, with `keep`, the rows'
    own keys and values (layers, b, s, kv, hd), else None."""
    b, s = inputs.shape
    pos = jnp.broadcast_to(n + jnp.arange(s), (b, s))
    allowed = jnp.broadcast_to(prefix_then_causal(pk.shape[1], n, s), (b, s, pk.shape[1] + s))
    x = p["embed"][inputs]

    def layer(x, xs):
        lp, kp, vp = xs
        h = rms_norm(x, lp["in_norm"], shape.eps)
        q, k, v = qkv(lp, h, pos, shape)
        # keys: the shared prefix's (pwidth, kv, hd) for every row, then the row's own
        keys = jnp.concatenate([jnp.broadcast_to(kp, (b, *kp.shape)), k], axis=1)
        vals = jnp.concatenate([jnp.broadcast_to(vp, (b, *vp.shape)), v], axis=1)
        x = attend(lp, x, q, keys, vals, allowed, shape)
        return mlp_block(lp, x, shape), ((k, v) if keep else None)

    return jax.lax.scan(layer, x, (p["layers"], pk, pv))


@functools.partial(jax.jit, static_argnames=("shape",))
def _suffix_nll(p, pk, pv, last, n, ids, n_in, *, shape: Shape):
    """Summed NLL of suffixes after a shared prefix of n tokens whose keys/values are pk, pv
    (layers, pwidth, kv, hd) and whose last log-softmax is `last` (vocab,).

    ids: (rows, width + 1) right-padded suffixes; n_in (rows,): how many of each row's tokens
    enter the forward pass (its length - 1: the last is only a target).
    """
    inputs, targets = ids[:, :-1], ids[:, 1:]
    x, _ = after_prefix(p, pk, pv, n, inputs, shape=shape)
    tok = token_logp(lm_logits(p, x, shape), targets)  # (rows, width)
    keep = jnp.arange(inputs.shape[1])[None] < n_in[:, None]
    return -(last[ids[:, 0]] + jnp.sum(jnp.where(keep, tok, 0.0), axis=-1))


@functools.partial(jax.jit, static_argnames=("shape", "steps", "top_k"))
def _generate(p, ids, mask, key, which, temperature, *, shape: Shape, steps: int,
              top_k: int | None):
    """Left-padded prompts (rows, width) -> (rows, steps) new tokens, KV cache of width+steps.

    Row r draws its step-i token with `fold_in(fold_in(key, which[r]), i)`: `which` holds each
    row's prompt index, so a prompt's draws do not depend on its batch."""
    b, w = ids.shape
    t = w + steps
    kmask = jnp.concatenate([mask, jnp.zeros((b, steps), bool)], axis=1)  # (rows, t)
    pos = jnp.maximum(jnp.cumsum(mask, axis=1) - 1, 0)
    allowed = jnp.tril(jnp.ones((w, t), bool))[None] & kmask[:, None, :]
    cache = tuple(jnp.zeros((shape.layers, b, t, shape.kv_heads, shape.head_dim),
                            p["embed"].dtype) for _ in range(2))
    logits, cache = forward(p, ids, pos, allowed, shape, cache=cache)

    row_keys = jax.vmap(jax.random.fold_in, in_axes=(None, 0))(key, which)

    def pick(logits, i):
        if top_k is None:
            return jnp.argmax(logits, axis=-1).astype(jnp.int32)
        vals, cand = jax.lax.top_k(logits / temperature, min(top_k, logits.shape[-1]))
        step_keys = jax.vmap(jax.random.fold_in, in_axes=(0, None))(row_keys, i)
        choice = jax.vmap(jax.random.categorical)(step_keys, vals)
        return jnp.take_along_axis(cand, choice[:, None], axis=-1)[:, 0].astype(jnp.int32)

    tok = pick(logits[:, -1], 0)
    state = (tok, pos[:, -1] + 1, cache, kmask)

    def step(state, i):
        tok, nxt, cache, kmask = state
        slot = w + i
        kmask = kmask.at[:, slot].set(True)
        allowed = (kmask & (jnp.arange(t)[None] <= slot))[:, None, :]
        logits, cache = forward(p, tok[:, None], nxt[:, None], allowed, shape, cache=cache,
                                start=slot)
        new = pick(logits[:, -1], i + 1)
        return (new, nxt + 1, cache, kmask), tok

    state, toks = jax.lax.scan(step, state, jnp.arange(steps - 1))
    return jnp.concatenate([toks.T, state[0][:, None]], axis=1) if steps > 1 else tok[:, None]


def random_llama(*, vocab_size: int, hidden: int, layers: int, heads: int, kv_heads: int,
                 intermediate: int | None = None, seed: int = 0) -> tuple[dict, dict]:
    """A random Llama as (HF state dict of numpy arrays, config.json dict): for benchmarks and
    examples, without torch."""
    rng = np.random.default_rng(seed)
    inter = intermediate or 2 * hidden
    hd = hidden // heads
    cfg = {"model_type": "llama", "vocab_size": vocab_size, "hidden_size": hidden,
           "intermediate_size": inter, "num_hidden_layers": layers,
           "num_attention_heads": heads, "num_key_value_heads": kv_heads,
           "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "tie_word_embeddings": False,
           "max_position_embeddings": 2048}
    shapes = {"self_attn.q_proj.weight": (heads * hd, hidden),
              "self_attn.k_proj.weight": (kv_heads * hd, hidden),
              "self_attn.v_proj.weight": (kv_heads * hd, hidden),
              "self_attn.o_proj.weight": (hidden, heads * hd),
              "mlp.gate_proj.weight": (inter, hidden), "mlp.up_proj.weight": (inter, hidden),
              "mlp.down_proj.weight": (hidden, inter)}
    sd = {"model.embed_tokens.weight": rng.normal(0, 0.02, (vocab_size, hidden)),
          "model.norm.weight": np.ones(hidden), "lm_head.weight":
          rng.normal(0, 0.02, (vocab_size, hidden))}
    for i in range(layers):
        sd[f"model.layers.{i}.input_layernorm.weight"] = np.ones(hidden)
        sd[f"model.layers.{i}.post_attention_layernorm.weight"] = np.ones(hidden)
        for name, shp in shapes.items():
            sd[f"model.layers.{i}.{name}"] = rng.normal(0, 0.02, shp)
    return {k: v.astype(np.float32) for k, v in sd.items()}, cfg


def wait(x) -> float:
    """Block until x is computed; the time now (for benchmarks timing asynchronous dispatch)."""
    jax.block_until_ready(x)
    return time.perf_counter()
