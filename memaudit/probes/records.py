"""The typed values a statistic produces: a measured `Cell` and a `Test` between two samples.

`memaudit.probes.stats` computes them; the report (`memaudit.reports`) reads, pools, adjusts and
writes them. Dicts exist only where a file is read or written: `Cell.from_json` / `Cell.to_json`
and `Test.from_json` / `Test.to_json` are the one pair each for probes.json and report.json. A
record read from a file and written again gives the same JSON, key order included, so a report
rebuilt from the same probes is byte-identical: each record keeps the order its JSON object had
(`keys`), and the keys it does not know (a metric's context, such as the repetitions of an
exposure bucket) in `extra`, in their order.

This module is at the bottom of `memaudit.probes`: it imports nothing of memaudit.

>>> c = Cell.from_json({"value": 0.5, "ci_low": 0.4, "ci_high": 0.6, "n": 96, "unit": "documents"})
>>> c.value, c.interval, c.n
(0.5, (0.4, 0.6), 96)
>>> c.to_json()
{'value': 0.5, 'ci_low': 0.4, 'ci_high': 0.6, 'n': 96, 'unit': 'documents'}
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

# the keys a cell knows, in the order a report writes a new cell's JSON (`Cell.to_json`); the
# keys a cell does not know (its `extra`) come after "note"
_CELL_HEAD = ("value", "ci_low", "ci_high", "n", "unit", "level", "note")
_CELL_TAIL = ("n_pos", "n_neg", "lower_bound", "ceiling_units", "n_seeds")
_CELL_KEYS = frozenset(_CELL_HEAD + _CELL_TAIL)


@dataclass(frozen=True, kw_only=True)
class Cell:
    """One measured number: value, two-sided interval (None when there is none, with `note`
    saying why: "n too small", a lower bound, ...) at confidence `level`, n and the unit n counts.
    `lower_bound`: the value is a one-sided bound (canaries at the exposure estimator's ceiling,
    `ceiling_units` of them). An attack's AUC also names both classes (`n_pos` members, `n_neg`
    non-members); a cell pooled over seeds says how many (`n_seeds`). `extra`: what the cell's
    JSON object carries beside the cell (the metric's context), in its order."""

    value: float | None
    interval: tuple[float, float] | None = None
    n: int | None = None
    unit: str | None = None
    note: str | None = None
    level: float | None = None
    lower_bound: bool = False
    ceiling_units: int | None = None
    n_pos: int | None = None
    n_neg: int | None = None
    n_seeds: int | None = None
    extra: Mapping[str, Any] = field(default_factory=dict, compare=False, hash=False)
    keys: tuple[str, ...] | None = field(default=None, compare=False, hash=False, repr=False)
    """The JSON object's keys in its order (None: `to_json`'s default order)."""

    # ------------------------------------------------------------------ JSON
    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> Cell:
        """The cell of a probes.json / report.json cell object."""
        lo, hi = d.get("ci_low"), d.get("ci_high")
        if (lo is None) != (hi is None):
            raise ValueError(f"a cell's interval needs both ends, got ci_low={lo!r} ci_high={hi!r}")
        lb = d.get("lower_bound", False)
        if not isinstance(lb, bool):
            raise TypeError(f"a cell's lower_bound is true or false, got {lb!r}")
        return cls(value=d.get("value"), interval=None if lo is None else (lo, hi), n=d.get("n"),
                   unit=d.get("unit"), note=d.get("note"), level=d.get("level"), lower_bound=lb,
                   ceiling_units=d.get("ceiling_units"), n_pos=d.get("n_pos"), n_neg=d.get("n_neg"),
                   n_seeds=d.get("n_seeds"), extra={k: v for k, v in d.items() if k not in _CELL_KEYS},
                   keys=tuple(d))

    def _field(self, key: str) -> Any:
        if key == "ci_low":
            return None if self.interval is None else self.interval[0]
        if key == "ci_high":
            return None if self.interval is None else self.interval[1]
        if key in _CELL_KEYS:
            return getattr(self, key)
        return self.extra[key]

    def default_keys(self) -> tuple[str, ...]:
        """The keys of a cell made in memory: value, interval, n, unit, note, its extra, both
        classes of an AUC, the lower bound, the seeds; the optional ones only when set."""
        head = ("value", "ci_low", "ci_high", "n", "unit") + (("level",) if self.level is not None else ()) + ("note",)
        tail = ((("n_pos", "n_neg") if self.n_pos is not None and self.n_neg is not None else ())
                + (("lower_bound", "ceiling_units") if self.lower_bound else ())
                + (("n_seeds",) if self.n_seeds is not None else ()))
        return head + tuple(k for k in self.extra if k not in head + tail) + tail

    def to_json(self) -> dict[str, Any]:
        """The cell as a JSON object, its keys in the order it was read or made (`keys`; None:
        `default_keys`), keys set by `replace` since then after them."""
        return {k: self._field(k) for k in (self.keys if self.keys is not None else self.default_keys())}

    # ------------------------------------------------------------------ derived values
    def replace(self, **changes: Any) -> Cell:
        """A copy with `changes` (fields, or `extra` keys by name: `repetitions=4`); a key it did
        not have comes last in its JSON, in the order of `changes`."""
        extra = {k: changes.pop(k) for k in list(changes) if k not in _FIELDS}
        if extra:
            changes["extra"] = {**self.extra, **extra}
        new = dataclasses.replace(self, **changes)
        if self.keys is None:
            return new
        named = [j for k in [*changes, *extra] if k != "extra"
                 for j in (("ci_low", "ci_high") if k == "interval" else (k,))]
        return dataclasses.replace(new, keys=self.keys + tuple(dict.fromkeys(k for k in named if k not in self.keys)))

    @property
    def ci_low(self) -> float | None:
        return None if self.interval is None else self.interval[0]

    @property
    def ci_high(self) -> float | None:
        return None if self.interval is None else self.interval[1]

    @property
    def has_value(self) -> bool:
        return self.value is not None

    @property
    def n_too_small(self) -> bool:
        """No interval because too few units stand behind the value (`memaudit.probes.stats.MIN_N`)."""
        return self.interval is None and bool(self.note) and self.note.startswith("n too small")


_FIELDS = frozenset(f.name for f in dataclasses.fields(Cell))

# the keys a test knows, in the order of `memaudit.probes.stats.compare_units`' result
_TEST_KEYS = ("statistic", "test", "alternative", "paired", "p_value", "estimate", "n_a", "n_b", "unit",
              "p_floor", "scope", "runs", "p_adjusted", "correction", "family", "alpha", "mde")
_TEST_ATTR = {"test": "name"}
_TEST_REQUIRED = frozenset(("test", "alternative", "p_value", "estimate", "n_a", "n_b", "unit"))


@dataclass(frozen=True, kw_only=True)
class Test:
    """A test between two runs or two groups of seeds (`memaudit.probes.stats.compare_units`,
    `compare_seeds`), with its correction once the report's family is adjusted: its adjusted p,
    the correction's name, the family's size and alpha; `mde`, the smallest difference it could
    have seen, when it shows none (`memaudit.probes.power`). `extra`: other keys of its JSON."""

    __test__ = False  # not a pytest class

    name: str
    alternative: str                # "less" (one-sided), "greater" or "two-sided"
    n_a: int
    n_b: int
    unit: str
    p_value: float
    estimate: float = 0.0
    scope: str | None = None        # "runs" (their units) or "configurations" (over seeds)
    statistic: str | None = None
    paired: bool | None = None
    runs: tuple[str, str] | None = None
    p_floor: float | None = None
    p_adjusted: float | None = None
    correction: str | None = None
    family: int | None = None
    alpha: float | None = None
    mde: Mapping[str, Any] | None = field(default=None, hash=False, compare=False)
    extra: Mapping[str, Any] = field(default_factory=dict, compare=False, hash=False)
    keys: tuple[str, ...] | None = field(default=None, compare=False, hash=False, repr=False)

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> Test:
        runs = d.get("runs")
        return cls(name=d["test"], alternative=d["alternative"], n_a=d["n_a"], n_b=d["n_b"], unit=d["unit"],
                   p_value=d["p_value"], estimate=d.get("estimate", 0.0), scope=d.get("scope"),
                   statistic=d.get("statistic"), paired=d.get("paired"),
                   runs=tuple(runs) if runs is not None else None, p_floor=d.get("p_floor"),
                   p_adjusted=d.get("p_adjusted"), correction=d.get("correction"), family=d.get("family"),
                   alpha=d.get("alpha"), mde=d.get("mde"),
                   extra={k: v for k, v in d.items() if k not in _TEST_KEYS}, keys=tuple(d))

    def _field(self, key: str) -> Any:
        if key in _TEST_KEYS:
            v = getattr(self, _TEST_ATTR.get(key, key))
            return list(v) if key == "runs" and v is not None else v
        return self.extra[key]

    def to_json(self) -> dict[str, Any]:
        """The test as a JSON object, its keys in the order it was read or made (`keys`; None:
        every key that is set, in `compare_units`' order), keys set by `replace` after them."""
        keys = self.keys if self.keys is not None else tuple(
            k for k in _TEST_KEYS if self._field(k) is not None or k in _TEST_REQUIRED)
        return {k: self._field(k) for k in keys}

    def replace(self, **changes: Any) -> Test:
        """A copy with `changes` (fields, or `extra` keys by name: `same_test_as="matched"`); a key
        it did not have comes last in its JSON, in the order of `changes`."""
        extra = {k: changes.pop(k) for k in list(changes) if k not in _TEST_FIELDS}
        if extra:
            changes["extra"] = {**self.extra, **extra}
        new = dataclasses.replace(self, **changes)
        if self.keys is None:
            return new
        named = ["test" if k == "name" else k for k in [*changes, *extra] if k != "extra"]
        return dataclasses.replace(new, keys=self.keys + tuple(dict.fromkeys(k for k in named if k not in self.keys)))

    @property
    def over_runs(self) -> bool:
        """A test on two runs' units (no scope said: the same), not over seeds."""
        return self.scope in (None, "runs")

    @property
    def sides(self) -> str:
        return "two-sided" if self.alternative == "two-sided" else "one-sided"


_TEST_FIELDS = frozenset(f.name for f in dataclasses.fields(Test))


@dataclass(frozen=True, kw_only=True)
class AttackSummary:
    """A membership attack's statistics (`memaudit.probes.stats.attack_summary`): its AUC and its
    TPR at each FPR (keyed "0.01", ...), over `n_pos` members and `n_neg` non-members of `unit`."""

    auc: Cell
    tpr_at_fpr: Mapping[str, Cell]
    n_pos: int
    n_neg: int
    unit: str

    def to_json(self) -> dict[str, Any]:
        """probes.json's attack summary."""
        return {"auc": self.auc.to_json(), "tpr_at_fpr": {f: c.to_json() for f, c in self.tpr_at_fpr.items()},
                "n_pos": self.n_pos, "n_neg": self.n_neg, "unit": self.unit}

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> AttackSummary:
        return cls(auc=Cell.from_json(d["auc"]),
                   tpr_at_fpr={f: Cell.from_json(c) for f, c in (d.get("tpr_at_fpr") or {}).items()},
                   n_pos=d["n_pos"], n_neg=d["n_neg"], unit=d["unit"])
