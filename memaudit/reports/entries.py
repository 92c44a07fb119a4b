"""A run's entry as the report reads it: typed, made once from the run's files.

`memaudit.reports.build.run_entry` makes a `RunEntry` from run.json, privacy.json, metrics.jsonl
and probes.json: the run's configuration (`ModelSummary`, `DataSummary`, `Mitigation`), its
ledger's figures (`PrivacySummary`), its utility (`Utility`) and what its probes measured (the
leakage cells, the probe table, the per-unit scores). The report's comparisons, frontier and
sections read its attributes. `to_json` gives report.json's run object, each record's fields in
their order; `RunEntry.of` reads one back (report.json, or a run object made by hand), a missing
key taking its field's default, so a report written by an older memaudit still reads.

>>> r = RunEntry.of({"id": "a", "backend": "federated", "privacy": {"epsilon": 8.0, "unit": "user"}})
>>> r.privacy.epsilon, r.privacy.unit, r.mitigation.goldfish, r.utility.holdout_perplexity
(8.0, 'user', False, None)
"""

from __future__ import annotations

import dataclasses
import functools
import math
import types
import typing
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from memaudit.probes.records import Cell


class Record:
    """A frozen dataclass whose fields are its JSON object's keys, in their order; a field typed
    as another `Record` holds the nested object (typed `Record | None`: None where the JSON has
    null or nothing; typed `Record`: its defaults there)."""

    @classmethod
    @functools.cache
    def _nested(cls) -> dict[str, tuple[type[Record], bool]]:
        """The fields holding a record: its type, and whether the field may be None."""
        out = {}
        for name, hint in typing.get_type_hints(cls).items():
            kinds = typing.get_args(hint) if isinstance(hint, types.UnionType) else (hint,)
            sub = [k for k in kinds if isinstance(k, type) and issubclass(k, Record)]
            if sub:
                out[name] = (sub[0], type(None) in kinds)
        return out

    @classmethod
    def of(cls, d: Mapping[str, Any] | Record | None):
        """The record of JSON object `d` (itself when already one; a record of another kind by its
        fields of the same names; a missing key: its default)."""
        if isinstance(d, cls):
            return d
        if isinstance(d, Record):
            d = {f.name: getattr(d, f.name) for f in dataclasses.fields(d)}
        d = d if isinstance(d, Mapping) else {}
        nested = cls._nested()
        kw = {}
        for f in dataclasses.fields(cls):
            if f.name in d:
                v = d[f.name]
            elif f.default is not dataclasses.MISSING:
                v = f.default
            elif f.default_factory is not dataclasses.MISSING:
                v = f.default_factory()
            else:
                v = None
            if f.name in nested and not (v is None and nested[f.name][1]):
                v = nested[f.name][0].of(v)
            kw[f.name] = v
        return cls(**kw)

    def to_json(self) -> dict[str, Any]:
        """The JSON object: every field, nested records as their objects."""
        return {f.name: (v.to_json() if isinstance(v := getattr(self, f.name), Record) else v)
                for f in dataclasses.fields(self)}


@dataclass(frozen=True, kw_only=True)
class ModelSummary(Record):
    preset: str | None = None
    params: int | None = None
    trained: str | None = None  # "full", or the LoRA label ("lora(r=8, q_proj,v_proj)")
    engine: str | None = None  # the centralized backend's engine (torch or jax); None before it was named
    upload_bytes_per_client_per_round: int | None = None

    @property
    def finetune(self) -> str:
        """What the run trained: "full", or its LoRA label."""
        return str(self.trained or "full")


@dataclass(frozen=True, kw_only=True)
class DataSummary(Record):
    fingerprint: str | None = None
    users: int | None = None
    sequences: int | None = None


@dataclass(frozen=True, kw_only=True)
class PrivacySummary(Record):
    """The guarantee, recomputed from the run's ledger: ε (inf without DP) at δ per `unit`."""

    mechanism: str | None = None
    description: str | None = None
    epsilon: float = math.inf
    target_epsilon: float | None = None
    noise_multiplier: float | None = None
    delta: float | None = None
    unit: str | None = None
    user_sampling: str | None = None  # centralized per-user DP: "els" or "uls"
    per_user: dict | None = None  # example-level: the group-privacy bound for a user's sequences
    document: dict | None = None  # example-level: the ε per document
    per_user_text: str | None = None


@dataclass(frozen=True, kw_only=True)
class Mitigation(Record):
    goldfish: bool = False


@dataclass(frozen=True, kw_only=True)
class Utility(Record):
    holdout_loss: float | None = None
    holdout_perplexity: float | None = None


