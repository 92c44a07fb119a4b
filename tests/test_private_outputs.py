"""Private stays private, and errors name their cause.

- Under DP the progress display is given step, epsilon so far and time only: never the loss or
  another unprivatised statistic (those go to sensitive_metrics.jsonl, 0600).
- Every sensitive file of a run (data/, state/, canaries.json, sensitive_metrics.jsonl,
  dp_secret.json) is 0600 inside 0700 folders.
- The report names extracted member documents by id and length; their text only with
  --show-secrets.
- Errors never echo a data value; a full disk names the file and the cause; a refused pickle
  and an out-of-memory get their own line; the libraries' log lines do not come before
  memaudit's one line.

One small DP run (4 steps) through the training driver, shared by the module; the CLI cases
run in-process and fail before anything trains.
"""

from __future__ import annotations

import errno
import json
import os
import pickle
import stat
from pathlib import Path
from types import SimpleNamespace

import pytest

from memaudit.cli import error_line, main
from memaudit.run.lifecycle import SENSITIVE_KEYS, SENSITIVE_METRICS
from tests.conftest import REPO_ROOT, TINY_TRAIN_OVERRIDES

TINY = str(REPO_ROOT / "configs" / "tiny.yaml")
SSN = "123-45-6789"


@pytest.fixture(scope="module")
def dp_run(tmp_path_factory) -> dict:
    """A 4-step DP-SGD run through `dispatch`, with every progress call recorded."""
    from memaudit.config import load_config
    from memaudit.run.dispatch import dispatch
    from memaudit.rundir import prepare_new_run

    overrides = [*TINY_TRAIN_OVERRIDES, "train.steps=4", "train.eval_every=2", "train.checkpoint_every=2",
                 "data.synth.users=12", "data.canaries.owners=[user]", "privacy.noise_multiplier=1.0"]
    cfg = load_config(TINY, overrides)
    out = tmp_path_factory.mktemp("dp") / "run"
    calls: list[tuple[int, int, dict]] = []
    result = dispatch(cfg, prepare_new_run(out, overwrite=False), resume=False,
                      progress=lambda d, t, info: calls.append((d, t, dict(info))))
    return {"path": out, "calls": calls, "result": result}


def test_no_unprivatised_statistic_reaches_the_progress_display_under_dp(dp_run):
    from memaudit.commands.train import _info_text

    steps = [info for d, _, info in dp_run["calls"] if info.get("phase") not in ("data",) and d > 0]
    assert len(steps) == 4
    for info in steps:
        assert not set(info) & SENSITIVE_KEYS, info
        assert set(info) <= {"phase", "epsilon"}, info
        assert _info_text(info, private=True).startswith("epsilon ")
    eps = [info["epsilon"] for info in steps]
    assert all(e is not None and e > 0 for e in eps) and eps == sorted(eps)
    # epsilon at the end is the ledger's (the oracle: privacy.json, recomputed by the ledger)
    from memaudit.privacy.ledger import PrivacyLedger

    ledger = PrivacyLedger.from_json(json.loads((dp_run["path"] / "privacy.json").read_text()))
    assert eps[-1] == pytest.approx(ledger.epsilon("rdp"), rel=1e-9)
    # the loss is recorded, in the sensitive metrics only
    sens = [json.loads(x) for x in (dp_run["path"] / SENSITIVE_METRICS).read_text().splitlines()]
    assert len(sens) == 4 and all("loss" in r for r in sens)
    # even a record that carries one is not shown under DP
    assert _info_text({"loss": 2.5, "holdout_loss": 3.0, "epsilon": 1.5}, private=True) == "epsilon 1.5"


def _mode(p: Path) -> int:
    return stat.S_IMODE(p.stat().st_mode)


def test_every_sensitive_file_is_0600_inside_0700_folders(dp_run):
    run = dp_run["path"]
    sensitive = [run / "canaries.json", run / SENSITIVE_METRICS, run / "dp_secret.json", run / "split.json"]
    for folder in (run / "data", run / "state"):
        sensitive += [p for p in folder.rglob("*") if p.is_file()]
        assert _mode(folder) == 0o700, folder
        for d in (p for p in folder.rglob("*") if p.is_dir()):
            assert _mode(d) == 0o700, d
    assert len(sensitive) > 8
    bad = {str(p.relative_to(run)): oct(_mode(p)) for p in sensitive if _mode(p) != 0o600}
    assert not bad, bad
    assert _mode(run) == 0o700


