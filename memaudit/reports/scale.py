"""The report's scale section: memorization against model size and repetitions, Goldfish on and off.

AxoNN's study (Singh et al. 2025) finds that memorization grows with model size and that
Goldfish loss (Hans et al. 2024) mitigates it. This section puts memaudit's runs on those axes:
per condition (backend and nominal epsilon), per model size (preset, ordered by parameter count)
and Goldfish setting, four metrics by repetition bucket:

- exposure of the inserted canaries (bits, Carlini et al. 2019), by the canaries' repetitions;
- the discoverable exact-extraction rate of member documents (shortest prefix k), by repeats;
- the Goldfish protocol's exact match and ROUGE-L of the last 50 tokens (`goldfish_extraction`).

Every cell is a `probes.stats` cell (value, n, unit; "n too small" below `MIN_N`). A difference
is claimed only from a test: one-sided "the larger of two adjacent sizes memorizes more" and
"Goldfish memorizes less", on the runs' shared units (paired when both runs hold the same
canaries / documents) or over seeds when both sides have several, with Holm's correction over
every test of the report (one family, `memaudit.reports.findings.adjust_report`; built alone,
over the section's own tests). A comparison with fewer than `MIN_N` units on a side is not tested
("n too small"). The section is present only when the runs differ in size or in Goldfish.

References:
  Singh et al., "Democratizing AI: Open-source Scalable LLM Training on GPU-based
  Supercomputers" (AxoNN), SC 2024 / 2025 (memorization vs model size).
  Hans et al., "Be like a Goldfish, Don't Memorize!", NeurIPS 2024.
  Carlini et al., "The Secret Sharer", USENIX Security 2019 (exposure).
  Holm, "A simple sequentially rejective multiple test procedure", Scand. J. Statist. 1979.
"""

from __future__ import annotations

import itertools
import math
import typing
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from memaudit.backends import report_rank
from memaudit.config import ModelConfig
from memaudit.probes.document import ProbesDoc, read_probes
from memaudit.probes.extraction import repeat_bucket
from memaudit.probes.records import Cell, Test
from memaudit.probes.stats import (
    MIN_N,
    N_TOO_SMALL,
    compare_seeds,
    compare_units,
    mean_summary,
    rate_summary,
)
from memaudit.reports.compare import nominal_epsilon, pool
from memaudit.reports.entries import Record, RunEntry, UnitScores, entries
from memaudit.reports.family import ALPHA, CORRECTION, correct
from memaudit.rundir import RunDir

# key -> (label, unit of the value, kind of unit scores for stats.compare_units)
METRICS: dict[str, tuple[str, str, str]] = {
    "exposure": ("exposure of inserted canaries", "bits", "mean"),
    "extraction_exact": ("discoverable exact extraction rate", "", "binary"),
    "goldfish_exact": ("exact match of a document's last m tokens (Goldfish protocol)", "",
                       "binary"),
    "goldfish_rouge_l": ("ROUGE-L of a document's last m tokens (Goldfish protocol)", "", "mean"),
}


def _units(kind: str, unit: str, rows: list[tuple[str, float]]) -> dict[str, Any]:
    return {"kind": kind, "unit": unit, "ids": [i for i, _ in rows], "values": [v for _, v in rows]}


def _by_bucket(rows: list[dict], key, value, *, with_all: bool) -> dict[str, list]:
    out: dict[str, list] = defaultdict(list)
    for r in rows:
        pair = (str(r.id), float(value(r)))
        out[key(r)].append(pair)
        if with_all:
            out["all"].append(pair)
    return dict(out)


def run_units(doc: ProbesDoc) -> dict[str, dict[str, dict[str, Any]]]:
    """Per metric and repetition bucket, the run's per-unit scores (ids and values, no text).

    Buckets: the canaries' repetitions for exposure; "all" and `repeat_bucket` of the documents'
    repeats for the document metrics.
    """
    out: dict[str, dict[str, list]] = {}
    if (p := doc.get("exposure")) is not None:
        ins = [r for r in p.exposure_scores() if r.role == "inserted"]
        out["exposure"] = _by_bucket(ins, lambda r: str(r.repetitions), lambda r: r.exposure, with_all=False)
    if (p := doc.get("extraction")) is not None:
        disc = p.discoverable_scores()
        if disc:
            k = min(r.k for r in disc)
            sel = [r for r in disc if r.k == k]
            out["extraction_exact"] = _by_bucket(sel, lambda r: repeat_bucket(r.repeats),
                                                 lambda r: r.exact, with_all=True)
    if (p := doc.get("goldfish_extraction")) is not None:
        sel = [r for r in p.goldfish_scores() if r.kind == "doc"]
        out["goldfish_exact"] = _by_bucket(sel, lambda r: repeat_bucket(r.repeats), lambda r: r.exact,
                                           with_all=True)
        out["goldfish_rouge_l"] = _by_bucket(sel, lambda r: repeat_bucket(r.repeats), lambda r: r.rouge_l,
                                             with_all=True)
    unit = {"exposure": "canaries"}
    return {m: {b: _units(METRICS[m][2], unit.get(m, "documents"), rows) for b, rows in bs.items()}
            for m, bs in out.items() if bs}


