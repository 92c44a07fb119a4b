"""The report's blocks, typed: the comparisons (their blocks of tests, the matched-utility pairs,
the utility curves, the frontier), the plot data of a run, and the findings' sentences.

report.json holds them as JSON objects; the functions that read them (`memaudit.reports.findings`,
`memaudit.reports.plots`) read them through these records (`memaudit.reports.entries.Record`), a
missing key taking its field's default. The comparison cells and tests they hold stay the
objects the report adjusts in place (`memaudit.reports.findings.adjust_report`); the literature
section's records (`Section`) are made typed and corrected into new records.

>>> c = Comparisons.of({"matched_utility": {"tolerance": 0.1, "pairs": [{"runs": ["a", "b"]}]}})
>>> c.matched_utility.tolerance, c.pair_runs(), c.frontier_metrics()
(0.1, [['a', 'b']], {})
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from memaudit.probes.records import Cell
from memaudit.reports.entries import Record


# ----------------------------------------------------------------------------- plot data
@dataclass(frozen=True, kw_only=True)
class FrontierPoint(Record):
    """A run on a metric's frontier (`memaudit.reports.frontier`): its utility and the cell."""

    run: str | None = None
    epsilon: float = math.inf
    unit: str | None = None
    perplexity: float | None = None
    value: float | None = None
    ci_low: float | None = None
    ci_high: float | None = None
    n: int | None = None
    n_unit: str | None = None
    note: str | None = None
    lower_bound: bool = False


@dataclass(frozen=True, kw_only=True)
class RepetitionPoint(Record):
    """A cell at one repetition count (exposure by repetitions) or repeat bucket (extraction)."""

    repetitions: int | None = None
    prefix_len: int | None = None
    repeats: int | None = None
    value: float | None = None
    ci_low: float | None = None
    ci_high: float | None = None
    lower_bound: bool = False

    @property
    def errors(self) -> tuple[float, float]:
        """The error bar's lengths below and above the value (0 without an interval)."""
        lo = self.value if self.ci_low is None else self.ci_low
        hi = self.value if self.ci_high is None else self.ci_high
        return self.value - lo, hi - self.value


@dataclass(frozen=True, kw_only=True)
class Roc(Record):
    """An ROC curve as the report keeps it (`memaudit.reports.probes_adapter.roc_points`)."""

    fpr: list = field(default_factory=list)
    tpr: list = field(default_factory=list)
    auc: float | None = None
    attack: str | None = None
    n_pos: int | None = None
    n_neg: int | None = None


@dataclass(frozen=True, kw_only=True)
class Spread(Record):
    mean: float | None = None
    std: float | None = None


@dataclass(frozen=True, kw_only=True)
class CurvePoint(Record):
    """A configuration on the utility curve: its epsilon, perplexity and lead leakage over seeds."""

    epsilon: float = math.inf
    perplexity: Spread = field(default_factory=Spread)
    leakage: Spread = field(default_factory=Spread)
    n_seeds: int | None = None


@dataclass(frozen=True, kw_only=True)
class FrontierSeries(Record):
    label: str | None = None
    points: list = field(default_factory=list)

    @property
    def frontier_points(self) -> list[FrontierPoint]:
        return [FrontierPoint.of(p) for p in self.points]


@dataclass(frozen=True, kw_only=True)
class FrontierMetric(Record):
    """One headline metric's frontier: a series per backend (and what changes its curve)."""

    label: str | None = None
    unit: str | None = None
    series: list = field(default_factory=list)
    n_points: int = 0
    all_zero: bool = False

    def each_series(self) -> list[FrontierSeries]:
        return [FrontierSeries.of(s) for s in self.series]


# ----------------------------------------------------------------------------- comparisons
@dataclass(frozen=True, kw_only=True)
class CurveSeries(Record):
    label: str | None = None
    points: list = field(default_factory=list)
    leakage_label: str | None = None


@dataclass(frozen=True, kw_only=True)
class MatchedPair(Record):
    """A centralized and a federated run within the utility tolerance (`frontier.matched_utility`):
    each list holds the centralized side first."""

    runs: list = field(default_factory=list)
    log_ratio: float | None = None
    perplexity: list = field(default_factory=list)
    epsilon: list = field(default_factory=list)
    units: list = field(default_factory=list)
    metrics: dict = field(default_factory=dict)


@dataclass(frozen=True, kw_only=True)
class MatchedUtility(Record):
    tolerance: float | None = None
    pairs: list = field(default_factory=list)
    closest: dict | None = None
    status: str | None = None
    message: str | None = None

    def each_pair(self) -> list[MatchedPair]:
        return [MatchedPair.of(p) for p in self.pairs or []]


