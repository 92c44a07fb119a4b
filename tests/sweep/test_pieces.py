"""A sweep run in time-boxed pieces (`memaudit sweep --stop-after`) ends where one uninterrupted
sweep ends: the same weights for every run and the same probe results, however short the box.

The box here is a millisecond, so every invocation stops at its first boundary after doing one
piece of work (a stretch between checkpoints, a run's end, a point's probes): the pieces are as
many as they can be, and the test does not depend on how fast the machine is."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from memaudit.cli import main
from memaudit.io import read_json
from memaudit.probes.weights import weights_sha256

# two probes keep the test short; what a piece stops and resumes is training and probing itself
PROBE = {"batch_size": 32, "n_boot": 20, "probes": ["exposure", "membership"]}


def _sweep_file(tmp: Path) -> Path:
    cfg = {
        # seed 16: its 3-digit secrets occur in no number of the public corpus (configs/scale-reduced.yaml)
        "pretrain": {"steps": 4, "users": 16, "docs_per_user": 3, "seed": 16,
                     "overrides": {"train.checkpoint_every": 2, "train.eval_every": 2}},
        "base": {
            "data": {"synth": {"users": 16, "docs_per_user": 3, "seed": 0, "paragraph_sentences": 2},
                     "canaries": {"repetitions": [1, 4], "owners": ["user"], "secret_length": 3},
                     "seq_len": 64},
            "model": {"preset": "tiny"},
            "train": {"engine": "jax", "steps": 6, "batch_size": 4, "lr": 3e-3, "warmup_steps": 1,
                      "eval_every": 2, "checkpoint_every": 2, "eval_batches": 1},
            "federated": {"rounds": 4, "cohort": 4, "local_steps": 1, "local_batch_size": 2,
                          "eval_every": 2, "checkpoint_every": 2},
        },
        # DP noise from train.seed (by default it comes from OS entropy, and two runs never agree)
        "per_backend": {"federated": {"privacy.clip": 0.5, "privacy.reproducible_randomness": True}},
        # the JAX centralized engine without DP, DP-FedAvg (its ledger and noise resumed too)
        "grid": {"backends": ["centralized", "federated"], "epsilons": ["inf", 8], "seeds": 1,
                 "only": ["centralized-epsinf-s0", "federated-eps8-s0"]},
        "probe": PROBE,
    }
    path = tmp / "sweep.yaml"
    path.write_text(yaml.safe_dump(cfg), encoding="utf-8")
    return path


def _results(out: Path) -> dict[str, tuple[str, dict]]:
    """Each run's weights and what its probes measured (their summaries and per-unit scores; not
    when, how long, or where the reference model lay)."""
    runs = {}
    for rd in sorted((out / "runs").iterdir()):
        probes = read_json(rd / "probes.json")["probes"]
        runs[rd.name] = (weights_sha256(rd / "model"),
                         {name: (p["summary"], p["scores"]) for name, p in probes.items()})
    return runs


@pytest.fixture(scope="module")
def swept(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("pieces")
    cfg = _sweep_file(tmp)
    whole = tmp / "whole"
    # the uninterrupted sweep in its own process, beside the pieces in this one
    proc = subprocess.Popen([sys.executable, "-m", "memaudit.cli", "sweep", str(cfg), "--out", str(whole)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        pieces, codes = tmp / "pieces", []
        # the first piece as JSON, and what it left: test_stopped_sweep_says_so reads them
        codes.append(main(["sweep", str(cfg), "--out", str(pieces), "--stop-after", "0.001", "--format", "json"]))
        first = (read_json(pieces / "sweep.json"), (pieces / "report").exists())
        while codes[-1] == 3:
            assert len(codes) < 80, f"the pieces do not end: exit codes {codes}"
            codes.append(main(["sweep", str(cfg), "--out", str(pieces), "--stop-after", "0.001"]))
        _, err = proc.communicate()
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, err.decode()[-2000:]
    return whole, pieces, codes, first


def test_pieces_end_where_one_sweep_ends(swept):
    whole, pieces, codes, _ = swept
    assert codes[-1] == 0 and set(codes[:-1]) == {3}
    assert read_json(pieces / "sweep.json")["status"] == "complete"
    assert (pieces / "report" / "report.json").is_file()
    a, b = _results(whole), _results(pieces)
    assert set(a) == set(b) == {"public-base", "centralized-epsinf-s0", "federated-eps8-s0"}
    for name in a:
        assert b[name][0] == a[name][0], f"{name}: other weights"
        assert b[name][1] == a[name][1], f"{name}: other probe results"


def test_training_stopped_at_checkpoints_and_resumed(swept):
    _, pieces, codes, _ = swept
    # 6 steps / 4 rounds with a checkpoint every 2: every point was stopped inside its training
    # and resumed (the base too), so the weights compared above went through a resume
    for name in ("centralized-epsinf-s0", "federated-eps8-s0"):
        m = read_json(pieces / "runs" / name / "run.json")
        assert m["status"] == "complete"
        assert len(m["timings"].get("resumed", [])) >= 1, name
    assert len(read_json(pieces / "base" / "run.json")["timings"].get("resumed", [])) == 1
    # one piece of work an invocation: pretraining (2 stretches), the reference's probes, then per
    # point its stretches and its probes
    assert len(codes) >= 2 + 1 + 2 * 3


def _leakage(report: Path) -> dict[str, tuple]:
    """Each run's measured leakage and utility in a report.json, by run name."""
    rep = read_json(report)
    return {Path(r["path"]).name: (r["leakage"], r["utility"]) for r in rep["runs"]}


