"""`model.init_from`: a Hugging Face Llama checkpoint as the starting point of both backends.

One session-scoped tiny base (the tiny preset's shape, initialised from another seed than any
run's, with its own tokenizer) is fine-tuned briefly on each backend. The oracle for "the run
started from the base's weights" is the base's holdout loss on the run's own holdout set,
computed here with a plain torch loop over the checkpoint on disk: the run's
`initial_holdout_loss` (evaluated before step 1) must equal it. Bad inputs go through
`memaudit.cli.main` and must give exit 2, one line, and leave the disk as it was.
"""

from __future__ import annotations

import hashlib
import json
import math
import shutil
from pathlib import Path

import numpy as np
import pytest

from memaudit.cli import main
from memaudit.errors import RunDirError
from tests.conftest import REPO_ROOT, tiny_train_args

TINY = str(REPO_ROOT / "configs" / "tiny.yaml")
FED = ("backend=federated", "federated.rounds=2", "federated.cohort=4", "federated.local_steps=1",
       "federated.eval_every=1", "federated.checkpoint_every=10", "federated.mesh_clients=1")


@pytest.fixture(scope="session")
def tiny_base(tmp_path_factory) -> Path:
    """A tiny Llama checkpoint + tokenizer trained on public text only (seed 123 weights)."""
    from memaudit.data.synth import synthesize_public
    from memaudit.models.hf_export import save_pretrained_quietly, set_special_tokens
    from memaudit.models.presets import build_model
    from memaudit.models.tokenizer import train_tokenizer

    d = tmp_path_factory.mktemp("base") / "model"
    tok = train_tokenizer([x.text for x in synthesize_public(16, 4, seed=3)], vocab_size=4096)
    model = build_model("tiny", vocab_size=4096, seed=123)
    set_special_tokens(model, tok)
    save_pretrained_quietly(model, d)
    tok.save_pretrained(str(d))
    return d


def _holdout_loss_of(model_dir: Path, run: Path, batches: int, batch_size: int) -> float:
    """Oracle: mean next-token loss of the checkpoint on the run's first holdout sequences."""
    import torch
    from safetensors.numpy import load_file
    from transformers import AutoModelForCausalLM

    h = load_file(str(run / "data" / "holdout.safetensors"))
    n = min(len(h["input_ids"]), batches * batch_size)
    ids, am = torch.as_tensor(h["input_ids"][:n]).long(), torch.as_tensor(h["attention_mask"][:n]).long()
    model = AutoModelForCausalLM.from_pretrained(str(model_dir)).float().eval()
    total, count = 0.0, 0
    with torch.no_grad():
        for i in range(n):  # one sequence at a time: no batching or padding effects
            m = am[i].bool()
            x = ids[i][m][None]
            logp = torch.log_softmax(model(input_ids=x).logits[0, :-1].double(), -1)
            total -= float(logp.gather(1, x[0, 1:, None]).sum())
            count += x.shape[1] - 1
    return total / count


def _train(tmp: Path, base: Path, *extra: str) -> tuple[int, Path]:
    out = tmp / "run"
    rc = main(["train", TINY, "--out", str(out),
               *tiny_train_args("train.steps=2", "train.eval_every=1", f"model.init_from={base}", *extra)])
    return rc, out


def _tokenizer_json(d: Path) -> dict:
    return json.loads((d / "tokenizer.json").read_text())["model"]["vocab"]


@pytest.mark.parametrize("extra", [(), FED], ids=["torch", "jax"])
def test_run_starts_from_the_base_and_adopts_its_tokenizer(tmp_path, tiny_base, extra):
    rc, out = _train(tmp_path, tiny_base, *extra)
    assert rc == 0
    m = json.loads((out / "run.json").read_text())
    assert m["status"] == "complete"
    oracle = _holdout_loss_of(tiny_base, out, batches=2, batch_size=8)
    assert m["result"]["initial_holdout_loss"] == pytest.approx(oracle, rel=1e-4)
    # the tokenizer is the base's, in data/ and in the exported model
    assert _tokenizer_json(out / "data" / "tokenizer") == _tokenizer_json(tiny_base)
    assert _tokenizer_json(out / "model") == _tokenizer_json(tiny_base)
    # provenance: path and sha256 of the weights in run.json and meta.json
    sha = hashlib.sha256(b"model.safetensors\0" + (tiny_base / "model.safetensors").read_bytes()).hexdigest()
    meta = json.loads((out / "data" / "meta.json").read_text())
    for rec in (m["base_model"], meta["base_model"]):
        assert rec["path"] == str(tiny_base.resolve()) and rec["weights_sha256"] == sha
    cfg = json.loads((out / "model" / "config.json").read_text())
    assert cfg["hidden_size"] == 128 and cfg["vocab_size"] == 4096


