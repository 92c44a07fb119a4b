"""The GPU check behind `benchmarks/gpu_check.sh`: one JSON object on stdout, exit 0 unless a check fails.

With no CUDA device it says so and exits 0. With one, it measures the bf16 MFU of the `1b`
preset (6 x parameters x tokens per second over the device's bf16 peak) and times the
(1,1,1,1) parallel path on an NCCL process group against plain transformers. With two or
more, it times NCCL grids of up to 8 ranks against the serial model (one GPU), blocking
against overlapped collectives, and checks the counted wire volume per kind against the planner.
With jax[cuda] installed it also runs a client stage exported for CPU and CUDA on the GPU against
the CPU (`flower_stage_on_cuda`). DP-SGD's noise for gradients on the GPU (`dp_noise_on`): the
grid's layout adds the CPU tiles, bit for bit, and one process draws on the device.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

# dense bf16 peak TFLOP/s by device-name fragment (vendor data sheets)
PEAKS = {"H200": 989.0, "H100": 989.0, "GH200": 989.0, "A100": 312.0, "L40S": 362.0, "A10": 125.0,
         "MI250X": 191.5, "MI300X": 1307.0, "V100": 125.0}
GRIDS = {2: "2,1,1,1;1,2,1,1;1,1,1,2", 4: "1,2,2,1;2,1,1,2;1,1,2,2;4,1,1,1",
         8: "2,2,1,2;1,2,2,2;2,2,2,1;8,1,1,1"}


def gpu_count() -> tuple[int, str | None]:
    try:
        import torch
    except ImportError:
        return 0, "torch is not installed"
    if not torch.cuda.is_available():
        return 0, f"torch {torch.__version__} sees no CUDA device"
    return torch.cuda.device_count(), None


def peak_tflops(name: str, given: float | None) -> float | None:
    if given:
        return given
    return next((v for k, v in sorted(PEAKS.items(), key=lambda kv: -len(kv[0])) if k in name), None)


def with_smaller_batch(fn: Callable[..., dict], batch: int, *args: Any) -> dict:
    """`fn(batch, *args)`, halving the batch on CUDA out-of-memory (down to 1)."""
    import gc

    import torch

    while True:
        try:
            return fn(batch, *args)
        except torch.cuda.OutOfMemoryError:
            gc.collect()
            torch.cuda.empty_cache()
            if batch == 1:
                return {"error": "out of memory at batch 1"}
            batch //= 2


def mfu_1b(batch: int, seconds: float, peak: float | None) -> dict:
    """bf16 training step of the 1b preset on one GPU (activation checkpointing off, AdamW)."""
    import torch

    from memaudit.models.presets import build_model, param_count
    from memaudit.train.losses import causal_lm_loss

    seq = 2048
    model = build_model("1b", seed=0).cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    ids = torch.randint(0, model.config.vocab_size, (batch, seq), device="cuda")
    mask = torch.ones_like(ids, dtype=torch.bool)
    times, deadline = [], time.monotonic() + seconds
    for i in range(12):
        torch.cuda.synchronize()
        t = time.perf_counter()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = causal_lm_loss(model(input_ids=ids).logits, ids, mask)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        torch.cuda.synchronize()
        if i >= 2:
            times.append(time.perf_counter() - t)
        if time.monotonic() > deadline and len(times) >= 3:
            break
    times.sort()
    step = times[len(times) // 2]
    n = param_count("1b")
    tflops = 6 * n * batch * seq / step / 1e12
    del model, opt
    torch.cuda.empty_cache()
    return {"preset": "1b", "params": n, "batch": batch, "seq": seq, "median_step_s": step, "steps": len(times),
            "model_tflops": tflops, "peak_tflops": peak, "mfu": tflops / peak if peak else None}


def nccl_1111(batch: int, repeats: int) -> dict:
    import torch
    import torch.distributed as dist
    from parallel_step import step_times

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.cuda.set_device(0)
    dist.init_process_group("nccl", rank=0, world_size=1)
    try:
        return step_times("1b", batch, 1024, repeats, device="cuda", bf16=True) | {"backend": dist.get_backend(),
                                                                                  "preset": "1b", "batch": batch}
    finally:
        dist.destroy_process_group()


def flower_stage_on_cuda(platform: str = "cuda") -> dict:
    """A client stage as a CUDA SuperNode gets it (`memaudit.federated.flower.partition
    .modules_for`: lowered for CUDA alone) against the CPU node's (CPU alone): the tiny model's
    loss gradient, each module deserialised and run on its device; the largest difference of
    the two gradients."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax import export

    try:
        gpu = jax.devices(platform)[0]
    except RuntimeError as e:
        return {"status": "skipped", "reason": f"this jax has no CUDA backend ({str(e)[:120]})"}
    from memaudit.config import load_config
    from memaudit.models.convert import hf_to_flax
    from memaudit.models.flax_llama import FlaxLlama
    from memaudit.models.init import flax_config, initial_state_dict

    cfg = load_config(None, [])
    vocab = 4096
    model = FlaxLlama(flax_config(cfg.model, vocab))
    params = hf_to_flax(initial_state_dict(cfg.model, vocab))
    ids = np.random.default_rng(0).integers(0, vocab, (4, 64)).astype(np.int32)

    def loss(p, x):
        logits = model.apply({"params": p}, x)
        lp = jax.nn.log_softmax(logits[:, :-1])
        return -jnp.take_along_axis(lp, x[:, 1:, None], axis=-1).mean()

    structs = (jax.tree.map(lambda v: jax.ShapeDtypeStruct(np.shape(v), np.asarray(v).dtype), params),
               jax.ShapeDtypeStruct(ids.shape, ids.dtype))
    cpu = jax.devices("cpu")[0]
    got = []
    for device, lowered in ((gpu, "cuda"), (cpu, "cpu")):
        exp = export.deserialize(export.export(jax.jit(jax.grad(loss)), platforms=(lowered,))(*structs).serialize())
        got.append(jax.tree.map(np.asarray, exp.call(*jax.device_put((params, ids), device))))
    diff = max(float(np.max(np.abs(a - b))) for a, b in zip(*map(jax.tree.leaves, got), strict=True))
    return {"status": "ok" if diff <= 1e-3 else "mismatch", "platforms": ["cuda", "cpu"],
            "max_abs_grad_diff": diff}


