"""The report's blocks, typed: the comparisons (their blocks of tests, the matched-utility pairs,
the utility curves, the frontier), the plot data of a run, and the findings' sentences.

The comparisons are frozen records from where they are made (`memaudit.reports.build.comparisons`,
`memaudit.reports.frontier.matched_utility`, `memaudit.reports.targets.target_comparisons`): each
block (`MatchedBlock`, `SamplingBlock`, `EffectBlock`, `TargetPair`, `MatchedPair`) holds per
metric a `Compared` (both sides' cells, the verdict, the `Test`), and the report's one correction
(`memaudit.reports.findings.adjust_report`) returns them new; so does the literature section
(`Section`). report.json holds them as JSON objects, written and read back only by
`memaudit.reports.write`; a record read from an older report (`Record.of`) takes a missing key's
default and writes back only the keys that report had.

>>> c = Comparisons.of({"matched_utility": {"tolerance": 0.1, "pairs": [{"runs": ["a", "b"]}]}})
>>> c.matched_utility.tolerance, c.pair_runs(), c.frontier_metrics()
(0.1, [['a', 'b']], {})
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar

from memaudit.backends import CENTRALIZED
from memaudit.probes.records import Cell, Test
from memaudit.reports.entries import Record


class _AsRead:
    """A record read from an older report writes back the keys that report had: a key it lacked
    reads as the field's default (`Record.of`) and stays out of `to_json`, also in a `replace`d copy."""

    _absent: frozenset[str] = frozenset()

    @classmethod
    def of(cls, d: Any):
        rec = super().of(d)
        if isinstance(d, Mapping) and rec is not d:
            object.__setattr__(rec, "_absent", frozenset(f.name for f in dataclasses.fields(cls)) - set(d))
        return rec

    def to_json(self) -> dict[str, Any]:
        out = super().to_json()
        for k in self._absent:
            out.pop(k, None)
        return out

    def replace(self, **changes: Any):
        rec = super().replace(**changes)
        object.__setattr__(rec, "_absent", self._absent - set(changes))
        return rec


# ----------------------------------------------------------------------------- plot data
@dataclass(frozen=True, kw_only=True)
class FrontierPoint(_AsRead, Record):
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
class Spread(_AsRead, Record):
    mean: float | None = None
    std: float | None = None


@dataclass(frozen=True, kw_only=True)
class CurvePoint(_AsRead, Record):
    """A configuration on the utility curve: its epsilon, perplexity and lead leakage over seeds."""

    epsilon: float = math.inf
    perplexity: Spread = field(default_factory=Spread)
    leakage: Spread = field(default_factory=Spread)
    n_seeds: int | None = None


@dataclass(frozen=True, kw_only=True)
class FrontierSeries(_AsRead, Record):
    label: str | None = None
    points: list[FrontierPoint] = field(default_factory=list)

    @property
    def frontier_points(self) -> list[FrontierPoint]:
        return list(self.points)


@dataclass(frozen=True, kw_only=True)
class FrontierMetric(_AsRead, Record):
    """One headline metric's frontier: a series per backend (and what changes its curve)."""

    label: str | None = None
    unit: str | None = None
    series: list[FrontierSeries] = field(default_factory=list)
    n_points: int = 0
    all_zero: bool = False

    def each_series(self) -> list[FrontierSeries]:
        return list(self.series)


# ----------------------------------------------------------------------------- comparisons
@dataclass(frozen=True, kw_only=True)
class CurveSeries(_AsRead, Record):
    label: str | None = None
    points: list[CurvePoint] = field(default_factory=list)
    leakage_label: str | None = None


@dataclass(frozen=True, kw_only=True)
class Compared(Record):
    """One metric of a comparison: both sides' cells under their names (`names`, in the JSON
    object's order), the verdict and the test (None: no per-unit scores); a targets pair's
    membership cell also names its `attack`. Its JSON object is {name: cell, name: cell,
    "verdict", "test"[, "attack"]}."""

    names: tuple[str, str] = ("a", "b")
    cells: tuple[Cell | None, Cell | None] = (None, None)
    verdict: str = "not tested"
    test: Test | None = None
    attack: str | None = None

    @classmethod
    def of(cls, d: Mapping[str, Any] | Compared | None) -> Compared:
        """From its JSON object (the two keys that are not verdict, test or attack name the sides)."""
        if isinstance(d, cls):
            return d
        d = d if isinstance(d, Mapping) else {}
        own = {k: v for k, v in d.items() if k not in _COMPARED_KEYS}
        names = tuple(own)[:2]
        cells = tuple(None if v is None else v if isinstance(v, Cell) else Cell.from_json(v) for v in own.values())
        test = d.get("test")
        return cls(names=names, cells=cells[:2], verdict=d.get("verdict", "not tested"),
                   test=test if test is None or isinstance(test, Test) else Test.from_json(test),
                   attack=d.get("attack"))

    def to_json(self) -> dict[str, Any]:
        return {**dict(zip(self.names, self.cells, strict=True)), "verdict": self.verdict, "test": self.test,
                **({} if self.attack is None else {"attack": self.attack})}

    def side(self, name: str) -> Cell | None:
        """The cell of side `name` (None where the comparison has no such side)."""
        return dict(zip(self.names, self.cells, strict=True)).get(name)


