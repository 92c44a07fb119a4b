"""Model-parallel clients: a (clients x model) mesh, the Flax Llama's kernels split over `model`.

On 8 fake CPU devices a FedAvg round of a small Llama on (clients 4, model 2) equals the round
on (clients 8, model 1) (the oracle: the same program without tensor parallelism), its compiled
program holds per-device weight shards, and bad mesh sizes are one line, exit 2.
"""

from __future__ import annotations

import numpy as np
import pytest

jax = pytest.importorskip("jax")
optax = pytest.importorskip("optax")

from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

N_CLIENTS = 8


@pytest.fixture(scope="module")
def llama():
    from memaudit.models.flax_llama import FlaxLlama, FlaxLlamaConfig

    cfg = FlaxLlamaConfig(vocab_size=80, hidden_size=64, intermediate_size=96, num_hidden_layers=1,
                          num_attention_heads=4, num_key_value_heads=2)
    model = FlaxLlama(cfg)
    # init_params' random initialisation, jitted: op by op, each operation compiles on its own
    return model, jax.jit(model.init)(jax.random.key(0), np.zeros((1, 2), np.int32))["params"]


@pytest.fixture(scope="module")
def cohort():
    from memaudit.federated.cohorts import ClientData

    rng = np.random.default_rng(0)
    ids = rng.integers(0, 80, (N_CLIENTS, 4, 8)).astype(np.int32)
    mask = np.ones((N_CLIENTS, 4), np.float32)
    mask[1, 2:] = 0
    mask[6:] = 0  # two absent cohort slots (Poisson capacity padding)
    return ClientData({"input_ids": ids, "attention_mask": np.ones_like(ids)}, mask)


def _mesh(clients, model):
    return jax.make_mesh((clients, model), ("clients", "model"),
                         axis_types=(jax.sharding.AxisType.Auto,) * 2)


def _round(llama, data, mesh, strategy="auto", aggregator=None):
    """(new server state, compiled round) of one FedAvg round with the trainer's loss."""
    from memaudit.federated.aggregators import mean_aggregator
    from memaudit.federated.algorithms import fedavg
    from memaudit.federated.cohorts import ClientData
    from memaudit.federated.sharding import server_shardings
    from memaudit.federated.trainer import make_loss_fn
    from memaudit.models.flax_llama import kernel_axes

    model, params = llama
    algo = fedavg(make_loss_fn(model), client_optimizer=optax.sgd(0.2),
                  server_optimizer=optax.sgd(1.0), local_steps=2, batch_size=2, mesh=mesh,
                  map_strategy=strategy,
                  aggregator=mean_aggregator(mesh) if aggregator == "mean" else None)
    state = algo.init(params)
    state = jax.device_put(state, server_shardings(state, mesh, kernel_axes))
    clients = NamedSharding(mesh, P("clients"))
    data = ClientData(jax.device_put(data.examples, clients), jax.device_put(data.mask, clients))
    key = jax.random.key(3)
    with jax.set_mesh(mesh):
        compiled = algo.jitted.lower(state, data, key).compile()
        new, _ = compiled(state, data, key)
    return new, compiled


@pytest.fixture(scope="module")
def reference(llama, cohort):
    return _round(llama, cohort, _mesh(8, 1))


def _kernel(params, layer="0", block="self_attn", name="q_proj"):
    return params["model"]["layers"][layer][block][name]["kernel"]


@pytest.mark.parametrize("variant", ["auto", "vmap", "mean_aggregator"])
def test_round_on_4x2_equals_8x1_and_holds_weight_shards(llama, cohort, reference, variant):
    strategy = "vmap" if variant == "vmap" else "auto"
    aggregator = "mean" if variant == "mean_aggregator" else None
    want, want_compiled = reference
    got, compiled = _round(llama, cohort, _mesh(4, 2), strategy, aggregator)
    for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(got.params),
                            jax.tree.leaves(want.params), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=2e-4, atol=2e-6,
                                   err_msg=jax.tree_util.keystr(path))
    # the server state stays split: column kernels over their output dim, row over input
    q, o = _kernel(got.params), _kernel(got.params, name="o_proj")
    down = _kernel(got.params, block="mlp", name="down_proj")
    assert q.addressable_shards[0].data.shape == (64, 32)
    assert o.addressable_shards[0].data.shape == (32, 64)
    assert down.addressable_shards[0].data.shape == (48, 64)
    assert _kernel(want.params).addressable_shards[0].data.shape == (64, 64)
    # ... and so does the compiled round: no whole attention or MLP kernel on any device
    text = compiled.as_text()
    assert "f32[64,32]" in text and "f32[64,48]" in text and "f32[48,64]" in text
    assert "f32[64,96]" not in text and "f32[96,64]" not in text, "a whole MLP kernel"
    assert "f32[64,96]" in want_compiled.as_text()
    mem, ref = compiled.memory_analysis(), want_compiled.memory_analysis()
    assert mem.argument_size_in_bytes < ref.argument_size_in_bytes


