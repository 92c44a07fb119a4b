"""Canary exposure (Carlini et al. 2019, "The Secret Sharer").

exposure(s) = log2 |R| - log2 rank(s), where rank(s) is the position of the canary's
log-perplexity among all candidates in the secret space R (1 = most likely). When |R| is small
enough the rank is exact (every candidate is scored). Otherwise the rank is estimated from
uniformly sampled candidates: the empirical CDF (interpolated) where the sample resolves it, and
beyond that the ceiling, a one-sided lower bound ("lower_bound" in the scores, shown as ">= X").
Each sampled canary also gets `exposure_extrapolated`, the paper's skew-normal extrapolation of
the tail: an estimate, labelled as such, never below the bound. Both are monotone in the
canary's log-perplexity. Never-inserted reference canaries give the null: their exposure
averages about 1/ln 2 ≈ 1.44 bits.

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

from memaudit.probes.stats import holm, mann_whitney, mean_summary


def exact_exposure(canary_logppl: np.ndarray, space_logppl: np.ndarray) -> np.ndarray:
    """Exposure against the full secret space: rank = 1 + #candidates strictly more likely."""
    space = np.sort(space_logppl)
    rank = 1 + np.searchsorted(space, canary_logppl, side="left")
    return math.log2(len(space)) - np.log2(rank)


TAIL_CONFIDENCE = 0.95


def ceiling_fraction(n: int) -> float:
    """The largest share of more likely candidates that n samples cannot rule out at
    TAIL_CONFIDENCE when none of them is more likely: F <= 1 - (1 - c)^(1/n), about 3 / n."""
    return 1 - (1 - TAIL_CONFIDENCE) ** (1 / n)


def _sample_fraction(x: np.ndarray, s: np.ndarray) -> np.ndarray:
    """Interpolated share of sampled candidates more likely than x; 0 below the sample, 1 above
    (the i-th sorted sample sits at (i + 0.5) / n). Non-decreasing in x."""
    n = len(s)
    return np.interp(x, s, (np.arange(n) + 0.5) / n, left=0.0, right=1.0)


def _exposure_of(f: np.ndarray, space_size: int) -> np.ndarray:
    rank = 1 + space_size * f
    return np.clip(math.log2(space_size) - np.log2(rank), 0.0, math.log2(space_size))


def estimated_exposure(
    canary_logppl: np.ndarray, sample_logppl: np.ndarray, space_size: int
) -> np.ndarray:
    """Exposure from n sampled candidates: interpolated empirical CDF, never above the ceiling.

    rank ≈ 1 + |R| F(x), F the share of candidates strictly more likely. n samples resolve F
    only down to the ceiling `ceiling_fraction(n)` (about 3 / n): wherever the interpolated F is
    at or below it, the value is the ceiling's exposure (`at_ceiling`); beyond the sample that is
    a one-sided lower bound at TAIL_CONFIDENCE (`tail_mask`, shown as ">= X bits"). So the estimate
    is monotone: a more likely canary never reads fewer bits (before, the bound below the sample
    sat under the interpolation just inside it: 11.70 bits against 14.26).
    """
    s = np.sort(np.asarray(sample_logppl, dtype=np.float64))
    x = np.asarray(canary_logppl, dtype=np.float64)
    f = np.maximum(_sample_fraction(x, s), ceiling_fraction(len(s)))
    return _exposure_of(f, space_size)


def tail_mask(canary_logppl: np.ndarray, sample_logppl: np.ndarray) -> np.ndarray:
    """True where a canary is more likely than every sampled candidate: its exposure is the
    ceiling, a one-sided lower bound at TAIL_CONFIDENCE, shown as ">= X". A canary inside the
    sample held at the ceiling (`at_ceiling`, k >= 1 samples more likely) is no 95% bound: it is
    an estimate held at the resolution limit, below the interpolation."""
    return np.asarray(canary_logppl, float) < np.min(sample_logppl)


