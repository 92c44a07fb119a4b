"""The jax engine on its own: sharded over 8 host devices equal to one device, exact resume,
Goldfish's mask, the compute dtype, and the options it refuses at config time."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from memaudit.cli import main
from memaudit.config import load_config
from memaudit.io import read_json, read_jsonl
from memaudit.run.checks import centralized_engine
from memaudit.run.driver import run_trainer
from memaudit.run.lifecycle import SENSITIVE_METRICS
from memaudit.rundir import RunDir, prepare_new_run
from tests.train.conftest import JAX_TINY, JAX_ULS

REPO_CONFIG = str(Path(__file__).resolve().parents[2] / "configs" / "centralized-jax.yaml")
TINY = JAX_TINY


def _fit(path, *overrides, devices=None, progress=None, resume=False) -> RunDir:
    import jax

    from memaudit.train.jax_trainer import JaxTrainer

    cfg = load_config(None, [*TINY, *overrides])
    run = RunDir(path) if resume else prepare_new_run(path, overwrite=False)
    devs = jax.devices() if devices is None else devices
    run_trainer(JaxTrainer(cfg, run, devices=devs, progress=progress), resume=resume)
    return run


def _weights(run: RunDir) -> dict[str, np.ndarray]:
    from safetensors.numpy import load_file

    return load_file(str(run.model_dir / "model.safetensors"))


def _initial(*overrides) -> dict[str, np.ndarray]:
    """The run's seeded starting weights under their Hugging Face names."""
    from memaudit.models.init import initial_state_dict

    cfg = load_config(None, [*TINY, *overrides])
    return {k: v.numpy() for k, v in initial_state_dict(cfg.model, 4096).items()}


def _losses(run: RunDir, name: str = "metrics.jsonl") -> list[float]:
    return [m["loss"] for m in read_jsonl(run.path / name)]


# ----------------------------------------------------------------------------- mesh
LR = 3e-3  # train.lr of these runs (the tiny preset's)


def test_a_4x2_mesh_of_8_devices_trains_as_one_device(tmp_path, jax_uls_run):
    """3 steps on a (data 4, model 2) mesh against one device, without DP and under DP (ULS,
    σ = 1): losses to 1e-5 relative; each exported weight's difference to 1e-3 of how far that
    tensor moved from its start (L2 norms), but for a few entries. The reductions' order differs,
    so gradients differ in the last bits; AdamW divides by the root of the second moment, so an
    entry whose gradient is almost 0 (a rare token's row) can step by up to lr either way: such
    entries (over 1e-4 apart) are at most 4 a tensor and within Adam's bound of lr a step, and
    the norm is taken over the rest. Measured: on one CPU 6e-5 at most in one entry of lm_head; on
    another (2026-12-07) two entries of embed_tokens 1.4e-3 and 3e-4 apart (rows 73 and 2148), the
    whole tensor 1.4e-3 of its movement, the rest 2e-4 of it. Under DP the noise is the same too:
    it is keyed per step, not per device. The bound separates runs: the plain and the DP run's
    weights (same seed, same start) are far outside it of each other."""
    import jax

    assert len(jax.devices()) == 8
    plain = ("train.steps=3", "train.eval_every=3", "train.checkpoint_every=3")
    start = _initial(*plain)
    assert load_config(None, [*TINY, *plain]).train.lr == LR
    ones = {}
    for kind, extra in (("plain", plain), ("uls", (*JAX_ULS, "train.clipping=ghost"))):
        if kind == "uls":  # tests/train/conftest.py: this config on one device
            one = RunDir(jax_uls_run)
        else:
            one = _fit(tmp_path / f"{kind}-one", *extra, devices=jax.devices()[:1])
        mesh = _fit(tmp_path / f"{kind}-mesh", *extra, "train.mesh_model=2")
        assert read_json(mesh.path / "run.json")["result"]["mesh_data"] == 4
        name = "metrics.jsonl" if kind == "plain" else SENSITIVE_METRICS
        for a, b in zip(_losses(mesh, name), _losses(one, name), strict=True):
            assert abs(a - b) <= 1e-5 * abs(b), kind
        want, got = _weights(one), _weights(mesh)
        assert want.keys() == got.keys() == start.keys()
        for k, w in want.items():
            diff = got[k] - w
            flipped = np.abs(diff) > 1e-4  # a near-zero gradient's sign, flipped by the order
            assert flipped.sum() <= 4 and np.abs(diff).max() <= 3 * LR, (kind, k, int(flipped.sum()))
            assert np.linalg.norm(np.where(flipped, 0.0, diff)) <= 1e-3 * np.linalg.norm(w - start[k]), (kind, k)
        ones[kind] = want
    assert any(np.linalg.norm(ones["uls"][k] - w) > 1e-3 * np.linalg.norm(w - start[k])
               for k, w in ones["plain"].items())