def test_collect_brings_back_results_for_the_same_report(swept, tmp_path):
    _, pieces, *_ = swept
    back = tmp_path / "back"
    assert main(["collect", str(pieces), "--to", str(back)]) == 0
    files = sorted(p for p in back.iterdir())
    assert len(files) <= 8 and all(p.stat().st_size <= 16 * 2**20 for p in files)
    members = read_json(back / "collected.json")["members"]
    assert "runs/federated-eps8-s0/probes.json" in members and "report/report.json" in members
    assert not [m for m in members if re.search(r"/(model|state)/|split\.json|sensitive|\.safetensors|^cache/", m)]
    merged = tmp_path / "merged"
    assert main(["collect", str(back / "results.tar.gz"), "--to", str(merged)]) == 0
    assert main(["report", str(merged / "runs"), "--out", str(tmp_path / "rep")]) == 0
    assert _leakage(tmp_path / "rep" / "report.json") == _leakage(pieces / "report" / "report.json")


def test_no_report_trains_nothing_again_and_collect_takes_no_stale_report(swept, tmp_path):
    """`--no-report` on the complete sweep: every point is already complete, so nothing is trained
    or probed again; no report is written (the earlier one stays on disk, untouched) and the
    summary names none, so `collect` takes only the runs, as on a leased machine whose report is
    built at home. (On the fixture's own folder, its runs' paths being absolute; its summary is
    put back after.)"""
    _, pieces, *_ = swept
    summary_before = (pieces / "sweep.json").read_bytes()
    before = {p: p.read_bytes() for p in (pieces / "report").iterdir()}
    results = _results(pieces)
    try:
        assert main(["sweep", str(pieces.parent / "sweep.yaml"), "--out", str(pieces), "--no-report"]) == 0
        summary = read_json(pieces / "sweep.json")
        assert summary["status"] == "complete" and summary["report"] is None
        assert [o["action"] for o in summary["outcomes"]] == ["skipped", "skipped"]
        assert {p: p.read_bytes() for p in (pieces / "report").iterdir()} == before
        members = collect_members(pieces, tmp_path / "back")
        assert "runs/federated-eps8-s0/probes.json" in members
        assert not [m for m in members if m.startswith("report/")]
        assert not (tmp_path / "back" / "report.json").exists()
        assert _results(pieces) == results
    finally:
        (pieces / "sweep.json").write_bytes(summary_before)


def collect_members(sweep: Path, dest: Path) -> list[str]:
    assert main(["collect", str(sweep), "--to", str(dest)]) == 0
    return read_json(dest / "collected.json")["members"]


