"""Federated LoRA against the torch side: the Flax LoRA forward against peft's, a FedSGD round
against the centralized LoRA step on the same data, the upload of a client, and a DP-FedAvg run
whose exports are the adapters only. Adapter dropout: the unmerged layer against a NumPy oracle,
the model against peft under the same masks, the merged path kept bit for bit without a key, and
a run with dropout that trains, repeats and resumes bit for bit."""

from __future__ import annotations

import json

import jax
import numpy as np
import pytest
import torch

from memaudit.config import LoraConfig, load_config
from memaudit.models.flax_lora import LoraModel, adapters_from_peft, adapters_to_peft, count
from memaudit.models.lora import adapter_state, apply_lora
from memaudit.run.driver import run_trainer
from memaudit.run.lifecycle import SENSITIVE_METRICS
from tests.federated.test_trainer import OVERRIDES

VOCAB = 4096  # the tiny preset's, of the end-to-end run
SMALL_VOCAB = 61  # tests.train.test_dpsgd._model's
LORA = LoraConfig(rank=4, alpha=8, target_modules=("q_proj", "k_proj", "v_proj", "o_proj",
                                                   "gate_proj", "up_proj", "down_proj"))


@pytest.fixture(scope="module")
def pair():
    """(torch peft model with moved B, Flax LoraModel, its adapter tree) on the same weights."""
    from memaudit.models.convert import hf_to_flax
    from memaudit.models.flax_llama import FlaxLlama, FlaxLlamaConfig
    from tests.train.test_dpsgd import _model

    base = _model(seed=3)  # 2 layers of 32 (cheap to compile), RMSNorm weights moved
    base_sd = {k: v.detach().clone() for k, v in base.state_dict().items()}
    peft_model = apply_lora(base, LORA, seed=0)
    with torch.no_grad():  # B starts at 0; move it so the adapters change the function
        g = torch.Generator().manual_seed(1)
        for n, p in peft_model.named_parameters():
            if "lora_B" in n:
                p.copy_(0.05 * torch.randn(p.shape, generator=g))
    adapters = adapters_from_peft(adapter_state(peft_model))
    c = base.config
    shape = FlaxLlamaConfig(vocab_size=c.vocab_size, hidden_size=c.hidden_size, max_position_embeddings=64,
                            intermediate_size=c.intermediate_size, num_hidden_layers=c.num_hidden_layers,
                            num_attention_heads=c.num_attention_heads, num_key_value_heads=c.num_key_value_heads,
                            rms_norm_eps=c.rms_norm_eps, rope_theta=10000.0)
    flax = LoraModel(FlaxLlama(shape), hf_to_flax(base_sd), LORA.alpha / LORA.rank)
    return peft_model.eval(), flax, adapters


def _ids(seed=0, b=3, length=20, vocab=SMALL_VOCAB):
    return np.random.default_rng(seed).integers(0, vocab, (b, length)).astype(np.int32)


def test_adapter_names_round_trip(pair):
    peft_model, _, adapters = pair
    back = adapters_to_peft(adapters)
    want = adapter_state(peft_model)
    assert set(back) == set(want) and len(back) == 2 * 7 * 2
    for k, v in want.items():
        np.testing.assert_array_equal(back[k], v.numpy())
    assert count(adapters) == sum(v.numel() for v in want.values())


def test_flax_lora_forward_equals_the_peft_forward(pair):
    peft_model, flax, adapters = pair
    ids = _ids()
    am = np.ones_like(ids)
    am[1, 13:] = 0
    got = np.asarray(jax.jit(lambda a, i, m: flax.apply({"params": a}, i, m))(adapters, ids, am))
    with torch.no_grad():
        want = peft_model(input_ids=torch.as_tensor(ids, dtype=torch.long),
                          attention_mask=torch.as_tensor(am)).logits.numpy()
    real = am.astype(bool)  # padded query positions are not compared (HF and Flax fill them differently)
    np.testing.assert_allclose(got[real], want[real], rtol=0, atol=1e-5)


