"""The report's records, typed: a run's entry, a probed model's entry, per-unit scores.

`memaudit.reports.build.read_run` makes a `RunEntry` from run.json, privacy.json, metrics.jsonl
and probes.json: the run's configuration (`ModelSummary`, `DataSummary`, `Mitigation`), its
ledger's figures (`PrivacySummary`), its utility (`Utility`) and what its probes measured (the
leakage cells, the probe table, the per-unit scores, `UnitScores`). `TargetEntry` is a probed
outside model's (`memaudit.reports.targets`). The report's comparisons, frontier, sections and
plots read their attributes; the report's other parts are read with the records of
`memaudit.reports.blocks`.

Each record is a `Record`: a frozen dataclass whose fields are its JSON object's keys in their
order. `to_json` gives report.json's object; `Record.of` reads one back (report.json, or an
object made by hand), a missing key taking its field's default, so a report written by an older
memaudit still reads.

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
from typing import Any, ClassVar

from memaudit.probes.records import Cell, Test


class Record:
    """A frozen dataclass whose fields are its JSON object's keys, in their order; a field typed
    as another `Record` holds the nested object (typed `Record | None`: None where the JSON has
    null or nothing; typed `Record`: its defaults there). The fields named in `OPTIONAL` are left
    out of the JSON object while they are None (a key the object has only when it is set)."""

    OPTIONAL: ClassVar[frozenset[str]] = frozenset()

    @classmethod
    @functools.cache
    def _nested(cls) -> dict[str, tuple[type, bool, type | None]]:
        """The fields holding records (a `Record`, or a `Cell` or `Test` of
        `memaudit.probes.records`): the record's type, whether the field may be None (`X | None`,
        `list[X] | None`: None where the JSON has null or nothing), and the container (`list[X]`:
        each element; `dict[str, X]`: each value, None kept) or None (the field is one record)."""
        out = {}
        for name, hint in typing.get_type_hints(cls).items():
            optional = False
            if isinstance(hint, types.UnionType):  # `list[X] | None`: the list, or None where absent
                inner = [k for k in typing.get_args(hint) if k is not type(None)]
                if len(inner) == 1 and typing.get_origin(inner[0]) in (list, dict):
                    hint, optional = inner[0], True
            container = typing.get_origin(hint)
            if container in (list, dict):
                hint = typing.get_args(hint)[-1]
            else:
                container = None
            kinds = typing.get_args(hint) if isinstance(hint, types.UnionType) else (hint,)
            sub = [k for k in kinds if isinstance(k, type) and issubclass(k, Record | Cell | Test)]
            if sub:
                out[name] = (sub[0], optional if container else type(None) in kinds, container)
        return out

    @classmethod
    def of(cls, d: Mapping[str, Any] | Record | None):
        """The record of JSON object `d` (itself when already one; a record of another kind by its
        fields of the same names, a `Cell` or `Test` by its JSON object's keys; a missing key: its
        default)."""
        if isinstance(d, cls):
            return d
        if isinstance(d, Record):
            d = {f.name: getattr(d, f.name) for f in dataclasses.fields(d)}
        if isinstance(d, Cell | Test):  # by its JSON object's keys
            d = d.to_json()
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
            if f.name in nested:
                kind, optional, container = nested[f.name]
                if v is None and optional:
                    pass
                elif container is list:
                    v = [_read(kind, x) for x in v or []]
                elif container is dict:
                    v = {k: None if x is None else _read(kind, x) for k, x in (v or {}).items()}
                else:
                    v = _read(kind, v)
            kw[f.name] = v
        return cls(**kw)

    def to_json(self) -> dict[str, Any]:
        """The JSON object: every field (an `OPTIONAL` one only when set), nested records as their
        objects; other typed values (`Cell`, `Test`, records in a list) as they are, for the
        report's one writer (`memaudit.reports.write.json_safe`)."""
        return {f.name: (v.to_json() if isinstance(v, Record) else v) for f in dataclasses.fields(self)
                if (v := getattr(self, f.name)) is not None or f.name not in self.OPTIONAL}

    def replace(self, **changes: Any):
        """A copy with `changes` (fields by name)."""
        return dataclasses.replace(self, **changes)


def _read(kind: type, v: Any) -> Any:
    """`v` as a `kind` record: a `Record` by `Record.of`, a `Cell` or `Test` by its `from_json`."""
    if issubclass(kind, Record):
        return kind.of(v)
    return v if isinstance(v, kind) else kind.from_json(v)


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
