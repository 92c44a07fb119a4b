"""LoRA cases run inside the world-2 and world-4 gloo groups of `tests.parallel._workers`.

The one-process oracle (`lora_reference`, computed by the parent) is peft + torch on `tiny`:
two AdamW steps, the merged weights and peft's adapter state dict, and a brute-force loop of
one backward per example for the per-example adapter-gradient norms and the clipped DP-SGD sum.
"""

from __future__ import annotations

import contextlib
import time
import traceback
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

LORA_GRIDS = [(1, 2, 1, 1), (1, 1, 2, 2), (2, 1, 1, 2)]  # (data, x, y, z)
LORA_KINDS = ("train", "dp", "dropout")
LORA_STEPS, LORA_SEED, LR, EPS = 2, 7, 2e-3, 1e-3
P_DROP, DROP_SEED = 0.25, 5  # adapter dropout's rate and train.seed (its masks' key)
# both layer kinds: q/v normal (in over x, out over y), o/down transposed
TARGETS = ("q_proj", "v_proj", "o_proj", "down_proj")
# Wire volume of one LoRA step against `planner.predict_collectives(lora=...)`, exactly:
# name -> (targets, recompute, dp, micro-batches, overlapped: ORS + OAG + data buckets). With one
# target past q, k, v (o_proj, down_proj), the first layer skips the backward of the frozen layers
# before it (the frozen embedding's output needs no gradient).
LORA_VOLUME_VARIANTS: dict[str, tuple[tuple[str, ...], bool, bool, int, bool]] = {
    "plain": (TARGETS, False, False, 1, False), "recompute": (TARGETS, True, False, 1, False),
    "dp": (TARGETS, False, True, 1, False), "overlapped-micro": (TARGETS, False, False, 2, True),
    "o-dp-recompute-micro": (("o_proj",), True, True, 2, False),
    "down-overlapped-recompute": (("down_proj",), True, False, 1, True),
}


def lora_config(targets: tuple[str, ...] = TARGETS, dropout: float = 0.0) -> Any:
    from memaudit.config import LoraConfig

    return LoraConfig(rank=4, alpha=8.0, target_modules=targets, dropout=dropout)


def _peft_tiny(seed: int, targets: tuple[str, ...] = TARGETS, *, recompute: bool = False, dropout: float = 0.0) -> Any:
    """peft on `tiny`; with `recompute`, activation checkpointing switched on first, as
    `Trainer.build_model` does (its input-gradient hook stays on the embedding the grid replaces)."""
    from memaudit.models.lora import apply_lora
    from memaudit.models.presets import build_model

    model = build_model("tiny", seed=seed)
    if recompute:
        model.config.use_cache = False
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.enable_input_require_grads()
    return apply_lora(model, lora_config(targets, dropout), seed=LORA_SEED)


def _trained(model: Any) -> list[torch.nn.Parameter]:
    return [p for p in model.parameters() if p.requires_grad]


def adamw_steps(pm: Any, opt: Any, batches: list, *, around: Any = None, frozen_have_no_grad: bool = False
                ) -> list[float]:
    """One optimizer step per (ids, mask) global batch on the grid model `pm`; the logged losses.
    `around(i)`: a context for step i's forward and backward."""
    losses = []
    for i, (ids, mask) in enumerate(batches):
        with around(i) if around is not None else contextlib.nullcontext():
            loss, logged = pm(pm.shard_batch(ids), pm.shard_batch(mask))
            opt.zero_grad()
            loss.backward()
        pm.finish_grad_sync()
        if frozen_have_no_grad:
            assert all(p.grad is None for p in pm.hf.parameters() if not p.requires_grad)
        opt.step()
        losses.append(float(logged))
    return losses


