"""Membership scores calibrated by reference models: the loss ratio against one reference (the
fine-tune's base), offline LiRA and offline RMIA against k reference models trained without the
candidates.

Every function here takes score arrays and returns a score per candidate (higher = more likely a
member), so `memaudit.probes.membership.run_membership` reports AUC and TPR at low FPR for them
like any other attack. The per-candidate statistic of a model is its mean token log-likelihood.

- ratio (Carlini et al. 2021, "zlib/reference"; the base as reference for a fine-tune):
  log-likelihood under the target minus under the reference.
- LiRA offline (Carlini et al. 2022, sec. IV-C): the one-sided Gaussian likelihood ratio of the
  target's score against the OUT distribution of the reference models' scores for the same
  candidate; with few reference models the variance is pooled over candidates (the paper's
  "fixed variance"). A pooled variance makes the score a monotone function of target minus the
  references' mean, so it ranks every candidate exactly as `ratio_mean` does: `reference_attacks`
  lists LiRA only from `LIRA_MIN_MODELS_PER_EXAMPLE_VARIANCE` (16) references, where each
  candidate has its own variance.
- RMIA offline (Zarifzadeh et al. 2024, ICML): Pr(x|θ)/Pr(x) with Pr(x) the reference models'
  mean probability, corrected for having OUT models only by Pr(x) ≈ ((1+a)/2)·mean_out + (1-a)/2.
  Here a probability is a document's per-token geometric mean (e^mean log-likelihood, ~0.05 for
  a small LM), next to which any constant (1-a)/2 swamps the reference term and turns RMIA into
  the loss attack; the paper tunes a on a reference model with known IN data, which offline
  references do not have, so a = 1 (Pr(x) = the OUT mean) unless set. Its score is the fraction of population samples z with LR(x)/LR(z) > γ. With one population
  for all candidates that fraction is monotone in LR(x), so AUC and TPR at FPR equal ranking by
  log LR(x); the score returned is the fraction (its ranking is the paper's).

References:
    Carlini et al. 2022, "Membership Inference Attacks From First Principles" (LiRA).
    Zarifzadeh, Liu, Ramos, Shokri 2024, "Low-Cost High-Power Membership Inference Attacks"
    (RMIA; ML Privacy Meter 2).
    Duan et al. 2024, "Do Membership Inference Attacks Work on Large Language Models?" (MIMIR).

>>> import numpy as np
>>> ratio_scores(np.array([-1.0, -2.0]), np.array([-1.5, -1.5]))
array([ 0.5, -0.5])
"""

from __future__ import annotations

import numpy as np
from scipy.stats import norm

from memaudit.probes.sources import load_model, resolve_model
from memaudit.probes.targets import load_tokenizer

LIRA_MIN_MODELS_PER_EXAMPLE_VARIANCE = 16  # below this, one pooled variance (Carlini et al.)


def ratio_scores(target: np.ndarray, reference: np.ndarray) -> np.ndarray:
    """Target minus reference mean log-likelihood per candidate (the loss-ratio attack)."""
    return np.asarray(target, float) - np.asarray(reference, float)


def lira_offline(target: np.ndarray, refs: np.ndarray) -> np.ndarray:
    """Offline LiRA: log Pr[score >= target | OUT] negated, per candidate.

    Args:
        target: (n,) the target model's score per candidate.
        refs: (k, n) each OUT reference model's score per candidate.

    Returns:
        (n,) -log(1 - Φ((target - μ_out) / σ_out)); higher = more likely a member.
    """
    refs = np.atleast_2d(np.asarray(refs, float))
    k = refs.shape[0]
    mu = refs.mean(0)
    if k >= LIRA_MIN_MODELS_PER_EXAMPLE_VARIANCE:
        sd = refs.std(0, ddof=1)
    else:  # few models: a per-candidate variance from k values is noise; pool it
        sd = np.full_like(mu, np.sqrt(np.mean(refs.var(0, ddof=1))) if k > 1 else 1.0)
    z = (np.asarray(target, float) - mu) / np.maximum(sd, 1e-12)
    return -norm.logsf(z)