@dataclass(frozen=True, kw_only=True)
class RunEntry(Record):
    """One run of the report (report.json's `runs[]`)."""

    id: str
    path: str | None = None
    role: str | None = None  # "public-base" for the frontier's origin
    backend: str | None = None
    status: str | None = None
    seed: int | None = None
    audit: bool = False
    model: ModelSummary = field(default_factory=ModelSummary)
    data: DataSummary = field(default_factory=DataSummary)
    privacy: PrivacySummary = field(default_factory=PrivacySummary)
    group_privacy: Any = None
    mitigation: Mitigation = field(default_factory=Mitigation)
    utility: Utility = field(default_factory=Utility)
    noise_per_round: list = field(default_factory=list)
    leakage: Mapping[str, Cell] = field(default_factory=dict)  # the headline cells, by metric
    probes_summary: dict = field(default_factory=dict)  # plot data, by plot
    probe_rows: list = field(default_factory=list)  # the probe table
    samples: list = field(default_factory=list)  # extracted member text: only with --show-secrets
    extracted_members: list = field(default_factory=list)  # their ids and lengths
    units: Mapping[str, Any] = field(default_factory=dict)  # per-unit scores; never in report.json

    def to_json(self) -> dict[str, Any]:
        """report.json's run object: every field but the per-unit scores."""
        out = super().to_json()
        del out["units"]
        return out

    def with_units(self) -> dict[str, Any]:
        """The run object with its per-unit scores, as the report holds it until it is written
        (the tests between runs and their refinements read them)."""
        return {**self.to_json(), "units": self.units}

    @property
    def goldfish(self) -> bool:
        return bool(self.mitigation.goldfish)

    def cell(self, metric: str) -> Cell | None:
        """The run's headline cell of `metric` (None: not measured)."""
        return self.leakage.get(metric)

    def plot_rows(self, plot: str, default: Any = None) -> Any:
        """The data of one of the run's plots (`default` where it has none)."""
        return (self.probes_summary or {}).get(plot) or default

    def units_of(self, metric: str) -> Any:
        """The per-unit scores behind `metric` (None: none kept)."""
        return (self.units or {}).get(metric)

    def measured(self, metric: str) -> bool:
        c = self.leakage.get(metric)
        return c is not None and c.value is not None


def entries(runs: Iterable[Mapping[str, Any] | RunEntry]) -> list[RunEntry]:
    """The runs as entries (a JSON run object read with `RunEntry.of`)."""
    return [RunEntry.of(r) for r in runs]


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


# ----------------------------------------------------------------------------- per-unit scores
@dataclass(frozen=True, kw_only=True)
class UnitScores(Record):
    """One metric's per-unit scores (`memaudit.reports.probes_adapter.units_of`): the units' ids
    and values, the kind of statistic the tests between runs compute on them (mean, binary, auc,
    exposure) and what a unit is; an attack's member flags, a canary's role, repetitions, owner
    kind and whether it sits at the exposure estimator's ceiling. Never written to report.json."""

    kind: str | None = None
    unit: str | None = None
    ids: list = field(default_factory=list)
    values: list = field(default_factory=list)
    member: list | None = None
    lower_bound: list | None = None
    role: list | None = None
    repetitions: list | None = None
    owner_kind: list | None = None


# ----------------------------------------------------------------------------- probed targets
@dataclass(frozen=True, kw_only=True)
class TargetPrivacy(Record):
    epsilon: Any = None  # a number, or "unknown" without a ledger beside the probes.json
    unit: str | None = None
    delta: float | None = None
    text: str | None = None


@dataclass(frozen=True, kw_only=True)
class Shift(Record):
    """The blind classifier's check: members vs non-members told apart on the texts alone."""

    auc: float | None = None
    flagged: bool = False
    note: str | None = None


@dataclass(frozen=True, kw_only=True)
class TargetEntry(Record):
    """A probed outside model (report.json's `targets[]`, `memaudit.reports.targets`)."""

    id: str
    model: str | None = None
    source: str | None = None
    base: str | None = None
    reference: str | None = None
    weights_sha256: str | None = None
    privacy: TargetPrivacy = field(default_factory=TargetPrivacy)
    counts: dict = field(default_factory=dict)
    shift: Shift | None = None
    attacks: list = field(default_factory=list)  # every membership attack: its name, AUC and TPR cells
    leakage: Mapping[str, Cell] = field(default_factory=dict)
    probe_rows: list = field(default_factory=list)
    units: Mapping[str, Any] = field(default_factory=dict)
    verdict: dict | None = None
    roc: dict | None = None

    def cell(self, metric: str) -> Cell | None:
        return self.leakage.get(metric)

    def units_of(self, metric: str) -> Any:
        return (self.units or {}).get(metric)

    def each_attack(self) -> list[AttackCells]:
        return [AttackCells.of(a) for a in self.attacks or []]

    def attack_aucs(self) -> dict[str, Cell]:
        """Each membership attack's AUC cell, by attack."""
        return {a.attack: Cell.from_json(a.auc) for a in self.each_attack()}


@dataclass(frozen=True, kw_only=True)
class AttackCells(Record):
    attack: str | None = None
    auc: dict | None = None
    tpr_at_fpr: dict = field(default_factory=dict)