@dataclass(frozen=True, kw_only=True)
class FrontierOrigin(Record):
    run: str | None = None
    perplexity: float | None = None
    leakage: dict = field(default_factory=dict)


@dataclass(frozen=True, kw_only=True)
class Frontier(Record):
    utility: str | None = None
    origin: FrontierOrigin = field(default_factory=FrontierOrigin)
    metrics: dict = field(default_factory=dict)


@dataclass(frozen=True, kw_only=True)
class Comparisons(Record):
    """report.json's `comparisons`: the blocks of tests (matched epsilon, samplings, effects,
    matched utility, targets), the utility curves and the frontier."""

    matched: list = field(default_factory=list)
    samplings: list = field(default_factory=list)
    effects: list = field(default_factory=list)
    curves: list = field(default_factory=list)
    matched_utility: MatchedUtility = field(default_factory=MatchedUtility)
    frontier: Frontier = field(default_factory=Frontier)
    targets: list = field(default_factory=list)

    def frontier_metrics(self) -> dict[str, FrontierMetric]:
        return {k: FrontierMetric.of(m) for k, m in (self.frontier.metrics or {}).items()}

    def origin(self) -> dict[str, FrontierPoint]:
        """The public base's point per metric ({} without a base)."""
        return {k: FrontierPoint.of(p) for k, p in (self.frontier.origin.leakage or {}).items()}

    def pair_runs(self) -> list[list[str]]:
        """The two runs of each matched-utility pair."""
        return [p.runs for p in self.matched_utility.each_pair()]

    def each_curve(self) -> list[CurveSeries]:
        return [CurveSeries.of(c) for c in self.curves or []]


@dataclass(frozen=True, kw_only=True)
class Block(Record):
    """One comparison of two sides, as report.json's `comparisons` lists them: a matched-epsilon
    backend pair (`units` and `algorithm` by backend), a ULS-vs-ELS sampling pair, a treatment
    effect (`treatment` against its baseline on `backend_label`) or a pair of probed `targets`.
    `metrics`: per metric, both sides' cells, the verdict and the test; `perplexity` by side."""

    epsilon: float = math.inf
    units: Any = None
    algorithm: dict | None = None
    equal_guarantee: bool | None = None
    unit: str | None = None
    goldfish: bool = False
    finetune: str = "full"
    backend: str | None = None
    backend_label: str | None = None
    treatment: str | None = None
    targets: list = field(default_factory=list)
    skipped: str | None = None
    metrics: dict = field(default_factory=dict)
    perplexity: dict = field(default_factory=dict)


def blocks(comparisons: Mapping[str, Any] | None, name: str) -> list[Block]:
    """The comparisons' blocks of one kind ("matched", "samplings", "effects", "targets")."""
    return [Block.of(b) for b in (comparisons or {}).get(name) or []]




# ----------------------------------------------------------------------------- findings
@dataclass(frozen=True, kw_only=True)
class Series(Record):
    """What the findings of one treatment at several levels share (`effect_findings`)."""

    backend_label: str | None = None
    treatment: str | None = None
    level: str | None = None
    epsilon: float | None = None
    perplexity: list = field(default_factory=list)  # treated, baseline
    tolerance: float | None = None
    key: list | None = None
    treated: str | None = None
    baseline: str | None = None
    test_text: str | None = None


@dataclass(frozen=True, kw_only=True)
class Sentence(Record):
    """A finding as the findings section holds it (`Finding.to_json`, or an audit's)."""

    kind: str | None = None
    group: str | None = None
    metric: str | None = None
    claim: str | None = None
    evidence: str | None = None
    short: str | None = None
    caveat: str | None = None
    verdict: str | None = None
    scope: str | None = None
    test: str | None = None
    p_adjusted: float | None = 0.0  # an audit has none: it sorts first within its group
    correction: str | None = None
    family: int | None = None
    text: str | None = None
    series: Series | None = None

    @property
    def passes(self) -> bool:
        return self.verdict in ("less", "more")


@dataclass(frozen=True, kw_only=True)
class HeadlineEntry(Record):
    """One finding of the first screen (`memaudit.reports.findings.headline`)."""

    text: str | None = None
    evidence: str | None = None
    caveat: str | None = None
    verdict: str | None = None
    group: str | None = None
    metric: str | None = None
    covers: int = 1


@dataclass(frozen=True, kw_only=True)
class Findings(Record):
    """report.json's `findings` (`memaudit.reports.findings.generate`)."""

    sentences: list = field(default_factory=list)
    headline: list = field(default_factory=list)
    passing: int | None = None  # None (a report from before the count): the headline's
    covered: int | None = None
    matched_pairs: list = field(default_factory=list)
    no_difference: list = field(default_factory=list)
    caveats: list = field(default_factory=list)
    correction: str = "holm"
    tests: int = 0
    alpha: float | None = None

    def first_screen(self) -> list[HeadlineEntry]:
        return [HeadlineEntry.of(h) for h in self.headline or []]


