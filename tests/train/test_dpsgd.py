"""DP-SGD: limit case, ghost vs vmap oracle, clipping, noise statistics, resume."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st
from transformers import LlamaConfig, LlamaForCausalLM

from memaudit.privacy.randomness import DPRandomness
from memaudit.train.dpsgd import DPSGD
from memaudit.train.ghost import GhostClipper, vmap_clipped_sum
from memaudit.train.losses import causal_lm_loss, causal_lm_loss_per_example

VOCAB = 61


def _model(*, bias: bool = False, tie: bool = False, seed: int = 0) -> LlamaForCausalLM:
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                      tie_word_embeddings=tie, attention_bias=bias, mlp_bias=bias,
                      bos_token_id=None, eos_token_id=None, pad_token_id=None)
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(seed)
    model = LlamaForCausalLM(cfg).float()
    with torch.no_grad():  # RMSNorm weights start at 1; move them so their gradients are generic
        for n, p in model.named_parameters():
            if "norm" in n:
                p.add_(0.1 * torch.randn_like(p))
    return model


def _batch(b: int = 5, length: int = 14, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (b, length), generator=g)
    ids[0, 3:9] = ids[0, 2]  # repeated token ids: the embedding rows add up
    attn = torch.ones(b, length, dtype=torch.long)
    if b > 2:
        attn[1, 9:] = 0  # right padding
        attn[2, 4:] = 0
    lmask = attn.bool().clone()
    lmask[-1, 5:8] = False  # a goldfish-style hole
    return ids, attn, lmask


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    """These matrices are tiny: one thread avoids OpenMP spin-waits on a busy machine."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def model():
    return _model()


@pytest.fixture(scope="module")
def batch():
    return _batch()


def test_per_example_loss_matches_loop():
    torch.manual_seed(0)
    logits = torch.randn(3, 6, 11)
    ids = torch.randint(0, 11, (3, 6))
    mask = torch.rand(3, 6) > 0.3
    mask[:, 1] = True
    per = causal_lm_loss_per_example(logits, ids, mask)
    tot, cnt = 0.0, 0
    for i in range(3):
        terms = [-torch.log_softmax(logits[i, t - 1], -1)[ids[i, t]] for t in range(1, 6) if mask[i, t]]
        assert per[i].item() == pytest.approx(torch.stack(terms).mean().item(), rel=1e-5)
        tot, cnt = tot + torch.stack(terms).sum().item(), cnt + len(terms)
    assert causal_lm_loss(logits, ids, mask).item() == pytest.approx(tot / cnt, rel=1e-5)


@pytest.mark.parametrize("norm_mode,keep", [("gram", 0), ("materialize", 2**28), ("materialize", 0),
                                            ("auto", 2**28)])
@pytest.mark.parametrize("bias", [False, True])
def test_ghost_matches_vmap_every_layer(norm_mode, keep, bias, batch):
    model = _model(bias=bias)
    ids, attn, lmask = batch
    clip = 0.7
    clipper = GhostClipper(model, norm_mode=norm_mode, keep_budget=keep)
    ghost = clipper.clipped_sum(ids, attn, lmask, clip, return_param_norms=True)
    ref = vmap_clipped_sum(model, ids, attn, lmask, clip, return_param_norms=True)
    assert set(ghost.grads) == set(ref.grads) == {n for n, _ in model.named_parameters()}
    kinds = set()
    for name in ref.grads:
        kinds.add(name.split(".")[-2] if "layers" in name else name)
        torch.testing.assert_close(ghost.param_sq_norms[name].float(), ref.param_sq_norms[name],
                                   rtol=1e-4, atol=1e-9, msg=f"per-example norm of {name}")
        torch.testing.assert_close(ghost.grads[name], ref.grads[name], rtol=1e-4, atol=1e-7,
                                   msg=f"clipped sum of {name}")
    # every Llama layer type took part: q,k,v,o, gate,up,down, both norms, embed, final norm, head
    assert {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj",
            "input_layernorm", "post_attention_layernorm", "model.embed_tokens.weight",
            "model.norm.weight", "lm_head.weight"} <= kinds
    torch.testing.assert_close(ghost.norms, ref.norms, rtol=1e-5, atol=1e-7)
    assert (ghost.norms > clip).any() and (ghost.norms < 50).all()
    assert all(p.grad is None for p in model.parameters())  # ghost leaves .grad alone


