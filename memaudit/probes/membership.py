"""Membership inference on member vs holdout documents.

Scores (higher = more likely a member), all from per-token log-probabilities:

- loss (Yeom et al. 2018): mean log p(x_t | x_<t), i.e. minus the loss.
- zlib (Carlini et al. 2021; MIMIR, Duan et al. 2024): the log-perplexity over the zlib entropy,
  here mean log p(x_t) / zlib-compressed bytes (higher = member).
- zlib_total: total log-likelihood / zlib bytes (the old statistic, kept under its own name).
- min_k (Shi et al. 2024, Min-K% Prob): mean of the k% lowest token log-probs (k = 20%).
- min_k_pp (Zhang et al. 2024, Min-K%++): the same over z_t = (log p(x_t) - μ_t) / σ_t, with μ_t and
  σ_t the mean and std of log p(v) for v drawn from the model's next-token distribution.
- reference (Carlini et al. 2022 calibration): log-likelihood under the target minus under a
  reference model (`--reference`).

>>> import numpy as np
>>> min_k(np.log(np.array([0.5, 0.1, 0.9, 0.2, 0.4])), 0.4)  # mean of the 2 lowest
-1.956...
"""

from __future__ import annotations

import zlib

import numpy as np

from memaudit.probes.stats import attack_summary

ATTACKS = ("loss", "zlib", "zlib_total", "min_k", "min_k_pp", "reference")


def _lowest_mean(x: np.ndarray, k: float) -> float:
    n = max(1, int(len(x) * k))
    return float(np.sort(x)[:n].mean())


def min_k(logp: np.ndarray, k: float = 0.2) -> float:
    """Min-K% Prob: mean of the int(k n) (at least one) lowest token log-probs."""
    return _lowest_mean(np.asarray(logp), k)


def min_k_pp(logp: np.ndarray, mu: np.ndarray, sigma: np.ndarray, k: float = 0.2) -> float:
    """Min-K%++: Min-K% over the standardised log-probs (log p - μ) / σ."""
    return _lowest_mean((np.asarray(logp) - mu) / sigma, k)


def _zlib_bytes(text: str) -> int:
    return max(1, len(zlib.compress(text.encode("utf-8"))))


def zlib_score(logp: np.ndarray, text: str) -> float:
    """The papers' zlib ratio: mean token log-likelihood / zlib-compressed length in bytes."""
    return float(np.mean(logp) / _zlib_bytes(text))


def zlib_total_score(logp: np.ndarray, text: str) -> float:
    """Total log-likelihood / zlib bytes (not the papers' ratio; grows with length)."""
    return float(np.sum(logp) / _zlib_bytes(text))


def encode_texts(codec, texts: list[str]) -> list[list[int]]:
    """`codec.encode` of each text, in one tokenizer call where the codec has `encode_all`."""
    batch = getattr(codec, "encode_all", None)
    return batch(texts) if batch is not None else [codec.encode(t) for t in texts]


def doc_scores(
    model,
    codec,
    docs,
    *,
    batch_size: int,
    k: float = 0.2,
    max_tokens: int = 1024,
    stride: int | None = None,
    reference=None,
    progress=None,
    reference_cache=None,
    target_cache=None,
) -> dict[str, np.ndarray]:
    """Every attack's score per document (reference only when a (model, codec) pair is given).

    Every token of a document is scored: one longer than `max_tokens` in windows of that many
    tokens, `stride` apart (`memaudit.probes.scoring.windowed_logprobs`). `reference_cache`: the
    reference's `memaudit.probes.score_cache.ModelScores`, where its mean log-likelihoods are
    kept for the next point that scores the same documents against it; None scores them every
    time. `target_cache`: the same for the target, whose means are kept for the runs that take
    it as their reference (the public base's own run, before its fine-tunes).
    """
    # lazy: torch (~2 s) only when called; this module imports without it
    from memaudit.probes.scoring import windowed_logprobs

    seqs = encode_texts(codec, [d.text for d in docs])
    ts = windowed_logprobs(model, seqs, window=max_tokens, stride=stride, batch_size=batch_size,
                           with_stats=True, progress=progress)
    out = {
        "loss": np.array([lp.mean() for lp in ts.logp]),
        "zlib": np.array([zlib_score(lp, d.text) for lp, d in zip(ts.logp, docs, strict=True)]),
        "zlib_total": np.array(
            [zlib_total_score(lp, d.text) for lp, d in zip(ts.logp, docs, strict=True)]
        ),
        "min_k": np.array([min_k(lp, k) for lp in ts.logp]),
        "min_k_pp": np.array(
            [min_k_pp(lp, m, s, k) for lp, m, s in zip(ts.logp, ts.mu, ts.sigma, strict=True)]
        ),
    }
    window = {"window": max_tokens, "stride": stride, "batch_size": batch_size}
    if target_cache is not None:
        target_cache.put(seqs, out["loss"], **window)
    if reference is not None:
        ref_model, ref_codec = reference
        # the reference shares the target's tokenizer (checked when it was loaded): with the
        # same start token its ids are the target's, not tokenized again
        ref_seqs = seqs if ref_codec.start == codec.start else encode_texts(ref_codec, [d.text for d in docs])
        ref_mean = reference_cache.get(ref_seqs, **window) if reference_cache is not None else None
        if ref_mean is None:
            rs = windowed_logprobs(ref_model, ref_seqs, window=max_tokens, stride=stride,
                                   batch_size=batch_size)
            ref_mean = np.array([lp.mean() for lp in rs.logp])
            if reference_cache is not None:
                reference_cache.put(ref_seqs, ref_mean, **window)
        out["reference"] = out["loss"] - ref_mean
    return out


def run_membership(
    members,
    nonmembers,
    scores: dict[str, np.ndarray],
    *,
    n_boot: int,
    seed: int,
    fprs=(0.01, 0.001),
) -> dict:
    """AUC and TPR at low FPR per attack; `scores` holds per-doc arrays, members first."""
    n1 = len(members)
    summary = {}
    for name, s in scores.items():
        summary[name] = attack_summary(s[:n1], s[n1:], unit="documents", fprs=fprs,
                                       n_boot=n_boot, seed=seed).to_json()
    rows = []
    for i, d in enumerate(list(members) + list(nonmembers)):
        rows.append(
            {
                "id": d.id,
                "member": i < n1,
                "repeats": d.repeats,
                **{name: float(s[i]) for name, s in scores.items()},
            }
        )
    return {"summary": summary, "scores": rows}
