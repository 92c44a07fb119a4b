"""The jax engine against the torch engine (the oracle), on the CPU in float32.

- From the same seeded weights and the same batches, 20 steps of the tiny preset: the losses
  per step agree to 1e-4 relative (measured: at most 3e-7), and so do the holdout losses.
- With the noise off, DP-SGD's clipped sums (jax-privacy's per-example and per-user clipping,
  and the jax engine's ghost clipping, against the torch engine's ghost clipping) agree to 1e-5 of each tensor's largest entry and
  the clip fractions are equal; a noise-free DP run (with Goldfish loss) gives the same losses
  and clip fractions, and so does one of LoRA adapters.
- The same config records the same ledger (events) and ε with either engine.
"""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from memaudit.config import load_config
from memaudit.io import read_json, read_jsonl
from memaudit.run.dispatch import dispatch
from memaudit.rundir import RunDir, prepare_new_run

TINY = (
    "data.synth.users=16", "data.synth.docs_per_user=6", "data.canaries.repetitions=[1,2,4]",
    "data.seq_len=64", "train.batch_size=8", "train.warmup_steps=4", "train.eval_batches=2",
)


def _train(tmp_path_factory, name: str, engine: str, *extra: str, one_device: bool = True) -> RunDir:
    """A run of either engine; the jax engine's on one device unless `one_device` is false (then
    through `dispatch`, on all 8: test_jax_engine.py's mesh test shows a mesh trains as one device)."""
    cfg = load_config(None, [*TINY, f"train.engine={engine}", *extra])
    run = prepare_new_run(tmp_path_factory.mktemp(name) / "run", overwrite=False)
    if engine == "jax" and one_device:
        import jax

        from memaudit.run.driver import run_trainer
        from memaudit.train.jax_trainer import JaxTrainer

        run_trainer(JaxTrainer(cfg, run, devices=jax.devices()[:1]), resume=False)
    else:
        dispatch(cfg, run, resume=False)
    return run


@pytest.fixture(scope="module")
def plain_pair(tmp_path_factory):
    """Both engines, no DP: 20 steps, evaluated at 10 and 20; the jax run through `dispatch`
    (the CLI's path), on all 8 devices."""
    extra = ("train.steps=20", "train.eval_every=10", "train.checkpoint_every=10")
    return {e: _train(tmp_path_factory, f"plain-{e}", e, *extra, one_device=False) for e in ("torch", "jax")}


def test_losses_per_step_agree_over_20_steps(plain_pair):
    torch_m = read_jsonl(plain_pair["torch"].metrics_path)
    jax_m = read_jsonl(plain_pair["jax"].metrics_path)
    assert [m["step"] for m in jax_m] == list(range(1, 21)) == [m["step"] for m in torch_m]
    for a, b in zip(jax_m, torch_m, strict=True):
        assert a["batch_size"] == b["batch_size"] and a["lr"] == b["lr"]
        assert abs(a["loss"] - b["loss"]) <= 1e-4 * abs(b["loss"]), a["step"]
        if "holdout_loss" in b:
            assert abs(a["holdout_loss"] - b["holdout_loss"]) <= 1e-4 * b["holdout_loss"]


def test_the_run_records_its_engine_and_exports_a_hugging_face_model(plain_pair):
    from transformers import AutoModelForCausalLM

    for engine, run in plain_pair.items():
        result = read_json(run.path / "run.json")["result"]
        assert result["engine"] == engine and result["steps"] == 20
    hf = AutoModelForCausalLM.from_pretrained(str(plain_pair["jax"].model_dir))
    assert sum(p.numel() for p in hf.parameters()) == read_json(plain_pair["jax"].path / "run.json")["result"]["parameters"]


# ----------------------------------------------------------------------------- clipped sums
@pytest.fixture(scope="module")
def tiny_model():
    from memaudit.models.presets import build_model

    return build_model("tiny", vocab_size=256, seed=3)


