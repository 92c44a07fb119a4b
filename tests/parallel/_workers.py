"""Case runners executed inside one spawned gloo process group per world size.

Each rank runs every case for its world and writes {case: error-or-None} to a JSON file;
the tests read the merged results. Serial references are computed by the parent (in-process)
and passed in as a torch file.
"""

from __future__ import annotations

import json
import os
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
STEPS, BATCH, SEQ, LR = 20, 4, 16, 2e-3
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
    """One process, plain transformers: losses of 20 AdamW steps, final weights, clip and DP refs."""
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
            "dp_grads": {k: v / BATCH for k, v in dp_sum.items()}}


_BASE: list[nn.Module] = []


def _pmodel(grid: tuple[int, int, int, int], init: dict[str, torch.Tensor]):
    import copy

    from memaudit.models.presets import build_model
    from memaudit.parallel.parallelize import parallelize_llama

    if not _BASE:
        _BASE.append(build_model("tiny", seed=99))  # different init: the state dict load must win
    model = copy.deepcopy(_BASE[0])
    pm = parallelize_llama(model, dims=ParallelDims(data=grid[0], x=grid[1], y=grid[2], z=grid[3]))
    pm.load_full_state_dict(init)
    return pm


def assert_weights_close(a_run: Path, b_run: Path) -> None:
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
        assert float(d.max()) < 1e-3, (k, float(d.max()))
        far, total = far + int((d > 1e-5).sum()), total + d.numel()
    assert far <= 1e-4 * total, (far, total)


def _close(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], atol: float, rtol: float = 1e-4) -> None:
    assert set(a) <= set(b), sorted(set(a) - set(b))[:3]
    for k, v in a.items():
        torch.testing.assert_close(v, b[k], atol=atol, rtol=rtol, msg=lambda m, k=k: f"{k}: {m}")


def model_cases(grid: tuple[int, int, int, int], ref: dict[str, Any], outdir: str) -> dict[str, str | None]:
    """Every model case of `grid`; `outdir` is a directory all ranks share."""
    from memaudit.parallel.clip import clip_grad_norm_
    from memaudit.parallel.dp import dp_sgd_backward
    from memaudit.parallel.planner import ModelShape, predict_payload

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
        losses = []
        for ids, mask in data:
            loss, logged = pm(pm.shard_batch(ids), pm.shard_batch(mask))
            opt.zero_grad()
            loss.backward()
            pm.finish_grad_sync()
            opt.step()
            losses.append(float(logged))
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref["losses"]), atol=1e-4, rtol=0)
        full = pm.full_state_dict()
        _close(full, ref["final"], atol=1e-5)
        checkpoint_roundtrip(pm, opt, full, tag)

    def checkpoint_roundtrip(pm: Any, opt: Any, full: dict[str, torch.Tensor], tag: str) -> None:
        """Sharded save of the trained model and AdamW; loading into a fresh model of this grid
        (own shard, and the assemble-and-slice path) gives them back bit for bit, and the
        assembled shards are the merged weights; rank 0 alone holds the dst=0 merge."""
        from memaudit.parallel.checkpoint import ShardReader, load_sharded, save_sharded
        from memaudit.rundir import RunDir

        run = RunDir(Path(outdir) / f"ckpt-{tag}")
        save_sharded(run, pm, opt, scalars={"step": len(data)}, extra=None, files=None)
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
        ids, mask = data[0]
        st = dp_sgd_backward(pm, pm.shard_batch(ids), pm.shard_batch(mask), clip=ref["dp_clip"],
                             noise_multiplier=0.0, expected_batch=BATCH, randomness=None, step=0)
        torch.testing.assert_close(st.per_example_norms.float(), pm.shard_batch(ref["dp_norms"]).float(),
                                   rtol=1e-4, atol=1e-5)
        assert abs(st.clip_fraction - 0.5) < 1e-9, st.clip_fraction
        _close(pm.full_state_dict(grads=True), ref["dp_grads"], atol=1e-6)

    def payload() -> None:
        pm = _pmodel(grid, ref["init"])
        ids, mask = data[0]
        with pm.comm.counting():
            loss, _ = pm(pm.shard_batch(ids), pm.shard_batch(mask))
            loss.backward()
            pm.finish_grad_sync()
            clip_grad_norm_(pm, 1.0)
        measured = pm.comm.per_axis()
        d = pm.pg.dims
        pred = predict_payload(ModelShape.from_config(pm.hf.config), d, batch=BATCH, seq=SEQ, clip=True)
        for axis, m in measured.items():
            assert abs(m - pred[axis]) <= 0.05 * max(pred[axis], 1), (axis, m, pred[axis], dict(pm.comm.bytes))
        if grid == (1, 1, 1, 1):
            assert sum(measured.values()) == 0

    for name, fn in (("train", train), ("clip", clip), ("dp", dp), ("payload", payload)):
        case(name, fn)
    return res


# ----------------------------------------------------------------------------- trainer
# ParallelTrainer runs inside the world-2 group (the same code the launcher runs in each rank);
# the tests compare them with `train_centralized` runs of the same config in the parent.
TRAIN_COMMON = ("data.seq_len=32", "train.steps=4", "train.eval_every=2", "train.checkpoint_every=4")
TRAIN_JOBS: dict[str, tuple[int, tuple[str, ...]]] = {
    # DP-SGD sigma=0 under x=2 tensor parallelism, a clip norm that clips some examples, not all,
    # micro-batches of 3 (the clipped sums of the passes accumulate, then one sync)
    "dp0-x2": (2, ("parallel.x=2", "privacy.noise_multiplier=0", "privacy.clip=3.0", "privacy.reproducible_randomness=true",
                   "train.micro_batch_size=3")),
    # gradient accumulation on a data=2 grid: chunks of 3, 3, 2 global rows, each padded to 2
    "accum-d2": (2, ("parallel.data=2", "train.micro_batch_size=3")),
}


def train_overrides(job: str, corpus: str, *, parallel: bool = True) -> list[str]:
    from tests.conftest import TINY_TRAIN_OVERRIDES

    extra = TRAIN_JOBS[job][1]
    if not parallel:
        extra = tuple(o for o in extra if not o.startswith("parallel."))
    return [*TINY_TRAIN_OVERRIDES, f"data.path={corpus}", *TRAIN_COMMON, *extra]


def run_train_jobs(world: int, jobs_path: str) -> dict[str, str | None]:
    from memaudit.config import load_config
    from memaudit.parallel.trainer_hooks import ParallelTrainer
    from memaudit.rundir import RunDir
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
            ParallelTrainer(cfg, RunDir(path)).fit()
            res[f"train-{job}"] = None
        except Exception:  # noqa: BLE001
            res[f"train-{job}"] = traceback.format_exc(limit=6)
        TIMES[f"train-{job}"] = time.perf_counter() - t0
    return res


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
        res |= run_train_jobs(world, jobs_path)
        try:  # a grid whose product is not the world size
            build_groups(ParallelDims(data=world * 2))
            res["bad-world"] = "no error for a grid of the wrong size"
        except ValueError as e:
            res["bad-world"] = None if f"but {world} processes run" in str(e) else str(e)
        Path(outdir, f"rank{rank}.json").write_text(json.dumps(res))
        Path(outdir, f"times{rank}.json").write_text(json.dumps(TIMES))
    finally:
        dist.destroy_process_group()
