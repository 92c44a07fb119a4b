"""The report's typed records against the JSON they read and write: a run's entry
(`memaudit.reports.entries`) and probes.json's one reader and writer (`memaudit.probes.document`)."""

from __future__ import annotations

import json
import math

import pytest

from memaudit.errors import DataError
from memaudit.probes.document import ProbesDoc, read_probes, read_stamp, write_probes
from memaudit.probes.records import Cell
from memaudit.reports.blocks import Comparisons, blocks
from memaudit.reports.build import build_report, comparisons
from memaudit.reports.entries import RunEntry, entries
from memaudit.reports.write import write_report
from tests.reports._fixtures import auc_units, cell, run, write_run_dir


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    """A report over a DP and a non-DP run of each backend, as report.json holds it."""
    root = tmp_path_factory.mktemp("entries")
    write_run_dir(root / "runs" / "cen", "centralized", ppl=80.0, dp=(1.0, 400, 16, 50), mia_shift=1.0)
    write_run_dir(root / "runs" / "cen-nodp", "centralized", ppl=70.0, mia_shift=1.5)
    write_run_dir(root / "runs" / "fed", "federated", ppl=85.0, dp=(1.0, 50, 8, 20), exposure_shift=0.5)
    paths = write_report(build_report([root / "runs"]), root / "report")
    return json.loads(paths["json"].read_text(encoding="utf-8"))


def test_a_run_object_read_as_an_entry_writes_the_same_json_in_the_same_order(written):
    assert len(written["runs"]) == 3
    for raw in written["runs"]:
        entry = RunEntry.of(raw)
        assert json.dumps(entry.to_json()) == json.dumps(raw)  # values and key order
        assert entry.privacy.epsilon == raw["privacy"]["epsilon"]
        assert entry.utility.holdout_perplexity == raw["utility"]["holdout_perplexity"]
        assert entry.model.preset == raw["model"]["preset"] and entry.goldfish is raw["mitigation"]["goldfish"]


def test_an_older_run_object_reads_with_its_fields_defaults():
    """A run object without the keys a newer memaudit writes: no guarantee, no Goldfish, a full
    fine-tune, nothing measured."""
    old = RunEntry.of({"id": "old", "backend": "centralized", "privacy": {"mechanism": "none"}})
    assert old.privacy.epsilon == math.inf and old.privacy.unit is None
    assert old.goldfish is False and old.model.finetune == "full"
    assert old.cell("mia_auc") is None and not old.measured("mia_auc") and old.units_of("mia_auc") is None
    assert RunEntry.of(old) is old  # an entry is read once


def test_comparisons_read_run_objects_and_entries_alike():
    """The comparison blocks over hand-built run objects, and over the same runs as entries, are
    the same blocks."""
    mia = cell(0.6, 0.05)
    runs = [run("par", "centralized", 8.0, mia=mia, unit="user", units={"mia_auc": auc_units(0.5)}),
            run("fed", "federated", 8.0, mia=mia, unit="user", units={"mia_auc": auc_units(0.0)})]
    a, b = comparisons(runs), comparisons(entries(runs))
    assert [m.epsilon for m in a.matched] == [m.epsilon for m in b.matched] == [8.0]
    (block,) = blocks(a, "matched")
    assert block.units == {"centralized": "user", "federated": "user"} and block.equal_guarantee
    assert block.metrics["mia_auc"].test.p_value == b.matched[0].metrics["mia_auc"].test.p_value
    assert Comparisons.of(a).matched_utility.status == a.matched_utility.status


