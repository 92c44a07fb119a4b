"""Canary exposure (Carlini et al. 2019, "The Secret Sharer").

exposure(s) = log2 |R| - log2 rank(s), where rank(s) is the position of the canary's
log-perplexity among all candidates in the secret space R (1 = most likely). When |R| is small
enough the rank is exact (every candidate is scored). Otherwise the rank is estimated from
>= 10^4 uniformly sampled candidates: the empirical CDF (interpolated) inside the sampled range,
and a fitted skew-normal CDF beyond it (the paper's extrapolation). Never-inserted reference
canaries give the null: their exposure averages about 1/ln 2 ≈ 1.44 bits.

References:
  Carlini, Liu, Erlingsson, Kos, Song. The Secret Sharer: Evaluating and Testing Unintended
  Memorization in Neural Networks. USENIX Security 2019.

>>> import numpy as np
>>> exact_exposure(np.array([0.5]), np.array([0.5, 1.0, 2.0, 3.0]))  # best of 4: log2 4 - log2 1
array([2.])
"""

from __future__ import annotations

import itertools
import math

import numpy as np

from memaudit.probes.stats import rate_summary


def exact_exposure(canary_logppl: np.ndarray, space_logppl: np.ndarray) -> np.ndarray:
    """Exposure against the full secret space: rank = 1 + #candidates strictly more likely."""
    space = np.sort(space_logppl)
    rank = 1 + np.searchsorted(space, canary_logppl, side="left")
    return math.log2(len(space)) - np.log2(rank)


def estimated_exposure(
    canary_logppl: np.ndarray, sample_logppl: np.ndarray, space_size: int
) -> np.ndarray:
    """Exposure from sampled candidates: interpolated empirical CDF, skew-normal below the sample.

    rank ≈ 1 + |R| F(x), F the probability that a random candidate is strictly more likely.
    """
    from scipy.stats import skewnorm

    s = np.sort(np.asarray(sample_logppl, dtype=np.float64))
    n = len(s)
    x = np.asarray(canary_logppl, dtype=np.float64)
    # interpolate between the CDF jumps; the i-th sorted sample sits at (i + 0.5) / n
    f = np.interp(x, s, (np.arange(n) + 0.5) / n, left=np.nan, right=1.0)
    below = np.isnan(f)
    if below.any():
        a, loc, scale = skewnorm.fit(s)
        f[below] = np.minimum(skewnorm.cdf(x[below], a, loc, scale), 0.5 / n)
    rank = 1 + space_size * f
    return np.clip(math.log2(space_size) - np.log2(rank), 0.0, math.log2(space_size))


def secret_space(alphabet: str, length: int) -> int:
    return len(alphabet) ** length


def enumerate_secrets(alphabet: str, length: int) -> list[str]:
    return ["".join(t) for t in itertools.product(alphabet, repeat=length)]


def sample_secrets(alphabet: str, length: int, n: int, seed: int) -> list[str]:
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, len(alphabet), (n, length))
    chars = np.array(list(alphabet))
    return ["".join(row) for row in chars[idx]]


def score_secrets(
    model, codec, template: str, secrets: list[str], *, batch_size: int, progress=None
) -> np.ndarray:
    """Log-perplexity (summed NLL, nats) of the secret and whatever follows it in the template."""
    from memaudit.probes.scoring import token_logprobs

    prefix, suffix = template.split("{secret}")
    seqs, starts = [], []
    for s in secrets:
        ids, n_prefix = codec.encode_split(prefix, s + suffix)
        seqs.append(ids)
        starts.append(n_prefix)
    lp = token_logprobs(model, seqs, batch_size=batch_size, progress=progress).logp
    # logp[i][t-1] scores token t, so tokens from n_prefix on are lp[n_prefix-1:]
    return np.array([-lp[i][starts[i] - 1 :].sum() for i in range(len(seqs))])


def run_exposure(
    model,
    codec,
    canaries: dict,
    *,
    batch_size: int,
    enumerate_max: int = 10_000,
    n_samples: int = 10_000,
    seed: int = 0,
    n_boot: int = 1000,
    progress=None,
) -> dict:
    """Exposure of every inserted and reference canary, grouped by repetitions and owner kind.

    Returns {"summary": ..., "scores": [...], "settings": ...}; no secret is included.
    """
    from scipy.stats import mannwhitneyu

    template, alphabet, length = (
        canaries["template"],
        canaries["alphabet"],
        int(canaries["secret_length"]),
    )
    inserted, refs = canaries.get("inserted", []), canaries.get("references", [])
    items = [(c, "inserted") for c in inserted] + [(c, "reference") for c in refs]
    if not items:
        raise ValueError("canaries file has no inserted or reference canaries; nothing to expose")
    size = secret_space(alphabet, length)
    canary_lp = score_secrets(
        model, codec, template, [c["secret"] for c, _ in items], batch_size=batch_size
    )
    if size <= enumerate_max:
        method, cands = "enumeration", enumerate_secrets(alphabet, length)
    else:
        method, cands = "sampling", sample_secrets(alphabet, length, n_samples, seed)
    cand_lp = score_secrets(model, codec, template, cands, batch_size=batch_size, progress=progress)
    if method == "enumeration":
        exp = exact_exposure(canary_lp, cand_lp)
    else:
        exp = estimated_exposure(canary_lp, cand_lp, size)
    scores = []
    for (c, role), e, lp in zip(items, exp, canary_lp, strict=True):
        scores.append(
            {
                "id": c["id"],
                "role": role,
                "repetitions": int(c.get("repetitions", 0)),
                "owner_kind": c.get("owner_kind"),
                "log_perplexity": float(lp),
                "exposure": float(e),
            }
        )
    return {
        "summary": _summarise(scores, size, method, n_boot, seed, mannwhitneyu),
        "scores": scores,
        "settings": {
            "method": method,
            "space_size": size,
            "candidates_scored": len(cands),
            "enumerate_max": enumerate_max,
            "n_samples": n_samples,
        },
    }


def _summarise(scores, size, method, n_boot, seed, mannwhitneyu) -> dict:
    ins = [s for s in scores if s["role"] == "inserted"]
    ref = np.array([s["exposure"] for s in scores if s["role"] == "reference"])
    by_rep: dict[str, dict] = {}
    for rep in sorted({s["repetitions"] for s in ins}):
        group = [s for s in ins if s["repetitions"] == rep]
        by_rep[str(rep)] = {
            "all": rate_summary(np.array([s["exposure"] for s in group]), n_boot=n_boot, seed=seed),
            **{
                kind: rate_summary(
                    np.array([s["exposure"] for s in group if s["owner_kind"] == kind]),
                    n_boot=n_boot,
                    seed=seed,
                )
                for kind in sorted({str(s["owner_kind"]) for s in group})
            },
        }
    ins_e = np.array([s["exposure"] for s in ins])
    test = None
    if len(ins_e) and len(ref):
        test = {
            "test": "mann-whitney-u two-sided",
            "p_value": float(mannwhitneyu(ins_e, ref).pvalue),
        }
    return {
        "max_exposure": math.log2(size),
        "method": method,
        "inserted": rate_summary(ins_e, n_boot=n_boot, seed=seed),
        "references": rate_summary(ref, n_boot=n_boot, seed=seed),
        "null_mean": 1 / math.log(2),
        "by_repetitions": by_rep,
        "inserted_vs_references": test,
    }