# ----------------------------------------------------------------------------- resume
def test_an_interrupted_dp_run_resumes_bit_identical(tmp_path):
    """Example-level DP-SGD with noise on a data mesh of 2 devices (the state restored onto the
    mesh's shardings as on 8): stopped after step 3 (checkpoint at 2), resumed past the next
    checkpoint (4); the exported weights equal an uninterrupted run's bit for bit."""
    import jax

    extra = ("train.steps=5", "train.eval_every=5", "train.checkpoint_every=2", "privacy.noise_multiplier=1.0",
             "privacy.reproducible_randomness=true")
    two = jax.devices()[:2]
    whole = _fit(tmp_path / "whole", *extra, devices=two)

    def stop(done, total, info):
        if done == 3:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        _fit(tmp_path / "cut", *extra, devices=two, progress=stop)
    assert read_json(tmp_path / "cut" / "state" / "trainer.json")["step"] == 2
    cut = _fit(tmp_path / "cut", *extra, devices=two, resume=True)
    assert read_json(cut.path / "run.json")["result"]["resumed_from_step"] == 2
    assert _losses(cut, SENSITIVE_METRICS) == _losses(whole, SENSITIVE_METRICS)
    want, got = _weights(whole), _weights(cut)
    assert all(np.array_equal(want[k], got[k]) for k in want)
    assert read_json(cut.privacy_path)["events"] == read_json(whole.privacy_path)["events"]


# ----------------------------------------------------------------------------- pieces
def test_goldfish_mask_equals_the_torch_engines():
    import torch

    from memaudit.train.goldfish import goldfish_mask as torch_mask
    from memaudit.train.jax_engine import goldfish_mask

    ids = np.random.default_rng(0).integers(0, 4096, (5, 70))
    for k, h in ((2, 1), (4, 13), (3, 69), (4, 70)):
        want = torch_mask(torch.as_tensor(ids), k=k, h=h).numpy()
        assert np.array_equal(goldfish_mask(ids, k=k, h=h), want)
    assert not goldfish_mask(ids, k=4, h=3).all()  # something is dropped


def test_compute_dtype_is_float32_on_the_cpu_and_bfloat16_on_accelerators():
    import jax.numpy as jnp

    from memaudit.train.jax_engine import compute_dtype

    assert compute_dtype("auto", "cpu") == jnp.float32
    assert compute_dtype("auto", "tpu") == compute_dtype("auto", "gpu") == jnp.bfloat16
    assert compute_dtype("float32", "tpu") == jnp.float32 and compute_dtype("bfloat16", "cpu") == jnp.bfloat16


def test_the_engine_is_torch_by_default_off_a_tpu():
    assert centralized_engine(load_config(None, [])) == "torch"  # this machine has no libtpu
    assert centralized_engine(load_config(REPO_CONFIG, [])) == "jax"


@pytest.mark.parametrize(("override", "names"), [
    ("parallel.x=2", "parallel.x=2"),
    ("parallel.data=2", "parallel.data=2"),
    ("parallel.overlap_all_gather=true", "parallel.overlap_all_gather"),
    ("parallel.overlap=false", "parallel.overlap"),
    ("train.device=cpu", "train.device=cpu"),
    ("train.activation_checkpointing=true", "train.activation_checkpointing"),
    ("train.mesh_model=3", "train.mesh_model=3"),
])
def test_options_the_jax_engine_lacks_are_refused_in_one_line(tmp_path, capsys, override, names):
    rc = main(["train", REPO_CONFIG, "--out", str(tmp_path / "r"), "--set", override])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and len(err.splitlines()) == 1 and names in err, err
    assert not (tmp_path / "r").exists()


def test_the_model_axis_is_refused_on_the_torch_engine(tmp_path, capsys):
    rc = main(["train", REPO_CONFIG, "--out", str(tmp_path / "r"), "--set", "train.engine=torch",
               "--set", "train.mesh_model=2"])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and "train.mesh_model=2" in err and len(err.splitlines()) == 1


def test_train_engine_is_validated():
    from memaudit.errors import ConfigError

    assert load_config(None, ["train.engine=jax"]).train.engine == "jax"
    with pytest.raises(ConfigError, match="train.engine"):
        load_config(None, ["train.engine=tpu"])


def test_the_report_names_the_engine_of_a_run():
    """run.json's result.engine reaches the report's run details (a run from before it: nothing)."""
    import copy

    from memaudit.reports.render import render_html, render_markdown
    from memaudit.reports.snapshots import load_snapshot

    report, _ = load_snapshot("quickstart")
    assert "engine)" not in render_markdown(report)
    named = copy.deepcopy(report)
    named["runs"][0]["model"]["engine"] = "jax"
    assert "(jax engine)" in render_markdown(named)
    assert "(jax engine)" in render_html(named)