def _batch(rows: int, length: int = 24, seed: int = 0):
    rng = np.random.default_rng(seed)
    ids = rng.integers(0, 256, (rows, length)).astype(np.int64)
    am = np.ones((rows, length), np.int64)
    for i in range(rows):  # right padding of varied lengths
        am[i, length - int(rng.integers(0, length // 2)):] = 0
    lm = am.astype(bool)
    lm[:, 0] = False
    return ids, am, lm


def _torch_clipped(model, ids, am, lm, clip, group):
    import torch

    from memaudit.train.dpsgd import DPSGD

    dp = DPSGD(model, clip=clip, noise_multiplier=0.0, expected_batch_size=1.0)
    stats = dp.step_gradients(torch.as_tensor(ids), torch.as_tensor(am), torch.as_tensor(lm), group_size=group)
    grads = {n: p.grad.detach().numpy().copy() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    return grads, stats


def _jax_clipped(model, ids, am, lm, clip, group, clipping="vmap"):
    import jax.numpy as jnp

    from memaudit.models.convert import flax_to_hf, hf_to_flax
    from memaudit.models.flax_llama import FlaxLlama
    from memaudit.models.init import flax_config
    from memaudit.train import jax_dp, jax_ghost
    from memaudit.train.jax_engine import make_forward

    cfg = load_config(None, ["model.preset=tiny"])
    params = hf_to_flax({k: v for k, v in model.state_dict().items()})
    flax_model = FlaxLlama(flax_config(cfg.model, 256))
    if clipping == "ghost":
        fn = jax_ghost.clipped_sum_fn(flax_model, clip=clip, group=group > 1)
    else:
        fn = jax_dp.clipped_sum_fn(make_forward(flax_model), clip=clip, group=group > 1, microbatch=None)
    shape = (-1, group, ids.shape[1]) if group > 1 else ids.shape
    grads, (values, norms) = fn(params, *(jnp.asarray(x.reshape(shape)) for x in (ids, am, lm)))
    return flax_to_hf(grads), np.asarray(norms), np.asarray(values)


@pytest.mark.parametrize("group", [1, 3])
def test_noise_free_clipped_sums_and_clip_fractions_match_the_torch_engine(tiny_model, group):
    """Per example (group 1) and per user (ULS: groups of 3 rows, one a padding row); the jax
    engine's clipped sum by jax-privacy's per-example gradients (vmap) and by ghost clipping,
    each against the same torch result."""
    ids, am, lm = _batch(12)
    if group > 1:
        lm[5] = False  # a user's padding row: no target
    _, norms, _ = _jax_clipped(tiny_model, ids, am, lm, math.inf, group)
    clip = float(np.median(norms))  # about half the units clipped
    want, stats = _torch_clipped(tiny_model, ids, am, lm, clip, group)
    units = 12 // group
    assert 0 < stats["clip_fraction"] < 1
    for clipping in ("vmap", "ghost"):
        got, norms, values = _jax_clipped(tiny_model, ids, am, lm, clip, group, clipping)
        assert got.keys() == want.keys()
        for name, w in want.items():
            assert np.max(np.abs(got[name] - w)) <= 1e-5 * np.max(np.abs(w)), (clipping, name)
        assert stats["clip_fraction"] == int((norms > clip).sum()) / units, clipping
        assert abs(float(values.sum()) / (12 - (group > 1)) - stats["loss"]) <= 1e-5 * stats["loss"], clipping


# ----------------------------------------------------------------------------- DP runs
@pytest.fixture(scope="module")
def noise_free_pair(tmp_path_factory):
    """Example-level DP-SGD with σ = 0 (reproducible sampling) and Goldfish loss: 6 steps of each engine."""
    extra = ("train.steps=6", "train.eval_every=6", "train.checkpoint_every=6", "privacy.noise_multiplier=0",
             "train.goldfish.enabled=true",
             "privacy.clip=4.5", "privacy.reproducible_randomness=true")
    return {e: _train(tmp_path_factory, f"dp0-{e}", e, *extra) for e in ("torch", "jax")}


def test_noise_free_dp_runs_agree_in_loss_and_clip_fraction(noise_free_pair):
    from memaudit.run.lifecycle import SENSITIVE_METRICS

    got = [json.loads(x) for x in (noise_free_pair["jax"].path / SENSITIVE_METRICS).read_text().splitlines()]
    want = [json.loads(x) for x in (noise_free_pair["torch"].path / SENSITIVE_METRICS).read_text().splitlines()]
    assert len(got) == len(want) == 6
    for a, b in zip(got, want, strict=True):
        assert a["batch_size"] == b["batch_size"]
        assert a["clip_fraction"] == b["clip_fraction"]
        assert abs(a["loss"] - b["loss"]) <= 1e-4 * abs(b["loss"])
    assert any(0 < m["clip_fraction"] < 1 for m in want)


@pytest.mark.parametrize("unit", ["example", "uls", "els"])
def test_the_same_config_records_the_same_ledger_and_epsilon(tmp_path_factory, unit):
    """One noisy step of each engine (one Poisson batch: one compiled step) records its ledger."""
    extra = ["train.steps=1", "train.eval_every=1", "train.checkpoint_every=1", "privacy.noise_multiplier=1.1"]
    if unit != "example":
        extra += ["privacy.unit=user", "privacy.max_examples_per_user=4", f"privacy.user_sampling={unit}",
                  "train.batch_size=8"]
    ledgers = {e: read_json(_train(tmp_path_factory, f"ledger-{unit}-{e}", e, *extra).privacy_path)
               for e in ("torch", "jax")}
    assert ledgers["jax"]["events"] == ledgers["torch"]["events"]
    assert ledgers["jax"]["epsilon"] == ledgers["torch"]["epsilon"]
    assert ledgers["jax"]["unit"] == ledgers["torch"]["unit"] == ("example" if unit == "example" else "user")


def test_lora_dp_sgd_matches_the_torch_engine(tmp_path_factory):
    """LoRA adapters (the trained parameters) under noise-free DP-SGD: 4 steps of each engine give
    the same losses (1e-4) and clip fractions, and the jax engine exports the adapter folder."""
    from memaudit.run.lifecycle import SENSITIVE_METRICS

    extra = ("train.steps=4", "train.eval_every=4", "train.checkpoint_every=4", "model.lora.rank=4",
             "model.lora.alpha=8", "privacy.noise_multiplier=0", "privacy.clip=0.05",
             "privacy.reproducible_randomness=true", "train.lr=1e-2")
    runs = {e: _train(tmp_path_factory, f"lora-{e}", e, *extra) for e in ("torch", "jax")}
    got, want = (read_jsonl(runs[e].path / SENSITIVE_METRICS) for e in ("jax", "torch"))
    for a, b in zip(got, want, strict=True):
        assert a["clip_fraction"] == b["clip_fraction"]
        assert abs(a["loss"] - b["loss"]) <= 1e-4 * abs(b["loss"])
    assert len(got) == 4 and (runs["jax"].path / "adapter").is_dir()
    result = read_json(runs["jax"].path / "run.json")["result"]
    assert result["trained"].startswith("lora") and 0 < result["trained_parameters"] < result["frozen_parameters"]
