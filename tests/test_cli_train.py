"""`memaudit train` through the CLI in-process: end to end, and bad input (exit 2, one line)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from memaudit.cli import main
from memaudit.io import read_json, read_jsonl
from tests.conftest import REPO_ROOT, tiny_train_args

TINY = str(REPO_ROOT / "configs" / "tiny.yaml")


def _secrets(run: Path) -> list[str]:
    c = read_json(run / "canaries.json")
    out = [x["secret"] for key in ("inserted", "references", "audit") for x in c.get(key, [])]
    assert out, "the run should hold canaries"
    return out


def test_end_to_end_synth_train_load_generate(tiny_run):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    assert tiny_run["rc"] == 0, tiny_run["stderr"][-2000:]
    run = tiny_run["path"]
    manifest = read_json(run / "run.json")
    assert manifest["status"] == "complete" and manifest["backend"] == "centralized"
    res = manifest["result"]
    assert res["steps"] == 40
    assert manifest["data_fingerprint"] and manifest["config"]["train"]["steps"] == 40
    # the holdout loss fell clearly from the untrained model's
    assert res["final_holdout_loss"] < res["initial_holdout_loss"] - 1.0
    metrics = read_jsonl(run / "metrics.jsonl")
    assert [m["step"] for m in metrics] == list(range(1, 41))
    evals = [m for m in metrics if "holdout_loss" in m]
    assert [m["step"] for m in evals] == [20, 40] and evals[-1]["holdout_loss"] == res["final_holdout_loss"]
    assert all({"loss", "lr", "tokens_per_s", "grad_norm"} <= set(m) for m in metrics)

    tok = AutoTokenizer.from_pretrained(run / "model")
    model = AutoModelForCausalLM.from_pretrained(run / "model")
    ids = tok("hello my name is", return_tensors="pt").input_ids
    with torch.no_grad():
        gen = model.generate(ids, max_new_tokens=8, do_sample=False)
    assert gen.shape[1] > ids.shape[1]
    assert isinstance(tok.decode(gen[0]), str)

    # no canary secret in the vocabulary, nor in anything printed
    vocab = tok.get_vocab()
    printed = tiny_run["stdout"] + tiny_run["stderr"]
    for s in _secrets(run):
        assert not any(s in t for t in vocab)
        assert s not in printed
    summary = tiny_run["stdout"].strip().splitlines()
    assert len(summary) == 1 and summary[0].startswith("trained tiny (centralized) for 40 steps")


def _snapshot(root: Path) -> dict[str, tuple[int, bytes]]:
    return {str(p): (p.stat().st_mtime_ns, p.read_bytes()) for p in sorted(root.rglob("*")) if p.is_file()}


def _refused(capsys, args: list[str], *, needle: str) -> str:
    rc = main(args)
    err = capsys.readouterr().err.strip()
    assert rc == 2, err
    assert len(err.splitlines()) == 1 and err.startswith("memaudit: error:") and "Traceback" not in err
    assert needle in err, err
    return err


def test_missing_config_file(tmp_path, capsys):
    _refused(capsys, ["train", str(tmp_path / "nope.yaml"), "--out", str(tmp_path / "r")], needle="not found")
    assert not (tmp_path / "r").exists()


def test_malformed_yaml(tmp_path, capsys):
    cfg = tmp_path / "bad.yaml"
    cfg.write_text("train: {steps: 3\nmodel: [\n")
    _refused(capsys, ["train", str(cfg), "--out", str(tmp_path / "r")], needle="not valid YAML")
    assert not (tmp_path / "r").exists()


def test_unknown_key(tmp_path, capsys):
    _refused(capsys, ["train", TINY, "--out", str(tmp_path / "r"), "--set", "train.learning_rate=1"],
             needle="unknown key 'train.learning_rate'")
    assert not (tmp_path / "r").exists()


def test_negative_learning_rate(tmp_path, capsys):
    _refused(capsys, ["train", TINY, "--out", str(tmp_path / "r"), "--set", "train.lr=-0.1"],
             needle="train.lr")
    assert not (tmp_path / "r").exists()


def _bad_corpus(tmp_path, capsys, content: bytes, needle: str) -> None:
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_bytes(content)
    before = _snapshot(tmp_path)
    out = tmp_path / "r"
    _refused(capsys, ["train", TINY, "--out", str(out), *tiny_train_args(f"data.path={corpus}")],
             needle=needle)
    after = _snapshot(tmp_path)
    assert {k: v for k, v in after.items() if k in before} == before  # the corpus is untouched
    assert not out.exists()  # checked before the run directory was written


def test_empty_corpus(tmp_path, capsys):
    _bad_corpus(tmp_path, capsys, b"", needle="corpus")


def test_corpus_without_text_field(tmp_path, capsys):
    rows = [json.dumps({"body": f"message {i}", "user": f"u{i % 4}"}) for i in range(40)]
    _bad_corpus(tmp_path, capsys, ("\n".join(rows) + "\n").encode(), needle="text")


def test_non_utf8_corpus(tmp_path, capsys):
    _bad_corpus(tmp_path, capsys, b'{"text": "caf\xe9 \xff\xfe", "user": "a"}\n', needle="UTF-8")


def test_completed_run_is_not_overwritten(tiny_run, tmp_path, capsys):
    run = tiny_run["path"]
    before = _snapshot(run)
    _refused(capsys, ["train", TINY, "--out", str(run)], needle="--overwrite")
    _refused(capsys, ["train", "--resume", str(run)], needle="already complete")
    assert _snapshot(run) == before


def test_overwrite_replaces_a_run(tmp_path, capsys):
    out = tmp_path / "r"
    args = ["train", TINY, "--out", str(out), *tiny_train_args("train.steps=2", "train.eval_every=1",
                                                              "data.synth.users=12",
                                                              "data.canaries.owners=[user]")]
    assert main(args) == 0
    (out / "probes.json").write_text("{}")  # a stale artifact of the old run
    assert main([*args, "--overwrite"]) == 0
    capsys.readouterr()
    assert not (out / "probes.json").exists()
    assert [m["step"] for m in read_jsonl(out / "metrics.jsonl")] == [1, 2]


def test_resume_on_a_directory_that_is_not_a_run(tmp_path, capsys):
    (tmp_path / "notes.txt").write_text("keep me")
    before = _snapshot(tmp_path)
    _refused(capsys, ["train", "--resume", str(tmp_path)], needle="not a memaudit run")
    assert _snapshot(tmp_path) == before


def test_resume_on_a_live_run(tmp_path, capsys):
    run = tmp_path / "live"
    run.mkdir()
    (run / "run.json").write_text(json.dumps({"status": "running", "config": {}}))
    import socket
    import time

    (run / "run.lock").write_text(json.dumps({"pid": os.getpid(), "host": socket.gethostname(),
                                              "heartbeat": time.time()}))
    before = _snapshot(run)
    _refused(capsys, ["train", "--resume", str(run)], needle="still alive")
    _refused(capsys, ["train", TINY, "--out", str(run), "--overwrite"], needle="live process")
    assert _snapshot(run) == before


def test_missing_federated_or_parallel_backend_is_one_line(tmp_path, capsys, monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "memaudit.run.launch", None)  # import fails like a missing module
    err = _refused(capsys, ["train", TINY, "--out", str(tmp_path / "p"), "--set", "parallel.x=2"],
                   needle="missing")
    assert "memaudit.run.launch" in err


@pytest.mark.parametrize("args", [["train"], ["train", TINY, "--backend", "mpi"]])
def test_usage_errors(args, capsys):
    _refused(capsys, args, needle="")


def test_summary_line_names_the_unit_per_sequence_and_per_document():
    from types import SimpleNamespace

    from memaudit.commands.train import summary_line

    cfg = SimpleNamespace(backend="parallel", model=SimpleNamespace(preset="tiny", init_from=None))
    priv = {"unit": "example", "delta": 1e-4, "epsilon": {"rdp": 3.0, "pld": 2.5},
            "document": {"max_sequences_per_document": 3, "epsilon": {"rdp": None, "pld": 7.2}}}
    line = summary_line(cfg, Path("run"), {"steps": 6, "final_holdout_loss": 4.0, "privacy": priv})
    # sigma given (no calibration): the tightest accountant's, named, as the report states it
    assert "epsilon 2.50 per sequence, 7.20 per document of up to 3 sequences (PLD; delta 1e-04)" in line
    priv["document"] = {"max_sequences_per_document": None, "epsilon": None}  # data before the count
    assert "per document unknown" in summary_line(cfg, Path("run"), {"steps": 6, "privacy": priv})
    priv.update(unit="user", document=None)
    assert "epsilon 2.50 per user (PLD; delta" in summary_line(cfg, Path("run"), {"steps": 6, "privacy": priv})


def test_summary_line_states_the_epsilon_of_the_accountant_that_set_sigma():
    """Issue 61, item 4: a ULS run calibrated by PLD to epsilon 8 printed "epsilon 10.13 per user"
    (its RDP figure) while its ledger said 8.0000. The input: a ledger whose calibration names PLD."""
    from types import SimpleNamespace

    from memaudit.commands.train import summary_line

    cfg = SimpleNamespace(backend="centralized", model=SimpleNamespace(preset="tiny", init_from=None))
    priv = {"unit": "user", "delta": 1e-5, "epsilon": {"rdp": 10.13, "pld": 7.9999},
            "calibration": {"target_epsilon": 8.0, "accountant": "pld", "noise_multiplier": 1.2}}
    line = summary_line(cfg, Path("run"), {"steps": 6, "privacy": priv})
    assert "epsilon 8.00 per user (PLD, the accountant that set sigma for target 8; delta 1e-05)" in line
    assert "10.13" not in line
    priv["calibration"] = {"target_epsilon": 8.0, "accountant": "rdp", "noise_multiplier": 1.2}
    assert "epsilon 10.13 per user (RDP, the accountant" in summary_line(cfg, Path("run"), {"privacy": priv})
    priv["calibration"] = None  # sigma given: the tightest accountant's, named
    assert "epsilon 8.00 per user (PLD; delta 1e-05)" in summary_line(cfg, Path("run"), {"privacy": priv})


def test_federated_ledger_records_how_sigma_was_calibrated():
    """Issue 61, item 4: DP-FedAvg's ledger had no calibration block (ELS, ULS and DP-SGD have
    one): the input is a federated config with privacy.target_epsilon."""
    from types import SimpleNamespace

    from memaudit.config import load_config
    from memaudit.federated.trainer import FederatedTrainer
    from memaudit.privacy.ledger import PrivacyLedger

    cfg = load_config(None, ["backend=federated", "privacy.target_epsilon=4", "federated.rounds=20",
                             "federated.cohort=5"])
    stub = SimpleNamespace(cfg=cfg, fcfg=cfg.federated, clients=SimpleNamespace(num_users=100), masked=False,
                           params0=None)
    plan = FederatedTrainer._privacy_plan(stub)
    cal = plan.calibration
    assert cal is not None and cal["target_epsilon"] == 4 and cal["noise_multiplier"] == plan.noise_multiplier
    assert cal["accountant"] == "pld" and cal["steps"] == 20 and cal["unit"] == "user"
    led = PrivacyLedger(unit="user", delta=plan.delta, calibration=plan.calibration)
    for _ in range(20):
        led.record_mechanism(plan.mechanism)
    assert 4 - 1e-3 <= led.epsilon(cal["accountant"]) <= 4


def test_summary_line_of_a_uls_ledger_calibrated_by_pld_states_its_target():
    """The issue's case from the ledger itself: ULS calibrated by PLD to epsilon 8 per user (as
    `memaudit.train.user_dp.uls_setup` does under privacy.accountant: both); its RDP figure is
    larger and was the one printed."""
    from types import SimpleNamespace

    from memaudit.commands.train import summary_line
    from memaudit.privacy.ledger import PrivacyLedger
    from memaudit.privacy.mechanisms import calibrate
    from memaudit.train.user_dp import uls_mechanism

    steps, delta = 120, 1e-4
    mech = uls_mechanism(noise_multiplier=0.0, users=51, expected_users=2, k=8)
    sigma = calibrate(8.0, lambda z: mech.with_noise(z).dp_event(), steps=steps, delta=delta, accountant="pld",
                      unit="user")
    led = PrivacyLedger(unit="user", delta=delta, calibration={"target_epsilon": 8.0, "accountant": "pld",
                                                               "noise_multiplier": sigma})
    led.record_mechanism(mech.with_noise(sigma), steps=steps)
    priv = led.to_json()
    assert priv["epsilon"]["rdp"] > 8.5 and 8 - 1e-3 <= priv["epsilon"]["pld"] <= 8
    cfg = SimpleNamespace(backend="centralized", model=SimpleNamespace(preset="tiny", init_from=None))
    line = summary_line(cfg, Path("run"), {"steps": steps, "privacy": priv})
    assert "epsilon 8.00 per user (PLD, the accountant that set sigma for target 8; delta 1e-04)" in line
    assert f"{priv['epsilon']['rdp']:.2f}" not in line