def dp_noise_on(device: str = "cuda") -> dict:
    """DP-SGD's noise for gradients on ``device``. The grid's layout (1 rank: its tiles drawn on
    torch's CPU threads, then copied and added on this thread) must equal one process's CPU draw
    bit for bit; one process's gradients on the device get one device draw per tensor, whose std
    is checked. Seconds of each (tiny)."""
    import torch

    from memaudit.models.presets import build_model
    from memaudit.parallel.dims import ParallelDims
    from memaudit.parallel.dp import add_noise_
    from memaudit.parallel.parallelize import parallelize_llama
    from memaudit.privacy.randomness import DPRandomness
    from memaudit.train.dpsgd import SerialClipping

    rand = DPRandomness.from_seed(0)

    def zero_grads(params):
        for p in params:
            p.grad = torch.zeros_like(p)

    def timed(fn) -> float:
        t0 = time.perf_counter()
        fn()
        if device == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter() - t0

    pm = parallelize_llama(build_model("tiny", seed=0).to(device), dims=ParallelDims())
    trained = [p for p in pm.hf.parameters() if p.requires_grad]
    zero_grads(trained)
    grid_s = timed(lambda: add_noise_(pm, std=0.5, randomness=rand, step=1))
    cpu = SerialClipping(build_model("tiny", seed=0), "ghost")
    zero_grads([p for _, p in cpu.params])
    cpu.add_noise_(0.5, rand, 1)
    same = all(torch.equal(p.grad.cpu(), p.shard_spec.local(q.grad, pm.comm))
               for p, (_, q) in zip(trained, cpu.params, strict=True))
    one = SerialClipping(build_model("tiny", seed=0).to(device), "ghost")
    zero_grads([p for _, p in one.params])
    serial_s = timed(lambda: one.add_noise_(0.5, rand, 1))
    flat = torch.cat([p.grad.reshape(-1).float().cpu() for _, p in one.params])
    std = float(flat.std())
    ok = same and abs(std - 0.5) < 0.01
    return {"status": "ok" if ok else "mismatch", "device": device, "grid_equals_cpu_tiles": same,
            "grid_s": round(grid_s, 4), "one_process_device_draw_s": round(serial_s, 4),
            "one_process_std": round(std, 4), "normals": flat.numel()}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--budget-s", type=float, default=540.0)
    ap.add_argument("--peak-tflops", type=float, default=None)
    a = ap.parse_args()
    t0 = time.monotonic()
    n, why = gpu_count()
    out: dict = {"gpus": n, "budget_s": a.budget_s}
    if n == 0:
        out |= {"status": "no_gpu", "reason": why, "checks": []}
        print(json.dumps(out, indent=1))
        return 0
    import torch

    name = torch.cuda.get_device_name(0)
    out |= {"device": name, "torch": torch.__version__, "cuda": torch.version.cuda, "status": "ok"}
    out["flower_stage_cuda"] = flower_stage_on_cuda()
    if out["flower_stage_cuda"]["status"] == "mismatch":
        out["status"] = "flower_stage_mismatch"
    try:  # one GPU run has to report the other checks too
        out["dp_noise_cuda"] = dp_noise_on("cuda")
    except Exception as e:  # noqa: BLE001
        out["dp_noise_cuda"] = {"status": "error", "error": f"{type(e).__name__}: {str(e)[:300]}"}
    if out["dp_noise_cuda"]["status"] != "ok":
        out["status"] = "dp_noise_mismatch"
    out["mfu_1b_bf16"] = with_smaller_batch(mfu_1b, 8, min(120.0, a.budget_s / 4), peak_tflops(name, a.peak_tflops))
    if n == 1:
        out["parallel_1111_nccl"] = with_smaller_batch(nccl_1111, 4, 5)
    else:
        from parallel_step import _grids, grid_times, step_times

        world = max(w for w in GRIDS if w <= n)
        serial = step_times("125m", 16, 1024, 5, device="cuda")
        rows = grid_times("125m", 16, 1024, world, _grids(GRIDS[world], world), 5, "nccl")
        for r in rows:
            r["vs_serial"] = {k: v / serial["median_s"]["serial"] for k, v in r["median_s"].items()}
        out["serial"] = serial
        out[f"nccl_world{world}"] = rows
        out["max_volume_rel_err"] = max(r["max_volume_rel_err"] for r in rows)
        if out["max_volume_rel_err"] != 0:
            out["status"] = "volume_mismatch"
    out["wall_s"] = time.monotonic() - t0
    print(json.dumps(out, indent=1))
    return 0 if out["status"] == "ok" else 1


if __name__ == "__main__":
    raise SystemExit(main())
