"""LoRA on the centralized backend against independent oracles: a plain peft + torch step, the
frozen base bit for bit, Opacus' per-sample gradients and a per-example loop, both exports."""

from __future__ import annotations

import json
import warnings

import pytest
import torch

from memaudit.config import LoraConfig, load_config
from memaudit.errors import ConfigError
from memaudit.io import read_json
from memaudit.models.lora import apply_lora
from memaudit.rundir import RunDir
from memaudit.train.ghost import GhostClipper, vmap_clipped_sum
from memaudit.train.losses import causal_lm_loss_per_example
from tests.conftest import REPO_ROOT, TINY_TRAIN_OVERRIDES
from tests.train.test_dpsgd import _batch, _model
from tests.train.test_trainer import _copy_prepared

ALL = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


# ----------------------------------------------------------------------------- bad input
@pytest.mark.parametrize("override,needle", [
    ("model.lora.rank=0", "model.lora.rank=0 must be >= 1"),
    ("model.lora.target_modules=[q_proj,qkv]", "no module 'qkv'"),
])
def test_bad_lora_config_is_one_line(override, needle):
    with pytest.raises(ConfigError, match=needle) as e:
        load_config(None, [override])
    assert "\n" not in str(e.value)


def test_rank_above_the_smaller_dimension_is_refused():
    from memaudit.run.checks import check_before_disk

    # tiny: k_proj is 128 -> 64 (2 kv heads of 64), so r = 65 fits q_proj but not k_proj
    check_before_disk(load_config(None, ["model.lora.rank=65", "model.lora.target_modules=[q_proj]"]))
    with pytest.raises(ConfigError, match=r"rank=65 exceeds k_proj's smaller dimension 64") as e:
        check_before_disk(load_config(None, ["model.lora.rank=65", "model.lora.target_modules=[q_proj,k_proj]"]))
    assert "\n" not in str(e.value)


def test_flower_lora_runs_where_the_base_fits_one_message_and_says_why_not_above():
    from memaudit.run.checks import check_before_disk

    fed = ["backend=federated", "federated.runtime=flower", "model.lora.rank=4", "model.lora.dropout=0"]
    check_before_disk(load_config(None, fed))  # tiny: the 7 MB base rides in the stage module
    with pytest.raises(ConfigError, match=r"frozen base inside each client stage \(4\.\d GiB in float32\), over "
                       "the 2 GiB") as e:
        check_before_disk(load_config(None, [*fed, "model.preset=1b"]))
    assert "\n" not in str(e.value)


def test_lora_dropout_is_accepted_on_both_backends_and_on_the_grid():
    """Adapter dropout runs on the federated backend (in JAX and on Flower) and centralized, in one
    process and on the tensor-parallel grid (refused there before: its masks are now keyed by
    each element's place in the global batch, `memaudit.models.keyed_dropout`)."""
    from memaudit.run.checks import check_before_disk

    for runtime in ("jax", "flower"):
        check_before_disk(load_config(None, ["backend=federated", f"federated.runtime={runtime}",
                                             "model.lora.rank=4", "model.lora.dropout=0.1"]))
    for grid in ((), ("parallel.x=2",), ("parallel.y=2", "parallel.z=2")):
        check_before_disk(load_config(None, ["model.lora.rank=4", "model.lora.dropout=0.1", *grid]))


def test_init_from_an_adapter_says_merge_or_name_its_base(tmp_path):
    from memaudit.run.checks import check_before_disk

    (tmp_path / "adapter_config.json").write_text(json.dumps({"base_model_name_or_path": "x"}))
    with pytest.raises(ConfigError, match="is a PEFT adapter.*merge it.*its base model"):
        check_before_disk(load_config(None, [f"model.init_from={tmp_path}", "model.lora.rank=4"]))


# ----------------------------------------------------------------------------- training runs
def _lora_cfg(tiny_run, *extra):
    manifest = read_json(tiny_run["path"] / "run.json")
    return load_config(REPO_ROOT / "configs" / "tiny.yaml", [
        *TINY_TRAIN_OVERRIDES, f"data.path={manifest['config']['data']['path']}", "train.device=cpu",
        "train.eval_every=100", "train.checkpoint_every=100", "model.lora.rank=4",
        "model.lora.alpha=8", *extra])


def _run(tiny_run, tmp_path, name, *extra):
    from memaudit.run.centralized import train_centralized

    run = RunDir(tmp_path / name)
    _copy_prepared(tiny_run["path"], run.path)
    cfg = _lora_cfg(tiny_run, *extra)
    return cfg, run, train_centralized(cfg, run)