_COMPARED_KEYS = frozenset({"verdict", "test", "attack"})


def compared(a: tuple[str, Cell], b: tuple[str, Cell], test: Test | None, **attack: str) -> Compared:
    """A metric's comparison before the report's correction: side `a` and side `b` (name, cell)."""
    return Compared(names=(a[0], b[0]), cells=(a[1], b[1]), test=test, **attack)


class _Tested(_AsRead):
    """A block of comparisons: its `metrics` (metric -> `Compared`) and `SIDES`, the names of the
    test's side a and side b."""

    SIDES: ClassVar[tuple[str, str]] = ("a", "b")

    def sides(self, c: Compared) -> tuple[Cell | None, Cell | None]:
        """Side a's and side b's cell of one metric."""
        return c.side(self.SIDES[0]), c.side(self.SIDES[1])

    def perplexities(self) -> tuple[float | None, float | None]:
        """Side a's and side b's mean holdout perplexity (None where unknown)."""
        ppl = getattr(self, "perplexity", None) or {}
        return ppl.get(self.SIDES[0]), ppl.get(self.SIDES[1])


@dataclass(frozen=True, kw_only=True)
class MatchedBlock(_Tested, Record):
    """Federated against centralized at one nominal epsilon (`memaudit.reports.build.comparisons`):
    each side's privacy unit and algorithm by backend, whether the guarantees are equal, per
    metric the comparison, mean perplexity by backend. A report from before the units has none."""

    SIDES: ClassVar[tuple[str, str]] = ("federated", CENTRALIZED)
    OPTIONAL: ClassVar[frozenset[str]] = frozenset({"units", "algorithm", "equal_guarantee"})

    epsilon: float = math.inf
    units: dict | None = None
    algorithm: dict | None = None
    equal_guarantee: bool | None = None
    metrics: dict[str, Compared] = field(default_factory=dict)
    perplexity: dict = field(default_factory=dict)

    def side_units(self) -> tuple[str | None, str | None]:
        """The federated and the centralized side's privacy unit (a report from before the units:
        user and example)."""
        units = self.units or {CENTRALIZED: "example", "federated": "user"}
        return units.get(self.SIDES[0]), units.get(self.SIDES[1])

    def algorithm_of(self, backend: str) -> str | None:
        """The algorithm of one side ("ULS", "ELS"; None where the backend has one only)."""
        return (self.algorithm or {}).get(backend)


@dataclass(frozen=True, kw_only=True)
class SamplingBlock(_Tested, Record):
    """Centralized per-user DP, ULS against ELS at one epsilon (and Goldfish, fine-tuning)."""

    SIDES: ClassVar[tuple[str, str]] = ("uls", "els")

    epsilon: float = math.inf
    unit: str | None = None
    goldfish: bool = False
    finetune: str = "full"
    metrics: dict[str, Compared] = field(default_factory=dict)
    perplexity: dict = field(default_factory=dict)


@dataclass(frozen=True, kw_only=True)
class EffectBlock(_Tested, Record):
    """A treatment (DP, Goldfish loss, LoRA) against its baseline on one backend (one-sided)."""

    SIDES: ClassVar[tuple[str, str]] = ("treated", "baseline")

    backend: str | None = None
    backend_label: str | None = None
    treatment: str | None = None
    epsilon: float = math.inf
    unit: str | None = None
    metrics: dict[str, Compared] = field(default_factory=dict)
    perplexity: dict = field(default_factory=dict)