def at_ceiling(canary_logppl: np.ndarray, sample_logppl: np.ndarray) -> np.ndarray:
    """True where the sample does not resolve the rank and the estimate is the ceiling."""
    s = np.sort(np.asarray(sample_logppl, dtype=np.float64))
    x = np.asarray(canary_logppl, dtype=np.float64)
    return _sample_fraction(x, s) <= ceiling_fraction(len(s))


def skew_normal_moments(sample: np.ndarray) -> tuple[float, float, float]:
    """(shape a, location, scale) of the skew-normal with the sample's mean, variance and
    skewness (method of moments; skewness clipped to the family's +-0.99)."""
    x = np.asarray(sample, dtype=np.float64)
    m, sd = float(x.mean()), float(x.std())
    if sd == 0:
        return 0.0, m, 1e-12
    g = float(np.clip(((x - m) ** 3).mean() / sd**3, -0.99, 0.99))
    g23 = abs(g) ** (2 / 3)
    delta = math.copysign(math.sqrt(math.pi / 2 * g23 / (g23 + ((4 - math.pi) / 2) ** (2 / 3))), g)
    omega = sd / math.sqrt(1 - 2 * delta**2 / math.pi)
    return delta / math.sqrt(1 - delta**2), m - omega * delta * math.sqrt(2 / math.pi), omega


def extrapolated_exposure(
    canary_logppl: np.ndarray, sample_logppl: np.ndarray, space_size: int
) -> np.ndarray:
    """The paper's extrapolation beyond the ceiling: an estimate, not a bound.

    Where the sample resolves the rank this equals `estimated_exposure`; beyond the ceiling F is
    the CDF of a skew-normal fitted to the sampled log-perplexities (Carlini et al. 2019, sec.
    4.3), capped at the ceiling's F, so the value is monotone and never below the stated bound.
    It rests on the fitted tail, which n samples cannot check: label it as an estimate.
    """
    # lazy: scipy.stats (~0.3 s) only when called; this module imports without it
    from scipy.stats import skewnorm

    s = np.sort(np.asarray(sample_logppl, dtype=np.float64))
    x = np.asarray(canary_logppl, dtype=np.float64)
    ceil = ceiling_fraction(len(s))
    f = _sample_fraction(x, s)
    a, loc, scale = skew_normal_moments(s)
    fit = np.minimum(skewnorm.cdf(x, a, loc=loc, scale=scale), ceil)
    return _exposure_of(np.where(f <= ceil, fit, f), space_size)


EXTRAPOLATION = ("skew-normal fit of the sampled candidates' log-perplexities beyond the "
                 "ceiling (an estimate, not a bound)")


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
    """Log-perplexity (summed NLL, nats) of the whole canary, the template with each secret, as
    the Secret Sharer defines it: every token after the start token is scored.

    The template's text around the secret is the same for every candidate, but its tokens need
    not be: a byte-level BPE (GPT-2's) may merge the space before the secret with a first digit
    it has seen there and keep it apart from another, so a span that starts at a token boundary
    of one candidate's tokenization scores a token another candidate does not have. Scoring the
    whole canary ranks every candidate on the same quantity under any tokenizer, and the same
    quantity whichever set of candidates is scored beside it (canaries and candidates are scored
    in separate calls). Without a start token the first token of the template is not scored: a
    constant for every candidate unless the template starts with the secret.

    Both engines run the candidates' longest common token prefix once and score only what
    follows it (`memaudit.probes.scoring.shared_prefix_nll`, `JaxLM.shared_prefix_nll`): the same
    sums. On the CPU the JAX engine also runs each distinct prefix of the candidates' own tokens
    once (`memaudit.probes.jax_trie.trie_nll`: digit secrets share their leading digits, 2.55x fewer tokens at 8
    digits, 1.3-1.6x faster); on a TPU v5e the trie's gathers cost what its tokens save (1.634
    against 1.644 s a canary of 10^5 candidates at 125m), and accelerators take the grouped path
    (`memaudit.probes.jax_groups.grouped_nll`, `JAX_ACCEL_PATH`): the distinct first digits run
    once as heads and the rest in chunks of one head, with no per-row gathers (1.125 against
    1.645 s a canary there, 1.46x; docs/results.md).
    """
    prefix, suffix = template.split("{secret}")  # not str.format: the template may hold other braces
    seqs = encode_many(codec, [prefix + s + suffix for s in secrets])
    if getattr(model, "is_jax", False):
        # lazy: jax only with a JAX model, which has imported it already
        import jax

        path = "trie" if jax.default_backend() == "cpu" else JAX_ACCEL_PATH
        return jax_exposure_path(path)(model, seqs, progress=progress)
    # lazy: torch (~2 s) only when called; this module imports without it
    from memaudit.probes.scoring import shared_prefix_nll

    return shared_prefix_nll(model, seqs, batch_size=batch_size, progress=progress)