def test_fedsgd_lora_round_equals_the_centralized_lora_step_and_uploads_the_adapters(pair):
    """FedSGD with server SGD (lr eta): the adapters move by -eta x the gradient of the mean
    per-sequence loss over all clients' sequences, computed here on the torch peft model."""
    import optax

    from memaudit.federated import algorithms as alg
    from memaudit.federated.cohorts import ClientData
    from memaudit.federated.trainer import make_loss_fn
    from memaudit.train.losses import causal_lm_loss_per_example

    peft_model, flax, adapters = pair
    eta = 0.5
    ids = _ids(seed=2, b=6, length=16).reshape(3, 2, 16)  # 3 clients x 2 sequences
    am = np.ones_like(ids)
    am[0, 1, 10:] = 0
    mask = np.array([[1, 1], [1, 1], [1, 0]], np.float32)  # client 2 has one sequence
    data = ClientData({"input_ids": jax.numpy.asarray(ids), "attention_mask": jax.numpy.asarray(am)},
                      jax.numpy.asarray(mask))
    loss_fn = make_loss_fn(flax)
    fed = alg.fedsgd(loss_fn, server_optimizer=optax.sgd(eta), weighting="examples")
    state, _ = fed.round(fed.init(adapters), data, jax.random.key(0))
    got = adapters_to_peft(jax.tree.map(np.asarray, state.params))

    real = mask.reshape(-1) > 0
    t_ids = torch.as_tensor(ids.reshape(6, 16)[real], dtype=torch.long)
    t_am = torch.as_tensor(am.reshape(6, 16)[real])
    trainable = {n: p for n, p in peft_model.named_parameters() if p.requires_grad}
    logits = peft_model(input_ids=t_ids, attention_mask=t_am).logits
    loss = causal_lm_loss_per_example(logits, t_ids, t_am.bool()).mean()
    grads = dict(zip(trainable, torch.autograd.grad(loss, list(trainable.values())), strict=True))
    for name, p in trainable.items():
        saved = name.replace(".default", "")
        np.testing.assert_allclose(got[saved], (p - eta * grads[name]).detach().numpy(), rtol=0, atol=1e-5,
                                   err_msg=saved)

    # one client's upload in a FedAvg round: its adapter delta, nothing of the base
    phase = alg.make_client_phase(loss_fn, optax.sgd(0.1), local_steps=1, batch_size=2)
    # the upload's shapes and dtypes (jax.eval_shape: traced, not compiled nor run)
    out = jax.eval_shape(phase, adapters, data, jax.random.key(1))
    per_client = sum(int(np.prod(x.shape[1:])) * x.dtype.itemsize for x in jax.tree.leaves(out.deltas))
    assert per_client == 4 * count(adapters) == 4 * sum(p.numel() for p in trainable.values())