def _suffix_tokens(doc: ProbesDoc) -> int | None:
    """The m of a probes.json's goldfish_extraction (summary.suffix_tokens), if it has one."""
    g = doc.probes.get("goldfish_extraction")
    return None if g is None else g.suffix_tokens


def _cell(units: dict[str, Any]) -> Cell:
    u = UnitScores.of(units)
    x = np.asarray(u.values, float)
    if u.kind == "binary":
        return rate_summary(x, unit=u.unit)
    return mean_summary(x, unit=u.unit)


def _preset_order() -> tuple[str, ...]:
    return typing.get_args(ModelConfig.model_fields["preset"].annotation)


@dataclass(frozen=True)
class ScaleRun:
    """A run of the section: its entry, its per-unit scores by metric and bucket (`run_units`)
    and the m of its goldfish_extraction."""

    entry: RunEntry
    units: dict[str, dict[str, dict[str, Any]]]
    m: int | None

    @property
    def id(self) -> str:
        return self.entry.id

    def scores(self, metric: str) -> dict[str, dict[str, Any]]:
        """The run's per-unit scores of `metric` by bucket ({} where it has none)."""
        return self.units.get(metric, {})


def _size_key(run: RunEntry) -> tuple:
    preset, params = run.model.preset, run.model.params
    order = _preset_order()
    return (order.index(preset) if preset in order else len(order),
            params if params is not None else -1, str(preset))


def _size_label(run: RunEntry) -> str:
    preset, params = run.model.preset, run.model.params
    if params is None:
        return str(preset)
    p = f"{params / 1e9:.3g}B" if params >= 1e9 else f"{params / 1e6:.3g}M"
    return p if preset is None else f"{preset} ({p})"


def _condition(run: RunEntry) -> tuple[str, float]:
    return run.backend, nominal_epsilon(run)


def _condition_label(backend: str, eps: float) -> str:
    side = backend
    return f"{side}, {'no DP' if math.isinf(eps) else f'epsilon = {eps:g}'}"


@dataclass(frozen=True, kw_only=True)
class ScaleTest(Record):
    """One planned comparison of the section: side `a` against side `b` (size labels) on `metric`
    at repetition `bucket`, one-sided (`alternative`), with its test (None, and the `note` saying
    why, below `MIN_N` units a side) and its verdict once the test is corrected ("more", "less",
    "no difference shown", "n too small"; "not tested" before)."""

    comparison: str | None = None  # "size" or "goldfish"
    condition: str | None = None
    metric: str | None = None
    bucket: str | None = None
    alternative: str | None = None
    a: str | None = None
    b: str | None = None
    value_a: float | None = None
    value_b: float | None = None
    verdict: str | None = None
    test: Test | None = None
    note: str | None = None


@dataclass(frozen=True, kw_only=True)
class ScaleRow(Record):
    """One (size, Goldfish) configuration of a table: its cell per repetition bucket, pooled over
    its seeds' runs."""

    size: str | None = None
    preset: str | None = None
    params: int | None = None
    goldfish: bool = False
    n_seeds: int | None = None
    runs: list = field(default_factory=list)
    cells: dict[str, Cell | None] = field(default_factory=dict)  # by bucket (None: not measured)


@dataclass(frozen=True, kw_only=True)
class ScaleTable(Record):
    """One condition's metric: a row per (size, Goldfish), a column per repetition bucket."""

    condition: str | None = None
    backend: str | None = None
    epsilon: float | None = None
    metric: str | None = None
    label: str | None = None
    unit: str | None = None
    buckets: list = field(default_factory=list)
    rows: list[ScaleRow] = field(default_factory=list)


