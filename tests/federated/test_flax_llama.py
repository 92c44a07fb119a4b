"""The Flax Llama against transformers' LlamaForCausalLM (the oracle), and the weight converters."""

from __future__ import annotations

import dataclasses
import functools

import numpy as np
import pytest

torch = pytest.importorskip("torch")
jax = pytest.importorskip("jax")

VOCAB = 4096  # the tiny preset's own vocabulary


@pytest.fixture(scope="module")
def hf_tiny():
    from memaudit.models.presets import build_model

    return build_model("tiny", vocab_size=VOCAB, seed=3).eval()


@pytest.fixture(scope="module")
def flax_tiny(hf_tiny):
    from memaudit.models.convert import hf_to_flax
    from memaudit.models.flax_llama import FlaxLlama, FlaxLlamaConfig

    model = FlaxLlama(FlaxLlamaConfig.from_preset("tiny", vocab_size=VOCAB))
    params = hf_to_flax(hf_tiny.state_dict())
    fwd = jax.jit(lambda p, ids, am: model.apply({"params": p}, ids, am))
    return model, params, fwd


def _batch(seed=0, b=3, length=24):
    rng = np.random.default_rng(seed)
    return rng.integers(0, VOCAB, (b, length)).astype(np.int32)


def test_logits_match_hf_without_padding(hf_tiny, flax_tiny):
    _, params, fwd = flax_tiny
    ids = _batch()
    am = np.ones_like(ids)
    got = np.asarray(fwd(params, ids, am))
    with torch.no_grad():
        ref = hf_tiny(input_ids=torch.tensor(ids, dtype=torch.long)).logits.numpy()
    np.testing.assert_allclose(got, ref, atol=1e-4, rtol=0)


@functools.cache
def _forward_at(model):
    """The jitted forward with explicit positions (one program for the padding cases)."""
    return jax.jit(lambda p, ids, am, pos: model.apply({"params": p}, ids, am, pos))


@pytest.mark.parametrize("side", ["right", "left"])
def test_logits_match_hf_with_padding(hf_tiny, flax_tiny, side):
    _, params, fwd = flax_tiny
    ids = _batch(seed=1)
    am = np.ones_like(ids)
    lengths = [24, 17, 6]
    for i, n in enumerate(lengths):
        if side == "right":
            am[i, n:] = 0
        else:
            am[i, : ids.shape[1] - n] = 0
    # HF numbers positions 0..L-1 whatever the mask; with left padding pass the same ids to both
    pos = np.broadcast_to(np.arange(ids.shape[1]), ids.shape).astype(np.int32)
    model = flax_tiny[0]
    # jitted: one program serves both sides (op by op, each operation compiles on its own)
    got = np.asarray(_forward_at(model)(params, ids, am, pos))
    with torch.no_grad():
        ref = hf_tiny(input_ids=torch.tensor(ids, dtype=torch.long),
                      attention_mask=torch.tensor(am, dtype=torch.long)).logits.numpy()
    real = am.astype(bool)
    np.testing.assert_allclose(got[real], ref[real], atol=1e-4, rtol=0)
    # padding really is masked: changing padded tokens leaves real positions unchanged
    ids2 = np.where(real, ids, (ids + 7) % VOCAB).astype(np.int32)
    got2 = np.asarray(fwd(params, ids2, am))
    np.testing.assert_allclose(np.asarray(fwd(params, ids, am))[real], got2[real], atol=1e-5)


def test_parameter_tree_maps_one_to_one_onto_hf_names(hf_tiny, flax_tiny):
    model, params, _ = flax_tiny
    # the module's own tree, as shapes (jax.eval_shape: nothing is initialised or compiled)
    init = jax.eval_shape(model.init, jax.random.key(0), np.zeros((1, 4), np.int32))["params"]
    flat_init = {"/".join(str(k.key) for k in p): v.shape for p, v in jax.tree_util.tree_leaves_with_path(init)}
    flat_conv = {"/".join(str(k.key) for k in p): v.shape for p, v in jax.tree_util.tree_leaves_with_path(params)}
    assert flat_init == flat_conv  # the converter builds exactly the module's own tree
    sd = hf_tiny.state_dict()
    assert len(flat_init) == len(sd)
    q = params["model"]["layers"]["0"]["self_attn"]["q_proj"]["kernel"]
    np.testing.assert_array_equal(q, sd["model.layers.0.self_attn.q_proj.weight"].numpy().T)
    np.testing.assert_array_equal(params["model"]["embed_tokens"]["embedding"],
                                  sd["model.embed_tokens.weight"].numpy())


