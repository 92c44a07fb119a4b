"""A probe stage stopped part-way (a time-boxed sweep piece ended by its hard limit) keeps each
probe it finished and, run again on the same weights with the same settings, runs only the rest:
the probes.json it then writes is the one an uninterrupted stage writes."""

from __future__ import annotations

import stat

import pytest

from memaudit.config import ProbeConfig
from memaudit.io import dumps
from memaudit.probes import runner
from memaudit.probes.runner import run_probes
from memaudit.probes.targets import resolve_target
from tests.probes.conftest import make_corpus, make_tokenizer, tiny_llama, write_run

SETTINGS = {"probes": ("exposure", "membership"), "exposure_enumerate_max": 1, "exposure_samples": 100,
            "n_boot": 20, "batch_size": 8, "device": "cpu"}


class Stopped(BaseException):
    """What SIGTERM's handler raises in a stopped piece: not an Exception a probe could catch."""


def test_an_interrupted_probe_stage_resumes_at_the_next_probe(tmp_path, monkeypatch):
    words, docs, canaries = make_corpus(0)
    tok = make_tokenizer(words)
    run = tmp_path / "run"
    write_run(run, tiny_llama(len(tok), seed=1), tok, docs, canaries)
    settings, partial = ProbeConfig(**SETTINGS), tmp_path / "probes.partial.json"
    whole = run_probes(resolve_target(run), settings, engine="torch").document

    real = dict(runner.REGISTRY)

    def stop(ctx):
        raise Stopped

    monkeypatch.setitem(runner.REGISTRY, "membership", stop)
    with pytest.raises(Stopped):
        run_probes(resolve_target(run), settings, engine="torch", partial=partial)
    assert stat.S_IMODE(partial.stat().st_mode) == 0o600  # it holds what probes.json holds

    calls = []
    monkeypatch.setitem(runner.REGISTRY, "membership", real["membership"])
    monkeypatch.setitem(runner.REGISTRY, "exposure", lambda ctx: calls.append("exposure") or real["exposure"](ctx))
    resumed = run_probes(resolve_target(run), settings, engine="torch", partial=partial).document
    assert calls == []  # exposure was kept, membership ran
    assert dumps(resumed["probes"]) == dumps(whole["probes"])
    assert list(resumed["probes"]) == list(settings.probes)

    # other settings (or other weights, or another engine): what was kept is not used
    run_probes(resolve_target(run), settings.model_copy(update={"seed": settings.seed + 1}), engine="torch",
               partial=partial)
    assert calls == ["exposure"]