def user_clipped_mean(grads: list[dict[str, torch.Tensor]], users: list[tuple[int, ...]], tag: str
                      ) -> dict[str, Any]:
    """Per-user clipping by brute force: each user's summed per-example gradient is one unit;
    the clip norm lies between the users' smallest and largest norms, so some are clipped."""
    summed = [{k: sum(grads[i][k] for i in rows) for k in grads[0]} for rows in users]
    norms = [float(torch.sqrt(sum(v.double().pow(2).sum() for v in g.values()))) for g in summed]
    clip = (min(norms) + max(norms)) / 2
    mean = {k: sum(g[k] * min(1.0, clip / (n + 1e-6)) for g, n in zip(summed, norms, strict=True)) / len(users)
            for k in summed[0]}
    return {f"{tag}_norms": torch.tensor(norms), f"{tag}_clip": clip, f"{tag}_grads": mean}


def lora_reference(batches: list[tuple[torch.Tensor, torch.Tensor]]) -> dict[str, Any]:
    """One process, peft: the start (B drawn non-zero so A has a gradient too), two AdamW steps,
    the merged model, the adapters; per-example adapter-gradient norms and the clipped mean."""
    from memaudit.models.lora import adapter_state, merged_copy
    from memaudit.train.losses import causal_lm_loss, causal_lm_loss_per_example

    model = _peft_tiny(0)
    gen = torch.Generator().manual_seed(11)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.05)
    inner = model.get_base_model()
    init = {n: p.detach().clone() for n, p in inner.named_parameters()}
    # per-example gradients at the start, one backward per example
    ids, mask = batches[0]
    grads, norms = [], []
    for b in range(ids.shape[0]):
        model.zero_grad()
        causal_lm_loss_per_example(model(input_ids=ids[b:b + 1]).logits, ids[b:b + 1], mask[b:b + 1]).sum().backward()
        g = {n: p.grad.clone() for n, p in inner.named_parameters() if p.requires_grad}
        grads.append(g)
        norms.append(float(torch.sqrt(sum(v.double().pow(2).sum() for v in g.values()))))
    clip = sorted(norms)[1] + 1e-3  # some examples clipped, some not
    dp = {n: sum(g[n] * min(1.0, clip / (norms[b] + 1e-6)) for b, g in enumerate(grads)) / ids.shape[0]
          for n in grads[0]}
    opt = torch.optim.AdamW(_trained(model), lr=LR, weight_decay=0.01, eps=EPS)
    losses = []
    for ids, mask in batches[:LORA_STEPS]:
        loss = causal_lm_loss(model(input_ids=ids).logits, ids, mask)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return {**user_clipped_mean(grads, [(0, 1), (2, 3)], "lora_uls"), "lora_init": init, "lora_losses": losses,
            "lora_final": {n: p.detach().clone() for n, p in inner.named_parameters()},
            "lora_merged": {k: v.clone() for k, v in merged_copy(model).state_dict().items()},
            "lora_adapter": {k: v.clone() for k, v in adapter_state(model).items()},
            "lora_norms": torch.tensor(norms), "lora_clip": clip, "lora_dp": dp,
            **_dropout_reference(batches, init)}


def _dropout_reference(batches: list[tuple[torch.Tensor, torch.Tensor]], init: dict[str, torch.Tensor]
                       ) -> dict[str, Any]:
    """One process, peft with keyed adapter dropout from `init`: each example's adapter-gradient
    norm and the clipped mean (one backward per example, example b drawing row b's mask), and
    two AdamW steps (step i drawing step i's masks)."""
    from memaudit.models.keyed_dropout import dropout_rows, dropout_step
    from memaudit.train.losses import causal_lm_loss, causal_lm_loss_per_example

    model = _peft_tiny(0, dropout=P_DROP)
    inner = model.get_base_model()
    inner.load_state_dict(init, strict=False)
    ids, mask = batches[0]
    grads, norms = [], []
    with dropout_step(model, seed=DROP_SEED, step=0):
        for b in range(ids.shape[0]):
            model.zero_grad()
            with dropout_rows(model, b):
                loss = causal_lm_loss_per_example(model(input_ids=ids[b:b + 1]).logits, ids[b:b + 1], mask[b:b + 1])
            loss.sum().backward()
            g = {n: p.grad.clone() for n, p in inner.named_parameters() if p.requires_grad}
            grads.append(g)
            norms.append(float(torch.sqrt(sum(v.double().pow(2).sum() for v in g.values()))))
    clip = sorted(norms)[1] + 1e-3
    dp = {n: sum(g[n] * min(1.0, clip / (norms[b] + 1e-6)) for b, g in enumerate(grads)) / ids.shape[0]
          for n in grads[0]}
    opt = torch.optim.AdamW(_trained(model), lr=LR, weight_decay=0.01, eps=EPS)
    losses = []
    for i, (ids, mask) in enumerate(batches[:LORA_STEPS]):
        with dropout_step(model, seed=DROP_SEED, step=i):
            loss = causal_lm_loss(model(input_ids=ids).logits, ids, mask)
            opt.zero_grad()
            loss.backward()
        opt.step()
        losses.append(loss.item())
    return {"drop_norms": torch.tensor(norms), "drop_clip": clip, "drop_dp": dp, "drop_losses": losses,
            "drop_final": {n: p.detach().clone() for n, p in inner.named_parameters()}}


