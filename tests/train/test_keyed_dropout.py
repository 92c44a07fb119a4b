"""Keyed adapter dropout: the mask against a scalar re-implementation of its hash, its rate, its
slices (what a grid's shard and a micro-batch draw), and a LoRA run that trains the same adapters
at any micro-batch size, with and without DP-SGD."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from memaudit.io import read_json
from memaudit.models.keyed_dropout import (
    KeyedDropout,
    dropout_rows,
    dropout_step,
    keep_mask,
    layer_key,
    step_key,
)

M32 = 0xFFFFFFFF


def _mix(x: int) -> int:  # Wang-Mueller, in Python integers
    x &= M32
    x = (((x >> 16) ^ x) * 0x45D9F3B) & M32
    x = (((x >> 16) ^ x) * 0x45D9F3B) & M32
    return (x >> 16) ^ x


def _kept(step: int, layer: int, p: float, r: int, t: int, f: int) -> bool:
    h = _mix(step ^ layer)
    return _mix(_mix(_mix(h + r) + t) + f) >= int(p * 2**32)


def test_the_mask_is_the_hash_of_each_place_and_drops_at_its_rate():
    k, lay, p = step_key(3, 7), layer_key("model.layers.1.self_attn.q_proj"), 0.3
    mask = keep_mask(k, lay, p, (6, 40, 64))
    rng = np.random.default_rng(0)
    for r, t, f in zip(rng.integers(0, 6, 300), rng.integers(0, 40, 300), rng.integers(0, 64, 300), strict=True):
        assert bool(mask[r, t, f]) == _kept(k, lay, p, int(r), int(t), int(f))
    n = mask.numel()
    dropped = n - int(mask.sum())
    assert abs(dropped - p * n) < 4 * math.sqrt(n * p * (1 - p)), (dropped, p * n)
    # keys: another step or layer draws another mask; the same key the same one
    assert torch.equal(mask, keep_mask(k, lay, p, (6, 40, 64)))
    assert not torch.equal(mask, keep_mask(step_key(3, 8), lay, p, (6, 40, 64)))
    assert not torch.equal(mask, keep_mask(k, layer_key("model.layers.1.self_attn.v_proj"), p, (6, 40, 64)))
    assert not torch.equal(mask, keep_mask(step_key(4, 7), lay, p, (6, 40, 64)))


def test_a_shard_or_a_micro_batch_draws_its_slice_of_the_full_mask():
    k, lay, p = step_key(0, 1), 12345, 0.5
    full = keep_mask(k, lay, p, (8, 5, 12))
    for rows in ((0, 8), (2, 5), (6, 8)):
        for feats in ((0, 12), (4, 8), (6, 12)):
            part = keep_mask(k, lay, p, (rows[1] - rows[0], 5, feats[1] - feats[0]),
                             first_row=rows[0], first_feature=feats[0])
            assert torch.equal(part, full[rows[0]:rows[1], :, feats[0]:feats[1]]), (rows, feats)
    # a 2-D input (rows, features) and a 4-D one (positions flattened) follow the same rule
    assert torch.equal(keep_mask(k, lay, p, (8, 12)), keep_mask(k, lay, p, (8, 1, 12)).reshape(8, 12))
    assert torch.equal(keep_mask(k, lay, p, (8, 5, 1, 12)).reshape(8, 5, 12), full)


def test_keyed_dropout_scales_what_it_keeps_and_outside_a_step_is_torch_dropout():
    d = KeyedDropout(0.25, layer_key=9).train()
    x = torch.randn(4, 3, 16)
    with dropout_step(d, seed=1, step=0):
        y = d(x)
        with dropout_rows(d, 2):
            y2 = d(x[2:])
    keep = keep_mask(step_key(1, 0), 9, 0.25, (4, 3, 16))
    torch.testing.assert_close(y, x * keep / 0.75, rtol=1e-6, atol=0)
    assert torch.equal(y2, y[2:])
    assert d.key.step is None and d.key.first_row == 0  # the step's key is gone after it
    assert torch.equal(d.eval()(x), x)
    d.train()
    torch.manual_seed(0)
    a = d(x)
    torch.manual_seed(0)
    assert torch.equal(a, torch.nn.functional.dropout(x, 0.25, True))  # nn.Dropout's behaviour
    with pytest.raises(RuntimeError, match="needs the step's key"):
        d(x, grid=True)
    with dropout_step(d, seed=1, step=0), pytest.raises(ValueError, match="no per-example vmap form"):
        torch.func.vmap(d)(x)
    with pytest.raises(ValueError, match="must be in"):
        KeyedDropout(1.0, layer_key=0)


def _adapters(run):
    from safetensors.torch import load_file

    return load_file(str(run.path / "adapter" / "adapter_model.safetensors"))


@pytest.mark.parametrize("private", [False, True], ids=["plain", "dpsgd"])
def test_a_lora_run_with_dropout_trains_the_same_adapters_at_any_micro_batch_size(tiny_run, tmp_path, private):
    """Two runs of the same config with adapter dropout, the batch of 8 in one pass and in
    micro-batches of 3, end with the same adapters (the masks follow the rows, not the passes);
    the run without dropout ends elsewhere, so the dropout was applied. Under DP-SGD (ghost
    clipping, sigma = 0) the per-example norms see the dropped inputs: the clip counts agree."""
    from tests.train.test_lora import _run

    dp = ("privacy.noise_multiplier=0", "privacy.clip=0.05", "privacy.reproducible_randomness=true") if private else ()
    common = ("train.steps=2", "train.warmup_steps=0", "model.lora.target_modules=[q_proj,o_proj,down_proj]", *dp)
    runs = {}
    for name, extra in (("whole", ("model.lora.dropout=0.2",)),
                        ("micro", ("model.lora.dropout=0.2", "train.micro_batch_size=3")),
                        ("none", ("model.lora.dropout=0",))):
        _, run, _ = _run(tiny_run, tmp_path, name, *common, *extra)
        runs[name] = run
    whole, micro, none = (_adapters(runs[n]) for n in ("whole", "micro", "none"))
    assert set(whole) == set(micro) == set(none)
    for k in whole:
        torch.testing.assert_close(micro[k], whole[k], rtol=1e-5, atol=1e-6, msg=k)
    assert any((whole[k] - none[k]).abs().max() > 1e-4 for k in whole if "lora_B" in k)
    from tests._metrics import merged_metrics

    mw, mm = merged_metrics(runs["whole"].path), merged_metrics(runs["micro"].path)
    assert [round(m["loss"], 5) for m in mw] == [round(m["loss"], 5) for m in mm]
    if private:
        assert [m["clip_fraction"] for m in mw] == [m["clip_fraction"] for m in mm]
        assert 0 < sum(m["clip_fraction"] for m in mw)
        assert read_json(runs["whole"].privacy_path)["steps"] == 2
