"""The whole pipeline in reduced form: a sweep over both backends, killed and re-run (two
points at a time, in worker processes), then the report in a headless browser, on a corpus
whose member text carries HTML/JS payloads."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from memaudit.cli import main
from memaudit.io import read_json
from tests.conftest import XLA_ONE_THREAD
from tests.reports.browser import check_report, chromium_path

XSS = ["<script>alert(1)</script>", '"><img src=x onerror=alert(1)>']
FILLER = "the quarterly inventory report lists every shelf in the north warehouse"


def _corpus(tmp: Path) -> Path:
    from memaudit.data.documents import Document
    from memaudit.data.synth import synthesize

    out = tmp / "corpus.jsonl"
    # short messages (the default closes each with 6 sentences, for extraction coverage): the
    # payloads stay a large share of this small corpus, so 100 steps memorise them
    rows = [Document.to_corpus_json(d) for d in synthesize(16, 3, 3, paragraph_sentences=2)]
    # payload documents, repeated so the no-DP centralized model memorises them
    for i, payload in enumerate(XSS):
        rows += [{"id": f"x{i}-{j}", "user": "u0001", "text": f"{payload} {FILLER} {i}"} for j in range(32)]
    out.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return out


def _sweep_config(tmp: Path, corpus: Path) -> Path:
    cfg = {
        "base": {
            "data": {"path": str(corpus), "seq_len": 128, "heldout_users": 0.25,
                     "canaries": {"repetitions": [1, 8], "owners": ["user", "spread"], "secret_length": 3}},
            "model": {"preset": "tiny"},
            "train": {"steps": 100, "batch_size": 8, "lr": 3e-3, "warmup_steps": 5, "eval_every": 50,
                      "checkpoint_every": 50},
            "federated": {"rounds": 3, "cohort": 4, "local_steps": 2, "local_batch_size": 2,
                          "eval_every": 3, "checkpoint_every": 3},
        },
        "per_backend": {"federated": {"privacy.clip": 0.5}},
        "grid": {"backends": ["centralized", "federated"], "epsilons": ["inf", 8], "seeds": 1},
        "probe": {"batch_size": 32, "extra": {
            "n_boot": 100, "nd_samples": 8, "nd_length": 32, "extraction_ks": [16], "extraction_m": 16,
            "pii_max_items": 4}},  # PII is most of a probe's time; the report only shows it
    }
    path = tmp / "sweep.yaml"
    path.write_text(yaml.safe_dump(cfg), encoding="utf-8")
    return path


@pytest.fixture(scope="module")
def swept(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("sweep")
    cfg = _sweep_config(tmp, _corpus(tmp))
    out = tmp / "out"
    first = out / "runs" / "centralized-epsinf-s0"
    env = {**os.environ, "XLA_FLAGS": f"--xla_force_host_platform_device_count=2 {XLA_ONE_THREAD}"}
    proc = subprocess.Popen([sys.executable, "-m", "memaudit.cli", "sweep", str(cfg), "--out", str(out)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=env, start_new_session=True)
    deadline = time.time() + 600
    try:
        while time.time() < deadline and proc.poll() is None:
            if (first / "probes.json").is_file() and (out / "runs" / "centralized-eps8-s0" / "run.json").is_file():
                break
            time.sleep(0.5)
        assert proc.poll() is None, proc.stderr.read().decode()[-2000:]
        os.killpg(proc.pid, signal.SIGKILL)  # mid-sweep: the second point is training
        proc.wait()
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    finished_first = read_json(first / "run.json")["timings"]["finished"]
    probes_mtime = (first / "probes.json").stat().st_mtime
    # the rest, two points at a time, in workers with the first invocation's 2 XLA devices (they
    # inherit this process's environment, 8 devices: a federated point of this sweep took 4 (epsilon
    # inf) and 16 (epsilon 8) more CPU seconds on 8 devices than on 2, alone, its probes included)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("XLA_FLAGS", env["XLA_FLAGS"])
        rc = main(["sweep", str(cfg), "--out", str(out), "--jobs", "2"])
    return out, rc, finished_first, probes_mtime


def test_rerun_after_kill_completes_without_redoing(swept):
    out, rc, finished_first, probes_mtime = swept
    assert rc == 0
    summary = read_json(out / "sweep.json")
    assert summary["status"] == "complete"
    actions = {o["name"]: o["action"] for o in summary["outcomes"]}
    assert list(actions) == [p["name"] for p in summary["plan"]["points"]]  # plan order, whatever finished first
    assert actions["centralized-epsinf-s0"] == "skipped"
    assert actions["centralized-eps8-s0"] in ("resumed", "trained")
    first = out / "runs" / "centralized-epsinf-s0"
    assert read_json(first / "run.json")["timings"]["finished"] == finished_first
    assert (first / "probes.json").stat().st_mtime == probes_mtime
    for name in actions:
        assert read_json(out / "runs" / name / "run.json")["status"] == "complete"


def test_report_compares_backends_and_follows_ledgers(swept):
    out, *_ = swept
    rep = json.loads((out / "report" / "report.json").read_text())
    ids = {r["id"]: r for r in rep["runs"]}
    assert set(ids) == {"centralized-epsinf-s0", "centralized-eps8-s0", "federated-epsinf-s0", "federated-eps8-s0"}
    assert ids["centralized-eps8-s0"]["privacy"]["unit"] == "example"
    assert ids["federated-eps8-s0"]["privacy"]["unit"] == "user"
    for rid in ("centralized-eps8-s0", "federated-eps8-s0"):
        # calibrated to the nominal target by the epsilon the report states (the tighter accountant)
        assert 8.0 - 1e-3 <= ids[rid]["privacy"]["epsilon"] <= 8.0 + 1e-9
    assert {m["epsilon"] for m in rep["comparisons"]["matched"]} == {8.0, "inf"}
    assert rep["findings"]["sentences"], "findings are generated from the numbers"
    md = (out / "report" / "report.md").read_text()
    assert "centralized" in md and "federated" in md


def test_payloads_extracted_and_shown_as_text_in_browser(swept):
    """The sweep's report names the extracted member documents (id, length) without their text;
    `memaudit report --show-secrets` shows the text, escaped."""
    out, *_ = swept
    assert chromium_path(), "Chromium is missing: scripts/install_browser.sh installs it"
    plain = (out / "report" / "report.html").read_text()
    assert "their text is shown only with --show-secrets" in plain
    assert not any(p in plain for p in XSS) and 'class="sample"' not in plain
    assert main(["report", str(out / "runs"), "--out", str(out / "report-secrets"), "--show-secrets"]) == 0
    html_path = out / "report-secrets" / "report.html"
    html = html_path.read_text()
    for bad in XSS:
        assert bad not in html
    seen = check_report(html_path, out / "report" / "screenshot.png")
    assert seen["dialogs"] == [] and seen["console_errors"] == [] and seen["page_errors"] == []
    assert seen["external_requests"] == []
    assert seen["plots"] >= 3
    assert seen["img_elements"] == 0
    shown = " ".join(seen["sample_texts"])
    assert any(p in shown for p in XSS), "the memorised payload text should be extracted and shown escaped"
