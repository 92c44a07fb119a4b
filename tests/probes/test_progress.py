"""Progress that reaches a log: per-stage lines with counts and time left (a fake clock, no sleeps),
and every probe stage, PII included, reporting through the progress callback."""

from __future__ import annotations

import pytest

from memaudit.cli import main
from memaudit.commands.probe import LogProgress
from memaudit.config import ProbeConfig
from memaudit.probes.runner import run_probes
from memaudit.probes.targets import resolve_target
from tests.probes.conftest import make_corpus, make_tokenizer, tiny_llama, write_run


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def test_log_lines_per_stage_every_30s_with_time_left():
    clock, lines = Clock(), []
    p = LogProgress(lines.append, clock=clock)
    p(10, 100, {"stage": "scoring"})  # first report of a stage: a line
    clock.t += 20
    p(30, 100, {"stage": "scoring"})  # 20 s later: none
    p(1, 5, {"stage": "exposure"})  # another stage starts: its own line
    clock.t += 15
    p(50, 100, {"stage": "scoring"})  # 35 s after the last scoring line: a line
    clock.t += 5
    p(100, 100, {"stage": "scoring"})  # done: a line at once
    p(100, 100, {"stage": "scoring"})  # never a second done line
    assert lines == [
        "probe scoring: 10/100 (10%), 0s spent, about 0s left",
        "probe exposure: 1/5 (20%), 0s spent, about 0s left",
        "probe scoring: 50/100 (50%), 35s spent, about 35s left",
        "probe scoring: 100/100 (100%), done in 40s",
    ]


def test_time_left_from_the_stage_rate():
    clock, lines = Clock(), []
    p = LogProgress(lines.append, clock=clock, every=30)
    p(0, 40, {"stage": "pii"})
    for k in range(1, 40):
        clock.t += 3  # 3 s per item
        p(k, 40, {"stage": "pii"})
    assert lines[0] == "probe pii: 0/40 (0%), 0s spent, time left not yet known"
    # a line every 30 s (10 items), each with (40 - k) items x 3 s left
    assert lines[1:] == [f"probe pii: {k}/40 ({100 * k // 40}%), {_d(3 * k)} spent, "
                         f"about {_d(3 * (40 - k))} left" for k in (10, 20, 30)]


def _d(s: int) -> str:
    return f"{s}s" if s < 60 else f"{s // 60}m{s % 60:02d}s"


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    words, docs, canaries = make_corpus(0)
    tok = make_tokenizer(words)
    model = tiny_llama(len(tok), seed=2)
    path = tmp_path_factory.mktemp("progress") / "run"
    write_run(path, model, tok, docs, canaries)
    return path, model, tok, canaries


FAST = {"exposure_enumerate_max": 1, "exposure_samples": 100, "extraction_ks": (8,),
        "extraction_m": 8, "extraction_max_docs": 8, "goldfish_m": 8, "goldfish_min_prompt": 4,
        "nd_samples": 8, "nd_length": 12, "nd_top_n": 4, "nd_ngram": 8, "n_boot": 20,
        "pii_candidates": 3, "pii_max_items": 6, "batch_size": 16}


def test_every_stage_reports(run):
    path, model, tok, _c = run
    seen: dict[str, list[tuple[int, int]]] = {}

    def record(done, total, info):
        assert set(info) == {"stage"}  # counts only: no text travels with progress
        seen.setdefault(info["stage"], []).append((done, total))

    run_probes(resolve_target(path), ProbeConfig(device="cpu", **FAST), model=model,
               tokenizer=tok, progress=record)
    assert {"scoring", "exposure", "extraction", "sampling", "goldfish", "pii",
            "audit"} <= set(seen)
    for stage, calls in seen.items():
        done = [d for d, _t in calls]
        assert done == sorted(done), stage
        assert calls[-1][0] == calls[-1][1] > 0, stage  # every stage ends at its total


def test_cli_writes_progress_lines_to_a_log(run, capsys):
    path, _m, _t, canaries = run
    out = path.parent / "probes.json"
    rc = main(["probe", str(path), "--probes", "exposure,audit", "--device", "cpu",
               "--exposure-candidates", "100", "--exposure-enumerate-max", "1",
               "--bootstrap", "10", "--out", str(out)])
    err = capsys.readouterr().err
    assert rc == 0, err
    lines = err.splitlines()
    for stage in ("exposure", "audit"):
        assert any(line.startswith(f"probe {stage}: ") and "(100%), done in " in line
                   for line in lines), err
    secrets = [c["secret"] for c in canaries["inserted"] + canaries["references"]]
    progress_lines = [line for line in lines if line.startswith("probe ")]
    assert not any(s in line for s in secrets for line in progress_lines)


def test_batch_encoding_equals_one_call_per_text(run):
    from memaudit.probes.exposure import encode_many, sample_secrets
    from memaudit.probes.targets import Codec

    _p, _m, tok, canaries = run
    codec = Codec(tok, start_id=0)
    texts = [canaries["template"].replace("{secret}", s)
             for s in sample_secrets(canaries["alphabet"], canaries["secret_length"], 50, 0)]
    assert encode_many(codec, texts) == [codec.encode(t) for t in texts]