def test_the_points_score_the_public_base_once(swept):
    """Both points are scored against their public base on the same documents, which the base's
    own zero-fine-tuning run scored as its target (torch, on the CPU): one entry of scores, kept
    by that run and read by both points, and one shift check of the split they share
    (memaudit.probes.score_cache); readable by their owner only, never brought back by `collect`."""
    whole, pieces, *_ = swept
    for out in (whole, pieces):
        folder = out / "cache" / "probes"
        assert sorted(p.suffix for p in folder.iterdir()) == [".json", ".npy"]
        assert all(p.stat().st_mode & 0o777 == 0o600 for p in folder.iterdir())
        # written once, by the base's run: a point that computed its reference again would have
        # replaced it after the base's probes.json
        (scores,) = folder.glob("*.npy")
        assert scores.stat().st_mtime <= (out / "runs" / "public-base" / "probes.json").stat().st_mtime
        assert all(d.stat().st_mode & 0o777 == 0o700 for d in (folder, folder.parent))
        for name in ("centralized-epsinf-s0", "federated-eps8-s0"):
            probes = read_json(out / "runs" / name / "probes.json")
            assert probes["target"]["reference"] and "reference" in probes["probes"]["membership"]["summary"]
            assert probes["checks"]["distribution_shift"] == read_json(
                out / "runs" / "public-base" / "probes.json")["checks"]["distribution_shift"]


def test_collect_refuses_a_file_over_the_limit(swept, tmp_path):
    from memaudit.errors import MemauditError
    from memaudit.sweep.collect import collect

    _, pieces, *_ = swept
    with pytest.raises(MemauditError, match="over the"):
        collect(pieces, tmp_path / "back", limit=1000)
    assert not (tmp_path / "back").exists()


def test_stopped_sweep_says_so(swept):
    """The first piece of `swept` (its own sweep before): exit code 3, a stopped summary, no report."""
    *_, codes, (summary, had_report) = swept
    assert codes[0] == 3
    assert summary["status"] == "stopped" and summary["report"] is None
    assert not had_report


@pytest.mark.parametrize("value", ["0", "-5", "nan", "inf"])
def test_bad_stop_after_one_line(value, tmp_path, capsys):
    cfg = _sweep_file(tmp_path)
    assert main(["sweep", str(cfg), "--out", str(tmp_path / "o"), "--stop-after", value]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--stop-after" in err[0] and "Traceback" not in err[0]
    assert not (tmp_path / "o").exists()


def test_stop_after_refuses_scheduler_executors(tmp_path, capsys):
    cfg = _sweep_file(tmp_path)
    code = main(["sweep", str(cfg), "--out", str(tmp_path / "o"), "--stop-after", "60", "--executor", "local"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and "--stop-after needs the processes or debug executor" in err[0]


def test_dry_run_lists_points_and_writes_nothing(tmp_path, capsys):
    cfg = _sweep_file(tmp_path)
    assert main(["sweep", str(cfg), "--out", str(tmp_path / "o"), "--dry-run", "--format", "json"]) == 0
    import json

    listed = json.loads(capsys.readouterr().out)
    assert [p["name"] for p in listed["points"]] == ["centralized-epsinf-s0", "federated-eps8-s0"]
    # 6 steps x 4 sequences x 64 tokens; 4 rounds x 4 clients x 1 local step x 2 x 64
    assert [p["tokens_seen"] for p in listed["points"]] == [1536, 2048]
    assert listed["pretrain"] == [{"base": "base", "model": None, "steps": 4, "tokens": 4 * 4 * 64}]
    assert not (tmp_path / "o").exists()


def test_time_box_stops_after_work_and_before_a_stretch_that_would_not_fit():
    from memaudit.run import timebox

    with timebox.time_box(3600.0):
        timebox.after_checkpoint(1.0)  # another second fits in the hour
        with pytest.raises(timebox.TimeUp):
            timebox.after_checkpoint(7200.0)  # two hours do not
    with timebox.time_box(1e-6):
        assert timebox.expired() and not timebox.should_stop()  # no work yet: the first piece runs
        timebox.note_work()
        assert timebox.should_stop()
    assert timebox.stop_at() is None and not timebox.should_stop()  # no box: never
