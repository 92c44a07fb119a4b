"""A report built from real probes.json files: the trained model and its untrained weights."""

from __future__ import annotations

import json
import shutil

from memaudit.reports.build import build_report
from memaudit.reports.schema import validate_report
from memaudit.reports.write import write_report


def _strip_new_fields(obj):
    """probes.json as an earlier memaudit wrote it: cells without n, unit and note."""
    if isinstance(obj, dict):
        return {k: _strip_new_fields(v) for k, v in obj.items()
                if k not in ("n", "unit", "note", "level", "lower_bound")}
    if isinstance(obj, list):
        return [_strip_new_fields(v) for v in obj]
    return obj


def test_report_on_trained_and_untrained_runs(tmp_path, trained, probed):
    done, init = probed
    runs = {}
    for name, doc, backend in (("trained", done, "parallel"), ("untrained", init, "federated")):
        rd = tmp_path / name
        shutil.copytree(trained.run, rd)
        (rd / "run.json").write_text(json.dumps({"status": "complete", "backend": backend}))
        (rd / "probes.json").write_text(json.dumps(doc))
        runs[name] = rd
    rep = build_report([runs["trained"], runs["untrained"]])
    validate_report(rep)
    paths = write_report(rep, tmp_path / "report")  # plots and tables with "n too small" cells
    md = paths["md"].read_text()
    assert "n too small" in md and "needs &gt;= 1000 non-member documents" in md
    assert all("units" not in r for r in rep["runs"])
    # the two runs share their canaries: the exposure comparison is paired, and with 2 canaries
    # in the top bucket no difference can be shown however far apart the means are
    cell = rep["comparisons"]["matched"][0]["metrics"]["exposure_top"]
    assert cell["test"]["paired"] and cell["test"]["n_a"] == 2
    assert cell["verdict"] == "no difference shown"
    for s in rep["findings"]["sentences"]:
        if s["kind"] == "comparison":
            assert "in these runs" in s["text"] and s["correction"] == "holm"


def test_report_reads_an_older_probes_json(tmp_path, trained, probed):
    done, _ = probed
    rd = tmp_path / "old"
    shutil.copytree(trained.run, rd)
    (rd / "probes.json").write_text(json.dumps(_strip_new_fields(done)))
    rep = build_report([rd])
    validate_report(rep)
    assert rep["runs"][0]["leakage"]["mia_auc"]["value"] > 0.5
