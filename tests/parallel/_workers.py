"""Case runners executed inside one spawned gloo process group per world size.

Each rank runs every case for its world and writes {case: error-or-None} to a JSON file;
the tests read the merged results. Serial references are computed by the parent (in-process)
and passed in as a torch file.
"""

from __future__ import annotations

import json
import os
import resource
import time
import traceback
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from memaudit.parallel.comm import Comm
from memaudit.parallel.dims import ParallelDims, build_groups
from memaudit.run.driver import run_trainer
from tests.parallel._lora_workers import (
    LORA_GRIDS,
    adamw_steps,
    lora_cases,
    lora_reference,
    user_clipped_mean,
)

LAYER_GRIDS = [(2, 1, 1), (1, 2, 1), (1, 1, 2), (2, 2, 1), (2, 1, 2), (1, 2, 2), (2, 2, 2)]
LAYER_SHAPES = [(32, 64), (16, 128), (2, 256)]
MODEL_GRIDS = [(1, 1, 1, 1), (2, 1, 1, 1), (1, 2, 2, 1), (2, 2, 1, 2)]
TIMES: dict[str, float] = {}
TOL = {"rtol": 1e-4, "atol": 1e-5}


def layer_case_names(world: int) -> list[str]:
    out = []
    for g in LAYER_GRIDS:
        if g[0] * g[1] * g[2] != world:
            continue
        for b, f in LAYER_SHAPES:
            for bias in (False, True):
                for tr in (False, True):
                    out.append(f"layer-{g[0]}{g[1]}{g[2]}-{b}x{f}-{'bias' if bias else 'nobias'}-{'T' if tr else 'N'}")
    return out


def _layer_case(comm: Comm, batch: int, feat: int, bias: bool, transpose: bool, overlap: bool) -> None:
    from memaudit.parallel.layers import TPLinear
    from memaudit.parallel.parallelize import sync_param_grads

    gen = torch.Generator().manual_seed(batch * 1000 + feat + 7 * bias + 3 * transpose)
    out_f = feat + feat // 2
    ref = nn.Linear(feat, out_f, bias=bias)
    with torch.no_grad():
        ref.weight.copy_(torch.randn(out_f, feat, generator=gen) * 0.1)
        if bias:
            ref.bias.copy_(torch.randn(out_f, generator=gen))
    xin = torch.randn(batch, feat, generator=gen, requires_grad=True)
    r = torch.randn(batch, out_f, generator=gen)
    y_ref = ref(xin)
    (y_ref * r).sum().backward()

    layer = TPLinear(ref, comm, transpose=transpose, overlap=overlap)
    in_ax, out_ax = layer.in_axis, layer.out_axis
    pg = comm.pg
    i_l, o_l = feat // comm.size(in_ax), out_f // comm.size(out_ax)
    ii, oi = comm.index(in_ax), comm.index(out_ax)
    rows = pg.batch_shard(torch.arange(batch))
    x_loc = xin.detach()[rows][:, ii * i_l:(ii + 1) * i_l].clone().requires_grad_(True)
    y = layer(x_loc)
    (y * r[rows][:, oi * o_l:(oi + 1) * o_l]).sum().backward()
    sync_param_grads(list(layer.parameters()), comm)
    torch.testing.assert_close(y, y_ref.detach()[rows][:, oi * o_l:(oi + 1) * o_l], **TOL)
    torch.testing.assert_close(x_loc.grad, xin.grad[rows][:, ii * i_l:(ii + 1) * i_l], **TOL)
    torch.testing.assert_close(layer.weight.grad, layer.wspec.local(ref.weight.grad, comm), **TOL)
    if bias:
        torch.testing.assert_close(layer.bias.grad, layer.bspec.local(ref.bias.grad, comm), **TOL)


def run_layer_cases(world: int) -> dict[str, str | None]:
    res: dict[str, str | None] = {}
    pgs = {}
    for name in layer_case_names(world):
        _, g, shape, b, t = name.split("-")
        grid = tuple(int(c) for c in g)
        if grid not in pgs:
            pgs[grid] = Comm(build_groups(ParallelDims(data=1, x=grid[0], y=grid[1], z=grid[2])))
        batch, feat = (int(v) for v in shape.split("x"))
        try:
            _layer_case(pgs[grid], batch, feat, b == "bias", t == "T", overlap=(batch != 16))
            res[name] = None
        except Exception:  # noqa: BLE001 - reported to the test
            res[name] = traceback.format_exc(limit=3)
    return res


