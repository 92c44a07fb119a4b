"""Outside models as targets: a model folder, a hub id from the local cache, a LoRA adapter with
its base (the default reference). Oracles: plain transformers + sklearn.roc_auc_score."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
from sklearn.metrics import roc_auc_score

from memaudit.cli import main
from tests.probes.outside_models import hub_cache, mean_logp

ARGS = ["--probes", "membership", "--device", "cpu", "--bootstrap", "50"]


def _err_line(capsys):
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("memaudit: error: "), err
    return err[0]


def _probe(target, out, outside, *extra):
    rc = main(["probe", str(target), "--out", str(out), "--members", str(outside.members),
               "--nonmembers", str(outside.nonmembers), *ARGS, *extra])
    assert rc == 0
    return json.loads(out.read_text())


@pytest.fixture(scope="module")
def oracle(outside):
    """Mean token log-likelihoods of members then non-members under the merged fine-tune and
    the base, by plain transformers; and the membership labels."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(outside.base_dir)
    texts = outside.member_texts + outside.nonmember_texts
    ft = mean_logp(AutoModelForCausalLM.from_pretrained(outside.merged_dir), tok, texts)
    base = mean_logp(AutoModelForCausalLM.from_pretrained(outside.base_dir), tok, texts)
    y = np.r_[np.ones(len(outside.member_texts)), np.zeros(len(outside.nonmember_texts))]
    return ft, base, y


def _column(doc, name):
    return np.array([r[name] for r in doc["probes"]["membership"]["scores"]])


def test_model_folder_loss_auc_equals_sklearn(tmp_path, outside, oracle):
    ft, _, y = oracle
    doc = _probe(outside.merged_dir, tmp_path / "p.json", outside)
    np.testing.assert_allclose(_column(doc, "loss"), ft, atol=1e-4)
    auc = doc["probes"]["membership"]["summary"]["loss"]["auc"]["value"]
    assert auc == pytest.approx(roc_auc_score(y, ft), abs=1e-9)
    assert "reference" not in doc["probes"]["membership"]["summary"]  # a folder names no base


def test_hub_id_resolved_from_the_local_cache(tmp_path, outside, oracle, monkeypatch):
    cache = hub_cache(tmp_path / "hub", "acme/tiny-gpt2", outside.merged_dir)
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    doc = _probe("acme/tiny-gpt2", tmp_path / "p.json", outside)
    assert doc["target"]["source"] == "hub"
    np.testing.assert_allclose(_column(doc, "loss"), oracle[0], atol=1e-4)


def test_adapter_equals_merged_model_and_its_base_is_the_reference(tmp_path, outside, oracle):
    ft, base, y = oracle
    doc = _probe(outside.adapter_dir, tmp_path / "p.json", outside)
    assert doc["target"]["source"] == "adapter"
    assert doc["target"]["reference"] == str(outside.base_dir)  # used by default
    np.testing.assert_allclose(_column(doc, "loss"), ft, atol=1e-4)
    np.testing.assert_allclose(_column(doc, "reference"), ft - base, atol=1e-4)
    s = doc["probes"]["membership"]["summary"]
    assert s["reference"]["auc"]["value"] == pytest.approx(roc_auc_score(y, ft - base), abs=1e-9)
    assert s["reference"]["auc"]["value"] > s["loss"]["auc"]["value"]  # the base calibrates
    off = _probe(outside.adapter_dir, tmp_path / "q.json", outside, "--reference", "none")
    assert "reference" not in off["probes"]["membership"]["summary"]


def test_hub_id_not_in_cache_says_how_to_fetch_it(tmp_path, outside, monkeypatch, capsys):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "empty"))
    assert main(["probe", "acme/absent", "--out", str(tmp_path / "p.json"), *ARGS]) == 2
    line = _err_line(capsys)
    assert "not in the Hugging Face cache" in line and "hf download acme/absent" in line


def test_adapter_without_its_base_is_refused(tmp_path, outside, capsys):
    ad = tmp_path / "adapter"
    shutil.copytree(outside.adapter_dir, ad)
    cfg = json.loads((ad / "adapter_config.json").read_text())
    cfg["base_model_name_or_path"] = str(tmp_path / "gone")
    (ad / "adapter_config.json").write_text(json.dumps(cfg))
    assert main(["probe", str(ad), "--out", str(tmp_path / "p.json"), *ARGS]) == 2
    assert "base of adapter" in _err_line(capsys)


def test_adapter_on_a_mismatched_base_is_refused(tmp_path, outside, capsys):
    from transformers import GPT2Config, GPT2LMHeadModel

    other = tmp_path / "other"
    GPT2LMHeadModel(GPT2Config(vocab_size=600, n_positions=64, n_embd=32, n_layer=2,
                               n_head=4)).save_pretrained(other)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(outside.base_dir / f, other / f)
    rc = main(["probe", str(outside.adapter_dir), "--base", str(other), "--out",
               str(tmp_path / "p.json"), "--members", str(outside.members), "--nonmembers",
               str(outside.nonmembers), *ARGS])
    assert rc == 2 and "does not fit its base" in _err_line(capsys)


def test_model_needing_remote_code_is_refused(tmp_path, outside, capsys):
    m = tmp_path / "remote"
    shutil.copytree(outside.merged_dir, m)
    cfg = json.loads((m / "config.json").read_text())
    cfg.update(model_type="acme_lm", auto_map={"AutoModelForCausalLM": "modeling_acme.AcmeLM"})
    (m / "config.json").write_text(json.dumps(cfg))
    (m / "modeling_acme.py").write_text("raise SystemExit('remote code ran')\n")
    assert main(["probe", str(m), "--out", str(tmp_path / "p.json"), *ARGS]) == 2
    assert "trust_remote_code" in _err_line(capsys)


def test_run_names_its_init_from_as_the_default_reference(tmp_path, trained):
    from memaudit.probes.targets import resolve_target

    rd = tmp_path / "run"
    shutil.copytree(trained.run, rd)
    m = json.loads((rd / "run.json").read_text())
    m.setdefault("config", {}).setdefault("model", {})["init_from"] = str(trained.init_dir)
    (rd / "run.json").write_text(json.dumps(m))
    assert resolve_target(rd).base == str(trained.init_dir)
    (rd / "run.json").write_text(json.dumps({**m, "role": "public-base"}))
    assert resolve_target(rd).base is None  # the base is not its own reference