def rmia_offline(target: np.ndarray, refs: np.ndarray, *, a: float = 1.0, gamma: float = 1.0,
                 population: np.ndarray | None = None,
                 population_refs: np.ndarray | None = None) -> np.ndarray:
    """Offline RMIA on mean log-likelihoods (probabilities are their exponentials).

    Args:
        target: (n,) the target's mean log-likelihood per candidate.
        refs: (k, n) the OUT reference models' mean log-likelihoods per candidate.
        a: the offline correction of Pr(x) from OUT models only (1: none; see above).
        gamma: the likelihood-ratio threshold of a pairwise comparison.
        population, population_refs: the same for population samples z (default: the
            candidates themselves, which leaves the ranking unchanged).

    Returns:
        (n,) the fraction of population samples each candidate dominates.
    """
    def log_lr(t, r):
        r = np.atleast_2d(np.asarray(r, float))
        # log mean_j p_j, computed stably, then the offline mixture with 1
        log_mean_out = np.logaddexp.reduce(r, axis=0) - np.log(r.shape[0])
        if a >= 1:
            return np.asarray(t, float) - log_mean_out
        log_px = np.logaddexp(np.log((1 + a) / 2) + log_mean_out, np.log((1 - a) / 2))
        return np.asarray(t, float) - log_px

    if not 0 <= a <= 1:
        raise ValueError(f"RMIA's a must lie in [0, 1], got {a}")
    lx = log_lr(target, refs)
    lz = lx if population is None else log_lr(population, population_refs)
    lz = np.sort(lz)
    # #{z : LR(x)/LR(z) > gamma} = #{z : log LR(z) < log LR(x) - log gamma}
    return np.searchsorted(lz, lx - np.log(gamma), side="left") / len(lz)


def reference_attacks(target: np.ndarray, refs: np.ndarray) -> dict[str, np.ndarray]:
    """The attacks k reference models allow: k = 1 ratio only; k >= 2 also RMIA; k >= 16 also
    LiRA (with fewer, its pooled variance ranks candidates exactly as the ratio attack: the same
    attack under a second name, not a third one)."""
    refs = np.atleast_2d(np.asarray(refs, float))
    out = {"ratio_mean": ratio_scores(target, refs.mean(0))}
    if refs.shape[0] >= LIRA_MIN_MODELS_PER_EXAMPLE_VARIANCE:
        out["lira_offline"] = lira_offline(target, refs)
    if refs.shape[0] >= 2:
        out["rmia_offline"] = rmia_offline(target, refs)
    return out


def models_mean_logp(sources: tuple[str, ...], codec, texts: list[str], *, max_tokens: int,
                     batch_size: int, device: str, dtype: str,
                     stride: int | None = None) -> np.ndarray:
    """(k, n) mean token log-likelihoods of `texts` under each reference model, loaded in turn.

    Every reference must share the target's tokenizer (as the ratio attack requires), so one
    encoding serves all; a model is released before the next is loaded. A text longer than
    `max_tokens` is scored in strided windows, as for the target.
    """
    # lazy: torch (~2 s) only when references are scored
    from memaudit.probes.membership import encode_texts
    from memaudit.probes.scoring import windowed_logprobs

    seqs = encode_texts(codec, texts)
    out = []
    for name in sources:
        src = resolve_model(name)
        if load_tokenizer(src.tokenizer_path).get_vocab() != codec.tok.get_vocab():
            raise ValueError(f"--reference-models '{name}' uses another tokenizer than the "
                             "target; pass reference models with the target's tokenizer")
        model = load_model(src, device=device, dtype=dtype)
        lp = windowed_logprobs(model, seqs, window=max_tokens, stride=stride,
                               batch_size=batch_size).logp
        out.append([x.mean() for x in lp])
        del model
    return np.array(out)
