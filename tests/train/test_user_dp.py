"""User-level DP-SGD (ULS): per-user clipping through the ghost-norm path against brute force,
the noise per user, and the samplers of ULS and ELS (the contribution bound k)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from memaudit.privacy.randomness import DPRandomness
from memaudit.train.dpsgd import DPSGD
from memaudit.train.ghost import GhostClipper, vmap_clipped_sum
from memaudit.train.losses import causal_lm_loss_per_example
from tests.train.test_dpsgd import _batch, _model, _one_thread  # noqa: F401 - the autouse one-thread fixture


def _users_batch():
    """3 users x 2 slots: user 0 two sequences, user 1 two, user 2 one plus a padding row."""
    ids, attn, lmask = _batch(b=6, length=12, seed=4)
    lmask[5] = False  # padding row of user 2: no target
    return ids, attn, lmask


def _brute_force(model, ids, attn, lmask, clip, group):
    """Per-example gradients by autograd one at a time, summed per user, norm, clip, summed."""
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    per = []
    for i in range(ids.shape[0]):
        model.zero_grad(set_to_none=True)
        out = model(input_ids=ids[i:i + 1], attention_mask=attn[i:i + 1], use_cache=False)
        loss = causal_lm_loss_per_example(out.logits, ids[i:i + 1], lmask[i:i + 1])[0]
        grads = torch.autograd.grad(loss, [dict(model.named_parameters())[n] for n in names], allow_unused=True)
        per.append([torch.zeros_like(dict(model.named_parameters())[n]) if g is None else g.double()
                    for n, g in zip(names, grads, strict=True)])
    users = [[sum(per[u * group + j][k] for j in range(group)) for k in range(len(names))]
             for u in range(ids.shape[0] // group)]
    norms = torch.stack([torch.sqrt(sum(g.pow(2).sum() for g in gs)) for gs in users])
    c = torch.clamp(clip / (norms + 1e-6), max=1.0)
    total = {n: sum(c[u] * users[u][k] for u in range(len(users))) for k, n in enumerate(names)}
    return norms, total


@pytest.mark.parametrize("clip", [0.5, 1e6])
def test_per_user_clipped_sum_equals_brute_force(clip):
    model = _model(seed=2)
    ids, attn, lmask = _users_batch()
    norms, total = _brute_force(model, ids, attn, lmask, clip, group=2)
    for got in (GhostClipper(model).clipped_sum(ids, attn, lmask, clip, group_size=2),
                vmap_clipped_sum(model, ids, attn, lmask, clip, group_size=2)):
        assert got.norms.shape == (3,)
        torch.testing.assert_close(got.norms.double(), norms, rtol=1e-5, atol=1e-6)
        for n, g in got.grads.items():
            torch.testing.assert_close(g.double(), total[n], rtol=1e-5, atol=1e-5, msg=n)
        assert got.losses.shape == (6,)


def test_ghost_norm_modes_agree_per_user():
    model = _model(seed=5, bias=True)
    ids, attn, lmask = _users_batch()
    a = GhostClipper(model, norm_mode="gram").clipped_sum(ids, attn, lmask, 0.3, group_size=3)
    b = GhostClipper(model, norm_mode="materialize").clipped_sum(ids, attn, lmask, 0.3, group_size=3)
    torch.testing.assert_close(a.norms, b.norms, rtol=1e-5, atol=1e-6)
    for n in a.grads:
        torch.testing.assert_close(a.grads[n], b.grads[n], rtol=1e-5, atol=1e-6)


def test_user_step_clip_fraction_batch_size_and_micro_batches():
    model = _model(seed=2)
    ids, attn, lmask = _users_batch()
    norms, _ = _brute_force(model, ids, attn, lmask, 0.5, group=2)
    clip = float(norms.sort().values[1]) + 1e-4  # between the 2nd and 3rd user norm: 1 of 3 clipped
    whole = DPSGD(model, clip=clip, noise_multiplier=0.0, expected_batch_size=2.0, randomness=DPRandomness.fresh())
    st = whole.step_gradients(ids, attn, lmask, group_size=2)
    assert st["batch_size"] == 3 and st["sequences"] == 5
    assert st["clip_fraction"] == 1 / 3
    g1 = {n: p.grad.clone() for n, p in model.named_parameters()}
    # micro-batches of 3 rows are rounded down to whole users (2 rows): the same sum
    micro = DPSGD(model, clip=clip, noise_multiplier=0.0, expected_batch_size=2.0, micro_batch_size=3,
                  randomness=DPRandomness.fresh())
    assert micro.step_gradients(ids, attn, lmask, group_size=2)["clip_fraction"] == 1 / 3
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.grad, g1[n], rtol=1e-5, atol=1e-7)


def test_user_noise_std_per_coordinate_is_sigma_c():
    """Noise on the per-user clipped sum: (noisy - noiseless) * E[users] has std sigma*C per
    coordinate. n ~ 2e4 coordinates: the sample std's relative s.e. is 1/sqrt(2n) ~ 0.5 %;
    tolerance 3 % (6 s.e.)."""
    model = _model(seed=2)
    ids, attn, lmask = _users_batch()
    r = DPRandomness.fresh()
    DPSGD(model, clip=0.7, noise_multiplier=0.0, expected_batch_size=1.5, randomness=r).step_gradients(
        ids, attn, lmask, step=3, group_size=2)
    clean = torch.cat([p.grad.flatten() for p in model.parameters()])
    DPSGD(model, clip=0.7, noise_multiplier=2.0, expected_batch_size=1.5, randomness=r).step_gradients(
        ids, attn, lmask, step=3, group_size=2)
    noisy = torch.cat([p.grad.flatten() for p in model.parameters()])
    noise = (noisy - clean) * 1.5
    assert noise.numel() > 15_000
    assert float(noise.std()) == pytest.approx(2.0 * 0.7, rel=0.03)
    assert abs(float(noise.mean())) < 5 * 1.4 / math.sqrt(noise.numel())


def test_groups_must_divide_the_rows():
    model = _model()
    ids, attn, lmask = _batch(b=5)
    with pytest.raises(ValueError, match="groups of 2"):
        GhostClipper(model).clipped_sum(ids, attn, lmask, 1.0, group_size=2)




def _packed(users):
    from memaudit.data.packing import PackedSequences

    idx = np.array([0, 0, 0, 1], dtype=np.int32)
    return PackedSequences(np.zeros((4, 8), np.int32), np.ones((4, 8), np.int8), idx, users)


def test_user_unit_without_user_ids_is_one_line_refused():
    from types import SimpleNamespace

    from memaudit.config import load_config
    from memaudit.errors import DataError
    from memaudit.run.checks import check_data

    cfg = load_config(None, ["privacy.unit=user", "privacy.noise_multiplier=1", "privacy.max_examples_per_user=2",
                             "train.batch_size=2"])
    with pytest.raises(DataError, match="no user id") as e:
        check_data(cfg, SimpleNamespace(meta={}, train=_packed(("pseudo-000", "pseudo-001"))), 1000)
    assert "\n" not in str(e.value)
    check_data(cfg, SimpleNamespace(meta={}, train=_packed(("alice", "bob"))), 1000)  # real ids: fine


def test_cap_larger_than_any_user_warns_once_and_caps_nothing():
    from memaudit.config import load_config
    from memaudit.rundir import RunDir
    from memaudit.train.trainer import Trainer

    seen = []
    cfg = load_config(None, ["train.device=cpu", "privacy.noise_multiplier=1", "privacy.max_examples_per_user=9"])
    tr = Trainer(cfg, RunDir("/nonexistent"), progress=lambda d, t, info: seen.append(info))
    tr.train_set = _packed(("alice", "bob"))
    assert tr._contribution_rows().tolist() == [0, 1, 2, 3]
    assert len(seen) == 1 and "exceeds the most sequences any user has (3)" in seen[0]["warning"]
    cfg = load_config(None, ["train.device=cpu", "privacy.noise_multiplier=1", "privacy.max_examples_per_user=2"])
    tr = Trainer(cfg, RunDir("/nonexistent"))
    tr.train_set = _packed(("alice", "bob"))
    assert np.bincount(tr.train_set.user_index[tr._contribution_rows()]).tolist() == [2, 1]
