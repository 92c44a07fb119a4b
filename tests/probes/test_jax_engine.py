"""`run_probes(engine="jax")` writes the numbers the torch engine writes (CPU, untrained tiny run)."""

from __future__ import annotations

import numpy as np
import pytest

from memaudit.config import ProbeConfig
from memaudit.probes.engines import choose_engine, tpu_present
from memaudit.probes.runner import run_probes
from memaudit.probes.targets import resolve_target
from tests.probes.conftest import make_corpus, make_tokenizer, tiny_llama, write_run

SETTINGS = {"probes": ("exposure", "membership", "goldfish_extraction", "audit"),
            "exposure_enumerate_max": 1, "exposure_samples": 200, "goldfish_m": 8,
            "goldfish_min_prompt": 4, "extraction_max_docs": 12, "n_boot": 50, "batch_size": 8}


@pytest.fixture(scope="module")
def docs(tmp_path_factory):
    words, docs, canaries = make_corpus(0)
    tok = make_tokenizer(words)
    model = tiny_llama(len(tok), seed=1)
    run = tmp_path_factory.mktemp("jaxrun") / "run"
    write_run(run, model, tok, docs, canaries)
    out = {}
    for engine in ("torch", "jax"):
        res = run_probes(resolve_target(run), ProbeConfig(device="cpu", **SETTINGS), model=model,
                         tokenizer=tok, engine=engine)
        out[engine] = res.document
    return out


def _col(doc, probe, key, rows="scores"):
    return np.array([r[key] for r in doc["probes"][probe][rows]], dtype=float)


def test_engines_agree(docs):
    t, j = docs["torch"], docs["jax"]
    assert (t["engine"], j["engine"]) == ("torch", "jax")
    np.testing.assert_allclose(_col(j, "exposure", "log_perplexity"),
                               _col(t, "exposure", "log_perplexity"), atol=1e-4, rtol=0)
    np.testing.assert_allclose(_col(j, "exposure", "exposure"), _col(t, "exposure", "exposure"),
                               atol=1e-3)
    _same_rows(t["probes"]["membership"]["scores"], j["probes"]["membership"]["scores"])
    _same_rows(t["probes"]["audit"]["scores"], j["probes"]["audit"]["scores"])
    assert t["probes"]["goldfish_extraction"]["scores"] == j["probes"]["goldfish_extraction"]["scores"]


def _same_rows(want: list[dict], got: list[dict]) -> None:
    assert len(want) == len(got) > 0
    for a, b in zip(want, got, strict=True):
        assert a.keys() == b.keys()
        for k, v in a.items():
            if isinstance(v, float):
                assert b[k] == pytest.approx(v, abs=1e-4), k
            else:
                assert b[k] == v, k

def test_choose_engine():
    model = tiny_llama(20)
    assert choose_engine("torch", model) == "torch"
    assert choose_engine("jax", model) == "jax"
    assert choose_engine("auto", model) == ("jax" if tpu_present() else "torch")
    with pytest.raises(ValueError, match="--engine"):
        choose_engine("tpu", model)

    with pytest.raises(ValueError, match="--engine torch"):
        choose_engine("jax", type("M", (), {"config": type("C", (), {"model_type": "gpt2"})()})())
