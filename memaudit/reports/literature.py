"""The effects the memorization literature reports, checked by memaudit's own rules.

One section of the report, computed from the runs' per-unit scores (never from a stored verdict):

- **Exposure against repetitions.** Per run, the excess exposure of each canary bucket
  (repetitions x owner kind) over the run's reference canaries, with its effective epsilon
  under group privacy (`memaudit.reports.group`) and a one-sided Mann-Whitney test (inserted >
  references); per run a one-sided Spearman test that exposure rises with repetitions (Carlini et
  al. 2019). Where the effective epsilon is small the excess should vanish; where it is large it
  need not: under example-level DP a canary one user repeats r times is covered by r * epsilon,
  under user-level DP by epsilon (Thakkar et al. 2020). That contrast on the same canaries is
  the centralized-vs-federated answer.
- **Extraction without DP.** Exact extraction of member documents, canary completion and PII
  extraction of the non-DP fine-tunes: k of n with a Clopper-Pearson interval; "non-zero" means
  at least one unit extracted.
- **The one-run audit** (Steinke et al. 2023): each audit run's epsilon lower bound against the
  ledger's epsilon (positive without DP; at most the ledger's epsilon with it).
- **DP fine-tunes that learn.** Per backend and epsilon, the share of the holdout-loss gap between
  the public base and the non-DP fine-tune that the DP fine-tune closes, (L_base - L_dp) /
  (L_base - L_nodp), on the per-document losses of the same holdout documents (the membership
  probe's non-members), with a paired bootstrap interval (Li et al. 2022 report DP fine-tunes
  that keep most of the non-DP utility).

Every test of the section is Holm-corrected with every other test of the report, one family
(`memaudit.reports.findings.adjust_report`; built alone, over the section's own tests); a bucket with fewer than
`MIN_N` canaries gets "n too small" and no test.

References:
  Carlini et al. The Secret Sharer. USENIX Security 2019.
  Thakkar et al. Understanding unintended memorization in federated learning. 2020.
  Steinke, Nasr, Jagielski. Privacy auditing with one (1) training run. NeurIPS 2023.
  Li, Tramer, Liang, Hashimoto. Large language models can be strong differentially private
  learners. ICLR 2022.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from memaudit.backends import BACKENDS
from memaudit.probes.records import Cell
from memaudit.probes.stats import LEVEL, MIN_N, N_TOO_SMALL, cell, percentile_interval
from memaudit.reports.blocks import (
    AuditEntry,
    Bucket,
    DpLearns,
    ExposureEntry,
    Extracted,
    ExtractionEntry,
    Section,
    SectionTest,
)
from memaudit.reports.entries import RunEntry, UnitScores, entries
from memaudit.reports.family import ALPHA, CORRECTION, correct
from memaudit.reports.frontier import PUBLIC_BASE
from memaudit.reports.probes_adapter import at_ceiling

N_BOOT = 2000
HALF = 0.5  # the share of the loss gap a DP fine-tune at the largest epsilon should close


def _eps(run: RunEntry) -> float:
    e = run.privacy.epsilon
    return math.inf if e is None or e == "inf" else float(e)


def _comparison_runs(runs: list[RunEntry]) -> list[RunEntry]:
    return [r for r in runs if not r.audit and r.role != PUBLIC_BASE and not r.mitigation.goldfish]


def run_label(run: dict[str, Any] | RunEntry) -> str:
    run = RunEntry.of(run)
    sampling = run.privacy.user_sampling  # centralized per user: ELS or ULS
    side = run.backend + (f" ({sampling.upper()})" if sampling else "")
    e, unit = _eps(run), run.privacy.unit
    return f"{side}, no DP" if math.isinf(e) else f"{side}, epsilon = {e:.3g} per {unit}"


def _cell(value: float, n: int, unit: str, boot: np.ndarray | None) -> Cell:
    """A probe-style cell with the percentile interval of `boot` (the probes' own level)."""
    ci = percentile_interval(boot, LEVEL) if boot is not None and n > 0 and len(boot) else None
    return cell(value, n=n, unit=unit, ci=ci)


# ----------------------------------------------------------------------------- exposure
def _exposure_run(run: RunEntry, rng: np.random.Generator) -> ExposureEntry | None:
    """Per bucket: excess exposure over the references with its test; the rising-trend test
    (each test not yet corrected: `literature_section` does, then the report's family)."""
    # lazy: scipy.stats (~0.3 s) only when called; this module imports without it
    from scipy.stats import mannwhitneyu, spearmanr


    if not (raw := run.units_of("exposure_canaries")):
        return None
    u = UnitScores.of(raw)
    refs = np.asarray([v for v, role in zip(u.values, u.role, strict=True) if role == "reference"])
    at_top = u.lower_bound or [False] * len(u.values)  # reports from before the flag
    ins = [(v, r, o) for v, role, r, o in zip(u.values, u.role, u.repetitions, u.owner_kind, strict=True)
           if role == "inserted"]
    bounded = [b for b, role in zip(at_top, u.role, strict=True) if role == "inserted"]
    if not len(refs) or not ins:
        return None
    groups = {(g["repetitions"], g["owner_kind"]): g for g in run.group_privacy or []}
    buckets = []
    for rep, owner in sorted({(r, o) for _v, r, o in ins}):
        x = np.asarray([v for v, r, o in ins if (r, o) == (rep, owner)])
        k = sum(b for b, (_v, r, o) in zip(bounded, ins, strict=True) if (r, o) == (rep, owner))
        g = groups.get((rep, owner)) or {}
        bucket = Bucket(repetitions=int(rep), owner_kind=owner, effective_epsilon=g.get("effective_epsilon"),
                        rule=g.get("rule"))
        if len(x) < MIN_N:
            excess = at_ceiling(_cell(float(x.mean() - refs.mean()), len(x), "canaries", None), k)
            bucket = bucket.replace(excess=excess, note=N_TOO_SMALL)
        else:
            boot = (x[rng.integers(0, len(x), (N_BOOT, len(x)))].mean(1)
                    - refs[rng.integers(0, len(refs), (N_BOOT, len(refs)))].mean(1))
            excess = at_ceiling(_cell(float(x.mean() - refs.mean()), len(x), "canaries", boot), k)
            p = float(mannwhitneyu(x, refs, alternative="greater").pvalue)
            bucket = bucket.replace(excess=excess, test=SectionTest(
                test="Mann-Whitney U, one-sided (inserted > references)", p_value=p, n_a=len(x),
                n_b=len(refs), unit="canaries"))
        buckets.append(bucket)
    reps = np.asarray([r for _v, r, _o in ins], dtype=float)
    vals = np.asarray([v for v, _r, _o in ins])
    trend = None
    if len(vals) >= MIN_N and len(set(reps)) > 1:
        res = spearmanr(reps, vals, alternative="greater")
        trend = SectionTest(test="Spearman rank correlation, one-sided (rising)", rho=float(res.statistic),
                            p_value=float(res.pvalue), n_a=len(vals), n_b=len(vals), unit="canaries")
    return ExposureEntry(run=run.id, label=run_label(run), backend=run.backend, epsilon=_eps(run),
                         unit=run.privacy.unit, trend=trend, buckets=buckets)


# ----------------------------------------------------------------------------- extraction, audit
EXTRACTION = (("extraction_exact", "member documents extracted exactly"),
              ("canary_completion", "canary secrets completed greedily"),
              ("pii_extraction", "PII values extracted"))


def _extraction(runs: list[RunEntry]) -> list[ExtractionEntry]:
    """Per non-DP run, each extraction metric's cell with k of its n units extracted, what they
    are, and whether any was."""
    out = []
    for run in runs:
        if not math.isinf(_eps(run)):
            continue
        cells = {}
        for key, what in EXTRACTION:
            c = run.cell(key)
            if c and c.value is not None and c.n:
                k = round(c.value * c.n)
                cells[key] = c.replace(k=k, what=what, nonzero=k > 0)
        out.append(ExtractionEntry(run=run.id, label=run_label(run), metrics=cells))
    return out


def _audit(runs: list[RunEntry]) -> list[dict[str, Any]]:
    out = []
    for run in runs:
        a = run.cell("audit_epsilon")
        if not run.audit or not a or a.value is None:
            continue
        eps, bound, more = _eps(run), float(a.value), a.extra
        verdict = (("positive lower bound" if bound > 0 else "no leakage shown") if math.isinf(eps) else
                   ("below the ledger's epsilon" if bound <= eps else "ABOVE the ledger's epsilon"))
        out.append({"run": run.id, "label": run_label(run), "bound": bound, "ledger_epsilon": eps,
                    "ceiling": more.get("ceiling"), "n": a.n, "unit": a.unit,
                    "confidence": more.get("confidence"), "verdict": verdict,
                    "guesses": more.get("guesses"), "correct": more.get("correct"),
                    "canaries": more.get("canaries", "secret"), "score": more.get("score", "mean_log_likelihood"),
                    "all_thresholds": more.get("all_thresholds"), "gdp_estimate": more.get("gdp_estimate")})
    return out


# ----------------------------------------------------------------------------- DP learns
def _holdout_losses(run: RunEntry) -> dict[str, float]:
    """Per-document mean token loss of the membership probe's non-members (holdout documents)."""
    if not (raw := run.units_of("mia_auc")):
        return {}
    u = UnitScores.of(raw)
    return {i: -float(v) for i, v, m in zip(u.ids, u.values, u.member, strict=True) if not m}


def _dp_learns(runs: list[RunEntry], all_runs: list[RunEntry],
               rng: np.random.Generator) -> list[DpLearns]:
    base = next((r for r in all_runs if r.role == PUBLIC_BASE), None)
    if base is None:
        return []
    lb = _holdout_losses(base)
    out = []
    for backend in BACKENDS:
        side = [r for r in runs if r.backend == backend]
        nodp = next((r for r in side if math.isinf(_eps(r))), None)
        if nodp is None:
            continue
        ln = _holdout_losses(nodp)
        for run in sorted((r for r in side if not math.isinf(_eps(r))), key=_eps, reverse=True):
            ld = _holdout_losses(run)
            ids = sorted(set(lb) & set(ln) & set(ld))
            if not ids:
                continue
            b, n0, d = (np.asarray([m[i] for i in ids]) for m in (lb, ln, ld))
            if not b.mean() - n0.mean() > 0:  # nothing to close: the non-DP fine-tune is no better
                out.append(DpLearns(backend=backend, run=run.id, label=run_label(run), epsilon=_eps(run),
                                    verdict="no gap: the non-DP fine-tune does not beat the public base "
                                            f"on these {len(ids)} holdout documents"))
                continue
            idx = rng.integers(0, len(ids), (N_BOOT, len(ids)))
            with np.errstate(divide="ignore", invalid="ignore"):
                boot = (b[idx].mean(1) - d[idx].mean(1)) / (b[idx].mean(1) - n0[idx].mean(1))
            closed = float((b.mean() - d.mean()) / (b.mean() - n0.mean()))
            c = _cell(closed, len(ids), "holdout documents", boot[np.isfinite(boot)])
            verdict = ("at least half closed" if c.ci_low is not None and c.ci_low >= HALF else
                       "less than half closed" if c.ci_high is not None and c.ci_high < HALF else
                       "half not separated")
            out.append(DpLearns(backend=backend, run=run.id, label=run_label(run), epsilon=_eps(run), closed=c,
                                loss={"base": float(b.mean()), "no_dp": float(n0.mean()), "dp": float(d.mean()),
                                      "unit": "nats per token"}, verdict=verdict))
    return out


# ----------------------------------------------------------------------------- the section
def _trend_sentences(sec: Section) -> list[str]:
    out = []
    for e in sec.exposure_entries():
        t = e.trend
        if t:
            out.append(f"{e.label}: exposure rises with repetitions {'(shown)' if t.verdict == 'shown' else '(not shown)'}"
                       f": Spearman rho = {t.rho:.2f}, n = {t.n_a} canaries, Holm p = {t.p_adjusted:.3g}")
    return out


def extraction_sentences(sec: dict[str, Any] | Section) -> list[str]:
    """One sentence per non-DP run: k/n per extraction metric."""
    out = []
    for x in map(ExtractionEntry.of, Section.of(sec).extraction):
        ms = {k: Extracted.of(c) for k, c in x.metrics.items()}  # in EXTRACTION's order, whatever a stored report kept
        parts = [f"{ms[k].k}/{ms[k].n} {ms[k].what}" for k, _ in EXTRACTION if k in ms]
        if parts:
            out.append(f"{x.label}: " + ", ".join(parts))
    return out


AUDIT_CANARY_TEXT = {"secret": "random secrets by log-likelihood", "document": "new users' messages by Min-K%"}


def audit_sentences(sec: dict[str, Any] | Section) -> list[str]:
    """One sentence per audit run: its lower bound against the ledger's epsilon."""
    out = []
    for a in map(AuditEntry.of, Section.of(sec).audit):
        led = "no DP" if math.isinf(a.ledger_epsilon) else f"ledger epsilon = {a.ledger_epsilon:.3g}"
        kind = a.canaries or "secret"  # a report from before the kinds: secrets
        what = AUDIT_CANARY_TEXT.get(kind, kind)
        guessed = (f", {a.correct} of {a.guesses} guesses right" if a.guesses else "")
        conf = f", {a.confidence:.0%} one-sided" if a.confidence else ""
        out.append(f"{a.label}: one-run audit lower bound epsilon >= {a.bound:.3g} ({led}; "
                   f"n = {a.n} {a.unit}, {what}{guessed}{conf}; ceiling {a.ceiling:.3g}): "
                   f"{a.verdict}{_other_estimators(a)}")
    return out


def _other_estimators(a: AuditEntry) -> str:
    """The all-thresholds bound and the Gaussian-DP estimate beside the one-run bound, each named
    for what it is."""
    parts = []
    if (t := a.all_thresholds) is not None:
        parts.append(f"all-thresholds lower bound epsilon >= {t.eps:.3g} ({t.confidence:.0%} one-sided, "
                     f"Bonferroni over {t.thresholds} thresholds)")
    if (g := a.gdp_estimate) is not None:
        parts.append(f"Gaussian-DP estimate epsilon = {g.eps:.3g} [{g.ci_low:.3g}, {g.ci_high:.3g}] "
                     f"(an estimate, not a bound: assumes {g.assumes})")
    return ("; " + "; ".join(parts)) if parts else ""


def dp_learns_sentences(sec: dict[str, Any] | Section) -> list[str]:
    """One sentence per DP run: the share of the public-base-to-non-DP loss gap it closes."""
    out = []
    for g in map(DpLearns.of, Section.of(sec).dp_learns):
        if g.closed is None:
            out.append(f"{g.label}: {g.verdict}")
            continue
        c = g.closed
        ci = f" [{c.ci_low:.0%}, {c.ci_high:.0%}]" if c.ci_low is not None else ""
        out.append(f"{g.label}: closes {c.value:.0%}{ci} of the holdout-loss gap between the public "
                   f"base and the non-DP fine-tune (n = {c.n} holdout documents): {g.verdict}")
    return out


def _sentences(read: Section) -> list[str]:
    return [*_trend_sentences(read), *_contrast(read.exposure), *extraction_sentences(read),
            *audit_sentences(read), *dp_learns_sentences(read)]


def contrast_buckets(exposure: list[dict[str, Any] | ExposureEntry], *, dp_only: bool = False) -> list[tuple[ExposureEntry, Bucket]]:
    """(run entry, bucket) per run: its tested user-owned canaries at the most repetitions, the
    bucket where example-level and user-level DP differ most (without DP too unless `dp_only`)."""
    out = []
    for e in map(ExposureEntry.of, exposure):
        rows = [b for b in e.each_bucket() if b.owner_kind == "user" and b.test]
        if rows and not (dp_only and math.isinf(e.epsilon)):
            out.append((e, max(rows, key=lambda b: b.repetitions)))
    return out


def _contrast(exposure: list[dict[str, Any] | ExposureEntry]) -> list[str]:
    """Example-level vs user-level DP on the same user-owned canaries at the most repetitions."""
    out = []
    for e, b in contrast_buckets(exposure, dp_only=True):
        x = b.excess
        ci = f" [{x.ci_low:.2f}, {x.ci_high:.2f}]" if x.ci_low is not None else ""
        ge = ">= " if x.lower_bound else ""
        out.append(f"{e.label}, canaries one user repeats {b.repetitions} times (effective epsilon = "
                   f"{b.effective_epsilon:.3g}, {b.rule}): excess exposure {ge}{x.value:.2f}{ci} bits over "
                   f"the references (n = {x.n} canaries), {b.test.verdict} "
                   f"(Holm p = {b.test.p_adjusted:.3g})")
    return out


def literature_section(runs: list[dict[str, Any] | RunEntry], seed: int = 0) -> Section | None:
    """The section over `runs` (entries with their per-unit scores), its tests Holm-corrected over
    the section alone (a report corrects them again with all its tests, `settle`), or None with
    nothing to show."""
    runs = entries(runs)
    rng = np.random.default_rng(seed)
    comp = _comparison_runs(runs)
    exposure = [e for r in comp if (e := _exposure_run(r, rng)) is not None]
    sec = Section(exposure=exposure, extraction=_extraction(comp), audit=_audit(runs),
                  dp_learns=_dp_learns(comp, runs, rng), alpha=ALPHA, correction=CORRECTION)
    if not (sec.exposure or sec.extraction or sec.audit or sec.dp_learns):
        return None
    tests = tests_of(sec)
    return settle(sec, correct(tests, CORRECTION, ALPHA), len(tests))


def tests_of(sec: Section) -> list[SectionTest]:
    """The section's tests in a fixed order: every run's trend, then every run's tested buckets."""
    exposure = sec.exposure_entries()
    return [e.trend for e in exposure if e.trend] + [b.test for e in exposure for b in e.each_bucket() if b.test]


def passing(sec: Section) -> int:
    """The section's tests whose effect is shown."""
    return sum(t.verdict == "shown" for t in tests_of(sec))


def _decided(t: SectionTest) -> SectionTest:
    return t.replace(verdict="shown" if t.p_adjusted <= ALPHA else "not shown")


def settle(sec: Section, tests: list[SectionTest], family: int) -> Section:
    """The section with `tests` in place of `tests_of(sec)` (the same tests, corrected: by the
    report's one family of `family` tests, `memaudit.reports.family.correct`), each test's verdict,
    the family's size and the sentences that follow from them; `sec` is left as it was."""
    if len(tests) != len(tests_of(sec)):
        raise ValueError(f"the literature section holds {len(tests_of(sec))} tests, {len(tests)} given")
    given = iter(map(_decided, tests))
    exposure = sec.exposure_entries()
    trends = [next(given) if e.trend else None for e in exposure]  # tests_of's order: trends first
    exposure = [e.replace(trend=trend, buckets=[b.replace(test=next(given)) if b.test else b
                                                for b in e.each_bucket()])
                for e, trend in zip(exposure, trends, strict=True)]
    sec = sec.replace(exposure=exposure, family=family)
    return sec.replace(sentences=_sentences(sec))