# ----------------------------------------------------------------------------- model
# 8 AdamW steps (20 before): every step runs the same forward, backward, gradient sync and update,
# and Adam's moments are carried across steps from the second on; the losses of every step and the
# final weights are compared at the same tolerances, and the checkpoint round trip carries the
# moments. The 8-process grid's 20 steps were 30 s of its group on the suite's 2 cores.
STEPS, BATCH, SEQ, LR = 8, 4, 16, 2e-3
# Adam's update g / (|g| + eps) has slope ~ lr / eps where |g| ~ eps: with the default eps=1e-8
# a 1e-8 rounding difference (summation order differs across grids; step-0 gradients agree to
# ~1e-7) moves rarely-seen embedding rows by ~1e-4 within 20 steps. eps=1e-3 bounds that slope
# so the comparison tests the parallel algorithm, not Adam's conditioning.
EPS = 1e-3


def batches(steps: int = STEPS) -> list[tuple[torch.Tensor, torch.Tensor]]:
    from memaudit.models.presets import get_preset

    v = get_preset("tiny").vocab_size
    gen = torch.Generator().manual_seed(1234)
    out = []
    for _ in range(steps):
        ids = torch.randint(0, v, (BATCH, SEQ), generator=gen)
        mask = torch.ones(BATCH, SEQ, dtype=torch.bool)
        mask[1, -5:] = False  # uneven target counts per example
        mask[3, -2:] = False
        out.append((ids, mask))
    return out


def serial_reference() -> dict[str, Any]:
    """One process, plain transformers: losses of STEPS AdamW steps, final weights, clip and DP refs."""
    from memaudit.models.presets import build_model
    from memaudit.train.losses import causal_lm_loss, causal_lm_loss_per_example

    model = build_model("tiny", seed=0)
    init = {k: v.clone() for k, v in model.state_dict().items()}
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.01, eps=EPS)
    losses = []
    data = batches()
    for ids, mask in data:
        loss = causal_lm_loss(model(input_ids=ids).logits, ids, mask)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    final = {k: v.clone() for k, v in model.state_dict().items()}
    # clipping: gradient at the initial weights, clipped to 0.3 of its norm
    model.load_state_dict(init)
    ids, mask = data[0]
    model.zero_grad()
    causal_lm_loss(model(input_ids=ids).logits, ids, mask).backward()
    norm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05))
    clipped = {k: p.grad.clone() for k, p in model.named_parameters()}
    # DP-SGD oracle: one backward per example, clip, sum, divide
    per_norms, dp_sum = [], {k: torch.zeros_like(p) for k, p in model.named_parameters()}
    grads = []
    for b in range(BATCH):
        model.zero_grad()
        causal_lm_loss_per_example(model(input_ids=ids[b:b + 1]).logits, ids[b:b + 1], mask[b:b + 1]).sum().backward()
        g = {k: p.grad.clone() for k, p in model.named_parameters()}
        grads.append(g)
        per_norms.append(float(torch.sqrt(sum(v.double().pow(2).sum() for v in g.values()))))
    clip = sorted(per_norms)[1] + 1e-3  # some examples clipped, some not
    for b, g in enumerate(grads):
        f = min(1.0, clip / (per_norms[b] + 1e-6))
        for k in dp_sum:
            dp_sum[k] += g[k] * f
    return {"init": init, "losses": losses, "final": final, "clip_norm": norm, "clipped": clipped,
            "dp_norms": torch.tensor(per_norms), "dp_clip": clip,
            "dp_grads": {k: v / BATCH for k, v in dp_sum.items()}, **uls_reference(grads), **lora_reference(data)}


def uls_reference(grads: list[dict[str, torch.Tensor]]) -> dict[str, Any]:
    """Per-user clipping (ULS) of the first batch read as 2 users of 2 rows each, the second user
    with one sequence (its second row has no target: ULS pads a group with such rows): each
    user's summed gradient is one unit; a clip norm between the two users' norms clips one."""
    return user_clipped_mean(grads, [(0, 1), (2,)], "uls")


def uls_batch(data: list[tuple[torch.Tensor, torch.Tensor]]) -> tuple[torch.Tensor, torch.Tensor]:
    """The first batch with row 3 (user 2's padding row) given no target."""
    ids, mask = data[0]
    mask = mask.clone()
    mask[3] = False
    return ids, mask


_BASE: list[nn.Module] = []


def _pmodel(grid: tuple[int, int, int, int], init: dict[str, torch.Tensor], **opts: Any):
    import copy

    from memaudit.models.presets import build_model
    from memaudit.parallel.parallelize import parallelize_llama

    if not _BASE:
        _BASE.append(build_model("tiny", seed=99))  # different init: the state dict load must win
    model = copy.deepcopy(_BASE[0])
    pm = parallelize_llama(model, dims=ParallelDims(data=grid[0], x=grid[1], y=grid[2], z=grid[3]), **opts)
    pm.load_full_state_dict(init)
    return pm