def test_embedding_norm_against_dense_oracle(model, batch):
    """The scatter-add embedding norm equals the norm of the dense per-example gradient."""
    ids, attn, lmask = batch
    ghost = GhostClipper(model).clipped_sum(ids, attn, lmask, math.inf, return_param_norms=True)
    for i in range(ids.shape[0]):
        model.zero_grad()
        logits = model(input_ids=ids[i:i + 1], attention_mask=attn[i:i + 1]).logits
        causal_lm_loss_per_example(logits, ids[i:i + 1], lmask[i:i + 1]).sum().backward()
        dense = model.model.embed_tokens.weight.grad.pow(2).sum()
        assert ghost.param_sq_norms["model.embed_tokens.weight"][i].item() == pytest.approx(dense.item(), rel=1e-4)
    model.zero_grad(set_to_none=True)


@pytest.mark.parametrize("mode", ["ghost", "vmap"])
def test_limit_case_equals_sgd(mode, model, batch):
    """C = inf, σ = 0: the DP gradient is Σ_i ∇ℓ_i / E, the plain SGD gradient."""
    ids, attn, lmask = batch
    expected = 7.0
    dp = DPSGD(model, clip=math.inf, noise_multiplier=0.0, expected_batch_size=expected, mode=mode)
    stats = dp.step_gradients(ids, attn, lmask)
    got = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    logits = model(input_ids=ids, attention_mask=attn).logits
    (causal_lm_loss_per_example(logits, ids, lmask).sum() / expected).backward()
    for n, p in model.named_parameters():
        torch.testing.assert_close(got[n], p.grad, rtol=1e-4, atol=1e-7, msg=n)
    model.zero_grad(set_to_none=True)
    assert stats["clip_fraction"] == 0.0 and stats["batch_size"] == 5 and stats["noise_std"] == 0.0


def test_micro_batches_match_one_batch(model, batch):
    ids, attn, lmask = batch
    full = DPSGD(model, clip=0.5, noise_multiplier=0.0, expected_batch_size=4)
    s1 = full.step_gradients(ids, attn, lmask)
    g1 = {n: p.grad.clone() for n, p in model.named_parameters()}
    micro = DPSGD(model, clip=0.5, noise_multiplier=0.0, expected_batch_size=4, micro_batch_size=2)
    s2 = micro.step_gradients(ids, attn, lmask)
    for n, p in model.named_parameters():
        torch.testing.assert_close(g1[n], p.grad, rtol=1e-5, atol=1e-7)
    assert s1["loss"] == pytest.approx(s2["loss"]) and s1["clip_fraction"] == s2["clip_fraction"]
    assert 0 < s1["clip_fraction"] <= 1
    model.zero_grad(set_to_none=True)


@settings(max_examples=6, deadline=None)
@given(seed=st.integers(0, 10_000), b=st.integers(1, 4), clip_frac=st.floats(0.001, 0.09),
       scale=st.floats(1e2, 1e4))
@example(seed=581, b=1, clip_frac=0.0625, scale=100.0)  # once gave a zero norm (see docstring)
def test_clipping_bounds_each_contribution(model, seed, b, clip_frac, scale):
    """σ = 0 and one example with a huge gradient: its contribution has norm ≤ C.

    C is drawn as a fraction of that example's unclipped norm, so the gradient is huge
    relative to C whatever the drawn batch (softmax caps how large the norm itself gets).
    The target of example 0 at position 2 is made very unlikely by pointing its output row
    against that position's final hidden state (logit = -scale * |h|), so the norm is never
    0. (Subtracting a constant from the row instead moves the logit by -scale * sum(h), whose
    sign depends on the batch: it can make the target certain and the gradient exactly 0.)
    """
    ids, attn, lmask = _batch(b=b, length=8, seed=seed)
    head = model.lm_head.weight
    saved = head.detach().clone()
    with torch.no_grad():
        h = model.model(input_ids=ids[:1], attention_mask=attn[:1]).last_hidden_state[0, 2]
        head[ids[0, 3]] = -scale * h / h.norm()
    try:
        res = GhostClipper(model).clipped_sum(ids, attn, lmask, math.inf)
        clip = clip_frac * float(res.norms[0])
        dp = DPSGD(model, clip=clip, noise_multiplier=0.0, expected_batch_size=1.0)
        dp.step_gradients(ids[:1], attn[:1], lmask[:1])
        alone = torch.sqrt(sum(p.grad.pow(2).sum() for p in model.parameters()))
        assert res.norms[0] > 10 * clip  # the gradient really is huge
        assert alone.item() <= clip * (1 + 1e-4)
        total = dp.step_gradients(ids, attn, lmask)
        all_norm = torch.sqrt(sum(p.grad.pow(2).sum() for p in model.parameters()))
        assert all_norm.item() <= b * clip * (1 + 1e-4)  # triangle inequality over b contributions
        assert total["clip_fraction"] >= 1 / b
    finally:
        with torch.no_grad():
            head.copy_(saved)
        model.zero_grad(set_to_none=True)