# ----------------------------------------------------------------------------- the literature section
@dataclass(frozen=True, kw_only=True)
class SectionTest(Record):
    """One test of the section: the bucket's Mann-Whitney test or a run's trend (Spearman `rho`;
    a bucket's test has none), with its adjustment once the report's family is corrected
    (`memaudit.reports.family.correct`) and its verdict ("shown", "not shown")."""

    OPTIONAL = frozenset({"rho"})

    test: str | None = None
    rho: float | None = None
    p_value: float | None = None
    n_a: int | None = None
    n_b: int | None = None
    unit: str | None = None
    p_adjusted: float | None = None
    correction: str | None = None
    family: int | None = None
    alpha: float | None = None
    verdict: str | None = None


@dataclass(frozen=True, kw_only=True)
class Bucket(Record):
    """A run's canaries of one repetition count and owner kind: the excess over the references."""

    repetitions: int | None = None
    owner_kind: str | None = None
    effective_epsilon: float | None = None
    rule: str | None = None
    test: SectionTest | None = None
    excess: Cell | None = None
    note: str | None = None  # why it has no test ("n too small"); absent from a tested bucket

    OPTIONAL = frozenset({"note"})


@dataclass(frozen=True, kw_only=True)
class ExposureEntry(Record):
    run: str | None = None
    label: str | None = None
    backend: str | None = None
    epsilon: float = math.inf
    unit: str | None = None
    trend: SectionTest | None = None
    buckets: list[Bucket] = field(default_factory=list)

    def each_bucket(self) -> list[Bucket]:
        return [Bucket.of(b) for b in self.buckets or []]


@dataclass(frozen=True, kw_only=True)
class AllThresholds(Record):
    eps: float | None = None
    confidence: float | None = None
    thresholds: int | None = None


@dataclass(frozen=True, kw_only=True)
class GdpEstimate(Record):
    eps: float | None = None
    ci_low: float | None = None
    ci_high: float | None = None
    assumes: str | None = None


@dataclass(frozen=True, kw_only=True)
class AuditEntry(Record):
    run: str | None = None
    label: str | None = None
    bound: float | None = None
    ledger_epsilon: float = math.inf
    ceiling: float | None = None
    n: int | None = None
    unit: str | None = None
    confidence: float | None = None
    verdict: str | None = None
    guesses: int | None = None
    correct: int | None = None
    canaries: str | None = None
    score: str | None = None
    all_thresholds: AllThresholds | None = None
    gdp_estimate: GdpEstimate | None = None


@dataclass(frozen=True, kw_only=True)
class DpLearns(Record):
    """A DP fine-tune's share of the holdout-loss gap closed (`closed`, None without a gap to close,
    and then no `loss`), its mean losses and the verdict against half."""

    OPTIONAL = frozenset({"loss"})

    backend: str | None = None
    run: str | None = None
    label: str | None = None
    epsilon: float | None = None
    closed: Cell | None = None
    loss: dict | None = None  # base, no_dp, dp (nats per token) and their unit
    verdict: str | None = None


@dataclass(frozen=True, kw_only=True)
class ExtractionEntry(Record):
    """A non-DP run's extraction: per metric its cell, with k of n units extracted (`Extracted`)."""

    run: str | None = None
    label: str | None = None
    metrics: dict[str, Cell] = field(default_factory=dict)  # with k, what and nonzero beside the cell


@dataclass(frozen=True, kw_only=True)
class Section(Record):
    """The literature section (`memaudit.reports.literature`): per run its exposure entries (their
    buckets' and trend's tests), extraction, audit and DP-learns entries; the correction, its
    family's size and alpha; the sentences that follow from the corrected tests."""

    exposure: list[ExposureEntry] = field(default_factory=list)
    extraction: list[ExtractionEntry] = field(default_factory=list)
    audit: list = field(default_factory=list)  # objects read with AuditEntry: they keep every key of the bounds
    dp_learns: list[DpLearns] = field(default_factory=list)
    alpha: float | None = None
    correction: str | None = None
    family: int | None = None
    sentences: list = field(default_factory=list)

    def exposure_entries(self) -> list[ExposureEntry]:
        return [ExposureEntry.of(e) for e in self.exposure or []]


@dataclass(frozen=True, kw_only=True)
class Extracted(Record):
    """k of n units extracted (`what`), as the section's extraction cells say."""

    k: int | None = None
    n: int | None = None
    what: str | None = None