def _rand(seed: int):
    """Seed-derived DP randomness (privacy.reproducible_randomness): the same keys on every rank."""
    from memaudit.privacy.randomness import DPRandomness

    return DPRandomness.from_seed(seed)


def _dp(pm: Any, *, clip: float, noise_multiplier: float, randomness: Any, micro: int | None = None):
    """The one DP-SGD (`memaudit.train.dpsgd.DPSGD`) with the grid's per-example clipping;
    `micro` counts global rows per pass."""
    from memaudit.parallel.dp import TensorParallelClipping
    from memaudit.train.dpsgd import DPSGD

    return DPSGD(pm, clip=clip, noise_multiplier=noise_multiplier, expected_batch_size=BATCH,
                 randomness=randomness, micro_batch_size=micro, clipping=TensorParallelClipping(pm))


def assert_weights_close(a_run: Path, b_run: Path, *, max_abs: float = 1e-3, far_fraction: float = 1e-4) -> None:
    """The `model/` weights of two runs agree up to a grid's fp32 summation order.

    AdamW's update g / (sqrt(v) + 1e-8) is ill-conditioned where g ~ 1e-8 (embedding rows of
    rarely seen tokens): there summation-order differences are amplified, so a handful of
    elements may move by up to ~1e-3 (the lr); everything else agrees within 1e-5.
    """
    from safetensors.torch import load_file

    wa, wb = (load_file(str(d / "model" / "model.safetensors")) for d in (a_run, b_run))
    assert set(wa) == set(wb)
    far = total = 0
    for k in wb:
        d = (wa[k] - wb[k]).abs()
        assert float(d.max()) < max_abs, (k, float(d.max()))
        far, total = far + int((d > 1e-5).sum()), total + d.numel()
    assert far <= far_fraction * total, (far, total)


def _close(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], atol: float, rtol: float = 1e-4) -> None:
    assert set(a) <= set(b), sorted(set(a) - set(b))[:3]
    for k, v in a.items():
        torch.testing.assert_close(v, b[k], atol=atol, rtol=rtol, msg=lambda m, k=k: f"{k}: {m}")