def test_preset_start_differs_from_the_base(tmp_path, tiny_base):
    """The oracle separates the two starting points (so the test above can fail)."""
    out = tmp_path / "run"
    rc = main(["train", TINY, "--out", str(out), *tiny_train_args("train.steps=1", "train.eval_every=1")])
    assert rc == 0
    m = json.loads((out / "run.json").read_text())
    # same data, another tokenizer: compare the preset run's start with the base on the preset data
    assert "base_model" not in m
    assert m["result"]["initial_holdout_loss"] != pytest.approx(
        _holdout_loss_of(tiny_base, out, batches=2, batch_size=8), rel=1e-3)


def test_jax_params_equal_the_checkpoint(tiny_base):
    """The federated trainer's starting parameters are the checkpoint's, bit for bit."""
    from safetensors.numpy import load_file

    from memaudit.config import load_config
    from memaudit.models.convert import flax_to_hf, hf_to_flax
    from memaudit.models.init import flax_config, initial_state_dict

    cfg = load_config(TINY, [f"model.init_from={tiny_base}"])
    params = hf_to_flax(initial_state_dict(cfg.model, 4096))
    disk = load_file(str(tiny_base / "model.safetensors"))
    back = flax_to_hf(params)
    assert set(back) == set(disk)
    for k, v in disk.items():
        np.testing.assert_array_equal(back[k], v)
    assert flax_config(cfg.model).hidden_size == 128


# ----------------------------------------------------------------------------- bad input
def _snapshot(root: Path) -> dict[str, str]:
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


def _variant(tmp: Path, base: Path, name: str, edit) -> Path:
    d = tmp / name
    shutil.copytree(base, d)
    cfg = json.loads((d / "config.json").read_text())
    edit(d, cfg)
    if (d / "config.json").exists():
        (d / "config.json").write_text(json.dumps(cfg))
    return d


def _edit(**kv):
    def f(d, cfg):
        cfg.update(kv)
    return f


def _no_config(d, cfg):
    (d / "config.json").unlink()


def _no_tokenizer(d, cfg):
    for f in d.glob("tokenizer*"):
        f.unlink()


BAD = [
    ("not-a-dir", lambda t, b: (t / "nope", ()), "is not a directory"),
    ("no-config", lambda t, b: (_variant(t, b, "nc", _no_config), ()), "no config.json"),
    ("gpt2", lambda t, b: (_variant(t, b, "g", _edit(architectures=["GPT2LMHeadModel"], model_type="gpt2")), ()),
     "GPT2LMHeadModel"),
    ("bias", lambda t, b: (_variant(t, b, "bi", _edit(attention_bias=True)), ()), "attention_bias"),
    ("no-tokenizer", lambda t, b: (_variant(t, b, "nt", _no_tokenizer), ()), "no tokenizer"),
    ("data-tokenizer", lambda t, b: (b, (f"data.tokenizer={b}",)), "data.tokenizer"),
    ("preset", lambda t, b: (b, ("model.preset=small",)), "model.preset=small"),
    ("vocab", lambda t, b: (_variant(t, b, "v", _edit(vocab_size=300)), ()), "vocab_size 4096 vs 300"),
    ("mesh-heads", lambda t, b: (b, (*FED, "federated.mesh_model=8", "federated.mesh_clients=1")),
     "num_attention_heads=4"),
    ("grid-heads", lambda t, b: (b, ("parallel.y=8",)), "num_attention_heads=4"),
]


@pytest.mark.parametrize("case", BAD, ids=[c[0] for c in BAD])
def test_bad_init_from_is_one_line_exit_2_nothing_written(tmp_path, tiny_base, capsys, case):
    _, make, needle = case
    path, extra = make(tmp_path, tiny_base)
    before = _snapshot(tmp_path)
    capsys.readouterr()
    out = tmp_path / "out"
    rc = main(["train", TINY, "--out", str(out), *tiny_train_args(f"model.init_from={path}", *extra)])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2
    assert len(err) == 1 and err[0].startswith("memaudit: error: ") and needle in err[0], err
    assert _snapshot(tmp_path) == before and not out.exists()


def test_name_or_path_is_an_alias(tiny_base):
    from memaudit.config import load_config

    cfg = load_config(TINY, [f"model.name_or_path={tiny_base}"])
    assert cfg.model.init_from == str(tiny_base) and cfg.model.name_or_path == str(tiny_base)
    assert load_config(None).model.preset == "tiny"
    assert load_config(None, [f"model.init_from={tiny_base}"]).model.preset is None