def test_dp_fedavg_lora_run_trains_the_adapters_and_exports_both(tmp_path):
    """A DP-FedAvg LoRA run under secure aggregation: clipping, the masked sum, noise and the server
    optimizer see only the adapters; each client uploads a masked input of one uint32 word per
    adapter parameter (counted in the protocol's own traffic), the exported base is the
    initialisation bit for bit, and the adapter folder and merged model agree."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from memaudit.io import read_json
    from memaudit.models.init import initial_model
    from memaudit.run.federated import train_federated
    from memaudit.rundir import RunDir

    cfg = load_config(None, [*OVERRIDES, "federated.rounds=1", "federated.eval_every=1",
                             "privacy.noise_multiplier=0.5", "privacy.clip=0.5",
                             "privacy.reproducible_randomness=true", "model.lora.rank=4",
                             "model.lora.target_modules=[q_proj,v_proj]",
                             "privacy.secure_aggregation.enabled=true"])
    run = RunDir(tmp_path / "fl")
    res = train_federated(cfg, run)
    assert res["trained"] == "lora(r=4, q_proj,v_proj)"
    n_adapters = 4 * ((128 * 4 + 4 * 128) + (128 * 4 + 4 * 64))  # 4 layers x (q_proj + v_proj)
    assert res["trained_parameters"] == n_adapters
    # the masked input: a 34-byte header, the vector's 8-byte length, 4 bytes per adapter parameter
    assert res["upload_bytes_per_client_per_round"] == 34 + 8 + 4 * n_adapters
    rounds = [json.loads(line) for line in (run.path / SENSITIVE_METRICS).read_text().splitlines()]
    secure = [r for r in rounds if r.get("secagg_aborted") == 0]
    assert secure and all(r["secagg_bytes_masked"] == r["survivors"] * (34 + 8 + 4 * n_adapters) for r in secure)
    assert all(r["secagg_bytes_up"] > r["secagg_bytes_masked"] for r in secure)  # keys, shares, unmasking
    assert read_json(run.privacy_path)["unit"] == "user"
    base_dir = run.path / "adapter" / "base"
    start = initial_model(cfg.model, VOCAB).state_dict()
    base = AutoModelForCausalLM.from_pretrained(str(base_dir)).float()
    for k, v in base.state_dict().items():
        assert torch.equal(v, start[k]), k
    adapter = PeftModel.from_pretrained(base, str(run.path / "adapter")).eval()
    merged = AutoModelForCausalLM.from_pretrained(str(run.model_dir)).float().eval()
    ids = torch.as_tensor(_ids(seed=4, b=2, length=12, vocab=VOCAB), dtype=torch.long)
    with torch.no_grad():
        torch.testing.assert_close(adapter(input_ids=ids).logits, merged(input_ids=ids).logits,
                                   rtol=1e-5, atol=1e-5)
    moved = [not torch.equal(v, torch.zeros_like(v)) for k, v in adapter_state(adapter).items() if "lora_B" in k]
    assert len(moved) == 8 and all(moved)


# ----------------------------------------------------------------------------- adapter dropout
P_DROP = 0.3


def test_lora_dense_equals_the_numpy_oracle_under_its_mask():
    """y = x W + s ((x * mask / (1 - p)) A) B in float64, with the mask the layer drew; the mask
    keeps a fraction 1 - p of the inputs (8,192 draws: 4 sigma is 0.02)."""
    from memaudit.models.flax_lora import dropout_mask, lora_dense

    r = np.random.default_rng(0)
    x = r.normal(size=(4, 32, 64)).astype(np.float32)  # (batch, seq, in)
    w = r.normal(size=(64, 48)).astype(np.float32)
    a, b = r.normal(size=(64, 4)).astype(np.float32), r.normal(size=(4, 48)).astype(np.float32)
    key, s = jax.random.key(5), 2.0
    got = np.asarray(jax.jit(lora_dense, static_argnums=(4, 5))(x, x @ w, a, b, s, P_DROP, key))
    mask = np.asarray(dropout_mask(key, P_DROP, x.shape))
    assert mask.dtype == bool and abs(mask.mean() - (1 - P_DROP)) < 0.02
    x64 = x.astype(np.float64)
    want = x64 @ w + s * (((x64 * mask / (1 - P_DROP)) @ a) @ b)
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-4)
    no_drop = x64 @ w + s * ((x64 @ a) @ b)
    assert np.abs(got - no_drop).max() > 1.0  # the mask matters at this size


def test_an_adapter_that_matches_no_layer_is_an_error_not_a_silent_no_op():
    import jax.numpy as jnp

    from memaudit.models.flax_llama import FlaxLlama, FlaxLlamaConfig
    from memaudit.models.flax_lora import LoraModel

    cfg = FlaxLlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=24, num_hidden_layers=1,
                          num_attention_heads=2, num_key_value_heads=1)
    model = FlaxLlama(cfg)
    base = jax.jit(model.init)(jax.random.key(0), jnp.zeros((1, 4), jnp.int32))["params"]
    ab = {"lora_A": np.ones((16, 2), np.float32), "lora_B": np.ones((2, 16), np.float32)}
    ids = jnp.zeros((1, 4), jnp.int32)
    lora = LoraModel(model, base, 2.0, dropout=P_DROP)
    # jitted (op by op, each operation compiles on its own); the check runs as the forward traces
    forward = jax.jit(lambda a: lora.apply({"params": a}, ids, dropout_rng=jax.random.key(1)))
    ok = {"model": {"layers": {"0": {"self_attn": {"q_proj": ab}}}}}
    assert forward(ok).shape == (1, 4, 32)
    bad = {"model": {"layers": {"0": {"self_attn": {"q_proj": ab, "qkv_proj": ab}}}}}
    with pytest.raises(ValueError, match="qkv_proj.*match no Dense"):
        forward(bad)


def _masks(adapters, flax_model, rng, ids):
    """Each adapted layer's mask, drawn as `LoraModel` documents: adapter i (in `adapter_paths`
    order) under fold_in(rng, i), of its input's shape (batch, seq, in)."""
    from memaudit.models.flax_lora import LORA_A, adapter_paths, dropout_mask

    out = {}
    for i, path in enumerate(adapter_paths(adapters)):
        node = adapters
        for k in path:
            node = node[k]
        shape = (*ids.shape, node[LORA_A].shape[0])
        out[".".join(path)] = np.asarray(dropout_mask(jax.random.fold_in(rng, i), flax_model.dropout, shape))
    return out