def model_cases(grid: tuple[int, int, int, int], ref: dict[str, Any], outdir: str) -> dict[str, str | None]:
    """Every model case of `grid`; `outdir` is a directory all ranks share."""
    from memaudit.parallel.clip import clip_grad_norm_
    tag = "".join(str(v) for v in grid)
    res: dict[str, str | None] = {}

    def case(name: str, fn: Any) -> None:
        t0 = time.perf_counter()
        try:
            fn()
            TIMES[f"{name}-{tag}"] = time.perf_counter() - t0
            res[f"{name}-{tag}"] = None
        except Exception:  # noqa: BLE001
            res[f"{name}-{tag}"] = traceback.format_exc(limit=4)

    data = batches()

    def train() -> None:
        pm = _pmodel(grid, ref["init"])
        opt = torch.optim.AdamW(pm.parameters(), lr=LR, weight_decay=0.01, eps=EPS)
        losses = adamw_steps(pm, opt, data)
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref["losses"]), atol=1e-4, rtol=0)
        full = pm.full_state_dict()
        _close(full, ref["final"], atol=1e-5)
        checkpoint_roundtrip(pm, opt, full, tag)

    def checkpoint_roundtrip(pm: Any, opt: Any, full: dict[str, torch.Tensor], tag: str) -> None:
        """Sharded save of the trained model and AdamW; loading into a fresh model of this grid
        (own shard, and the assemble-and-slice path) gives them back bit for bit, and the
        assembled shards are the merged weights; rank 0 alone holds the dst=0 merge."""
        from memaudit.checkpoints import seal, swap_in
        from memaudit.parallel.checkpoint import ShardReader, load_sharded, save_sharded
        from memaudit.rundir import RunDir

        run = RunDir(Path(outdir) / f"ckpt-{tag}")
        tmp = run.path / f".state.{len(data)}.tmp"
        save_sharded(tmp, pm, opt, scalars={"step": len(data)}, extra=None, files=None,
                     commit=lambda: (seal(tmp, step=len(data)), swap_in(tmp, run.state_dir)))
        assert len(list((run.state_dir / "shards").iterdir())) == pm.pg.dims.tp_size
        for own in (pm.pg.rank % pm.pg.dims.tp_size, None):
            pm2 = _pmodel(grid, ref["init"])
            opt2 = torch.optim.AdamW(pm2.parameters(), lr=LR, weight_decay=0.01, eps=EPS)
            load_sharded(run, params=dict(pm2.hf.named_parameters()), optimizer=opt2, own_rank=own,
                         local=lambda n, t, m=pm2: m.hf.get_parameter(n).shard_spec.local(t, m.comm))
            for (n, a), b in zip(pm.hf.named_parameters(), pm2.hf.parameters(), strict=True):
                assert torch.equal(a, b), (n, own)
            s1, s2 = opt.state_dict(), opt2.state_dict()
            assert s1["param_groups"] == s2["param_groups"]
            for i, st in s1["state"].items():
                for k, v in st.items():
                    assert torch.equal(v, s2["state"][i][k]), (i, k, own)
        reader = ShardReader(run.state_dir)
        for n, t in full.items():
            assert torch.equal(reader.full(n, f"param/{n}"), t), n
        merged = pm.full_state_dict(dst=0)
        assert (set(merged) == set(full)) if pm.pg.rank == 0 else merged == {}

    def clip() -> None:
        pm = _pmodel(grid, ref["init"])
        ids, mask = data[0]
        loss, _ = pm(pm.shard_batch(ids), pm.shard_batch(mask))
        loss.backward()
        pm.finish_grad_sync()
        norm = clip_grad_norm_(pm, 0.05)
        assert abs(norm - ref["clip_norm"]) <= 1e-4 * ref["clip_norm"], (norm, ref["clip_norm"])
        _close(pm.full_state_dict(grads=True), ref["clipped"], atol=1e-6)

    def dp() -> None:
        pm = _pmodel(grid, ref["init"])
        ids, mask = data[0]  # every rank passes the global batch; the clipping keeps its share
        dp = _dp(pm, clip=ref["dp_clip"], noise_multiplier=0.0, randomness=None)  # secret: rank 0's
        st = dp.step_gradients(ids, None, mask, step=0, right_padded=True)
        assert abs(st["clip_fraction"] - 0.5) < 1e-9, st["clip_fraction"]
        assert st["batch_size"] == BATCH and dp.step == 1
        _close(pm.full_state_dict(grads=True), ref["dp_grads"], atol=1e-6)

    def uls() -> None:
        """Per-user clipping on the grid: groups of 2 rows, one user a padding row short, padded
        with whole empty groups to data x z shards; the clipped mean equals the one-process loop's."""
        from memaudit.parallel.dp import TensorParallelClipping, per_example_grad_norms
        from memaudit.train.dpsgd import DPSGD

        pm = _pmodel(grid, ref["init"])
        ids, mask = uls_batch(data)
        local_ids, local_mask = pm.shard_batch(ids), pm.shard_batch(mask)
        if local_ids.shape[0] % 2 == 0:  # whole users on this rank: their norms, directly
            norms = per_example_grad_norms(pm, local_ids, local_mask, group_size=2)
            torch.testing.assert_close(norms.float(), pm.shard_batch(ref["uls_norms"]).float(), rtol=1e-4, atol=1e-5)
        dp = DPSGD(pm, clip=ref["uls_clip"], noise_multiplier=0.0, expected_batch_size=BATCH // 2, randomness=None,
                   micro_batch_size=2, clipping=TensorParallelClipping(pm))
        st = dp.step_gradients(ids, None, mask, step=0, right_padded=True, group_size=2)
        assert (st["clip_fraction"], st["batch_size"], st["sequences"]) == (0.5, 2, 3), st
        _close(pm.full_state_dict(grads=True), ref["uls_grads"], atol=1e-6)

    def ghost() -> None:
        """The ghost-norm call returns every local example's full-gradient norm (against one
        backward per example in one process), and leaves nothing open behind it."""
        from memaudit.parallel.dp import per_example_grad_norms

        pm, other = _pmodel(grid, ref["init"]), _pmodel(grid, ref["init"])
        ids, mask = (pm.shard_batch(t) for t in data[0])
        norms = per_example_grad_norms(pm, ids, mask)
        torch.testing.assert_close(norms.float(), pm.shard_batch(ref["dp_norms"]).float(), rtol=1e-4, atol=1e-5)
        assert not pm.ghost.active and pm.ghost is not other.ghost
        # another model's backward inside this model's call writes nothing into its norms
        with pm.ghost.collect(ids.shape[0]) as acc:
            other(ids, mask)[0].backward()
        assert float(acc.abs().sum()) == 0.0
        torch.testing.assert_close(per_example_grad_norms(pm, ids, mask), norms, rtol=0, atol=0)

    def noise() -> None:
        """DP-SGD's noise on the grid is the one-process noise element for element, and each rank
        draws the tiles of its own elements, not every logical tensor. Failed before: every rank
        drew each parameter's whole tensor (all of the noise)."""
        from memaudit.models.presets import build_model
        from memaudit.parallel.dp import add_noise_
        from memaudit.train.dpsgd import SerialClipping
        from tests.parallel._draws import counting_normals

        pm = _pmodel(grid, ref["init"])
        for p in pm.hf.parameters():
            p.grad = torch.zeros_like(p)
        with counting_normals() as drawn:
            add_noise_(pm, std=0.5, randomness=_rand(5), step=3)
        serial = SerialClipping(build_model("tiny", seed=0), "ghost")
        for _, p in serial.params:
            p.grad = torch.zeros_like(p)
        serial.add_noise_(0.5, _rand(5), 3)
        got = pm.full_state_dict(grads=True)
        for n, p in serial.params:
            assert torch.equal(got[n], p.grad), n
        full = sum(p.numel() for _, p in serial.params)
        tp = pm.pg.dims.tp_size
        # tiny's matrices are a few tiles each (256 x 256; 512 x 128 of its 128-wide ones), so on
        # its 4-rank grids a rank draws 0.56 (x=y=2) and 0.71 (x=z=2) of the noise, not all of it;
        # at scale the share tends to 1/4 (tests/parallel/test_dp_noise.py, with small tiles)
        assert full / tp <= sum(drawn) <= (full if tp == 1 else 0.75 * full), (sum(drawn), full, tp)

    def payload() -> None:
        pm = _pmodel(grid, ref["init"])
        check_volume(pm, data[0], recompute=False, dp=False, micro=1, clip=True)
        if grid == (1, 1, 1, 1):
            assert sum(pm.comm.per_axis().values()) == 0

    for name, fn in (("train", train), ("clip", clip), ("dp", dp), ("uls", uls), ("ghost", ghost), ("noise", noise),
                     ("payload", payload)):
        case(name, fn)
    return res