@dataclass(frozen=True, kw_only=True)
class ScaleSection(Record):
    """The section (report.json's `scale`): the sizes, the tables, every planned comparison with its
    test, the correction and its family's size, and the sentences of the differences shown."""

    sizes: list = field(default_factory=list)
    metrics: dict = field(default_factory=dict)  # key -> {"label", "unit"}, from METRICS
    tables: list[ScaleTable] = field(default_factory=list)
    tests: list[ScaleTest] = field(default_factory=list)
    family: int | None = None
    correction: str = CORRECTION
    alpha: float = ALPHA
    min_n: int = MIN_N
    goldfish_m: list = field(default_factory=list)  # the m of goldfish_extraction in these runs
    sentences: list = field(default_factory=list)



def _test(a: list[ScaleRun], b: list[ScaleRun], metric: str, bucket: str, alternative: str) -> dict[str, Any]:
    """The test of one cell pair: over seeds when both sides have several, else on units (the
    `ScaleTest` fields `verdict`, `test` and `note`)."""
    ua, ub = a[0].scores(metric)[bucket], b[0].scores(metric)[bucket]
    sa, sb = UnitScores.of(ua), UnitScores.of(ub)
    if min(len(sa.ids), len(sb.ids)) < MIN_N:
        return {"verdict": N_TOO_SMALL, "test": None,
                "note": f"{len(sa.ids)}/{len(sb.ids)} {sa.unit}, needs >= {MIN_N} a side"}

    def seeds(rs):
        return [float(np.mean(UnitScores.of(u).values)) for r in rs
                if (u := r.scores(metric).get(bucket)) is not None]

    va, vb = seeds(a), seeds(b)
    if len(va) > 1 and len(vb) > 1:
        t = compare_seeds(va, vb, alternative=alternative).replace(scope="configurations")
    else:
        t = compare_units(ua, ub, alternative=alternative).replace(scope="runs", runs=(a[0].id, b[0].id))
    return {"verdict": "not tested", "test": t, "note": None}


def _pairs(cells: dict[tuple, list[dict]]):
    """(comparison, a key, b key, alternative): adjacent sizes per Goldfish setting, then Goldfish
    on vs off per size, within each condition."""
    by_cond: dict[tuple, set] = defaultdict(set)
    for cond, size, gf in cells:
        by_cond[cond].add((size, gf))
    for cond, keys in sorted(by_cond.items()):
        sizes = sorted({s for s, _ in keys})
        for gf in (False, True):
            have = [s for s in sizes if (s, gf) in keys]
            for small, large in itertools.pairwise(have):
                yield "size", (cond, large, gf), (cond, small, gf), "greater"
        for s in sizes:
            if (s, True) in keys and (s, False) in keys:
                yield "goldfish", (cond, s, True), (cond, s, False), "less"


def _sentence(t: ScaleTest, family: int) -> str:
    x = t.test
    scope = "these configurations" if x.scope == "configurations" else "these runs"
    label, unit, _ = METRICS[t.metric]
    u = f" {unit}" if unit else ""
    where = "over all documents" if t.bucket == "all" else f"at {t.bucket} repetitions"
    verb = ("shows a higher" if t.comparison == "size" else "shows a lower")
    return (f"In {scope} ({t.condition}), {t.a} {verb} {label} than {t.b} {where}: "
            f"{t.value_a:.3g}{u} vs {t.value_b:.3g}{u} ({x.name}, one-sided, "
            f"n = {x.n_a}/{x.n_b} {x.unit}, p = {x.p_value:.3g}, {CORRECTION} "
            f"p = {x.p_adjusted:.3g} over {family} tests)")


def _pooled(rs: list[ScaleRun], metric: str, bucket: str) -> Cell | None:
    """One cell over a group's seeds (`compare.pool`: one run's cell as it is)."""
    return pool([_cell(r.scores(metric)[bucket]) for r in rs if bucket in r.scores(metric)])


def _bucket_order(b: str) -> tuple:
    return (b != "all", int(b.split("-")[0]) if b != "all" else 0)


def _tables(cells: dict[tuple, list[ScaleRun]]) -> list[ScaleTable]:
    """Per condition and metric: one row per (size, Goldfish), one cell per repetition bucket."""
    tables = []
    for cond in sorted({c for c, _, _ in cells}, key=lambda c: (report_rank(c[0]), c[1])):
        keys = sorted(k for k in cells if k[0] == cond)
        for metric, (label, unit, _kind) in METRICS.items():
            buckets = sorted({b for k in keys for r in cells[k] for b in r.scores(metric)}, key=_bucket_order)
            if not buckets:
                continue
            rows = [ScaleRow(size=_size_label(cells[k][0].entry), preset=cells[k][0].entry.model.preset,
                             params=cells[k][0].entry.model.params, goldfish=k[2], n_seeds=len(cells[k]),
                             runs=[r.id for r in cells[k]],
                             cells={b: _pooled(cells[k], metric, b) for b in buckets}) for k in keys]
            tables.append(ScaleTable(condition=_condition_label(*cond), backend=cond[0], epsilon=cond[1],
                                     metric=metric, label=label, unit=unit, buckets=buckets, rows=rows))
    return tables