def test_probes_json_is_written_and_read_back_by_one_module(tmp_path):
    doc = {"schema": 1, "target": {"model": "m", "weights_sha256": "ab" * 32}, "settings": {"batch_size": 4},
           "counts": {}, "checks": {"distribution_shift": {"auc": 0.5, "flagged": False}},
           "probes": {"user_inference": {"summary": {"auc": cell(0.7, 0.1, 20, "users"),
                                                     "tpr_at_fpr": {"0.1": cell(0.2, 0.1, 10, "users")}},
                                         "scores": [{"user": "u1", "score": 2.0, "training_user": True},
                                                    {"user": "u2", "score": 1.0, "training_user": False}]},
                      "audit": {"summary": {"skipped": "no audit canaries"}, "scores": []}}}
    path = tmp_path / "probes.json"
    write_probes(path, doc)
    assert json.loads(path.read_text(encoding="utf-8")) == doc
    back = read_probes(path)
    assert back.weights_sha256 == "ab" * 32 and back.settings == {"batch_size": 4}
    assert back.distribution_shift == {"auc": 0.5, "flagged": False}
    assert back.get("audit") is None and back.probes["audit"].skipped == "no audit canaries"
    users = back.get("user_inference")
    attack = users.attack()
    assert attack.auc == Cell.from_json(doc["probes"]["user_inference"]["summary"]["auc"])
    assert attack.tpr_at_fpr["0.1"].value == pytest.approx(0.2)
    assert [(u.user, u.score, u.training_user) for u in users.user_scores()] == [
        (r["user"], r["score"], r["training_user"]) for r in doc["probes"]["user_inference"]["scores"]]


@pytest.mark.parametrize("content, settings, weights", [
    ('{"settings": {"batch_size": 4}, "target": {"weights_sha256": "ab"}}', {"batch_size": 4}, "ab"),
    ('{"settings": {"batch_size": 4}}', {"batch_size": 4}, None),  # written before the fingerprint
    ('{"target": {"weights_sha256": 3}}', None, None),
    ("[1, 2]", None, None)])
def test_a_sweep_reads_the_stamp_of_any_json_file(tmp_path, content, settings, weights):
    """What a sweep asks of a stored probes.json (its settings and weights), read from whatever
    JSON it holds: a file that says neither is re-probed, not refused."""
    path = tmp_path / "probes.json"
    path.write_text(content, encoding="utf-8")
    stamp = read_stamp(path)
    assert (stamp.settings, stamp.weights_sha256) == (settings, weights)


@pytest.mark.parametrize("content, what", [('{"schema": 2, "probes": {}}', "schema 2"),
                                           ('{"schema": 1}', "no 'probes' object"),
                                           ('{"schema": 1, "probes": {"pii": {}}}', "probe 'pii' has no 'summary'")])
def test_a_malformed_probes_json_is_refused_in_one_line(tmp_path, content, what):
    path = tmp_path / "probes.json"
    path.write_text(content, encoding="utf-8")
    with pytest.raises(DataError) as e:
        read_probes(path)
    assert what in str(e.value) and str(path) in str(e.value) and "\n" not in str(e.value)


def test_the_typed_sections_hold_what_the_file_holds(tmp_path):
    """A run directory's probes.json (exposure by repetitions, membership scores) read through the
    typed sections against the same file read as JSON."""
    rd = write_run_dir(tmp_path / "run", "federated", ppl=90.0, exposure_shift=0.5, mia_shift=1.0)
    raw = json.loads((rd / "probes.json").read_text(encoding="utf-8"))
    doc = read_probes(rd / "probes.json")
    assert isinstance(doc, ProbesDoc)
    exposure, expected = doc.get("exposure"), raw["probes"]["exposure"]
    summary = exposure.exposure()
    assert list(summary.by_repetitions) == list(expected["summary"]["by_repetitions"])
    for reps, bucket in expected["summary"]["by_repetitions"].items():
        got = summary.by_repetitions[reps]
        assert got.all.to_json() == bucket["all"] and got.excess.to_json() == bucket["excess"]
        assert {k: c.to_json() for k, c in got.by_owner.items() if c is not None} == {
            k: bucket[k] for k in ("user", "spread") if k in bucket}
    assert [(s.id, s.role, s.exposure, s.repetitions) for s in exposure.exposure_scores()] == [
        (r["id"], r["role"], r["exposure"], r["repetitions"]) for r in expected["scores"]]
    rows = doc.get("membership").membership_scores()
    assert [(r.id, r.loss, r.member) for r in rows] == [
        (r["id"], r["loss"], r["member"]) for r in raw["probes"]["membership"]["scores"]]
    assert doc.get("extraction") is None and doc.weights_sha256 is None