# ----------------------------------------------------------------------------- volume
# Wire volume per (axis, collective kind) as counted in `Comm` against the planner's prediction,
# exactly (integers and exact fractions), with and without recomputation, DP-SGD (per example and per
# user: groups of 2 rows) and micro-batches.
VOLUME_GRIDS = [(1, 1, 1, 2), (1, 1, 2, 1), (1, 2, 1, 1), (1, 1, 2, 2), (2, 1, 1, 2), (1, 2, 2, 2)]
VOLUME_VARIANTS = {"plain": (False, False, 1), "recompute": (True, False, 1), "dp": (False, True, 1),
                   "dp-recompute-micro": (True, True, 2), "micro": (False, False, 2),
                   "overlapped-recompute": (True, False, 1), "overlapped-dp-micro": (False, True, 2),
                   "overlapped-micro": (False, False, 2), "dp-users": (False, True, 1),
                   "dp-users-recompute-micro": (True, True, 2)}
OVERLAPPED = {"overlap_reduce_scatter": True, "overlap_all_gather": True, "bucket_mb": 0.02}
# the 4- and 8-process grids (4 and 8 ranks on the suite's 2 cores: 21 s of the 4-process group
# for its two grids' twenty variants, 33 s of the 8-process one for ten) run the combinations
# only: between them they switch on recomputation, DP-SGD, micro-batches, the overlaps and
# per-user groups, every term of the prediction the single variants switch on. Each single
# variant runs on each 2-process grid, one per tensor axis (x, y, z).
VOLUME_COMBINED = ("plain", "dp-recompute-micro", "overlapped-recompute", "overlapped-dp-micro",
                   "dp-users-recompute-micro")


def volume_variants(grid: tuple[int, int, int, int]) -> dict[str, tuple[bool, bool, int]]:
    """Every variant on the 2-process grids, the combinations on the 4- and 8-process grids."""
    if grid[0] * grid[1] * grid[2] * grid[3] >= 4:
        return {name: VOLUME_VARIANTS[name] for name in VOLUME_COMBINED}
    return VOLUME_VARIANTS