def test_round_trip_hf_flax_hf_is_bit_identical(hf_tiny):
    from memaudit.models.convert import flax_to_hf, hf_to_flax

    sd = hf_tiny.state_dict()
    back = flax_to_hf(hf_to_flax(sd))
    assert set(back) == set(sd)
    for name, t in sd.items():
        ref = t.numpy()
        assert back[name].dtype == ref.dtype and back[name].shape == ref.shape, name
        assert back[name].tobytes() == ref.tobytes(), name


def test_initial_weights_are_the_shared_seeded_init():
    from memaudit.models.convert import flax_to_hf
    from memaudit.models.flax_llama import FlaxLlamaConfig, init_params
    from memaudit.models.presets import init_state_dict

    cfg = FlaxLlamaConfig.from_preset("tiny", vocab_size=512)
    got = flax_to_hf(init_params(cfg, preset="tiny", seed=5))
    ref = init_state_dict("tiny", vocab_size=512, seed=5)
    assert all(np.array_equal(got[k], ref[k].numpy()) for k in ref)
    other = flax_to_hf(init_params(cfg, preset="tiny", seed=6))
    assert not np.array_equal(other["lm_head.weight"], got["lm_head.weight"])


def test_loss_matches_hf_labels_loss(hf_tiny, flax_tiny):
    from memaudit.models.flax_llama import causal_lm_loss

    _, params, fwd = flax_tiny
    ids = _batch(seed=2, b=2, length=16)
    am = np.ones_like(ids)
    am[1, 9:] = 0
    total, count = causal_lm_loss(fwd(params, ids, am), ids, am)
    labels = torch.tensor(np.where(am > 0, ids, -100), dtype=torch.long)
    with torch.no_grad():
        ref = hf_tiny(input_ids=torch.tensor(ids, dtype=torch.long),
                      attention_mask=torch.tensor(am, dtype=torch.long), labels=labels).loss.item()
    assert int(count) == 15 + 8
    assert float(total) / float(count) == pytest.approx(ref, abs=1e-5)


def test_saved_checkpoint_loads_in_transformers_and_generates(hf_tiny, flax_tiny, tmp_path):
    from transformers import AutoModelForCausalLM

    from memaudit.models.convert import load_hf_checkpoint, save_hf_checkpoint

    _, params, _ = flax_tiny
    save_hf_checkpoint(params, tmp_path / "m", preset="tiny", vocab_size=VOCAB)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "m").eval()
    sd, ref = loaded.state_dict(), hf_tiny.state_dict()
    assert all(torch.equal(sd[k], ref[k]) for k in ref)
    out = loaded.generate(torch.tensor(_batch(b=1, length=5), dtype=torch.long), max_new_tokens=3,
                          do_sample=False)
    assert out.shape == (1, 8)
    back, cfg = load_hf_checkpoint(tmp_path / "m")
    assert cfg["num_hidden_layers"] == 4
    assert jax.tree.all(jax.tree.map(np.array_equal, back, jax.tree.map(np.asarray, params)))


def test_bad_weight_name_is_rejected():
    from memaudit.models.convert import hf_to_flax

    with pytest.raises(ValueError, match="bias"):
        hf_to_flax({"model.layers.0.self_attn.q_proj.bias": np.zeros(3, np.float32)})


# ------------------------------------------------------------------ scanned decoder layers
@pytest.fixture(scope="module")
def scanned_tiny(hf_tiny):
    from memaudit.models.convert import hf_to_flax
    from memaudit.models.flax_llama import FlaxLlama, FlaxLlamaConfig
    from memaudit.models.precision import resolve_policy

    policy = resolve_policy("float32", backend="cpu", scan_layers=True)
    model = FlaxLlama(FlaxLlamaConfig.from_preset("tiny", vocab_size=VOCAB, policy=policy))
    return model, hf_to_flax(hf_tiny.state_dict(), scan_layers=True)


def test_scanned_layers_match_hf_and_the_unrolled_model(hf_tiny, flax_tiny, scanned_tiny):
    model, params = scanned_tiny
    ids = _batch(seed=4)
    am = np.ones_like(ids)
    am[2, 15:] = 0
    got = np.asarray(jax.jit(lambda p: model.apply({"params": p}, ids, am))(params))
    with torch.no_grad():
        ref = hf_tiny(input_ids=torch.tensor(ids, dtype=torch.long),
                      attention_mask=torch.tensor(am, dtype=torch.long)).logits.numpy()
    real = am.astype(bool)
    np.testing.assert_allclose(got[real], ref[real], atol=1e-4, rtol=0)
    unrolled = np.asarray(flax_tiny[2](flax_tiny[1], ids, am))
    np.testing.assert_allclose(got, unrolled, atol=2e-5, rtol=0)