def test_noise_std_with_zero_gradients(model):
    """Empty batch (zero gradients), SGD at lr 1: update std = σC/E within 2 %."""
    sigma, clip, expected = 1.3, 0.8, 16.0
    dp = DPSGD(model, clip=clip, noise_multiplier=sigma, expected_batch_size=expected, randomness=DPRandomness.from_seed(123))
    before = [p.detach().clone() for p in model.parameters()]
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    ids = torch.zeros(0, 8, dtype=torch.long)
    stats = dp.step_gradients(ids, torch.ones_like(ids), torch.ones_like(ids, dtype=torch.bool))
    opt.step()
    update = torch.cat([(b - p.detach()).flatten() for b, p in zip(before, model.parameters())])
    with torch.no_grad():
        for b, p in zip(before, model.parameters()):
            p.copy_(b)
    model.zero_grad(set_to_none=True)
    n = update.numel()
    want = sigma * clip / expected
    # the sample std of n normals has relative sd 1/sqrt(2n) = 0.5 % here; 3 % is 6 of those
    assert n > 15_000
    assert update.std().item() == pytest.approx(want, rel=0.03)
    assert abs(update.mean().item()) < 5 * want / math.sqrt(n)
    assert stats == {"loss": stats["loss"], "clip_fraction": 0.0, "batch_size": 0, "noise_std": want}
    assert math.isnan(stats["loss"])


def test_noise_resume_is_exact(model, batch):
    ids, attn, lmask = batch
    a = DPSGD(model, clip=1.0, noise_multiplier=1.0, expected_batch_size=5, )
    a.step_gradients(ids, attn, lmask)
    state = a.state_dict()
    a.step_gradients(ids, attn, lmask)
    want = [p.grad.clone() for p in model.parameters()]
    b = DPSGD(model, clip=1.0, noise_multiplier=1.0, expected_batch_size=5, )
    b.load_state_dict(state)
    b.step_gradients(ids, attn, lmask)
    for w, p in zip(want, model.parameters()):
        torch.testing.assert_close(w, p.grad, rtol=1e-6, atol=1e-7)
    c = DPSGD(model, clip=1.0, noise_multiplier=1.0, expected_batch_size=5, )
    c.step_gradients(ids, attn, lmask)  # fresh OS entropy: different noise
    assert not torch.allclose(want[0], model.model.embed_tokens.weight.grad)
    with pytest.raises(ValueError, match="noise_multiplier"):
        DPSGD(model, clip=1.0, noise_multiplier=2.0, expected_batch_size=5).load_state_dict(state)
    model.zero_grad(set_to_none=True)


def test_bad_settings_and_tied_weights(model):
    with pytest.raises(ValueError, match="clip"):
        DPSGD(model, clip=0.0, noise_multiplier=1.0, expected_batch_size=4)
    with pytest.raises(ValueError, match="noise multiplier"):
        DPSGD(model, clip=1.0, noise_multiplier=-1.0, expected_batch_size=4)
    with pytest.raises(ValueError, match="finite clip"):
        DPSGD(model, clip=math.inf, noise_multiplier=1.0, expected_batch_size=4)
    ckpt = _model()
    ckpt.activation_checkpointing_enable()
    with pytest.raises(ValueError, match="activation checkpointing"):
        DPSGD(ckpt, clip=1.0, noise_multiplier=1.0, expected_batch_size=4)
    tied = _model(tie=True)
    with pytest.raises(ValueError, match="tie_word_embeddings"):
        DPSGD(tied, clip=1.0, noise_multiplier=1.0, expected_batch_size=4)
    # the vmap reference handles tied weights: the limit case still holds
    ids, attn, lmask = _batch(b=3)
    dp = DPSGD(tied, clip=math.inf, noise_multiplier=0.0, expected_batch_size=3, mode="vmap")
    dp.step_gradients(ids, attn, lmask)
    got = tied.lm_head.weight.grad.clone()
    tied.zero_grad(set_to_none=True)
    logits = tied(input_ids=ids, attention_mask=attn).logits
    (causal_lm_loss_per_example(logits, ids, lmask).sum() / 3).backward()
    torch.testing.assert_close(got, tied.lm_head.weight.grad, rtol=1e-4, atol=1e-7)


def _loop_per_example(model, ids, attn, lmask):
    """Oracle: one ordinary forward/backward per example, model as configured."""
    out = []
    for i in range(ids.shape[0]):
        model.zero_grad(set_to_none=True)
        logits = model(input_ids=ids[i:i + 1], attention_mask=attn[i:i + 1], use_cache=False).logits
        causal_lm_loss_per_example(logits, ids[i:i + 1], lmask[i:i + 1]).sum().backward()
        out.append({n: p.grad.detach().clone() for n, p in model.named_parameters()})
    model.zero_grad(set_to_none=True)
    return out