def _tests(cells: dict[tuple, list[ScaleRun]], labels: dict[tuple, str]) -> list[ScaleTest]:
    """Every planned comparison with its test (or why none), not yet corrected."""
    tests = []
    for comparison, ka, kb, alt in _pairs(cells):
        a, b = cells[ka], cells[kb]
        for metric in METRICS:
            shared = set(a[0].scores(metric)) & set(b[0].scores(metric))
            for bucket in sorted(shared, key=_bucket_order):
                va, vb = _pooled(a, metric, bucket), _pooled(b, metric, bucket)
                tests.append(ScaleTest(comparison=comparison, condition=_condition_label(*ka[0]), metric=metric,
                                       bucket=bucket, alternative=alt, a=labels[ka], b=labels[kb],
                                       value_a=None if va is None else va.value,
                                       value_b=None if vb is None else vb.value,
                                       **_test(a, b, metric, bucket, alt)))
    return tests


def _verdict(t: ScaleTest) -> str:
    return ("no difference shown" if t.test.p_adjusted >= ALPHA
            else "more" if t.comparison == "size" else "less")


def tests_of(sec: ScaleSection) -> list[Test]:
    """The section's tests (of the comparisons that have one) in a fixed order."""
    return [t.test for t in sec.tests if t.test is not None]


def passing(sec: ScaleSection) -> int:
    """The section's tests that show a difference."""
    return sum(t.verdict in ("more", "less") for t in sec.tests)


def settle(sec: ScaleSection, tests: list[Test], family: int) -> ScaleSection:
    """The section with `tests` in place of `tests_of(sec)` (the same tests, corrected: by the
    report's one family of `family` tests, `memaudit.reports.family.correct`), each comparison's
    verdict, the family's size and the sentences of the differences shown; `sec` is left as it was."""
    if len(tests) != len(tests_of(sec)):
        raise ValueError(f"the scale section holds {len(tests_of(sec))} tests, {len(tests)} given")
    given = iter(tests)
    out = []
    for t in sec.tests:
        if t.test is not None:
            t = t.replace(test=next(given))
            t = t.replace(verdict=_verdict(t))
        out.append(t)
    return sec.replace(tests=out, family=family,
                       sentences=[_sentence(t, family) for t in out if t.verdict in ("more", "less")])


def _scale_run(r: RunEntry) -> ScaleRun:
    path = RunDir(r.path).probes_path
    doc = read_probes(path) if path.is_file() else None
    return ScaleRun(entry=r, units={} if doc is None else run_units(doc),
                    m=None if doc is None else _suffix_tokens(doc))


def scale_section(runs: list[dict[str, Any] | RunEntry]) -> ScaleSection | None:
    """The section from the report's run entries (their probes.json read again for per-unit
    scores), its tests Holm-corrected over the section alone (a report corrects them again with
    all its tests, `settle`), or None when the runs all have one size and one Goldfish setting."""
    # audit runs train on other data; a public base was not fine-tuned on the private data
    runs = [r for r in entries(runs) if not r.audit and r.role != "public-base"]
    if len({_size_key(r) for r in runs}) < 2 and len({bool(r.goldfish) for r in runs}) < 2:
        return None
    cells: dict[tuple, list[ScaleRun]] = defaultdict(list)
    for r in runs:
        cells[(_condition(r), _size_key(r), r.goldfish)].append(_scale_run(r))
    labels = {k: _size_label(rs[0].entry) + (" + Goldfish" if k[2] else "") for k, rs in cells.items()}
    suffix = sorted({r.m for rs in cells.values() for r in rs if r.m is not None})
    sec = ScaleSection(
        sizes=list(dict.fromkeys(_size_label(cells[k][0].entry) for k in sorted(cells, key=lambda k: k[1]))),
        metrics={k: {"label": v[0], "unit": v[1]} for k, v in METRICS.items()},
        tables=_tables(cells), tests=_tests(cells, labels),
        goldfish_m=suffix)  # the m of goldfish_extraction in these runs (50 in the paper)
    tests = tests_of(sec)
    return settle(sec, correct(tests, CORRECTION, ALPHA), len(tests))