def _probes_with_extraction() -> dict:
    hit = {"value": 1.0, "ci_low": 0.2, "ci_high": 1.0, "n": 1, "unit": "documents"}
    return {"schema": 1, "target": {}, "settings": {}, "probes": {"extraction": {
        "summary": {"discoverable": {"8": {"exact": hit}}},
        "scores": {"discoverable": [{"id": "d7", "exact": True, "repeats": 2}]}}}}


def test_extracted_member_text_is_in_a_report_only_with_show_secrets(tmp_path):
    from memaudit.reports.probes_adapter import summarize_probes
    from memaudit.reports.write import json_safe

    text = f"my ssn is {SSN}, call me"
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "documents.jsonl").write_text(
        json.dumps({"id": "d7", "text": text, "role": "member", "kind": "doc"}) + "\n")
    plain = summarize_probes(_probes_with_extraction(), run_dir=tmp_path)
    assert SSN not in json.dumps(json_safe(plain))  # as report.json would store it
    assert plain["samples"] == [] and plain["extracted_members"] == [{"id": "d7", "length": len(text)}]
    shown = summarize_probes(_probes_with_extraction(), run_dir=tmp_path, show_secrets=True)
    assert shown["samples"] == [text]


def _one_line(capsys) -> str:
    _, err = capsys.readouterr()
    assert err.count("\n") == 1 and err.startswith("memaudit: error: ") and "Traceback" not in err, err
    return err


def test_an_error_never_echoes_a_corpus_value(tmp_path, capsys):
    corpus = tmp_path / "c.jsonl"
    corpus.write_text(json.dumps({"text": "hello there", "user": "a",
                                  "pii": [{"type": "ssn", "value": SSN, "start": f"my ssn is {SSN}"}]}) + "\n")
    assert main(["train", TINY, "--out", str(tmp_path / "out"), "--set", f"data.path={corpus}"]) == 2
    err = _one_line(capsys)
    assert SSN not in err and "c.jsonl" in err and "row 1" in err and "pii" in err
    # Python's own conversion errors quote the value: the CLI never shows it
    line = error_line(ValueError(f"invalid literal for int() with base 10: 'my ssn is {SSN}'"))
    assert SSN not in line and "not shown" in line


def test_a_library_log_line_never_comes_before_memauditss_line(tmp_path, capsys):
    corpus = tmp_path / "c.jsonl"
    corpus.write_text(json.dumps({"text": f"my ssn is {SSN}", "user": "a"}) + '\n{"text": "torn\n')
    assert main(["train", TINY, "--out", str(tmp_path / "out"), "--set", f"data.path={corpus}"]) == 2
    err = _one_line(capsys)
    assert "c.jsonl" in err and SSN not in err


def test_a_full_disk_names_the_file_and_the_cause(tmp_path, capsys, monkeypatch):
    def full(fd):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr("memaudit.io.os.fsync", full)
    out = tmp_path / "corpus.jsonl"
    assert main(["data", "synth", "--users", "2", "--docs-per-user", "1", "--out", str(out)]) == 2
    err = _one_line(capsys)
    assert f"no space left on device writing '{out}'" in err, err
    assert not out.exists() and not list(tmp_path.iterdir())  # the temporary file is gone too


def test_torchs_failed_write_is_a_named_os_error(tmp_path, monkeypatch):
    """torch reports a full disk as `[enforce fail ...] file write failed` without a file."""
    from memaudit.io import writing

    monkeypatch.setattr("memaudit.io.shutil.disk_usage", lambda p: SimpleNamespace(free=1024))
    state = tmp_path / "state"
    with pytest.raises(OSError) as e, writing(state):
        raise RuntimeError("[enforce fail at inline_container.cc:672] . PytorchStreamWriter failed "
                           "writing file data/0: file write failed")
    assert e.value.errno == errno.ENOSPC and e.value.filename == str(state)
    assert error_line(e.value).startswith(f"no space left on device writing '{state}'")


@pytest.mark.parametrize("exc, words", [
    (pickle.UnpicklingError("Weights only load failed"), "pickled object"),
    (MemoryError("Unable to allocate 226. GiB for an array with shape (30000000000,)"), "out of memory"),
])
def test_a_refused_pickle_and_out_of_memory_say_what_to_do(exc, words):
    line = error_line(exc)
    assert words in line and not line.startswith("unexpected") and "; " in line


def test_a_failed_sweep_point_and_run_json_never_quote_a_value():
    """A point's error is printed by the sweep and recorded in run.json: no value there either."""
    from memaudit.run.lifecycle import one_line_error
    from memaudit.sweep.work import one_line

    e = ValueError(f"invalid literal for int() with base 10: 'my ssn is {SSN}'")
    for line in (one_line(e), one_line_error(e)):
        assert SSN not in line and line.startswith("ValueError: a value in the input")
