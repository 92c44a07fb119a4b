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
    cell = rep["comparisons"].matched[0].metrics["exposure_top"]
    assert cell.test.paired and cell.test.n_a == 2
    assert cell.verdict == "no difference shown"
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
    assert rep["runs"][0]["leakage"]["mia_auc"].value > 0.5


def test_report_names_the_unit_per_document_and_reads_an_older_ledger(tmp_path, trained, probed):
    """An example-level run's description and caveat name the sequence and the document with its
    m; a privacy.json written before memaudit counted m still reports, the document unknown."""
    from memaudit.privacy.ledger import PrivacyLedger

    done, _ = probed
    runs = []
    for name, m in (("doc3", 3), ("old", None)):
        rd = tmp_path / name
        shutil.copytree(trained.run, rd)
        (rd / "probes.json").write_text(json.dumps(done))
        (rd / "run.json").write_text(json.dumps({"status": "complete", "backend": "parallel",
                                                 "config": {"privacy": {"noise_multiplier": 1.2}}}))
        led = PrivacyLedger(unit="example", delta=1e-5, max_sequences_per_document=m)
        led.record_steps(0.05, 1.2, 40)
        obj = led.to_json()
        if m is None:
            for key in ("document", "max_sequences_per_document", "protects"):
                del obj[key]
        (rd / "privacy.json").write_text(json.dumps(obj))
        runs.append(rd)
    rep = build_report(runs)
    validate_report(rep)
    by_id = {r["id"]: r["privacy"] for r in rep["runs"]}
    want = PrivacyLedger(unit="example", delta=1e-5, max_sequences_per_document=3)
    want.record_steps(0.05, 1.2, 40)
    assert by_id["doc3"]["document"]["epsilon"] == want.document()["epsilon"]["pld"]
    assert by_id["doc3"]["document"]["max_sequences_per_document"] == 3
    assert "per sequence" in by_id["doc3"]["description"] and "up to 3 sequences" in by_id["doc3"]["description"]
    assert by_id["old"]["document"]["epsilon"] is None and "per document: unknown" in by_id["old"]["description"]
    cav = {c.split(":")[0]: c for c in rep["findings"]["caveats"] if "per packed training sequence" in c}
    assert "up to 3 sequences" in cav["Run doc3"] and "unknown" in cav["Run old"]