# ----------------------------------------------------------------------------- public pretraining
def _sweep_raw(**pretrain) -> dict:
    return {
        "base": {"data": {"synth": {"users": 12, "docs_per_user": 4, "paragraph_sentences": 2},
                          "canaries": {"repetitions": [1, 2]}, "seq_len": 48},
                 "model": {"preset": "tiny"},
                 "train": {"steps": 1, "batch_size": 8, "warmup_steps": 0, "eval_every": 1,
                           "eval_batches": 1, "checkpoint_every": 10},
                 "federated": {"rounds": 1, "cohort": 3, "local_steps": 1, "eval_every": 1,
                               "mesh_clients": 1}},
        "grid": {"backends": ["centralized", "federated"], "epsilons": ["inf"]},
        "pretrain": {"steps": 2, "users": 6, "docs_per_user": 2, **pretrain},
        "probe": {"probes": ["exposure"], "n_boot": 10, "exposure_samples": 100},
    }


def test_public_base_is_cached_and_reused(tmp_path):
    from memaudit.rundir import RunDir
    from memaudit.sweep.config import sweep_config_from_dict
    from memaudit.sweep.pretrain import ensure_public_base

    cfg = sweep_config_from_dict(_sweep_raw())
    first = ensure_public_base(cfg, tmp_path)
    weights = first / "model.safetensors"
    stamp = weights.stat().st_mtime_ns
    m = RunDir(first.parent).read_manifest()
    assert m["role"] == "public-pretrain" and m["status"] == "complete"
    assert m["public_private_overlap"]["disjoint"] is True
    assert m["config"]["data"]["synth"]["kind"] == "public" and m["config"]["privacy"]["target_epsilon"] is None
    heard: list[dict] = []
    assert ensure_public_base(cfg, tmp_path, lambda d, t, info: heard.append(info)) == first
    assert weights.stat().st_mtime_ns == stamp  # not retrained
    assert not [i for i in heard if "warning" in i]
    # a base whose holdout loss ended well above its best memorised its corpus: the sweep says so
    # (one line, public numbers only), each time it uses that base
    metrics = first.parent / "metrics.jsonl"
    kept = metrics.read_text()
    metrics.write_text("".join(json.dumps({"step": s, "loss": 1.0, "holdout_loss": h}) + "\n"
                               for s, h in ((100, 5.0), (200, 5.64), (400, 7.22))))
    assert ensure_public_base(cfg, tmp_path, lambda d, t, info: heard.append(info)) == first
    (warning,) = [i["warning"] for i in heard if "warning" in i]
    assert "memorised its corpus" in warning and "from 5.00 (step 100) to 7.22 (step 400)" in warning
    assert "pretrain.users" in warning and "\n" not in warning
    metrics.write_text("".join(json.dumps({"step": s, "holdout_loss": h}) + "\n"
                               for s, h in ((200, 4.75), (400, 4.80))))  # within 0.1 nats: no line
    heard.clear()
    ensure_public_base(cfg, tmp_path, lambda d, t, info: heard.append(info))
    assert not [i for i in heard if "warning" in i]
    metrics.write_text(kept)
    changed = sweep_config_from_dict(_sweep_raw(steps=3))
    with pytest.raises(RunDirError, match="pretrained under other settings"):  # never silently
        ensure_public_base(changed, tmp_path)
    assert weights.stat().st_mtime_ns == stamp
    assert ensure_public_base(changed, tmp_path, overwrite=True) == first
    assert RunDir(first.parent).read_manifest()["result"]["steps"] == 3  # another key: retrained


def test_overlapping_public_corpus_is_one_line_exit_2_nothing_written(tmp_path, capsys):
    import yaml

    from memaudit.data.prepare import private_documents
    from memaudit.sweep.config import plan_points, point_config, sweep_config_from_dict

    raw = _sweep_raw()
    cfg = sweep_config_from_dict(raw)
    docs, _, _ = private_documents(point_config(cfg, plan_points(cfg)[0]).data)
    public = tmp_path / "public.jsonl"
    rows = [{"text": f"public notice number {i} about the weather"} for i in range(20)]
    rows.append({"text": next(d.text for d in docs if d.kind == "doc")})  # one private document
    public.write_text("".join(json.dumps(r) + "\n" for r in rows))
    raw["pretrain"]["path"] = str(public)
    (tmp_path / "sweep.yaml").write_text(yaml.safe_dump(raw))
    before = _snapshot(tmp_path)
    capsys.readouterr()
    rc = main(["sweep", str(tmp_path / "sweep.yaml"), "--out", str(tmp_path / "out")])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and "1 shared document(s)" in err[0], err
    assert _snapshot(tmp_path) == before and not (tmp_path / "out").exists()


