"""`memaudit report` over probed outside models (ProbedTarget) beside memaudit runs."""

from __future__ import annotations

import json
import shutil

import pytest

from memaudit.cli import main
from memaudit.reports.build import build_report
from memaudit.reports.schema import validate_report
from memaudit.reports.targets import ProbedTarget
from memaudit.reports.write import write_report

FAST = ["--probes", "membership", "--device", "cpu", "--bootstrap", "50"]


@pytest.fixture(scope="module")
def probed_targets(tmp_path_factory, outside):
    """The released LoRA fine-tune (base as reference) and the base, each probed into a folder."""
    root = tmp_path_factory.mktemp("probed")
    for name, model in (("released", outside.adapter_dir), ("base", outside.base_dir)):
        (root / name).mkdir()
        assert main(["probe", str(model), "--out", str(root / name / "probes.json"),
                     "--members", str(outside.members), "--nonmembers", str(outside.nonmembers),
                     *FAST]) == 0
    return root


def test_report_on_outside_models_only(tmp_path, probed_targets, capsys):
    """Before: 'no runs found'. Now one report: each target's attacks, privacy unknown, and the
    released model compared with its base on the documents both were scored on."""
    rep = build_report([probed_targets / "released", probed_targets / "base"])
    validate_report(rep)
    assert rep["runs"] == []
    t = {x["id"]: x for x in rep["targets"]}
    assert t["released"]["source"] == "adapter" and t["base"]["source"] == "folder"
    assert t["released"]["privacy"]["epsilon"] == "unknown"
    assert "reference" in {a["attack"] for a in t["released"]["attacks"]}
    block = rep["comparisons"].targets[0]
    assert block.targets == ["released", "base"]
    mia = block.metrics["mia_strongest"]  # the strongest attack both share, on the same documents
    assert mia.attack in {a["attack"] for a in t["base"]["attacks"]}
    assert mia.test.n_a == 80 and mia.test.p_adjusted is not None
    assert any(s["group"] == "targets" for s in rep["findings"]["sentences"])
    paths = write_report(rep, tmp_path / "report")
    md = paths["md"].read_text()
    assert "What an attacker learns from releasing these models" in md
    assert "centralized" not in md.lower().split("## runs")[0]
    assert "unknown: no privacy ledger" in md
    capsys.readouterr()
    assert main(["report", str(probed_targets), "--out", str(tmp_path / "r2")]) == 0


def test_stub_run_json_is_a_target_not_a_centralized_run(tmp_path, probed_targets):
    d = tmp_path / "stub"
    shutil.copytree(probed_targets / "released", d)
    (d / "run.json").write_text(json.dumps({"status": "complete"}))
    rep = build_report([d])
    assert rep["runs"] == [] and rep["targets"][0]["id"] == "stub"


def test_ledger_beside_probes_gives_epsilon(tmp_path, probed_targets):
    """A DP fine-tune's privacy.json beside its probes.json: epsilon and unit recomputed from the
    ledger's events; without one, "unknown"."""
    from memaudit.privacy.ledger import PrivacyLedger

    d = tmp_path / "dp"
    shutil.copytree(probed_targets / "released", d)
    assert ProbedTarget.load(d / "probes.json").privacy_text.startswith("unknown")
    led = PrivacyLedger(unit="example", delta=1e-5)
    led.record_steps(0.04, 1.5, 50)
    led.save(d / "privacy.json")
    t = ProbedTarget.load(d / "probes.json")
    tightest = min(led.epsilon("rdp"), led.epsilon("pld"))  # the ledger reports the tighter
    assert t.unit == "example" and t.epsilon == pytest.approx(tightest, rel=1e-6)
    rep = build_report([d])
    validate_report(rep)
    assert rep["targets"][0]["privacy"]["epsilon"] == t.epsilon


def test_targets_beside_runs(tmp_path, probed_targets, trained, probed):
    rd = tmp_path / "run"
    shutil.copytree(trained.run, rd)
    (rd / "run.json").write_text(json.dumps({"status": "complete", "backend": "parallel"}))
    (rd / "probes.json").write_text(json.dumps(probed[0]))
    rep = build_report([rd, probed_targets / "released"])
    validate_report(rep)
    assert [r["id"] for r in rep["runs"]] == ["run"]
    assert [t["id"] for t in rep["targets"]] == ["released"]
    write_report(rep, tmp_path / "report")


def test_nothing_to_report_names_probe_out(tmp_path, capsys):
    (tmp_path / "empty").mkdir()
    assert main(["report", str(tmp_path / "empty"), "--out", str(tmp_path / "r")]) == 2
    assert "memaudit probe MODEL --out" in capsys.readouterr().err