# Which JAX path scores exposure's candidates on an accelerator: "flat" (`JaxLM.shared_prefix_nll`),
# "trie" (`jax_trie.trie_nll`) or "grouped" (`jax_groups.grouped_nll`); all give the same sums.
# Grouped: 1.46x the flat path's candidates a second on a TPU v5e at 125m (10 canaries of 10^5
# 8-digit candidates, `benchmarks/probe_jax.py --parts exposure`, docs/results.md).
JAX_ACCEL_PATH = "grouped"


def jax_exposure_path(name: str):
    """The function `(lm, seqs, *, progress)` -> summed NLLs of a JAX exposure path by name."""
    if name == "flat":
        return lambda lm, seqs, *, progress=None: lm.shared_prefix_nll(seqs, progress=progress)
    if name == "trie":
        # lazy: the JAX paths only with a JAX model, which has imported jax already
        from memaudit.probes.jax_trie import trie_nll

        return trie_nll
    if name == "grouped":
        # lazy: as above
        from memaudit.probes.jax_groups import grouped_nll

        return grouped_nll
    raise ValueError(f"unknown JAX exposure path '{name}'; use 'flat', 'trie' or 'grouped'")


def encode_many(codec, texts: list[str]) -> list[list[int]]:
    """`codec.encode` of each text, the tokenizer called once on the whole list (a fast
    tokenizer encodes a batch in Rust: about 2x fewer seconds than one call per text on 10^4
    candidates, measured); not remembered by the codec, as each candidate is scored once."""
    return codec.batch(texts)


def canary_items(canaries) -> list[tuple[dict, str]]:
    """(canary, role) for every inserted and reference canary of a canaries.json document."""
    items = [(c, "inserted") for c in canaries.inserted] + [
        (c, "reference") for c in canaries.references
    ]
    if not items:
        raise ValueError("canaries file has no inserted or reference canaries; nothing to expose")
    return items


def run_exposure(
    model,
    codec,
    canaries,
    *,
    batch_size: int,
    enumerate_max: int = 10_000,
    n_samples: int = 10_000,
    seed: int = 0,
    n_boot: int = 1000,
    progress=None,
) -> dict:
    """Score every canary and the candidate space with the model, then `exposure_result`."""
    size = secret_space(canaries.alphabet, canaries.secret_length)
    items = canary_items(canaries)
    canary_lp = score_secrets(
        model, codec, canaries.template, [c.secret for c, _ in items], batch_size=batch_size
    )
    if size <= enumerate_max:
        method, cands = "enumeration", enumerate_secrets(canaries.alphabet, canaries.secret_length)
    else:
        method = "sampling"
        cands = sample_secrets(canaries.alphabet, canaries.secret_length, n_samples, seed)
    cand_lp = score_secrets(
        model, codec, canaries.template, cands, batch_size=batch_size, progress=progress
    )
    out = exposure_result(
        canary_lp, cand_lp, [(c.id, role, c.repetitions, c.owner_kind) for c, role in items],
        space_size=size, method=method, n_boot=n_boot, seed=seed,
    )
    out["settings"] = {
        "method": method,
        "space_size": size,
        "candidates_scored": len(cands),
        "enumerate_max": enumerate_max,
        "n_samples": n_samples,
    }
    return out


