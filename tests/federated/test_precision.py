"""The compute policy (`memaudit.models.precision`): train.dtype resolved per backend, bf16
compute with f32 weights against the f32 model, and CPU defaults that change nothing."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

jax = pytest.importorskip("jax")
optax = pytest.importorskip("optax")
import jax.numpy as jnp

from memaudit.models.precision import ComputePolicy, policy_of_config, resolve_policy

VOCAB = 256
ROUND_LAYERS = 2  # the bf16 rounds' model: the tiny preset with 2 of its 4 layers


def test_auto_is_bf16_on_accelerators_and_f32_on_the_cpu():
    assert resolve_policy("auto", backend="cpu") == ComputePolicy()
    for backend in ("tpu", "gpu", "cuda"):
        p = resolve_policy("auto", backend=backend)
        assert (p.compute_dtype, p.param_dtype, p.reduce_dtype, p.scan_layers) == (
            "bfloat16", "float32", "float32", True)
        assert p.mixed
    assert resolve_policy("bfloat16", backend="cpu").compute == jnp.bfloat16
    assert not resolve_policy("float32", backend="tpu").mixed
    assert resolve_policy("float32", backend="tpu", remat=True).remat
    assert not resolve_policy("auto", backend="cpu", remat=True).remat  # remat needs scanned layers


def test_bad_dtypes_say_what_to_set():
    with pytest.raises(ValueError, match="train.dtype='float16'"):
        resolve_policy("float16", backend="cpu")
    with pytest.raises(ValueError, match="scan_layers=True"):
        ComputePolicy(remat=True)


def test_lora_keeps_unrolled_layers_on_an_accelerator():
    from memaudit.config import load_config

    cfg = load_config(None, ["backend=federated", "model.lora.rank=4"])
    assert not policy_of_config(cfg, backend="tpu").scan_layers
    assert policy_of_config(load_config(None, ["backend=federated"]), backend="tpu").scan_layers


def test_train_layers_chooses_scanned_or_unrolled_layers_and_is_refused_where_it_cannot_apply():
    from memaudit.config import ConfigError, load_config

    fed = ["backend=federated"]
    assert not policy_of_config(load_config(None, [*fed, "train.layers=unroll"]), backend="tpu").scan_layers
    assert policy_of_config(load_config(None, [*fed, "train.layers=scan"]), backend="cpu").scan_layers
    assert not policy_of_config(load_config(None, fed), backend="cpu").scan_layers
    for bad in (["backend=centralized", "train.layers=scan"], [*fed, "model.lora.rank=4", "train.layers=scan"]):
        with pytest.raises(ConfigError, match="train.layers=scan applies to the federated backend"):
            load_config(None, bad)


def _tiny(policy: ComputePolicy):
    from memaudit.models.flax_llama import FlaxLlama, FlaxLlamaConfig

    return FlaxLlama(FlaxLlamaConfig.from_preset("tiny", vocab_size=VOCAB, policy=policy))


def test_the_cpu_default_is_the_unchanged_f32_model():
    from memaudit.models.flax_llama import FlaxLlama, FlaxLlamaConfig, init_params

    old = FlaxLlamaConfig.from_preset("tiny", vocab_size=VOCAB)  # what the trainer built before
    new = _tiny(resolve_policy("auto", backend="cpu"))
    assert new.cfg == old
    params = init_params(old, preset="tiny", seed=1)
    ids = np.random.default_rng(0).integers(0, VOCAB, (2, 12)).astype(np.int32)
    # jitted, each model one program (op by op, each operation compiles on its own)
    assert np.array_equal(np.asarray(jax.jit(lambda p: new.apply({"params": p}, ids))(params)),
                          np.asarray(jax.jit(lambda p: FlaxLlama(old).apply({"params": p}, ids))(params)))


@pytest.fixture(scope="module")
def round_inputs():
    from memaudit.federated.cohorts import pack_clients
    from memaudit.models.flax_llama import FlaxLlamaConfig, init_params

    rng = np.random.default_rng(3)
    clients = [{"input_ids": rng.integers(0, VOCAB, (k, 16)).astype(np.int32),
                "attention_mask": np.ones((k, 16), np.int32)} for k in (3, 2, 4)]
    params = init_params(FlaxLlamaConfig.from_preset("tiny", vocab_size=VOCAB), preset="tiny", seed=2)
    # the tiny preset's first ROUND_LAYERS layers: the policy acts on every layer alike, and each
    # unrolled layer is compiled on its own
    model = params["model"]
    layers = {str(i): model["layers"][str(i)] for i in range(ROUND_LAYERS)}
    return pack_clients(clients), {**params, "model": {**model, "layers": layers}}


def _round(data, params, dtype, scan):
    """(metrics, unrolled weights) of one FedAvg round under `dtype`, layers scanned or not."""
    from memaudit.federated.algorithms import fedavg
    from memaudit.federated.trainer import make_loss_fn
    from memaudit.models.convert import stack_layers, unstack_layers
    from memaudit.models.flax_llama import FlaxLlama

    policy = resolve_policy(dtype, backend="cpu", scan_layers=scan)
    model = FlaxLlama(dataclasses.replace(_tiny(policy).cfg, num_hidden_layers=ROUND_LAYERS))
    algo = fedavg(make_loss_fn(model), client_optimizer=optax.sgd(0.5),
                  server_optimizer=optax.sgd(1.0), local_steps=2, batch_size=2)
    p0 = stack_layers(params) if scan else params
    state, metrics = algo.round(algo.init(jax.tree.map(jnp.asarray, p0)), data, jax.random.key(0))
    assert all(x.dtype == jnp.float32 for x in jax.tree.leaves(state.params))  # master weights
    return metrics, unstack_layers(jax.tree.map(np.asarray, state.params))


@pytest.fixture(scope="module")
def f32_round(round_inputs):
    """The f32 round, layers unrolled: the oracle of both bf16 layouts (in f32 the scanned layers
    compute the unrolled model, test_flax_llama.py's test_scanned_gradient_and_remat_equal_the_unrolled_models;
    one f32 round compiles where the two layouts compiled one each)."""
    return _round(*round_inputs, "float32", scan=False)


@pytest.mark.parametrize("scan", [False, True])
def test_a_bf16_round_is_within_tolerance_of_f32_and_keeps_f32_weights(round_inputs, f32_round, scan):
    data, params = round_inputs
    (m32, p32), (m16, p16) = f32_round, _round(data, params, "bfloat16", scan)
    # bf16 has an 8-bit mantissa: the loss (log-softmax in f32) within 1%, the update within 5%
    assert m16["loss"] == pytest.approx(m32["loss"], rel=1e-2)
    assert m16["update_norm"] == pytest.approx(m32["update_norm"], rel=5e-2)
    d32 = np.concatenate([(a - b).ravel() for a, b in zip(jax.tree.leaves(p32), jax.tree.leaves(params))])
    d16 = np.concatenate([(a - b).ravel() for a, b in zip(jax.tree.leaves(p16), jax.tree.leaves(params))])
    assert np.dot(d16, d32) / (np.linalg.norm(d16) * np.linalg.norm(d32)) > 0.99  # the same direction