def check_volume(pm: Any, batch: tuple[torch.Tensor, torch.Tensor], *, recompute: bool, dp: bool, micro: int,
                 clip: bool = False, bucketed: bool = False, lora: Any = None, users: int = 1) -> None:
    """One step under `comm.counting()`; payload and wire per (axis, kind) equal the prediction
    (`lora`: the `planner.LoraShape` of a LoRA model; `users` > 1: DP-SGD clipping per user, groups
    of that many rows). With `recompute`, checkpointing is switched on here unless the model was
    built with it (as the Trainer builds it, before the layout)."""
    from memaudit.parallel.clip import clip_grad_norm_
    from memaudit.parallel.planner import ModelShape, predict_collectives, wire_bytes

    ids, mask = (pm.shard_batch(t) for t in batch)
    rows = ids.shape[0]
    if users > 1:  # local rows of whole users, the batch padded with empty ones
        rows = -(-batch[0].shape[0] // (users * pm.pg.batch_shards)) * users
    micro = min(micro, rows // users)
    chunk = -(-rows // users // micro) * users
    if recompute:
        if not pm.hf.is_activation_checkpointing:
            pm.hf.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        pm.hf.train()
    with pm.comm.counting():
        if dp:  # the global batch in; `chunk` local rows per pass
            _dp(pm, clip=1.0, noise_multiplier=0.0, randomness=_rand(0), micro=chunk * pm.pg.batch_shards
                ).step_gradients(batch[0], None, batch[1], step=0, right_padded=True, group_size=users)
        else:
            for s in range(0, rows, chunk):
                loss, _ = pm(ids[s:s + chunk], mask[s:s + chunk])
                loss.backward()
            pm.finish_grad_sync()
        if clip:
            clip_grad_norm_(pm, 1.0)
    d = pm.pg.dims
    pred = predict_collectives(ModelShape.from_config(pm.hf.config), d, batch=BATCH, seq=SEQ, recompute=recompute,
                               dp=dp, micro_batches=-(-rows // chunk), clip=clip, data_in_backward=bucketed,
                               lora=lora, user_group=users)
    measured = dict(pm.comm.bytes)
    assert measured == pred, {k: (measured.get(k), pred.get(k)) for k in set(measured) | set(pred)
                              if measured.get(k) != pred.get(k)}
    assert dict(pm.comm.wire) == wire_bytes(pred, d)


def volume_cases(grid: tuple[int, int, int, int], ref: dict[str, Any]) -> dict[str, str | None]:
    res: dict[str, str | None] = {}
    data = batches(1)
    for name, (rc, dp, micro) in volume_variants(grid).items():
        key = f"volume-{name}-{''.join(map(str, grid))}"
        opts = OVERLAPPED if name.startswith("overlapped") else {}
        try:
            check_volume(_pmodel(grid, ref["init"], **opts), data[0], recompute=rc, dp=dp, micro=micro,
                         bucketed=bool(opts), users=2 if "users" in name else 1)
            res[key] = None
        except Exception:  # noqa: BLE001 - reported to the test
            res[key] = traceback.format_exc(limit=4)
    return res


# ----------------------------------------------------------------------------- overlaps
# ORS, OAG and bucketed data all-reduce against the blocking path on the same grid: every axis
# here has size <= 2, so the summation order is unchanged and gradients agree bit for bit
# (micro-batches all-reduce each pass's gradient separately: equal within float tolerance).
OVERLAP_OPTIONS = {"ors": {"overlap_reduce_scatter": True}, "oag": {"overlap_all_gather": True},
                   "bucket": {"bucket_mb": 0.02}, "all": OVERLAPPED}


def overlap_variants(grid: tuple[int, int, int, int]) -> dict[str, dict[str, Any]]:
    """Each overlap alone on the 2-process grid, and all of them together everywhere: the
    8-process grid (8 ranks on the suite's 2 cores) runs only the combination, which switches on
    every path the single options do; so does the 4-process grid (data = z = 1), where no option
    has a collective to overlap (ORS and OAG act on the z axis, buckets on the data axis) and the
    combination routes the gradients through the same `GradSync` as each option alone."""
    world = grid[0] * grid[1] * grid[2] * grid[3]
    return {"all": OVERLAPPED} if world >= 4 else OVERLAP_OPTIONS


def _grads_of(pm: Any, batch: tuple[torch.Tensor, torch.Tensor], *, kind: str) -> list[torch.Tensor]:
    ids, mask = (pm.shard_batch(t) for t in batch)
    if kind == "recompute":
        pm.hf.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        pm.hf.train()
    if kind == "dp":
        _dp(pm, clip=1.0, noise_multiplier=1.0, randomness=_rand(5)).step_gradients(batch[0], None, batch[1], step=2,
                                                                                     right_padded=True)
    else:
        chunk = max(1, ids.shape[0] // 2) if kind == "micro" else ids.shape[0]
        for s in range(0, ids.shape[0], chunk):
            pm(ids[s:s + chunk], mask[s:s + chunk])[0].backward()
        pm.finish_grad_sync()
    return [p.grad.clone() for p in pm.hf.parameters()]


def _train_losses(pm: Any, data: list, steps: int) -> list[float]:
    opt = torch.optim.AdamW(pm.parameters(), lr=LR, weight_decay=0.01, eps=EPS)
    out = []
    for ids, mask in data[:steps]:
        loss, logged = pm(pm.shard_batch(ids), pm.shard_batch(mask))
        opt.zero_grad()
        loss.backward()
        pm.finish_grad_sync()
        opt.step()
        out.append(float(logged))
    return out


def _check_overlaps_ran(pm: Any, opts: dict[str, Any]) -> None:
    """The switched-on overlaps did run, and nothing is left in flight after the step."""
    from memaudit.parallel.layers import ParallelEmbedding, TPLinear

    gathered = [m.gathered for m in pm.hf.modules() if isinstance(m, TPLinear | ParallelEmbedding)]
    assert all(not g.ahead for g in gathered), "a prefetched all-gather was never used"
    if opts.get("overlap_all_gather") and pm.comm.size("z") > 1:
        assert sum(g.hits for g in gathered) >= len(gathered), "no prefetched block was used"
    sync = pm.grad_sync
    assert not sync.pending and not sync.in_flight and not sync.bucket and not sync.queued
    if opts.get("overlap_reduce_scatter") and pm.comm.size("z") > 1:
        assert sync.async_pieces > 0
    if opts.get("bucket_mb") and pm.comm.size("data") > 1:
        assert sync.buckets_issued > 1


def overlap_cases(grid: tuple[int, int, int, int], ref: dict[str, Any]) -> dict[str, str | None]:
    res: dict[str, str | None] = {}
    data = batches(3)
    tag = "".join(map(str, grid))
    for kind in ("plain", "recompute", "dp", "micro"):
        base = _grads_of(_pmodel(grid, ref["init"]), data[0], kind=kind)
        for name, opts in overlap_variants(grid).items():
            key = f"overlap-{name}-{kind}-{tag}"
            try:
                pm = _pmodel(grid, ref["init"], **opts)
                got = _grads_of(pm, data[0], kind=kind)
                _check_overlaps_ran(pm, opts)
                for i, (a, b) in enumerate(zip(got, base, strict=True)):
                    if kind == "micro" and "bucket_mb" in opts and grid[0] > 1:
                        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7, msg=f"param {i}")
                    else:
                        assert torch.equal(a, b), (i, float((a - b).abs().max()))
                res[key] = None
            except Exception:  # noqa: BLE001 - reported to the test
                res[key] = traceback.format_exc(limit=4)
    key = f"overlap-train-{tag}"
    try:
        a = _train_losses(_pmodel(grid, ref["init"]), data, 3)
        b = _train_losses(_pmodel(grid, ref["init"], **OVERLAPPED), data, 3)
        assert a == b, (a, b)
        res[key] = None
    except Exception:  # noqa: BLE001
        res[key] = traceback.format_exc(limit=4)
    return res


# ----------------------------------------------------------------------------- trainer
# The one Trainer with the grid's layout runs inside the world-2 group (the same code the launcher runs in each rank);
# the tests compare them with `train_centralized` runs of the same config in the parent.
TRAIN_COMMON = ("data.seq_len=32", "train.steps=4", "train.eval_every=2", "train.checkpoint_every=4")
TRAIN_JOBS: dict[str, tuple[int, tuple[str, ...]]] = {
    # DP-SGD sigma=0 under x=2 tensor parallelism, a clip norm that clips some examples, not all
    # (6.0 on the synthetic corpus of tests/conftest.py clips 25-50% of each step's examples),
    # micro-batches of 3 (the clipped sums of the passes accumulate, then one sync)
    "dp0-x2": (2, ("parallel.x=2", "privacy.noise_multiplier=0", "privacy.clip=6.0", "privacy.reproducible_randomness=true",
                   "train.micro_batch_size=3")),
    # gradient accumulation on a data=2 grid: chunks of 3, 3, 2 global rows, each padded to 2
    "accum-d2": (2, ("parallel.data=2", "train.micro_batch_size=3")),
    # LoRA (a normal and a transposed target) under DP-SGD sigma=0 on x=2: clipping over the adapters
    # (0.7 clips 29-67% of each step's examples), a sharded checkpoint at step 2, both LoRA exports from rank 0
    "lora-dp0-x2": (2, ("parallel.x=2", "model.lora.rank=4", "model.lora.alpha=8", "model.lora.dropout=0.1",
                        "model.lora.target_modules=[q_proj,o_proj]", "privacy.noise_multiplier=0",
                        "privacy.clip=0.7", "privacy.reproducible_randomness=true", "train.checkpoint_every=2")),
    # per-user clipping (ULS, user-level DP-SGD sigma=0) on a data=2 grid: 2 sequences per user at most, 4 users
    # a step in expectation (8.0 clips 33-60% of them), whole users on each rank (padded with empty users),
    # one user per pass
    "uls0-d2": (2, ("parallel.data=2", "privacy.unit=user", "privacy.user_sampling=uls",
                    "privacy.max_examples_per_user=2", "privacy.noise_multiplier=0", "privacy.clip=8.0",
                    "privacy.reproducible_randomness=true", "train.micro_batch_size=4")),
}
# the same job, every rank stopped by an error in step 3 (after the step-2 checkpoint), then resumed
TRAIN_JOBS["lora-dp0-x2-resume"] = TRAIN_JOBS["lora-dp0-x2"]
CRASH_AT = 2  # 0-based index of the step that fails


class _Crash(RuntimeError):
    pass


def train_overrides(job: str, corpus: str, *, parallel: bool = True) -> list[str]:
    from tests.conftest import TINY_TRAIN_OVERRIDES

    extra = TRAIN_JOBS[job][1]
    if not parallel:
        extra = tuple(o for o in extra if not o.startswith("parallel."))
    return [*TINY_TRAIN_OVERRIDES, f"data.path={corpus}", *TRAIN_COMMON, *extra]


def run_train_jobs(world: int, jobs_path: str) -> dict[str, str | None]:
    from memaudit.config import load_config
    from memaudit.parallel.layout import TensorParallelLayout
    from memaudit.rundir import RunDir
    from memaudit.train.trainer import Trainer
    from tests.conftest import REPO_ROOT

    spec = json.loads(Path(jobs_path).read_text())
    res: dict[str, str | None] = {}
    for job, (w, _) in TRAIN_JOBS.items():
        if w != world:
            continue
        t0 = time.perf_counter()
        try:
            cfg = load_config(REPO_ROOT / "configs" / "tiny.yaml", train_overrides(job, spec["corpus"]))
            path = Path(spec["out"]) / job
            if job.endswith("-resume"):
                _crash_then_resume(cfg, path)
            else:
                trainer = Trainer(cfg, RunDir(path), TensorParallelLayout(cfg))
                assert type(trainer) is Trainer  # composition: the grid is the layout, not a subclass
                run_trainer(trainer)
            res[f"train-{job}"] = None
        except Exception:  # noqa: BLE001
            res[f"train-{job}"] = traceback.format_exc(limit=6)
        TIMES[f"train-{job}"] = time.perf_counter() - t0
    return res


def _crash_then_resume(cfg: Any, path: Path) -> None:
    """Every rank fails in step CRASH_AT + 1 (as a job whose ranks all die there), then the run
    resumes from its step-2 checkpoint on the same grid."""
    from memaudit.parallel.layout import TensorParallelLayout
    from memaudit.rundir import RunDir
    from memaudit.train.trainer import Trainer

    class Crashing(Trainer):
        def step(self, i: int):
            if i == CRASH_AT:
                raise _Crash(f"stopped in step {i + 1}")
            return super().step(i)

    try:
        run_trainer(Crashing(cfg, RunDir(path), TensorParallelLayout(cfg)))
        raise AssertionError("the crashing run did not stop")
    except _Crash:
        pass
    run_trainer(Trainer(cfg, RunDir(path), TensorParallelLayout(cfg)), resume=True)


# ----------------------------------------------------------------------------- entry
def worker(rank: int, world: int, port: int, outdir: str, ref_path: str, jobs_path: str) -> None:
    warnings.filterwarnings("ignore")
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        t0 = time.perf_counter()
        res = run_layer_cases(world)
        TIMES["layers"] = time.perf_counter() - t0
        ref = torch.load(ref_path, weights_only=True)
        for grid in MODEL_GRIDS:
            if grid[0] * grid[1] * grid[2] * grid[3] == world:
                res |= model_cases(grid, ref, outdir)
        for grid in LORA_GRIDS:
            if grid[0] * grid[1] * grid[2] * grid[3] == world:
                res |= lora_cases(grid, ref, batches(), outdir, TIMES)
        t0 = time.perf_counter()
        for grid in VOLUME_GRIDS:
            if grid[0] * grid[1] * grid[2] * grid[3] == world:
                res |= volume_cases(grid, ref)
        TIMES["volume"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        for grid in MODEL_GRIDS:
            if grid[0] * grid[1] * grid[2] * grid[3] == world:
                res |= overlap_cases(grid, ref)
        TIMES["overlap"] = time.perf_counter() - t0
        res |= run_train_jobs(world, jobs_path)
        try:  # a grid whose product is not the world size
            build_groups(ParallelDims(data=world * 2))
            res["bad-world"] = "no error for a grid of the wrong size"
        except ValueError as e:
            res["bad-world"] = None if f"but {world} processes run" in str(e) else str(e)
        Path(outdir, f"rank{rank}.json").write_text(json.dumps(res))
        # this rank's CPU seconds: the spawned ranks are not the test process's children, so a
        # timer of the pytest process does not see them
        use = resource.getrusage(resource.RUSAGE_SELF)
        TIMES["cpu"] = use.ru_utime + use.ru_stime
        Path(outdir, f"times{rank}.json").write_text(json.dumps(TIMES))
    finally:
        dist.destroy_process_group()