def test_kernel_axes_and_server_shardings():
    from memaudit.federated.sharding import server_shardings
    from memaudit.models.flax_llama import kernel_axes

    mesh = _mesh(4, 2)
    tree = {"params": {"layers": {"0": {"mlp": {"up_proj": {"kernel": np.zeros((4, 6))},
                                                 "down_proj": {"kernel": np.zeros((6, 4))}},
                                         "self_attn": {"k_proj": {"kernel": np.zeros((4, 3))}}}},
                       "norm": {"weight": np.zeros(4)}},
            "count": np.zeros(())}
    sh = server_shardings(tree, mesh, kernel_axes)
    layer = sh["params"]["layers"]["0"]
    assert layer["mlp"]["up_proj"]["kernel"].spec == P(None, "model")
    assert layer["mlp"]["down_proj"]["kernel"].spec == P("model", None)
    assert layer["self_attn"]["k_proj"]["kernel"].spec == P(None, None)  # 3 % 2: replicated
    assert sh["params"]["norm"]["weight"].spec == P() and sh["count"].spec == P()
    one_d = jax.make_mesh((8,), ("clients",), axis_types=(jax.sharding.AxisType.Auto,))
    assert server_shardings(tree, one_d, kernel_axes)["params"]["layers"]["0"]["mlp"][
        "up_proj"]["kernel"].spec == P(None, None)


@pytest.mark.parametrize("size, what", [(3, "num_attention_heads=4"), (4, "num_key_value_heads=2"),
                                        (5, "num_attention_heads=4")])
def test_model_axis_must_divide_heads_kv_heads_and_intermediate(size, what):
    from memaudit.models.flax_llama import check_model_axis
    from memaudit.models.presets import get_preset

    with pytest.raises(ValueError) as err:
        check_model_axis(get_preset("tiny"), size)
    msg = str(err.value)
    assert "\n" not in msg and f"federated.mesh_model={size}" in msg and what in msg
    check_model_axis(get_preset("tiny"), 2)  # 4 heads, 2 kv heads, 352: divides
    import dataclasses

    odd = dataclasses.replace(get_preset("tiny"), intermediate_size=351)
    with pytest.raises(ValueError, match="intermediate_size=351"):
        check_model_axis(odd, 2)


def test_build_mesh_layouts_and_bad_sizes():
    from memaudit.errors import MemauditError
    from memaudit.federated.mesh import build_mesh

    mesh = build_mesh(None, 2, "tiny")
    assert dict(zip(mesh.axis_names, mesh.axis_sizes)) == {"clients": 4, "model": 2}
    assert build_mesh(None).axis_names == ("clients",) and build_mesh(1) is None
    assert build_mesh(2, 2, "tiny").devices.size == 4
    with pytest.raises(MemauditError, match="= 16 devices exceeds the 8 visible devices"):
        build_mesh(8, 2, "tiny")
    with pytest.raises(MemauditError, match="exceeds the 8 visible"):
        build_mesh(None, 16)
    with pytest.raises(MemauditError, match="num_key_value_heads=2.*model.preset=tiny"):
        build_mesh(None, 4, "tiny")


@pytest.mark.parametrize("override, message", [
    ("federated.mesh_model=4", "federated.mesh_model=4 does not divide the model's num_key_value"),
    ("federated.mesh_clients=8", "= 16 devices exceeds the 8 visible devices"),
])
def test_bad_mesh_through_the_cli_is_one_line_exit_2(tmp_path, capsys, override, message):
    from memaudit.cli import main

    args = ["train", "configs/federated-tiny.yaml", "--out", str(tmp_path / "r")]
    for o in ("data.synth.users=8", "data.synth.docs_per_user=2", "data.seq_len=32",
              "data.canaries.repetitions=[1]", "federated.cohort=2", "federated.mesh_model=2",
              override):
        args += ["--set", o]
    assert main(args) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0], err


def test_trainer_on_a_model_axis_matches_the_1d_mesh(tmp_path):
    """Two rounds of the federated trainer (tiny preset, DP off) on (clients 2, model 2) end with
    the weights of the same run on (clients 4): the server state is laid out over `model`
    between rounds (`_replicate`) and gathered for the checkpoint."""
    from safetensors.numpy import load_file

    from memaudit.config import load_config
    from memaudit.data import prepare_data
    from memaudit.run.federated import train_federated
    from memaudit.rundir import RunDir

    base = ["backend=federated", "data.synth.users=8", "data.synth.docs_per_user=2",
            "data.seq_len=32", "data.canaries.repetitions=[1]", "federated.rounds=2",
            "federated.cohort=4", "federated.sampling=fixed", "federated.local_steps=1",
            "federated.local_batch_size=2", "federated.server_optimizer=fedavg",
            "federated.eval_every=2", "federated.checkpoint_every=2", "train.batch_size=4",
            "train.eval_batches=1"]
    scratch = RunDir(tmp_path / "tok")
    prepare_data(load_config(None, base).data, scratch, vocab_size=4096)
    base.append(f"data.tokenizer={scratch.data_dir / 'tokenizer'}")  # one tokenizer for both
    weights = {}
    for name, mesh in (("1d", ["federated.mesh_clients=4"]),
                       ("2d", ["federated.mesh_clients=2", "federated.mesh_model=2"])):
        run = RunDir(tmp_path / name)
        result = train_federated(load_config(None, [*base, *mesh]), run)
        assert np.isfinite(result["final_holdout_loss"])
        weights[name] = load_file(str(run.model_dir / "model.safetensors"))
    assert weights["1d"].keys() == weights["2d"].keys()
    for k, w in weights["1d"].items():
        np.testing.assert_allclose(weights["2d"][k], w, rtol=1e-4, atol=1e-6, err_msg=k)


def test_mesh_model_config_field():
    from memaudit.config import load_config
    from memaudit.errors import ConfigError

    assert load_config(None, []).federated.mesh_model == 1
    assert load_config(None, ["federated.mesh_model=2"]).federated.mesh_model == 2
    with pytest.raises(ConfigError, match="federated.mesh_model"):
        load_config(None, ["federated.mesh_model=0"])