def test_flax_lora_dropout_forward_equals_peft_under_the_same_masks(pair):
    """The unmerged Flax forward with a dropout key equals peft's forward in which each layer's
    lora_dropout applies the same mask (x * mask / (1 - p)): dropout on the adapter input only."""
    import copy

    from memaudit.models.flax_lora import LoraModel

    peft_model, merged, adapters = pair
    flax = LoraModel(merged.model, merged.base, merged.scale, dropout=P_DROP)
    ids = _ids(seed=7)
    am = np.ones_like(ids)
    rng = jax.random.key(11)
    got = np.asarray(jax.jit(lambda a, i, m, k: flax.apply({"params": a}, i, m, dropout_rng=k))(adapters, ids, am, rng))

    class FixedMask(torch.nn.Module):
        def __init__(self, mask):
            super().__init__()
            self.mask = torch.tensor(mask, dtype=torch.float32)

        def forward(self, x):
            return x * self.mask / (1 - P_DROP)

    masks = _masks(adapters, flax, rng, ids)
    oracle = copy.deepcopy(peft_model)
    replaced = 0
    for name, module in oracle.named_modules():
        short = name.removeprefix("base_model.model.")
        if short in masks and hasattr(module, "lora_dropout"):
            module.lora_dropout["default"] = FixedMask(masks[short])
            replaced += 1
    assert replaced == len(masks) == 2 * 7
    with torch.no_grad():
        t_ids = torch.as_tensor(ids, dtype=torch.long)
        want = oracle(input_ids=t_ids, attention_mask=torch.as_tensor(am)).logits.numpy()
        plain = peft_model(input_ids=t_ids, attention_mask=torch.as_tensor(am)).logits.numpy()
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-5)
    assert np.abs(got - plain).max() > 1e-3  # and the masks change the function


def test_lora_without_a_key_or_without_dropout_is_the_merged_forward_bit_for_bit(pair):
    """Evaluation (no key) with dropout > 0, and a key with dropout 0, run the merged path: the
    logits and the loss are bit for bit those of LoRA without dropout."""
    from memaudit.federated.trainer import make_loss_fn
    from memaudit.models.flax_lora import LoraModel

    _, merged, adapters = pair
    drop = LoraModel(merged.model, merged.base, merged.scale, dropout=P_DROP)
    ids = _ids(seed=8)
    am = np.ones_like(ids)
    am[0, 15:] = 0
    key = jax.random.key(2)

    def logits(model, k=None):
        kw = {} if k is None else {"dropout_rng": k}
        return np.asarray(jax.jit(lambda a: model.apply({"params": a}, ids, am, **kw))(adapters))

    ref = logits(merged)
    np.testing.assert_array_equal(logits(drop), ref)
    np.testing.assert_array_equal(logits(merged, key), ref)
    assert not np.array_equal(logits(drop, key), ref)
    batch = {"input_ids": ids, "attention_mask": am}
    loss = jax.jit(lambda a: make_loss_fn(merged)(a, batch)[0])(adapters)
    loss_eval = jax.jit(lambda a: make_loss_fn(drop)(a, batch)[0])(adapters)
    np.testing.assert_array_equal(np.asarray(loss_eval), np.asarray(loss))


def test_fedsgd_with_dropout_equals_a_loop_over_the_clients_with_their_keys(pair):
    """FedSGD with loss_rng: the update is the gradient of the example-weighted mean of each
    client's loss under its own key, fold_in(k_i, DROPOUT_STREAM) with k_i the i-th split of the
    round key (an oracle looping over the clients). A round that ignored the keys, or drew the
    masks otherwise, would not match: the masks change the gradient far beyond the tolerance."""
    import optax

    from memaudit.federated import algorithms as alg
    from memaudit.federated.cohorts import ClientData
    from memaudit.federated.trainer import make_loss_fn
    from memaudit.models.flax_lora import LoraModel

    _, merged, adapters = pair
    flax = LoraModel(merged.model, merged.base, merged.scale, dropout=P_DROP)
    ids = _ids(seed=3, b=6, length=16).reshape(3, 2, 16)  # 3 clients x 2 sequences
    am = np.ones_like(ids)
    mask = np.array([[1, 1], [1, 0], [1, 1]], np.float32)
    jnp = jax.numpy
    data = ClientData({"input_ids": jnp.asarray(ids), "attention_mask": jnp.asarray(am)}, jnp.asarray(mask))
    loss_fn, key, eta = make_loss_fn(flax), jax.random.key(4), 0.5
    fed = alg.fedsgd(loss_fn, server_optimizer=optax.sgd(eta), loss_rng=True)
    got, _ = fed.round(fed.init(adapters), data, key)

    keys = jax.random.split(jax.random.key_data(key), 3)
    # the gradient of one client's loss under its own key; one program serves the three clients
    client_grad = jax.jit(jax.grad(lambda a, batch, m, rng: alg.masked_mean_loss(loss_fn, a, batch, m, rng=rng)))
    grads = [client_grad(adapters, {"input_ids": ids[i], "attention_mask": am[i]}, mask[i],
                         jax.random.fold_in(keys[i], alg.DROPOUT_STREAM)) for i in range(3)]

    def step(p, *g):  # the example-weighted mean of the clients' gradients
        return np.asarray(p) - eta * sum(mask[i].sum() * np.asarray(g[i]) for i in range(3)) / mask.sum()

    want = jax.tree.map(step, adapters, *grads)
    for g, w in zip(jax.tree.leaves(got.params), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=0, atol=1e-6)
    moved = jax.tree.map(lambda g, a: float(np.abs(np.asarray(g) - np.asarray(a)).max()), got.params, adapters)
    assert min(jax.tree.leaves(moved)) > 1e-5  # a real step (B starts moved, so every A and B has a gradient)


