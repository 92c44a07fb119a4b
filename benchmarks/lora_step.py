"""One training step of LoRA against the full fine-tune, private and not, side by side (CPU).

Variants, each one AdamW step (forward, backward, optimizer) on the same LlamaForCausalLM and batch,
as the centralized trainer takes it:
  full             every weight trained, token-mean loss, loss.backward()
  lora             LoRA adapters only (memaudit.models.lora.apply_lora), the base frozen
  full_dp          memaudit's DP-SGD (ghost norms + book-keeping) over every weight
  lora_dp          the same DP-SGD over the adapters only (frozen layers skipped)

Each (preset, variant) runs in its own process, so its peak resident memory (ru_maxrss) is its
own: `peak_rss_mib` is the process's peak, `step_peak_mib` its rise over the peak once the model
and the batch were built (the step's own working memory: activations, gradients, optimizer
state, per-example statistics). Prints one JSON object; times are the median over --repeats.

With `--grid DATA X Y Z` (world > 1) each variant runs as that many gloo processes on the 4D grid
(`memaudit.parallel.parallelize_llama`; LoRA through `memaudit.parallel.lora`, DP-SGD through
`TensorParallelClipping`); a step's time is rank 0's, between barriers, and the memory rank 0's.

    python benchmarks/lora_step.py --presets tiny small --repeats 5
    python benchmarks/lora_step.py --presets 125m --batch 4 --seq 128 --repeats 2
    python benchmarks/lora_step.py --presets tiny --grid 1 2 1 1 --threads 1 --repeats 5
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import platform
import resource
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

VARIANTS = ("full", "lora", "full_dp", "lora_dp")


def _mib_peak() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB


def _one(preset: str, variant: str, batch: int, seq: int, repeats: int, warmup: int, rank: int,
         threads: int | None, out: mp.Queue, grid: tuple[int, int, int, int] = (1, 1, 1, 1),
         who: int = 0, port: int = 0) -> None:
    import os

    import torch
    import torch.distributed as dist

    from memaudit.config import LoraConfig
    from memaudit.models.lora import apply_lora, parameter_counts
    from memaudit.models.presets import build_model
    from memaudit.privacy.randomness import DPRandomness
    from memaudit.train.dpsgd import DPSGD
    from memaudit.train.losses import causal_lm_loss

    if threads:
        torch.set_num_threads(threads)
    model = build_model(preset, seed=0)
    model.config.use_cache = False
    if variant.startswith("lora"):
        model = apply_lora(model, LoraConfig(rank=rank, alpha=2.0 * rank), seed=0)
    model.train()
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, model.config.vocab_size, (batch, seq), generator=g)
    attn = torch.ones_like(ids)
    world = grid[0] * grid[1] * grid[2] * grid[3]
    clipping = {}
    if world > 1:
        from memaudit.parallel.dims import ParallelDims
        from memaudit.parallel.dp import TensorParallelClipping
        from memaudit.parallel.parallelize import parallelize_llama

        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        dist.init_process_group("gloo", rank=who, world_size=world)
        model = parallelize_llama(model, dims=ParallelDims(data=grid[0], x=grid[1], y=grid[2], z=grid[3]))
        clipping = {"clipping": TensorParallelClipping(model)}
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-4)
    dp = (DPSGD(model, clip=1.0, noise_multiplier=1.0, expected_batch_size=batch,
                randomness=DPRandomness.from_seed(0), **clipping) if variant.endswith("_dp") else None)
    before = _mib_peak()

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        if dp is not None:
            dp.step_gradients(ids, attn, attn.bool())
        elif world > 1:
            model(model.shard_batch(ids), model.shard_batch(attn.bool()))[0].backward()
            model.finish_grad_sync()
        else:
            logits = model(input_ids=ids, attention_mask=attn).logits
            causal_lm_loss(logits, ids, attn.bool()).backward()
        opt.step()
        if world > 1:
            dist.barrier()

    for _ in range(warmup):
        step()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        step()
        times.append(round(time.perf_counter() - t0, 4))
    if who == 0:
        out.put({"median_s": round(statistics.median(times), 4), "times_s": times,
                 "peak_rss_mib": round(_mib_peak(), 1), "step_peak_mib": round(_mib_peak() - before, 1),
                 **parameter_counts(model)})
    if world > 1:
        dist.destroy_process_group()


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(presets: list[str], variants: list[str], *, batch: int, seq: int, repeats: int, warmup: int,
        rank: int, threads: int | None, grid: tuple[int, int, int, int] = (1, 1, 1, 1)) -> dict:
    import torch

    ctx = mp.get_context("spawn")  # a fresh process per variant: its own peak memory
    world = grid[0] * grid[1] * grid[2] * grid[3]
    result = {"batch": batch, "seq_len": seq, "repeats": repeats, "lora_rank": rank,
              "lora_targets": ["q_proj", "v_proj"], "grid": {"data": grid[0], "x": grid[1], "y": grid[2], "z": grid[3]},
              "torch": torch.__version__, "threads": threads or torch.get_num_threads(),
              "machine": platform.machine(), "presets": {}}
    for preset in presets:
        rows = {}
        for v in variants:
            q, port = ctx.Queue(), _free_port()
            procs = [ctx.Process(target=_one, args=(preset, v, batch, seq, repeats, warmup, rank, threads, q,
                                                    grid, who, port)) for who in range(world)]
            for p in procs:
                p.start()
            for p in procs:
                p.join()
            code = max(abs(p.exitcode or 0) for p in procs)
            rows[v] = q.get() if code == 0 and not q.empty() else {"error": f"exit code {code}"}
        for lora, full in (("lora", "full"), ("lora_dp", "full_dp")):
            if "median_s" in rows.get(lora, {}) and "median_s" in rows.get(full, {}):
                rows[lora]["x_full_time"] = round(rows[lora]["median_s"] / rows[full]["median_s"], 3)
                rows[lora]["x_full_step_memory"] = round(
                    rows[lora]["step_peak_mib"] / max(rows[full]["step_peak_mib"], 1e-9), 3)
        result["presets"][preset] = rows
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--presets", nargs="+", default=["tiny", "small"])
    ap.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--rank", type=int, default=8)
    ap.add_argument("--threads", type=int, default=None, help="torch intra-op threads (per process)")
    ap.add_argument("--grid", type=int, nargs=4, default=[1, 1, 1, 1], metavar=("DATA", "X", "Y", "Z"),
                    help="run each variant on this 4D grid of gloo processes")
    a = ap.parse_args()
    print(json.dumps(run(a.presets, a.variants, batch=a.batch, seq=a.seq, repeats=a.repeats, warmup=a.warmup,
                         rank=a.rank, threads=a.threads, grid=tuple(a.grid)), indent=2))


if __name__ == "__main__":
    main()
