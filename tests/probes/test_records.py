"""The typed records' one JSON pair: every cell and test object of the committed report snapshots
(written by the code before the records existed) read and written again is the same JSON, key
order included; and a record made in memory writes the keys a report cell had."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from memaudit.probes.records import Cell, Test

SNAPSHOTS = Path(__file__).resolve().parents[2] / "docs" / "snapshots"


def _objects(o, found):
    if isinstance(o, dict):
        if "value" in o and ("ci_low" in o or "n" in o) and "metric" not in o:
            found["cells"].append(o)
        if "p_value" in o and "alternative" in o:
            found["tests"].append(o)
        for v in o.values():
            _objects(v, found)
    elif isinstance(o, list):
        for v in o:
            _objects(v, found)
    return found


def test_every_cell_and_test_of_the_snapshots_round_trips_to_the_same_json():
    found = {"cells": [], "tests": []}
    for path in sorted(SNAPSHOTS.glob("*.report.json")):
        _objects(json.loads(path.read_text(encoding="utf-8")), found)
    assert len(found["cells"]) > 1000 and len(found["tests"]) > 100
    for d in found["cells"]:
        assert json.dumps(Cell.from_json(d).to_json()) == json.dumps(d)
    for d in found["tests"]:
        assert json.dumps(Test.from_json(d).to_json()) == json.dumps(d)


def test_a_cell_made_in_memory_writes_a_report_cells_keys_in_order():
    c = Cell(value=0.7, interval=(0.6, 0.8), n=50, unit="documents", note=None, n_pos=50, n_neg=60,
             extra={"prefix_len": 8})
    assert list(c.to_json()) == ["value", "ci_low", "ci_high", "n", "unit", "note", "prefix_len", "n_pos", "n_neg"]
    assert c.to_json()["ci_low"] == 0.6 and c.ci_high == 0.8
    bound = c.replace(interval=None, lower_bound=True, ceiling_units=3, repetitions=4)
    assert bound.to_json() == {"value": 0.7, "ci_low": None, "ci_high": None, "n": 50, "unit": "documents",
                               "note": None, "prefix_len": 8, "repetitions": 4, "n_pos": 50, "n_neg": 60,
                               "lower_bound": True, "ceiling_units": 3}


def test_a_read_cell_keeps_its_order_and_appends_what_was_set_since():
    d = {"value": 1.0, "n": 12, "unit": "canaries", "ci_low": 0.5, "ci_high": 1.5, "level": 0.95, "note": None}
    c = Cell.from_json(d)
    assert list(c.to_json()) == list(d)
    assert list(c.replace(n_seeds=1).to_json()) == [*d, "n_seeds"]
    t = Test.from_json({"test": "Fisher exact", "alternative": "less", "p_value": 0.2, "estimate": -0.1,
                        "n_a": 10, "n_b": 10, "unit": "documents"})
    adjusted = t.replace(p_adjusted=0.4, family=2).to_json()
    assert list(adjusted)[-2:] == ["p_adjusted", "family"] and adjusted["p_value"] == 0.2


def test_a_half_interval_or_a_lower_bound_that_is_not_a_bool_is_refused():
    with pytest.raises(ValueError, match="both ends"):
        Cell.from_json({"value": 1.0, "ci_low": 0.5, "ci_high": None})
    with pytest.raises(TypeError, match="true or false"):
        Cell.from_json({"value": 1.0, "lower_bound": "yes"})


def test_the_statistics_write_probes_json_cells_and_tests_in_their_order():
    """probes.json's layout, as the statistics wrote their dicts before the records: a cell is
    value, n, unit, interval, level, note, then its extra keys; a test between runs names the
    test, its sides and its floor, a test over seeds its statistic first."""
    import numpy as np

    from memaudit.probes.stats import attack_summary, compare_seeds, compare_units, rate_summary

    c = rate_summary(np.r_[np.ones(7), np.zeros(13)], unit="documents").to_json()
    assert list(c) == ["value", "n", "unit", "ci_low", "ci_high", "level", "note"]
    assert (c["value"], c["n"], c["level"], c["note"]) == (0.35, 20, 0.95, None)
    small = rate_summary(np.ones(3), unit="canaries").to_json()
    assert (small["ci_low"], small["level"], small["note"]) == (None, None, "n too small")
    rng = np.random.default_rng(0)
    a = attack_summary(rng.normal(1, 1, 20), rng.normal(0, 1, 50), n_boot=20).to_json()
    assert list(a) == ["auc", "tpr_at_fpr", "n_pos", "n_neg", "unit"]
    assert list(a["auc"])[-2:] == ["n_pos", "n_neg"] and (a["auc"]["n_pos"], a["auc"]["n_neg"]) == (20, 50)
    assert a["tpr_at_fpr"]["0.01"]["needed"] == 1000 and a["tpr_at_fpr"]["0.01"]["value"] is None
    ids = [f"d{i}" for i in range(12)]
    u = {"kind": "binary", "unit": "documents", "ids": ids, "values": [1.0] * 6 + [0.0] * 6}
    t = compare_units(u, {**u, "values": [0.0] * 12}, alternative="greater").to_json()
    assert list(t) == ["test", "alternative", "paired", "p_value", "estimate", "n_a", "n_b", "unit", "p_floor"]
    assert (t["test"], t["paired"], t["estimate"], t["p_floor"]) == ("exact McNemar", True, 0.5, None)
    s = compare_seeds([0.5, 0.6, 0.55], [0.7, 0.65, 0.72], alternative="less", kind="auc").to_json()
    assert list(s)[:2] == ["statistic", "test"] and s["unit"] == "seeds" and "p_floor" not in s