def _lora_pmodel(grid: tuple[int, int, int, int], init: dict[str, torch.Tensor] | None,
                 targets: tuple[str, ...] = TARGETS, *, recompute: bool = False, dropout: float = 0.0,
                 **opts: Any) -> Any:
    from memaudit.parallel.dims import ParallelDims
    from memaudit.parallel.parallelize import parallelize_llama

    pm = parallelize_llama(_peft_tiny(99, targets, recompute=recompute, dropout=dropout),
                           dims=ParallelDims(data=grid[0], x=grid[1], y=grid[2], z=grid[3]), **opts)
    if init is not None:
        pm.load_full_state_dict(init)  # a different base and A: the load must win
    return pm


def _close(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], atol: float) -> None:
    assert set(a) == set(b), sorted(set(a) ^ set(b))[:3]
    for k, v in a.items():
        torch.testing.assert_close(v, b[k], atol=atol, rtol=1e-4, msg=lambda m, k=k: f"{k}: {m}")


def _train(grid: tuple[int, int, int, int], ref: dict[str, Any], data: list, outdir: str) -> None:
    """Two AdamW steps equal one process (losses, adapters, merged model, peft's adapter state);
    the frozen base is bit-identical, has no gradient and no optimizer state; the adapters
    change; a sharded checkpoint of the LoRA model and AdamW loads back bit for bit."""
    from memaudit.models.lora import adapter_state, merged_copy
    from memaudit.parallel.lora import gather_peft

    init = ref["lora_init"]
    pm = _lora_pmodel(grid, init)
    trained = _trained(pm)
    assert {n for n, p in pm.hf.named_parameters() if p.requires_grad} == {n for n in init if "lora_" in n}
    opt = torch.optim.AdamW(trained, lr=LR, weight_decay=0.01, eps=EPS)
    losses = adamw_steps(pm, opt, data[:LORA_STEPS], frozen_have_no_grad=True)
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref["lora_losses"]), atol=1e-5, rtol=0)
    full = pm.full_state_dict()
    _close(full, ref["lora_final"], atol=1e-5)
    for n, t in full.items():
        if "lora_" not in n:
            assert torch.equal(t, init[n]), f"frozen {n} changed"
        else:
            assert not torch.equal(t, init[n]), f"adapter {n} did not change"
    whole = gather_peft(pm, _peft_tiny(5) if pm.pg.rank == 0 else None)
    if pm.pg.rank == 0:
        _close(merged_copy(whole).state_dict(), ref["lora_merged"], atol=1e-5)
        _close(adapter_state(whole), ref["lora_adapter"], atol=1e-5)
    else:
        assert whole is None
    _roundtrip(grid, pm, opt, init, outdir)


