"""Outside models as targets: a model folder, a hub id from the local cache, a LoRA adapter with
its base (the default reference), a GPT-NeoX. Oracles: plain transformers +
sklearn.roc_auc_score."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch
from sklearn.metrics import roc_auc_score

from memaudit.cli import main
from tests.probes.outside_models import hub_cache, mean_logp, train_lm

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


@torch.inference_mode()
def _whole_string_nll(model, tok, texts: list[str]) -> np.ndarray:
    """Plain transformers, one text at a time: minus the summed log p of [eos] + text."""
    out = []
    for t in texts:
        ids = torch.tensor([[tok.eos_token_id, *tok(t)["input_ids"]]])
        logp = torch.log_softmax(model(input_ids=ids).logits[0, :-1].double(), -1)
        out.append(-float(logp.gather(-1, ids[0, 1:, None]).sum()))
    return np.array(out)


def test_gpt_neox_exposure_and_loss_auc_equal_plain_transformers(tmp_path, outside):
    """A GPT-NeoX trained here with plain transformers on the member texts and one canary
    repeated: memaudit's exposure equals whole-canary scoring (the Secret Sharer's rank among
    all 100 secrets) and its loss-attack AUC equals sklearn's on plain transformers' losses."""
    from transformers import AutoTokenizer, GPTNeoXConfig, GPTNeoXForCausalLM

    tok = AutoTokenizer.from_pretrained(outside.base_dir)
    eos = tok.eos_token_id
    cfg = GPTNeoXConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64,
                        num_hidden_layers=2, num_attention_heads=4, max_position_embeddings=64,
                        bos_token_id=eos, eos_token_id=eos, tie_word_embeddings=False)
    torch.manual_seed(0)
    model = GPTNeoXForCausalLM(cfg)
    template, secret = "my pin is {secret}", "48"
    train_lm(model, tok, outside.member_texts + [template.format(secret=secret)] * 24,
             steps=40, lr=5e-3, seed=3)
    model.save_pretrained(tmp_path / "neox")
    tok.save_pretrained(tmp_path / "neox")
    rng = np.random.default_rng(4)
    refs = [f"{x:02d}" for x in rng.choice(100, 11, replace=False) if f"{x:02d}" != secret][:10]
    (tmp_path / "c.json").write_text(json.dumps({
        "template": template, "alphabet": "0123456789",
        "inserted": [{"id": "c0", "secret": secret, "repetitions": 24}],
        "references": [{"id": f"r{i}", "secret": s} for i, s in enumerate(refs)]}))
    doc = _probe(tmp_path / "neox", tmp_path / "p.json", outside, "--probes",
                 "membership,exposure", "--canaries", str(tmp_path / "c.json"),
                 "--exposure-enumerate-max", "100")
    assert doc["target"]["source"] == "folder"
    texts = outside.member_texts + outside.nonmember_texts
    y = np.r_[np.ones(len(outside.member_texts)), np.zeros(len(outside.nonmember_texts))]
    want = mean_logp(model, tok, texts)
    np.testing.assert_allclose(_column(doc, "loss"), want, atol=1e-4)
    auc = doc["probes"]["membership"]["summary"]["loss"]["auc"]["value"]
    assert auc == pytest.approx(roc_auc_score(y, want), abs=1e-9)
    space = [f"{i:02d}" for i in range(100)]
    nll = _whole_string_nll(model, tok, [template.format(secret=s) for s in space])
    got = {r["id"]: r["exposure"] for r in doc["probes"]["exposure"]["scores"]}
    for cid, s in {"c0": secret, **{f"r{i}": s for i, s in enumerate(refs)}}.items():
        rank = 1 + int((nll < nll[int(s)]).sum())
        assert got[cid] == pytest.approx(np.log2(100) - np.log2(rank), abs=0.05), cid
    assert got["c0"] > 4  # the repeated canary ranks near the top of the 100