def _load(path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(path)).float()


def test_one_step_merged_model_equals_a_plain_peft_torch_step(tiny_run, tmp_path):
    """memaudit's exported merged model after one step = get_peft_model + AdamW by hand (1e-6)."""
    from peft import LoraConfig as PeftLoraConfig
    from peft import get_peft_model

    from memaudit.data import load_prepared
    from memaudit.models.init import initial_model, model_vocab_size
    from memaudit.train.batches import EpochBatches

    cfg, run, res = _run(tiny_run, tmp_path, "one", "train.steps=1", "train.warmup_steps=0",
                         "train.grad_clip=null", "model.lora.target_modules=[q_proj,v_proj,down_proj]")
    prepared = load_prepared(run)
    rows = EpochBatches(len(prepared.train), cfg.train.batch_size, cfg.train.seed).indices(0)
    ids = torch.as_tensor(prepared.train.input_ids[rows], dtype=torch.long)
    am = torch.as_tensor(prepared.train.attention_mask[rows], dtype=torch.long)
    labels = ids.masked_fill(am == 0, -100)

    base = initial_model(cfg.model, model_vocab_size(cfg.model))
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(cfg.model.init_seed)
        oracle = get_peft_model(base, PeftLoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, task_type="CAUSAL_LM",
                                                     target_modules=["q_proj", "v_proj", "down_proj"]))
    trainable = [p for p in oracle.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(trainable, lr=cfg.train.lr, betas=cfg.train.betas, weight_decay=0.0)
    oracle.train()
    oracle(input_ids=ids, attention_mask=am, labels=labels).loss.backward()
    opt.step()
    want = oracle.merge_and_unload().state_dict()
    got = _load(run.model_dir).state_dict()
    assert set(got) == set(want)
    for k, v in want.items():
        torch.testing.assert_close(got[k], v, rtol=0, atol=1e-6, msg=k)
    man = read_json(run.manifest_path)["result"]
    assert man["trained"] == "lora(r=4, q_proj,v_proj,down_proj)"
    # (A 4 x d_in + B d_out x 4) per targeted layer, 4 layers
    per_layer = 4 * (128 + 128) + 4 * (128 + 64) + 4 * (352 + 128)
    assert man["trained_parameters"] == 4 * per_layer
    assert man["trained_parameters"] + man["frozen_parameters"] == res["parameters"]


def test_dp_lora_keeps_the_base_bit_identical_and_moves_both_adapters(tiny_run, tmp_path):
    """Three user-level DP-SGD steps (ULS; the example level is the same clipper with groups of
    one): the frozen base is the initialisation bit for bit, A and B both moved (opacus #820:
    adapters silently not updated under DP), and both exports are one model that probes load."""
    from peft import PeftModel

    from memaudit.models.init import initial_model
    from memaudit.probes.sources import load_model, resolve_model

    cfg, run, _ = _run(tiny_run, tmp_path, "dp", "train.steps=3", "train.warmup_steps=0",
                         "privacy.noise_multiplier=0.5", "privacy.clip=1.0", "privacy.unit=user",
                         "privacy.max_examples_per_user=2", "privacy.reproducible_randomness=true",
                         "privacy.delta=1e-4", f"model.lora.target_modules=[{','.join(ALL)}]")
    assert read_json(run.privacy_path)["unit"] == "user"
    start = initial_model(cfg.model, 4096).state_dict()
    base_dir = run.path / "adapter" / "base"
    for k, v in _load(base_dir).state_dict().items():
        assert torch.equal(v, start[k]), k  # the frozen base, bit for bit
    adapter = PeftModel.from_pretrained(_load(base_dir), str(run.path / "adapter"))
    init = apply_lora(initial_model(cfg.model, 4096), LoraConfig(rank=4, alpha=8, target_modules=ALL), seed=0)
    init_sd = dict(init.named_parameters())
    moved = {k: not torch.equal(p, init_sd[k]) for k, p in adapter.named_parameters() if "lora_" in k}
    assert len(moved) == 2 * len(ALL) * 4 and all(moved.values()), [k for k, m in moved.items() if not m]
    # the two exports are the same model, and the probes load either
    ids = torch.randint(0, 4096, (2, 16), generator=torch.Generator().manual_seed(0))
    merged = _load(run.model_dir).eval()
    src = resolve_model(run.path / "adapter")
    assert src.kind == "adapter" and src.base.path == base_dir.resolve()
    with torch.no_grad():
        want = merged(input_ids=ids).logits
        torch.testing.assert_close(adapter.eval()(input_ids=ids).logits, want, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(load_model(src)(input_ids=ids).logits, want, rtol=1e-5, atol=1e-5)


# ----------------------------------------------------------------------------- per-example gradients
def _lora_model(targets=ALL):
    model = apply_lora(_model(), LoraConfig(rank=3, alpha=6, target_modules=targets), seed=0)
    with torch.no_grad():  # B starts at 0 (A's gradient would be 0): move it
        g = torch.Generator().manual_seed(5)
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.copy_(0.3 * torch.randn(p.shape, generator=g))
    return model


def _per_example_loop(model, ids, attn, lmask):
    """Brute force: one backward per example, adapter gradients only."""
    params = {n: p for n, p in model.named_parameters() if p.requires_grad}
    out = {n: [] for n in params}
    for i in range(ids.shape[0]):
        logits = model(input_ids=ids[i:i + 1], attention_mask=attn[i:i + 1], use_cache=False).logits
        loss = causal_lm_loss_per_example(logits, ids[i:i + 1], lmask[i:i + 1])[0]
        for n, g in zip(params, torch.autograd.grad(loss, list(params.values())), strict=True):
            out[n].append(g.double())
    return {n: torch.stack(v) for n, v in out.items()}


def test_clipped_adapter_gradients_equal_opacus_and_a_per_example_loop():
    import opacus  # the dev extra installs it: missing is a failure
    model = _lora_model()
    ids, attn, lmask = _batch()
    loop = _per_example_loop(model, ids, attn, lmask)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        gsm = opacus.GradSampleModule(model, loss_reduction="sum")
        logits = gsm(input_ids=ids, attention_mask=attn, use_cache=False).logits
        causal_lm_loss_per_example(logits, ids, lmask).sum().backward()
    per = {n: p.grad_sample.detach().double() for n, p in model.named_parameters() if p.requires_grad}
    gsm._close()
    assert not any(p.grad is not None for n, p in model.named_parameters() if not p.requires_grad)
    model.zero_grad(set_to_none=True)
    for p in model.parameters():
        p.grad_sample = None
    assert set(per) == set(loop) and len(per) == 2 * len(ALL) * 2
    for n, g in loop.items():
        torch.testing.assert_close(per[n], g, rtol=1e-5, atol=1e-7, msg=f"opacus vs loop: {n}")
    norms = torch.sqrt(sum(g.flatten(1).pow(2).sum(1) for g in loop.values()))  # (B,)
    clip = float(norms.median())
    assert (norms > clip).any() and (norms < clip * 0.999).any()
    factor = (clip / (norms + 1e-6)).clamp(max=1.0)
    for name, res in (("ghost", GhostClipper(model).clipped_sum(ids, attn, lmask, clip)),
                      ("vmap", vmap_clipped_sum(model, ids, attn, lmask, clip))):
        assert set(res.grads) == set(loop), name  # adapters only: nothing of the frozen base
        torch.testing.assert_close(res.norms.double(), norms, rtol=1e-5, atol=1e-8, msg=f"{name} norms")
        for n, g in per.items():
            want = torch.einsum("b,b...->...", factor, g)
            torch.testing.assert_close(res.grads[n].double(), want, rtol=1e-5, atol=1e-7, msg=f"{name}: {n}")


def test_user_level_clipped_adapter_gradients_equal_a_per_user_loop():
    """ULS: a user's (g consecutive rows') summed adapter gradient is the clipped unit."""
    model = _lora_model(("q_proj", "v_proj", "down_proj"))
    ids, attn, lmask = _batch(b=6)
    lmask[5] = False  # a user's padding row: no target
    loop = _per_example_loop(model, ids, attn, lmask)
    users = {n: g.reshape(3, 2, *g.shape[1:]).sum(1) for n, g in loop.items()}
    norms = torch.sqrt(sum(g.flatten(1).pow(2).sum(1) for g in users.values()))  # (3,)
    clip = float(norms.median())
    factor = (clip / (norms + 1e-6)).clamp(max=1.0)
    res = GhostClipper(model).clipped_sum(ids, attn, lmask, clip, group_size=2)
    torch.testing.assert_close(res.norms.double(), norms, rtol=1e-5, atol=1e-8)
    for n, g in users.items():
        torch.testing.assert_close(res.grads[n].double(), torch.einsum("b,b...->...", factor, g),
                                   rtol=1e-5, atol=1e-7, msg=n)
