"""Memorization as the Goldfish-loss study measures it (`goldfish_extraction`).

Hans et al. (2024) prompt the model with a training document up to its last m = 50 tokens,
decode m tokens greedily and score them against the document's true last m tokens: exact match
(all m tokens equal) and ROUGE-L (Lin 2004), the F-measure of the longest common subsequence of
the generated and true tokens. memaudit computes ROUGE-L on token ids, so the tokenizer's pieces
are the units and no text is re-tokenized (rouge-score's whitespace/alphanumeric split of the
decoded text would merge or drop pieces such as digits of a canary); on text whose words are the
tokens it equals rouge-score's `rougeL` F-measure (tests/probes/test_goldfish_extraction.py).

Units: each member document (bucketed by how often it was repeated in training, like the
discoverable extraction beside it) and each inserted canary (by its repetitions). A unit with
fewer than `min_prompt` tokens before its last m is skipped and counted. A prompt that with its
m new tokens exceeds the context the model was trained with (the run's `seq_len`, at most the
model's `max_position_embeddings`) keeps its last tokens and is counted as truncated: a packed
document longer than `seq_len` was never seen whole in training.

References:
  Hans et al., "Be like a Goldfish, Don't Memorize! Mitigating Memorization in Generative
  LLMs", NeurIPS 2024 (Sec. 4: exact match and RougeL of the last 50 tokens).
  Lin, "ROUGE: A Package for Automatic Evaluation of Summaries", ACL Workshop 2004.
  Hyyro, "Bit-parallel LCS-length computation revisited", AWOCA 2004.

>>> lcs_length([1, 2, 3, 4, 5], [2, 9, 4, 5])
3
>>> rouge_l([1, 2, 3, 4], [1, 2, 3, 4])
1.0
>>> round(rouge_l([1, 2, 9, 9], [1, 2, 3, 4]), 3)
0.5
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from memaudit.probes.extraction import repeat_bucket
from memaudit.probes.stats import mean_summary, rate_summary


def lcs_length(a: Sequence[int], b: Sequence[int]) -> int:
    """Length of the longest common subsequence of two token sequences.

    Bit-parallel (Hyyro 2004): one bit per position of `a` in a Python integer, one add, and,
    or per token of `b`, so a 50 x 50 comparison is 50 big-integer steps instead of 2500 cells.
    """
    a, b = list(a), list(b)
    if not a or not b:
        return 0
    match: dict[int, int] = {}
    for i, x in enumerate(a):
        match[x] = match.get(x, 0) | (1 << i)
    full = (1 << len(a)) - 1
    v = full
    for y in b:
        u = v & match.get(y, 0)
        v = ((v + u) | (v - u)) & full
    return len(a) - v.bit_count()


def rouge_l(generated: Sequence[int], reference: Sequence[int]) -> float:
    """ROUGE-L F-measure (beta = 1, as rouge-score's `rougeL`): 2PR / (P + R) of the LCS."""
    lcs = lcs_length(generated, reference)
    if lcs == 0:
        return 0.0
    p, r = lcs / len(generated), lcs / len(reference)
    return 2 * p * r / (p + r)


@dataclass(frozen=True)
class Unit:
    """One scored sequence: a member document or an inserted canary (ids and counts only)."""

    id: str
    kind: str  # "doc" | "canary"
    repeats: int
    ids: list[int]


def goldfish_prompts(units: list[Unit], *, m: int, min_prompt: int, n_start: int,
                     max_context: int | None):
    """(kept units, prompts, targets, truncated flags) of the units long enough to score.

    A unit's ids are its start token(s) (`n_start` of them) and its document tokens; it is kept
    when at least `min_prompt` document tokens precede its last m. A prompt that would not fit
    the model's context with m new tokens keeps its last `max_context - m` tokens.
    """
    kept, prompts, targets, truncated = [], [], [], []
    for u in units:
        if len(u.ids) - n_start < min_prompt + m:
            continue
        prompt, target = u.ids[:-m], u.ids[-m:]
        cut = max_context is not None and len(prompt) + m > max_context
        if cut:
            prompt = prompt[len(prompt) + m - max_context :]
        kept.append(u)
        prompts.append(prompt)
        targets.append(target)
        truncated.append(cut)
    return kept, prompts, targets, truncated


def goldfish_extraction(
    model,
    codec,
    docs,
    canaries=None,
    *,
    m: int = 50,
    min_prompt: int = 32,
    context: int | None = None,
    batch_size: int = 32,
    n_boot: int = 1000,
    seed: int = 0,
    progress=None,
) -> dict:
    """Greedy decoding of the last m tokens of each member document and inserted canary.

    Model-facing (one batched greedy decode, `scoring.decode`); `goldfish_result` does the
    statistics. Args: `docs` are `targets.Doc`s, `canaries` a `loaders.Canaries` or None;
    `context` the most tokens (prompt + m) the model saw at once in training (a run's
    `seq_len`), capped by the model's `max_position_embeddings`; None: the model's limit only.
    Returns {"summary", "scores"}: per unit its id, kind, repeats, exact and rouge_l; no text.
    """
    # lazy: torch (~2 s) only when called; this module imports without it
    from memaudit.probes.scoring import decode

    if m < 1 or min_prompt < 1:
        raise ValueError(f"goldfish_m and goldfish_min_prompt must be >= 1, got {m} and "
                         f"{min_prompt}; use 50 and 32")
    units = [Unit(d.id, "doc", int(d.repeats), codec.encode(d.text)) for d in docs]
    if canaries is not None:
        units += [Unit(c.id, "canary", int(c.repetitions), codec.encode(c.text))
                  for c in canaries.inserted]
    limits = [c for c in (context, getattr(getattr(model, "config", None),
                                           "max_position_embeddings", None)) if c is not None]
    max_context = min(limits) if limits else None
    if max_context is not None and max_context <= m:
        raise ValueError(f"goldfish_m = {m} leaves no room for a prompt in a {max_context}-token "
                         f"context (the model's, or the run's seq_len); set probe goldfish_m "
                         f"below {max_context}")
    kept, prompts, targets, truncated = goldfish_prompts(
        units, m=m, min_prompt=min_prompt, n_start=len(codec.start), max_context=max_context)
    gen = decode(model, prompts, m, batch_size=batch_size, pad_id=codec.pad_id, progress=progress)
    rows = [
        {"id": u.id, "kind": u.kind, "repeats": u.repeats, "prompt_tokens": len(p),
         "truncated": cut, "exact": g.tolist() == t, "rouge_l": rouge_l(g.tolist(), t)}
        for u, p, g, t, cut in zip(kept, prompts, gen, targets, truncated, strict=True)
    ]
    n_units = {"doc": len(docs), "canary": len(canaries.inserted) if canaries is not None else 0}
    return goldfish_result(rows, n_units=n_units, m=m, min_prompt=min_prompt, n_boot=n_boot,
                           seed=seed)


def _cells(rows: list[dict], unit: str, n_boot: int, seed: int) -> dict:
    return {
        "exact": rate_summary(np.array([r["exact"] for r in rows], float), unit=unit,
                              n_boot=n_boot, seed=seed).to_json(),
        "rouge_l": mean_summary(np.array([r["rouge_l"] for r in rows], float), unit=unit,
                                n_boot=n_boot, seed=seed).to_json(),
    }


def goldfish_result(
    rows: list[dict],
    *,
    n_units: dict[str, int],
    m: int,
    min_prompt: int,
    n_boot: int = 1000,
    seed: int = 0,
) -> dict:
    """Pure statistics: exact-match rate (Clopper-Pearson) and mean ROUGE-L (bootstrap) by kind.

    Documents are bucketed by `extraction.repeat_bucket` of their repeats, canaries by their
    repetitions; each block states how many units were scored, skipped as too short and
    truncated to the model's context.
    """
    summary: dict = {"suffix_tokens": m, "min_prompt_tokens": min_prompt}
    for kind, unit, name, key in (("doc", "documents", "documents", "by_repeats"),
                                  ("canary", "canaries", "canaries", "by_repetitions")):
        if kind == "canary" and not n_units.get("canary"):
            continue
        per = [r for r in rows if r["kind"] == kind]
        bucket = repeat_bucket if kind == "doc" else str
        names = sorted({bucket(r["repeats"]) for r in per}, key=lambda b: int(b.split("-")[0]))
        summary[name] = {
            **_cells(per, unit, n_boot, seed),
            "scored": len(per),
            "skipped_short": n_units.get(kind, 0) - len(per),
            "truncated": sum(bool(r["truncated"]) for r in per),
            key: {b: _cells([r for r in per if bucket(r["repeats"]) == b], unit, n_boot, seed)
                  for b in names},
        }
    return {"summary": summary, "scores": rows}