def _roundtrip(grid: tuple[int, int, int, int], pm: Any, opt: Any, init: dict[str, torch.Tensor], outdir: str) -> None:
    from memaudit.checkpoints import seal, swap_in
    from memaudit.parallel.checkpoint import load_sharded, save_sharded
    from memaudit.rundir import RunDir

    run = RunDir(Path(outdir) / f"lora-ckpt-{''.join(map(str, grid))}")
    tmp = run.path / f".state.{LORA_STEPS}.tmp"
    save_sharded(tmp, pm, opt, scalars={"step": LORA_STEPS}, extra=None, files=None,
                 commit=lambda: (seal(tmp, step=LORA_STEPS), swap_in(tmp, run.state_dir)))
    pm2 = _lora_pmodel(grid, init)
    opt2 = torch.optim.AdamW(_trained(pm2), lr=LR, weight_decay=0.01, eps=EPS)
    load_sharded(run, params=dict(pm2.hf.named_parameters()), optimizer=opt2, own_rank=pm.pg.rank % pm.pg.dims.tp_size,
                 local=None)
    for (n, a), b in zip(pm.hf.named_parameters(), pm2.hf.parameters(), strict=True):
        assert torch.equal(a, b), n
    s1, s2 = opt.state_dict(), opt2.state_dict()
    assert len(s1["state"]) == len(_trained(pm)) and s1["param_groups"] == s2["param_groups"]
    for i, st in s1["state"].items():
        for k, v in st.items():
            assert torch.equal(v, s2["state"][i][k]), (i, k)


def _dp(grid: tuple[int, int, int, int], ref: dict[str, Any], data: list) -> None:
    """Per-example adapter-gradient norms on the grid equal the one-process loop's; one DP-SGD
    step (sigma=0, ghost clipping) clips and sums the adapter gradients as that loop does, per
    example and per user (ULS); the frozen base gets no gradient (one model for all: none
    changes the weights)."""
    from memaudit.parallel.dp import TensorParallelClipping, per_example_grad_norms
    from memaudit.train.dpsgd import DPSGD

    pm = _lora_pmodel(grid, ref["lora_init"])
    ids, mask = data[0]
    norms = per_example_grad_norms(pm, pm.shard_batch(ids), pm.shard_batch(mask))
    torch.testing.assert_close(norms.float(), pm.shard_batch(ref["lora_norms"]).float(), rtol=1e-4, atol=1e-6)
    dp = DPSGD(pm, clip=ref["lora_clip"], noise_multiplier=0.0, expected_batch_size=ids.shape[0], randomness=None,
               micro_batch_size=None, clipping=TensorParallelClipping(pm))
    st = dp.step_gradients(ids, None, mask, step=0, right_padded=True)  # every rank passes the global batch
    assert abs(st["clip_fraction"] - 0.5) < 1e-9, st["clip_fraction"]
    assert all(p.grad is None for p in pm.hf.parameters() if not p.requires_grad)
    grads = {n: g for n, g in pm.full_state_dict(grads=True).items() if "lora_" in n}
    _close(grads, ref["lora_dp"], atol=1e-6)
    # per-user clipping (ULS) over the adapters: rows (0, 1) and (2, 3) are two users
    uls = DPSGD(pm, clip=ref["lora_uls_clip"], noise_multiplier=0.0, expected_batch_size=2, randomness=None,
                micro_batch_size=None, clipping=TensorParallelClipping(pm))
    st = uls.step_gradients(ids, None, mask, step=0, right_padded=True, group_size=2)
    assert (st["clip_fraction"], st["batch_size"], st["sequences"]) == (0.5, 2, 4), st
    grads = {n: g for n, g in pm.full_state_dict(grads=True).items() if "lora_" in n}
    _close(grads, ref["lora_uls_grads"], atol=1e-6)