@pytest.mark.parametrize("attn_impl", ["eager", "sdpa"])
def test_vmap_reference_is_right_under_eager_and_sdpa(attn_impl, batch):
    """The vmap path once passed a boolean 4D mask that eager attention added as 0/1 (no causal mask)."""
    model = _model()
    model.config._attn_implementation = attn_impl
    ids, attn, lmask = batch
    ref = vmap_clipped_sum(model, ids, attn, lmask, math.inf, return_param_norms=True)
    loop = _loop_per_example(model, ids, attn, lmask)
    for name in ref.grads:
        want = torch.stack([g[name] for g in loop]).sum(0)
        torch.testing.assert_close(ref.grads[name], want, rtol=1e-4, atol=1e-6, msg=f"{attn_impl}: {name}")
    want_norms = torch.stack([torch.sqrt(sum(g.double().pow(2).sum() for g in d.values())) for d in loop])
    torch.testing.assert_close(ref.norms.double(), want_norms, rtol=1e-4, atol=1e-8)


@pytest.mark.parametrize("mode", ["ghost", "vmap"])
def test_bf16_autocast_clipped_gradients_within_clip(mode):
    """Under bf16 autocast every clipped per-example gradient has a float64 norm <= C (1 + 1e-6)."""
    model = _model()
    ids, attn, lmask = _batch(b=6, length=12, seed=4)
    clip = 0.05  # far below the gradient norms: every example is clipped
    fn = (lambda *a: GhostClipper(model).clipped_sum(*a, clip)) if mode == "ghost" else \
        (lambda *a: vmap_clipped_sum(model, *a, clip))
    worst = 0.0
    with torch.autocast("cpu", dtype=torch.bfloat16):
        for i in range(ids.shape[0]):
            res = fn(ids[i:i + 1], attn[i:i + 1], lmask[i:i + 1])
            norm = math.sqrt(sum(float(g.double().pow(2).sum()) for g in res.grads.values()))
            assert float(res.norms[0]) > clip
            worst = max(worst, norm / clip)
    assert worst <= 1 + 1e-6, f"clipped per-example norm reached {worst:.6f} C"


def test_measured_noise_and_sensitivity_give_an_epsilon_within_the_ledger(model, batch):
    """DP-SGD measured: noise std on an empty batch, sensitivity of one example present vs absent
    (σ = 0, so the difference is that example's clipped gradient), ε from dp_accounting."""
    from dp_accounting import dp_event
    from dp_accounting.rdp import RdpAccountant

    from memaudit.privacy.accounting import RDP_ORDERS
    from memaudit.privacy.ledger import PrivacyLedger

    sigma, clip, expected, n, steps = 1.1, 0.3, 4.0, 200, 300

    def summed(dp, ids, attn, lmask):
        dp.step_gradients(ids, attn, lmask)
        out = torch.cat([p.grad.flatten().double() for p in model.parameters()]) * expected
        model.zero_grad(set_to_none=True)
        return out

    noisy = DPSGD(model, clip=clip, noise_multiplier=sigma, expected_batch_size=expected, population=n)
    empty = torch.zeros(0, 8, dtype=torch.long)
    noise = summed(noisy, empty, torch.ones_like(empty), torch.ones_like(empty, dtype=torch.bool))
    std = float(noise.std()) * (1 + 4 / math.sqrt(2 * noise.numel())) / clip
    quiet = DPSGD(model, clip=clip, noise_multiplier=0.0, expected_batch_size=expected)
    ids, attn, lmask = batch
    full = summed(quiet, ids, attn, lmask)
    sens = max(float((full - summed(quiet, torch.cat([ids[:i], ids[i + 1:]]), torch.cat([attn[:i], attn[i + 1:]]),
                                    torch.cat([lmask[:i], lmask[i + 1:]]))).norm()) for i in range(ids.shape[0]))
    sens /= clip
    assert 0.9 < sens <= 1 + 1e-5  # the clipped examples move the sum by (almost exactly) C
    acc = RdpAccountant(list(RDP_ORDERS))
    acc.compose(dp_event.PoissonSampledDpEvent(expected / n, dp_event.GaussianDpEvent(std / sens)), steps)
    led = PrivacyLedger(unit="example", delta=1e-5)
    led.record_mechanism(noisy.mechanism, steps=steps)
    assert acc.get_epsilon(1e-5) <= led.epsilon("rdp") + 1e-3