@dataclass(frozen=True, kw_only=True)
class TargetPair(_Tested, Record):
    """Two probed outside models (`memaudit.reports.targets.target_comparisons`); `skipped` says
    why a pair has no test."""

    OPTIONAL: ClassVar[frozenset[str]] = frozenset({"skipped"})

    targets: list = field(default_factory=list)
    metrics: dict[str, Compared] = field(default_factory=dict)
    skipped: str | None = None


@dataclass(frozen=True, kw_only=True)
class MatchedPair(_Tested, Record):
    """A centralized and a federated run within the utility tolerance (`frontier.matched_utility`):
    each list holds the centralized side first; the tests are federated's against centralized's."""

    SIDES: ClassVar[tuple[str, str]] = ("federated", CENTRALIZED)

    runs: list = field(default_factory=list)
    log_ratio: float | None = None
    perplexity: list = field(default_factory=list)
    epsilon: list = field(default_factory=list)
    units: list = field(default_factory=list)
    metrics: dict[str, Compared] = field(default_factory=dict)


@dataclass(frozen=True, kw_only=True)
class MatchedUtility(_AsRead, Record):
    tolerance: float | None = None
    pairs: list[MatchedPair] = field(default_factory=list)
    closest: dict | None = None
    status: str | None = None
    message: str | None = None

    def each_pair(self) -> list[MatchedPair]:
        return list(self.pairs)


@dataclass(frozen=True, kw_only=True)
class FrontierOrigin(_AsRead, Record):
    """The public base model: its utility and its point per metric."""

    run: str | None = None
    perplexity: float | None = None
    leakage: dict[str, FrontierPoint] = field(default_factory=dict)


@dataclass(frozen=True, kw_only=True)
class Frontier(_AsRead, Record):
    """The frontier (`memaudit.reports.frontier.frontier`): the utility it is drawn against, the
    public base as its origin (None without one), a `FrontierMetric` per headline metric."""

    utility: str | None = None
    origin: FrontierOrigin | None = None
    metrics: dict[str, FrontierMetric] = field(default_factory=dict)


# the blocks of tests, in the order their tests enter the report's one family
BLOCKS = ("matched_utility", "matched", "samplings", "effects", "targets")


@dataclass(frozen=True, kw_only=True)
class Comparisons(Record):
    """report.json's `comparisons`: the blocks of tests (matched epsilon, samplings, effects,
    matched utility, targets), the utility curves and the frontier. `samplings` is None in a report from before them, `targets` where
    no outside model was probed: their keys are then absent."""

    OPTIONAL: ClassVar[frozenset[str]] = frozenset({"samplings", "targets"})

    matched: list[MatchedBlock] = field(default_factory=list)
    samplings: list[SamplingBlock] | None = None
    effects: list[EffectBlock] = field(default_factory=list)
    curves: list[CurveSeries] = field(default_factory=list)
    matched_utility: MatchedUtility = field(default_factory=MatchedUtility)
    frontier: Frontier = field(default_factory=Frontier)
    targets: list[TargetPair] | None = None

    def blocks(self, name: str) -> list:
        """The blocks of one kind (`BLOCKS`; "matched_utility": its pairs)."""
        if name == "matched_utility":
            return list(self.matched_utility.pairs)
        return list(getattr(self, name) or [])

    def with_blocks(self, new: Mapping[str, list]) -> Comparisons:
        """A copy with the blocks of `new` (by name, as `blocks` gives them) in place."""
        changes = {k: v for k, v in new.items() if k != "matched_utility" and getattr(self, k) is not None}
        if "matched_utility" in new:
            changes["matched_utility"] = self.matched_utility.replace(pairs=list(new["matched_utility"]))
        return self.replace(**changes)

    def frontier_metrics(self) -> dict[str, FrontierMetric]:
        return dict(self.frontier.metrics)

    def origin(self) -> dict[str, FrontierPoint]:
        """The public base's point per metric ({} without a base)."""
        return dict(self.frontier.origin.leakage) if self.frontier.origin else {}

    def pair_runs(self) -> list[list[str]]:
        """The two runs of each matched-utility pair."""
        return [p.runs for p in self.matched_utility.each_pair()]

    def each_curve(self) -> list[CurveSeries]:
        return list(self.curves)


def comparisons_of(report: Mapping[str, Any]) -> Comparisons:
    """A report's comparisons as their record (a report without them: no blocks)."""
    return Comparisons.of(report.get("comparisons"))


def blocks(comparisons: Mapping[str, Any] | Comparisons | None, name: str) -> list:
    """The comparisons' blocks of one kind ("matched", "samplings", "effects", "targets")."""
    return Comparisons.of(comparisons).blocks(name)


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
