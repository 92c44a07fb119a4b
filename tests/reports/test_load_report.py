"""report.json read back: the comparisons and the sections come back as records, and a report
written by an older memaudit (the committed snapshots, one from before the ULS/ELS comparisons and
the backend's rename) reads and writes back what it holds."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from memaudit.probes.records import Cell, Test
from memaudit.reports.blocks import (
    Compared,
    Comparisons,
    CurveSeries,
    EffectBlock,
    Frontier,
    FrontierPoint,
    MatchedBlock,
    Section,
    TargetPair,
)
from memaudit.reports.scale import ScaleSection
from memaudit.reports.snapshots import SNAPSHOTS
from memaudit.reports.write import json_safe, load_report

COMMITTED = sorted(SNAPSHOTS.glob("*.report.json"))


def _today(o, *, keys: bool = False):
    """The expected reading of an old report: every backend named `parallel` is `centralized`
    (in the comparisons also as a side's key); infinities as report.json writes them."""
    if isinstance(o, dict):
        return {("centralized" if keys and k == "parallel" else k):
                ("centralized" if k == "backend" and v == "parallel" else _today(v, keys=keys)) for k, v in o.items()}
    if isinstance(o, list):
        return [_today(v, keys=keys) for v in o]
    return o


def test_the_committed_snapshots_are_six_and_one_predates_the_sampling_comparisons():
    names = [p.name.removesuffix(".report.json") for p in COMMITTED]
    assert len(names) == 6  # the TPU study's tiny part (study-tpu-tiny) the sixth
    old = [n for n, p in zip(names, COMMITTED, strict=True)
           if "samplings" not in json.loads(p.read_text())["comparisons"]]
    assert old == ["study-overfit"]


@pytest.mark.parametrize("path", COMMITTED, ids=lambda p: p.name.removesuffix(".report.json"))
def test_a_committed_snapshot_loads_typed_and_writes_back_what_it_holds(path: Path):
    raw = json.loads(path.read_text(encoding="utf-8"))
    rep = load_report(path)
    comp = rep["comparisons"]
    assert isinstance(comp, Comparisons)
    assert all(isinstance(b, MatchedBlock) for b in comp.matched)
    assert all(isinstance(b, EffectBlock) for b in comp.effects)
    for block in comp.matched + comp.effects + comp.matched_utility.pairs:
        for c in block.metrics.values():
            assert isinstance(c, Compared) and all(isinstance(x, Cell) for x in c.cells)
            assert c.test is None or isinstance(c.test, Test)
    assert isinstance(comp.frontier, Frontier) and all(isinstance(c, CurveSeries) for c in comp.curves)
    assert all(isinstance(p, FrontierPoint) for m in comp.frontier.metrics.values() for s in m.series for p in s.points)
    assert isinstance(rep["literature"], Section)
    if "scale" in raw:
        assert isinstance(rep["scale"], ScaleSection)
    # a key the old report lacked stays absent; nothing it held is lost or changed
    assert json_safe(rep) == _today({k: v for k, v in raw.items() if k != "comparisons"}) | {
        "comparisons": _today(raw["comparisons"], keys=True)}
    assert ("samplings" in raw["comparisons"]) == (comp.samplings is not None)


def test_an_effect_block_of_an_old_report_reads_its_defaults_and_writes_back_without_them():
    old = {"backend": "federated", "backend_label": "federated", "treatment": "DP at epsilon = 8", "epsilon": 8.0,
           "metrics": {}, "perplexity": {"treated": 110.0, "baseline": 100.0}}  # no "unit": written before it
    e = EffectBlock.of(old)
    assert e.unit is None and e.perplexities() == (110.0, 100.0)
    assert e.to_json() == old
    assert e.replace(unit="user").to_json() == {**old, "unit": "user"}  # set: written
    made = EffectBlock(backend="federated", epsilon=math.inf)  # made now: every key, unset ones null
    assert made.to_json()["unit"] is None


def test_a_compared_metric_keeps_its_sides_in_order_and_the_attack_only_when_named():
    cell = {"value": 0.6, "ci_low": 0.5, "ci_high": 0.7, "n": 40, "unit": "documents"}
    test = {"test": "paired AUC permutation", "alternative": "two-sided", "paired": True, "p_value": 0.2,
            "estimate": 0.05, "n_a": 40, "n_b": 40, "unit": "documents"}
    for obj in ({"centralized": cell, "federated": {**cell, "value": 0.55}, "verdict": "not tested", "test": test},
                {"a": cell, "b": cell, "verdict": "no difference shown", "test": None, "attack": "min_k"}):
        c = Compared.of(obj)
        assert json_safe(c) == obj and list(json_safe(c)) == list(obj)
    c = Compared.of({"centralized": cell, "federated": {**cell, "value": 0.55}, "verdict": "less", "test": test})
    assert c.side("federated").value == 0.55 and c.side("centralized").value == 0.6 and c.side("els") is None
    assert MatchedBlock(metrics={"mia_auc": c}).sides(c) == (c.side("federated"), c.side("centralized"))
    assert TargetPair(targets=["x", "y"], skipped="the same model").to_json() == {
        "targets": ["x", "y"], "metrics": {}, "skipped": "the same model"}
    assert "skipped" not in TargetPair(targets=["x", "y"]).to_json()