def exposure_result(
    canary_lp: np.ndarray,
    cand_lp: np.ndarray,
    items: list[tuple[str, str, int, str | None]],
    *,
    space_size: int,
    method: str,
    n_boot: int = 1000,
    seed: int = 0,
) -> dict:
    """Pure statistics: exposures from log-perplexities; items are (id, role, repetitions, owner).

    Returns {"summary", "scores"}; no secret is included. Inserted canaries are reported as
    excess exposure over the same run's reference canaries, with a one-sided Mann-Whitney test
    per repetition bucket (Holm-adjusted across buckets).
    """
    sampled = method != "enumeration"
    if not sampled:
        exp, bound = exact_exposure(canary_lp, cand_lp), np.zeros(len(canary_lp), bool)
    else:
        exp, bound = estimated_exposure(canary_lp, cand_lp, space_size), tail_mask(canary_lp, cand_lp)
        extra = extrapolated_exposure(canary_lp, cand_lp, space_size)
        held = at_ceiling(canary_lp, cand_lp)
    scores = [
        {
            "id": cid,
            "role": role,
            "repetitions": int(rep or 0),
            "owner_kind": owner,
            "log_perplexity": float(lp),
            "exposure": float(e),
            "lower_bound": bool(b),
        }
        for (cid, role, rep, owner), e, lp, b in zip(items, exp, canary_lp, bound, strict=True)
    ]
    summary = _summarise(scores, space_size, method, n_boot, seed)
    if sampled:
        for row, x, h in zip(scores, extra, held, strict=True):
            row["exposure_extrapolated"] = float(x)
            row["at_ceiling"] = bool(h)
        ceil = ceiling_fraction(len(cand_lp))
        summary["ceiling"] = float(_exposure_of(np.array([ceil]), space_size)[0])
        summary["extrapolation"] = EXTRAPOLATION
    return {"summary": summary, "scores": scores}


def _summarise(scores, size, method, n_boot, seed) -> dict:
    ins = [s for s in scores if s["role"] == "inserted"]
    ref = np.array([s["exposure"] for s in scores if s["role"] == "reference"])
    ref_mean = float(ref.mean()) if len(ref) else None

    def bucket(group: list[dict]) -> dict:
        e = np.array([s["exposure"] for s in group])
        out = {"all": mean_summary(e, unit="canaries", n_boot=n_boot, seed=seed).to_json(),
               "lower_bound": any(s["lower_bound"] for s in group)}
        for kind in sorted({str(s["owner_kind"]) for s in group}):
            sub = np.array([s["exposure"] for s in group if str(s["owner_kind"]) == kind])
            out[kind] = mean_summary(sub, unit="canaries", n_boot=n_boot, seed=seed).to_json()
        if ref_mean is not None and len(e):
            out["excess"] = mean_summary(e - ref_mean, unit="canaries", n_boot=n_boot, seed=seed).to_json()
            out["test"] = {"test": "mann-whitney-u one-sided (inserted > references)",
                           "p_value": mann_whitney(e, ref, alternative="greater"),
                           "n": len(e), "n_references": len(ref)}
        return out

    by_rep = {str(rep): bucket([s for s in ins if s["repetitions"] == rep])
              for rep in sorted({s["repetitions"] for s in ins})}
    tested = [k for k, v in by_rep.items() if "test" in v]
    for k, adj in zip(tested, holm([by_rep[k]["test"]["p_value"] for k in tested]), strict=True):
        by_rep[k]["test"]["p_holm"] = adj
    ins_e = np.array([s["exposure"] for s in ins])
    overall = None
    if len(ins_e) and len(ref):
        overall = {"test": "mann-whitney-u one-sided (inserted > references)",
                   "p_value": mann_whitney(ins_e, ref, alternative="greater")}
    return {
        "max_exposure": math.log2(size),
        "method": method,
        "inserted": mean_summary(ins_e, unit="canaries", n_boot=n_boot, seed=seed).to_json(),
        "references": mean_summary(ref, unit="canaries", n_boot=n_boot, seed=seed).to_json(),
        "null_mean": 1 / math.log(2),
        "by_repetitions": by_rep,
        "inserted_vs_references": overall,
    }