def test_scanned_tree_is_the_modules_own_and_maps_one_to_one_onto_hf(hf_tiny, scanned_tiny):
    from memaudit.models.convert import flax_to_hf, hf_to_flax, unstack_layers

    model, params = scanned_tiny
    init = jax.eval_shape(model.init, jax.random.key(0), np.zeros((1, 4), np.int32))["params"]
    shapes = lambda t: {jax.tree_util.keystr(p): v.shape for p, v in jax.tree_util.tree_leaves_with_path(t)}
    assert shapes(init) == shapes(params)
    sd = hf_tiny.state_dict()
    stacked = params["model"]["layers"]["stacked"]["self_attn"]["q_proj"]["kernel"]
    assert stacked.shape[0] == 4
    np.testing.assert_array_equal(stacked[2], sd["model.layers.2.self_attn.q_proj.weight"].numpy().T)
    back = flax_to_hf(params)  # unstacks: HF -> stacked Flax -> HF is bit-identical
    assert set(back) == set(sd)
    assert all(back[k].tobytes() == sd[k].numpy().tobytes() for k in sd)
    per_layer = hf_to_flax(sd)
    assert jax.tree.all(jax.tree.map(np.array_equal, unstack_layers(params), per_layer))


def test_scanned_gradient_and_remat_equal_the_unrolled_models(flax_tiny, scanned_tiny):
    from memaudit.models.convert import stack_layers
    from memaudit.models.flax_llama import FlaxLlama, causal_lm_loss

    unrolled, per_layer, _ = flax_tiny
    model, params = scanned_tiny
    remat = FlaxLlama(dataclasses.replace(model.cfg, remat=True))
    ids = _batch(seed=5, b=2, length=12)
    am = np.ones_like(ids)

    def grad(m, p):
        loss = lambda q: causal_lm_loss(m.apply({"params": q}, ids, am), ids, am)[0]
        return jax.jit(jax.grad(loss))(p)

    ref = stack_layers(jax.tree.map(np.asarray, grad(unrolled, per_layer)))
    for m in (model, remat):
        got = jax.tree.map(np.asarray, grad(m, params))
        assert jax.tree.all(jax.tree.map(lambda a, b: np.allclose(a, b, atol=2e-5, rtol=1e-4), got, ref))


def test_flash_attention_kernel_equals_the_einsum_path_forward_and_backward():
    """The Pallas flash-attention path (`attention="flash"`, run by Pallas's TPU interpreter on
    the CPU) gives the einsum path's logits and gradients at every real token, with right padding
    and grouped-query heads, layers unrolled and scanned."""
    import jax.numpy as jnp
    from jax.experimental.pallas import tpu as pltpu

    from memaudit.models.flax_llama import FlaxLlama, FlaxLlamaConfig

    base = dataclasses.replace(FlaxLlamaConfig.from_preset("tiny"), num_hidden_layers=1, num_attention_heads=2,
                               num_key_value_heads=1)  # the interpreter runs the kernel's grid one cell at a time
    assert base.num_attention_heads > base.num_key_value_heads  # grouped-query heads exercised
    ids = jax.random.randint(jax.random.key(1), (1, 100), 0, base.vocab_size)  # padded to the kernel's 128
    mask = jnp.ones((1, 100), jnp.int32).at[0, 90:].set(0)
    real = np.asarray(mask, bool)
    for scan in (True,):  # the mask reaches the kernel through the scan's broadcast
        cfg = dataclasses.replace(base, scan_layers=scan)
        ref, fl = FlaxLlama(cfg), FlaxLlama(dataclasses.replace(cfg, attention="flash"))
        p = jax.jit(ref.init)(jax.random.key(0), ids)["params"]

        def loss(p, model):
            return (model.apply({"params": p}, ids, mask)[:, :, :7] * mask[..., None]).sum()

        # one jitted program a path (logits and gradient): op by op, the interpreter dispatches
        # every cell of the kernel's grid on its own
        def both(model):
            return jax.jit(lambda q: (model.apply({"params": q}, ids, mask), jax.grad(loss)(q, model)))

        want, gwant = both(ref)(p)
        with pltpu.force_tpu_interpret_mode():
            got, ggot = both(fl)(p)
        np.testing.assert_allclose(np.asarray(got)[real], np.asarray(want)[real], atol=1e-5, rtol=1e-5)
        for w, g in zip(jax.tree.leaves(gwant), jax.tree.leaves(ggot), strict=True):
            assert float(jnp.abs(w - g).max()) <= 1e-5 * float(jnp.abs(w).max()) + 1e-8


def test_an_unknown_attention_kernel_is_refused():
    from memaudit.models.flax_llama import FlaxLlamaConfig

    with pytest.raises(ValueError, match="xla or flash"):
        dataclasses.replace(FlaxLlamaConfig.from_preset("tiny"), attention="fast")