@pytest.fixture(scope="module")
def dropout_overrides(tmp_path_factory):
    """A small in-JAX LoRA run (12 users, cohort 4, 2 rounds of 2 local steps) with one shared
    tokenizer, so runs compare bit for bit."""
    from memaudit.data import prepare_data
    from memaudit.rundir import RunDir

    over = ["backend=federated", "data.synth.users=12", "data.synth.docs_per_user=3", "data.seq_len=32",
            "data.canaries.repetitions=[1]", "federated.rounds=2", "federated.cohort=4",
            "federated.sampling=fixed", "federated.local_steps=2", "federated.local_batch_size=2",
            "federated.server_optimizer=fedavg", "federated.client_lr=0.5", "federated.eval_every=10",
            "federated.checkpoint_every=1", "federated.mesh_clients=1", "train.batch_size=8",
            "train.eval_batches=1", "model.lora={rank: 4, alpha: 8, target_modules: [q_proj, v_proj]}"]
    scratch = RunDir(tmp_path_factory.mktemp("tok") / "run")
    prepare_data(load_config(None, over).data, scratch, vocab_size=VOCAB)
    return [*over, f"data.tokenizer={scratch.data_dir / 'tokenizer'}"]


def _adapter(run_path):
    from safetensors.numpy import load_file

    return load_file(str(run_path / "adapter" / "adapter_model.safetensors"))


def test_federated_lora_dropout_run_trains_repeats_resumes_and_differs_from_no_dropout(dropout_overrides,
                                                                                         tmp_path):
    """FedAvg LoRA with model.lora.dropout=0.1: every adapter moves and the base stays the
    initialisation bit for bit; a run interrupted after round 1 and resumed ends with the
    uninterrupted run's adapters bit for bit (the dropout keys are functions of the seed, the
    round, the client slot and the local step); the same run without dropout ends elsewhere."""
    from memaudit.federated.trainer import FederatedTrainer
    from memaudit.models.flax_lora import adapters_to_peft, initial_lora
    from memaudit.rundir import RunDir

    cfg = load_config(None, [*dropout_overrides, "model.lora.dropout=0.1"])
    run_trainer(FederatedTrainer(cfg, RunDir(tmp_path / "a")))

    def stop_after_one(done, total, info):
        if done == 1 and "round" in info:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        run_trainer(FederatedTrainer(cfg, RunDir(tmp_path / "b"), progress=stop_after_one))
    assert run_trainer(FederatedTrainer(cfg, RunDir(tmp_path / "b")), resume=True)["resumed_from_round"] == 1
    run_trainer(FederatedTrainer(load_config(None, [*dropout_overrides, "model.lora.dropout=0"]), RunDir(tmp_path / "c")))

    a, b, c = (_adapter(tmp_path / r) for r in "abc")
    assert set(a) == set(b) == set(c)
    assert all(np.array_equal(a[k], b[k]) for k in a)
    assert max(float(np.abs(a[k] - c[k]).max()) for k in a) > 1e-4
    _, start = initial_lora(cfg.model, VOCAB)
    for k, v in adapters_to_peft(start).items():
        assert not np.array_equal(a[k], v), k  # every A and B moved
    from transformers import AutoModelForCausalLM

    from memaudit.models.init import initial_model

    base = initial_model(cfg.model, VOCAB).state_dict()
    trained_base = AutoModelForCausalLM.from_pretrained(str(tmp_path / "a" / "adapter" / "base")).float()
    for k, v in trained_base.state_dict().items():
        assert torch.equal(v, base[k]), k