def _dropout(grid: tuple[int, int, int, int], ref: dict[str, Any], data: list) -> None:
    """Adapter dropout on the grid draws the one-process masks: per-example adapter-gradient
    norms, one DP-SGD step's clipped sum (sigma = 0) and two AdamW steps with activation
    recomputation (its recomputed forward drops alike) equal peft in one process with the same
    keyed dropout; the losses differ from the run without dropout, so it dropped."""
    from memaudit.models.keyed_dropout import dropout_rows, dropout_step
    from memaudit.parallel.dp import TensorParallelClipping, per_example_grad_norms
    from memaudit.train.dpsgd import DPSGD

    init = ref["lora_init"]
    pm = _lora_pmodel(grid, init, dropout=P_DROP)
    ids, mask = data[0]
    lids, lmask = pm.shard_batch(ids), pm.shard_batch(mask)
    first = pm.pg.batch_index * lids.shape[0]
    with dropout_step(pm, seed=DROP_SEED, step=0):
        with dropout_rows(pm, first):
            norms = per_example_grad_norms(pm, lids, lmask)
        torch.testing.assert_close(norms.float(), pm.shard_batch(ref["drop_norms"]).float(), rtol=1e-4, atol=1e-6)
        dp = DPSGD(pm, clip=ref["drop_clip"], noise_multiplier=0.0, expected_batch_size=ids.shape[0],
                   randomness=None, micro_batch_size=2, clipping=TensorParallelClipping(pm))
        st = dp.step_gradients(ids, None, mask, step=0, right_padded=True)
    assert abs(st["clip_fraction"] - 0.5) < 1e-9, st["clip_fraction"]
    grads = {n: g for n, g in pm.full_state_dict(grads=True).items() if "lora_" in n}
    _close(grads, ref["drop_dp"], atol=1e-6)
    pm = _lora_pmodel(grid, init, recompute=True, dropout=P_DROP)
    opt = torch.optim.AdamW(_trained(pm), lr=LR, weight_decay=0.01, eps=EPS)

    @contextlib.contextmanager
    def keyed(i: int) -> Iterator[None]:
        with dropout_step(pm, seed=DROP_SEED, step=i), dropout_rows(pm, first):
            yield

    losses = adamw_steps(pm, opt, data[:LORA_STEPS], around=keyed)
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref["drop_losses"]), atol=1e-5, rtol=0)
    assert abs(losses[1] - ref["lora_losses"][1]) > 1e-4, (losses, ref["lora_losses"])
    _close(pm.full_state_dict(), ref["drop_final"], atol=1e-5)


def _volume(grid: tuple[int, int, int, int], data: list, variant: str) -> None:
    """One LoRA step's payload and wire bytes per (axis, kind), counted in `Comm`, equal the
    planner's; the model is built as `Trainer.build_model` builds it (checkpointing switched on
    before the layout); with the overlaps, every prefetched block was used."""
    from memaudit.parallel.layers import TPLinear
    from memaudit.parallel.planner import LoraShape
    from tests.parallel._workers import OVERLAPPED, check_volume

    targets, recompute, dp, micro, overlapped = LORA_VOLUME_VARIANTS[variant]
    pm = _lora_pmodel(grid, None, targets, recompute=recompute, **(OVERLAPPED if overlapped else {}))
    check_volume(pm, data[0], recompute=recompute, dp=dp, micro=micro, clip=variant == "plain", bucketed=overlapped,
                 lora=LoraShape(lora_config(targets).rank, targets))
    if overlapped:
        gathered = [m.gathered for m in pm.hf.modules() if isinstance(m, TPLinear)]
        assert all(not g.ahead for g in gathered), "a prefetched all-gather was never used"
        assert pm.comm.size("z") == 1 or sum(g.hits for g in gathered) > 0


def lora_cases(grid: tuple[int, int, int, int], ref: dict[str, Any], data: list, outdir: str,
               times: dict[str, float]) -> dict[str, str | None]:
    tag = "".join(map(str, grid))
    res: dict[str, str | None] = {}
    cases = [("train", lambda: _train(grid, ref, data, outdir)), ("dp", lambda: _dp(grid, ref, data)),
             ("dropout", lambda: _dropout(grid, ref, data))]
    cases += [(f"volume-{v}", lambda v=v: _volume(grid, data, v)) for v in LORA_VOLUME_VARIANTS]
    for kind, fn in cases:
        t0 = time.perf_counter()
        try:
            fn()
            res[f"lora-{kind}-{tag}"] = None
        except Exception:  # noqa: BLE001 - reported to the test
            res[f"lora-{kind}-{tag}"] = traceback.format_exc(limit=4)
        times[f"lora-{kind}-{tag}"] = time.perf_counter() - t0
    return res
