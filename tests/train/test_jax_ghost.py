"""Ghost clipping (`memaudit.train.jax_ghost`) against jax-privacy's per-example gradients (the
oracle: `jax_dp.clipped_sum_fn`, vmap), on the CPU in float32 at tiny shapes.

- The clipped sum, the per-unit gradient norms and the unit losses agree to 1e-5 of each
  tensor's largest entry, per example and per user (units of 2 rows, with cross-row terms),
  with some units clipped and some not, a padding row among them; for unrolled and scanned
  decoder layers, a tied head, both norm paths (ghost Gram matrices and materialised), LoRA's
  adapters, and in micro-batches.
- The whole DP step with the noise off gives the same parameters and statistics.
- A trained run records the same ledger and ε with either clipping, and similar losses;
  train.clipping is resolved (auto: ghost, vmap under LoRA's adapter dropout) and refused where
  it cannot apply.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest

from memaudit.cli import main
from memaudit.config import load_config
from memaudit.io import read_json, read_jsonl
from tests.train.conftest import JAX_TINY, JAX_ULS

REPO_CONFIG = str(Path(__file__).resolve().parents[2] / "configs" / "centralized-jax.yaml")


def _model(tied: bool = False, scan: bool = False):
    import jax
    import jax.numpy as jnp

    from memaudit.models.flax_llama import FlaxLlama, FlaxLlamaConfig

    cfg = FlaxLlamaConfig(vocab_size=48, hidden_size=16, intermediate_size=24, num_hidden_layers=2,
                          num_attention_heads=2, num_key_value_heads=1, tie_word_embeddings=tied,
                          scan_layers=scan)
    model = FlaxLlama(cfg)
    return model, model.init(jax.random.key(0), jnp.zeros((1, 4), jnp.int32))["params"]


def _batch(rows: int, length: int):
    """Rows of few distinct tokens (repeats exercise the embedding's cross terms), one with
    padding at its end, one padding row (no target)."""
    rng = np.random.default_rng(3)
    ids = rng.integers(0, 10, (rows, length)).astype(np.int32)
    am = np.ones((rows, length), np.int32)
    am[1, length // 2:] = 0
    lm = am.astype(bool)
    lm[:, 0] = False
    lm[rows - 3] = False
    return ids, am, lm


def _both(model, params, batch, k, microbatch=None):
    """at(clip) -> (jax-privacy's vmap result, ghost clipping's) at that clip norm. The clip is an
    argument of the two compiled functions, so each compiles once for every clip a test asks."""
    import jax
    import jax.numpy as jnp

    from memaudit.train import jax_dp, jax_ghost
    from memaudit.train.jax_engine import make_forward

    shape = (-1, k, batch[0].shape[1]) if k > 1 else batch[0].shape
    args = [jnp.asarray(x.reshape(shape)) for x in batch]
    oracle = jax.jit(lambda p, c, *a: jax_dp.clipped_sum_fn(make_forward(model), clip=c, group=k > 1,
                                                            microbatch=None)(p, *a))
    ghost = jax.jit(lambda p, c, *a: jax_ghost.clipped_sum_fn(model, clip=c, group=k > 1,
                                                              microbatch=microbatch)(p, *a))

    def at(clip):
        c = jnp.float32(clip)
        return jax.device_get(oracle(params, c, *args)), jax.device_get(ghost(params, c, *args))

    return at


def _assert_close(want, got):
    import jax
    from flax import traverse_util

    (wg, (wv, wn)), (gg, (gv, gn)) = want, got
    fw, fg = traverse_util.flatten_dict(wg), traverse_util.flatten_dict(gg)
    assert fw.keys() == fg.keys()
    for name, w in fw.items():
        assert fg[name].shape == w.shape and fg[name].dtype == w.dtype, name
        assert np.max(np.abs(fg[name] - w)) <= 1e-5 * np.max(np.abs(w)), name
    assert np.max(np.abs(gn - wn)) <= 1e-5 * np.max(wn)
    assert np.max(np.abs(gv - wv)) <= 1e-5 * np.max(np.abs(wv))
    assert all(np.all(np.isfinite(x)) for x in jax.tree.leaves(gg))


@pytest.mark.parametrize(("length", "k", "tied", "scan"), [
    (8, 1, False, False),   # (kT)² < in·out: Gram matrices for the square projections
    (32, 1, False, False),  # (kT)² >= in·out: materialised per-unit gradients
    (8, 2, False, False),   # per user: 2 rows a unit
    (8, 2, True, True),     # tied embedding and head, crossed in the norm; scanned decoder layers
])
def test_the_clipped_sum_and_norms_equal_jax_privacys_per_example_gradients(length, k, tied, scan):
    model, params = _model(tied, scan)
    batch = _batch(8, length)
    at = _both(model, params, batch, k)
    _, (_, norms) = at(math.inf)[0]
    real = norms[norms > 0]
    assert len(real) >= 3
    clip = float(np.median(real))  # about half of the units with a gradient clipped
    want, got = at(clip)
    n = want[1][1]
    assert 0 < int((n > clip).sum()) < int((n > 0).sum())
    assert (n == 0).sum() == (1 if k == 1 else 0) and np.all(got[1][1][n == 0] == 0)  # the padding row
    _assert_close(want, got)


def _lora(scan: bool):
    """LoRA adapters (rank 3, random, B non-zero) on q_proj and v_proj of every layer."""
    import jax

    from memaudit.models.flax_lora import LoraModel

    model, base = _model(scan=scan)
    layers = base["model"]["layers"]

    def adapter(kernel, key):
        lead, (fan_in, fan_out) = kernel.shape[:-2], kernel.shape[-2:]
        return {"lora_A": 0.3 * jax.random.normal(key, (*lead, fan_in, 3)),
                "lora_B": 0.3 * jax.random.normal(jax.random.fold_in(key, 1), (*lead, 3, fan_out))}

    adapters = {"model": {"layers": {
        name: {"self_attn": {p: adapter(layers[name]["self_attn"][p]["kernel"], jax.random.key(10 * i + j))
                             for j, p in enumerate(("q_proj", "v_proj"))}}
        for i, name in enumerate(layers)}}}
    return LoraModel(model, base, 2.0), adapters


@pytest.mark.parametrize(("k", "scan"), [(1, False), (2, True)])
def test_lora_adapters_clipped_sum_equals_jax_privacys(k, scan):
    """The adapters' clipped sum (∇A = s aᵀ g Bᵀ, ∇B = s (a A)ᵀ g from the base's captures):
    per example on unrolled layers, per user on scanned ones (a layer's terms are the same
    function of k either way, vmapped over the scanned layers' axis)."""
    lora, adapters = _lora(scan)
    batch = _batch(8, 8)
    at = _both(lora, adapters, batch, k)
    norms = at(math.inf)[0][1][1]
    clip = float(np.median(norms[norms > 0]))
    want, got = at(clip)
    assert 0 < int((want[1][1] > clip).sum()) < int((want[1][1] > 0).sum())
    _assert_close(want, got)


def test_micro_batches_of_units_give_the_same_sum():
    """3 units at a time over 4 (the last micro-batch short): the same as one pass."""
    model, params = _model()
    batch = _batch(8, 8)
    want, got = _both(model, params, batch, 2, microbatch=3)(1.0)
    _assert_close(want, got)


def test_a_noise_free_dp_step_is_the_same_with_either_clipping():
    import jax
    import jax.numpy as jnp
    from flax import traverse_util

    from memaudit.train import jax_dp
    from memaudit.train import jax_engine as eng

    model, params = _model()
    tx = eng.adamw((0.9, 0.95), 0.0)
    batch = _batch(8, 8)
    norms = _both(model, params, batch, 1)(math.inf)[0][1][1]
    clip = float(np.median(norms[norms > 0]))
    ids, am, lm = (jnp.asarray(x) for x in batch)
    out = {}
    for clipping in ("vmap", "ghost"):
        step = jax_dp.private_step(eng.make_forward(model), tx, clip=clip, noise_multiplier=0.0, expected=8.0,
                                   group=False, microbatch=None, clipping=clipping, model=model)
        p, _, stats = jax.jit(step)(params, tx.init(params), ids, am, lm, jnp.float32(1e-3),
                                    jnp.zeros((2,), jnp.uint32))
        out[clipping] = jax.device_get((p, stats))
    (pv, sv), (pg, sg) = out["vmap"], out["ghost"]
    assert sv["clipped"] == sg["clipped"] and 0 < sg["clipped"] < 7 and sv["examples"] == sg["examples"] == 7
    for key in ("loss_sum", "grad_norm"):
        assert abs(float(sg[key]) - float(sv[key])) <= 1e-5 * abs(float(sv[key]))
    fv, fg, f0 = (traverse_util.flatten_dict(x) for x in (pv, pg, jax.device_get(params)))
    for name, w in fv.items():  # AdamW's first step moves each entry by about lr: 1e-5 of that
        assert np.max(np.abs(fg[name] - w)) <= 1e-5 * max(np.max(np.abs(w - f0[name])), 1e-12), name


def test_an_unknown_clipping_is_refused():
    from memaudit.train import jax_dp
    from memaudit.train import jax_engine as eng

    model, _ = _model()
    with pytest.raises(ValueError, match="clipping='exact'"):
        jax_dp.private_step(eng.make_forward(model), eng.adamw((0.9, 0.95), 0.0), clip=1.0, noise_multiplier=1.0,
                            expected=1.0, group=False, microbatch=None, clipping="exact", model=model)


# ----------------------------------------------------------------------------- runs and config
def test_a_uls_run_records_the_same_ledger_and_losses_with_either_clipping(tmp_path, jax_uls_run):
    """3 steps of ULS DP-SGD (tests/train/conftest.py's run: ghost clipping, one device) and the
    same config with vmap."""
    import jax

    from memaudit.run.driver import run_trainer
    from memaudit.run.lifecycle import SENSITIVE_METRICS
    from memaudit.rundir import RunDir, prepare_new_run
    from memaudit.train.jax_trainer import JaxTrainer

    cfg = load_config(None, [*JAX_TINY, *JAX_ULS, "train.clipping=vmap"])
    vmap = prepare_new_run(tmp_path / "vmap", overwrite=False)
    run_trainer(JaxTrainer(cfg, vmap, devices=jax.devices()[:1]), resume=False)
    runs = {"vmap": vmap, "ghost": RunDir(jax_uls_run)}
    ledgers = {c: read_json(r.privacy_path) for c, r in runs.items()}
    assert ledgers["ghost"]["events"] == ledgers["vmap"]["events"]
    assert ledgers["ghost"]["epsilon"] == ledgers["vmap"]["epsilon"]
    got, want = (read_jsonl(runs[c].path / SENSITIVE_METRICS) for c in ("ghost", "vmap"))
    assert len(got) == len(want) == 3
    for a, b in zip(got, want, strict=True):
        assert a["batch_size"] == b["batch_size"] and a["clip_fraction"] == b["clip_fraction"]
        assert abs(a["loss"] - b["loss"]) <= 1e-4 * abs(b["loss"])
    assert read_json(runs["ghost"].path / "run.json")["result"]["clipping"] == "ghost"
    assert read_json(vmap.path / "run.json")["result"]["clipping"] == "vmap"


def test_auto_clipping_is_ghost_and_vmap_under_adapter_dropout():
    from memaudit.train.jax_dp import jax_clipping

    assert jax_clipping(load_config(None, ["train.engine=jax"])) == "ghost"
    assert jax_clipping(load_config(None, ["train.engine=jax", "model.lora.rank=4"])) == "ghost"
    assert jax_clipping(load_config(None, ["train.engine=jax", "model.lora.rank=4",
                                           "model.lora.dropout=0.1"])) == "vmap"
    assert jax_clipping(load_config(None, ["train.engine=jax", "train.clipping=vmap"])) == "vmap"
    # ULS (a user's rows clipped as one): ghost on the CPU, vmap on an accelerator (measured faster)
    cfg = load_config(None, ["train.engine=jax"])
    assert jax_clipping(cfg, group=True, platform="cpu") == "ghost"
    assert jax_clipping(cfg, group=True, platform="tpu") == "vmap"
    assert jax_clipping(cfg, group=False, platform="tpu") == "ghost"
    assert jax_clipping(load_config(None, ["train.engine=jax", "train.clipping=ghost"]), group=True,
                        platform="tpu") == "ghost"


@pytest.mark.parametrize(("overrides", "names"), [
    (["model.lora.rank=4", "model.lora.dropout=0.1", "train.clipping=ghost"], "train.clipping=ghost"),
    (["train.engine=torch", "train.clipping=vmap"], "train.clipping=vmap"),
])
def test_clipping_it_cannot_apply_is_refused_in_one_line(tmp_path, capsys, overrides, names):
    args = ["train", REPO_CONFIG, "--out", str(tmp_path / "r")]
    for o in overrides:
        args += ["--set", o]
    rc = main(args)
    err = capsys.readouterr().err.strip()
    assert rc == 2 and len(err.splitlines()) == 1 and names in err, err
    assert not (tmp_path / "r").exists()