def test_sweep_pretrains_then_fine_tunes_both_backends(tmp_path):
    from memaudit.rundir import RunDir
    from memaudit.sweep.config import sweep_config_from_dict
    from memaudit.sweep.runner import run_sweep

    cfg = sweep_config_from_dict(_sweep_raw())
    summary = run_sweep(cfg, tmp_path / "sw")
    assert summary["status"] == "complete", summary["outcomes"]
    base = RunDir(tmp_path / "sw" / "base")
    record = base.read_manifest()
    ref = RunDir(tmp_path / "sw" / "runs" / "public-base")
    rm = ref.read_manifest()
    assert rm["role"] == "public-base" and ref.probes_path.is_file() and rm["result"]["steps"] == 0
    fingerprints = {rm["data_fingerprint"]}
    for o in summary["outcomes"]:
        m = RunDir(tmp_path / "sw" / "runs" / o["name"]).read_manifest()
        assert m["config"]["model"]["init_from"] == str(base.model_dir.resolve())
        assert m["base_model"]["path"] == str(base.model_dir.resolve())
        fingerprints.add(m["data_fingerprint"])
        # each fine-tune started from the base: its initial holdout loss is the reference's
        assert m["result"]["initial_holdout_loss"] == pytest.approx(rm["result"]["final_holdout_loss"], rel=1e-4)
    assert len(fingerprints) == 1  # the same private data for the reference and every point
    assert record["role"] == "public-pretrain"
    again = run_sweep(cfg, tmp_path / "sw")
    assert [o["action"] for o in again["outcomes"]] == ["skipped", "skipped"]
    # a fine-tune of other starting weights (the base retrained in place) or of another config
    # is stale: the next run trains it again instead of skipping it
    from memaudit.config import with_overrides
    from memaudit.sweep.config import plan_points, point_config
    from memaudit.sweep.point import training_action
    from memaudit.sweep.pretrain import pretrain_stage

    points, _ = pretrain_stage(cfg, tmp_path / "sw", plan_points(cfg))
    point_cfg = point_config(cfg, points[0])
    rd = RunDir(tmp_path / "sw" / "runs" / points[0].name)
    assert training_action(rd, point_cfg).action == "skipped"
    assert training_action(rd, with_overrides(point_cfg, {"train.lr": point_cfg.train.lr * 2})).action == "trained"
    weights = next(base.model_dir.glob("*.safetensors"))
    weights.write_bytes(weights.read_bytes() + b" ")  # the base's weights are not what it started from
    assert training_action(rd, point_cfg).action == "trained"


@pytest.mark.parametrize("name", ["quickstart.yaml", "study.yaml"])
def test_shipped_sweeps_pretrain_then_fine_tune(name):
    """Both tiers pretrain a public base and fine-tune it on both backends; the base's config
    validates (public corpus, no DP, no canaries) and shares nothing with the private data."""
    from memaudit.sweep.config import load_sweep_config, plan_points
    from memaudit.sweep.pretrain import public_base_config

    cfg = load_sweep_config(REPO_ROOT / "configs" / name)
    assert cfg.pretrain is not None
    base = public_base_config(cfg)
    assert base.data.synth.kind == "public" and not base.privacy.enabled and base.backend == "centralized"
    assert base.data.canaries.per_setting == 0 and base.model.init_from is None
    # the base sees its public corpus at most twice: the study's base at 8 epochs memorised it
    epochs = cfg.pretrain.steps * base.train.batch_size / (cfg.pretrain.users * cfg.pretrain.docs_per_user)
    assert epochs <= 2, epochs
    pts = plan_points(cfg)
    assert {p.backend for p in pts} == {"centralized", "federated"}
    assert math.inf in {p.nominal_epsilon for p in pts}
    if name == "study.yaml":
        assert {p.nominal_epsilon for p in pts} >= {math.inf, 32.0, 8.0, 2.0, 1.0, 0.5}
        assert any(p.audit for p in pts)


def test_the_public_base_does_not_depend_on_the_private_canaries():
    """Canary settings (their template, schedule, audit kind) shape only the private data: a
    sweep that changes them reuses its cached base instead of pretraining again."""
    import copy

    from memaudit.sweep.config import load_sweep_config
    from memaudit.sweep.pretrain import pretrain_key, public_base_config

    cfg = load_sweep_config(REPO_ROOT / "configs" / "study.yaml")
    key = pretrain_key(public_base_config(cfg))
    base = copy.deepcopy(cfg.base)
    base.setdefault("data", {})["canaries"] = {"audit_kind": "document", "template": "the vault code is {secret}",
                                               "repetitions": [2, 8], "secret_length": 8}
    other = cfg.model_copy(update={"base": base})
    assert public_base_config(other).data.canaries.per_setting == 0
    assert pretrain_key(public_base_config(other)) == key
