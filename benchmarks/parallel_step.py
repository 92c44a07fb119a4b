"""Step time of the 4D-parallel model on the 1x1x1x1 grid vs plain transformers, and the
per-axis collective payload of a few grids vs the planner. Prints JSON.

    python benchmarks/parallel_step.py --preset tiny --batch 8 --seq 64 --repeats 5
    python benchmarks/parallel_step.py --reduced      # quick check (CPU, gloo)

Targets (issue 4): parallel/plain step-time ratio <= 1.05 on 1x1x1x1; payload within 5%.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import socket
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def _data(vocab: int, batch: int, seq: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (batch, seq), generator=g), torch.ones(batch, seq, dtype=torch.bool)


def step_times(preset: str, batch: int, seq: int, repeats: int, warmup: int = 2) -> dict:
    from memaudit.models.presets import build_model
    from memaudit.parallel.dims import ParallelDims
    from memaudit.parallel.parallelize import parallelize_llama
    from memaudit.train.losses import causal_lm_loss

    base = build_model(preset, seed=0)
    ids, mask = _data(base.config.vocab_size, batch, seq)
    plain = copy.deepcopy(base)
    par = parallelize_llama(copy.deepcopy(base), dims=ParallelDims())
    opt_p = torch.optim.AdamW(plain.parameters(), lr=1e-4)
    opt_q = torch.optim.AdamW(par.parameters(), lr=1e-4)

    def plain_step() -> None:
        loss = causal_lm_loss(plain(input_ids=ids).logits, ids, mask)
        opt_p.zero_grad()
        loss.backward()
        opt_p.step()

    def par_step() -> None:
        loss, _ = par(ids, mask)
        opt_q.zero_grad()
        loss.backward()
        par.finish_grad_sync()
        opt_q.step()

    times: dict[str, list[float]] = {"plain": [], "parallel_1111": []}
    for i in range(warmup + repeats):  # interleaved so load drifts hit both alike
        for name, fn in (("plain", plain_step), ("parallel_1111", par_step)):
            t = time.perf_counter()
            fn()
            if i >= warmup:
                times[name].append(time.perf_counter() - t)
    med = {k: statistics.median(v) for k, v in times.items()}
    return {"median_s": med, "all_s": times, "ratio": med["parallel_1111"] / med["plain"], "target_ratio": 1.05}


def _payload_worker(rank: int, world: int, port: int, grids: list, preset: str, batch: int, seq: int,
                    out: str) -> None:
    import torch.distributed as dist

    from memaudit.models.presets import build_model
    from memaudit.parallel.clip import clip_grad_norm_
    from memaudit.parallel.dims import ParallelDims, build_groups
    from memaudit.parallel.parallelize import parallelize_llama
    from memaudit.parallel.planner import ModelShape, predict_payload

    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    base = build_model(preset, seed=0)
    ids, mask = _data(base.config.vocab_size, batch, seq)
    rows = []
    for g in grids:
        dims = ParallelDims(data=g[0], x=g[1], y=g[2], z=g[3])
        pm = parallelize_llama(copy.deepcopy(base), dims=dims, pg=build_groups(dims))
        with pm.comm.counting():
            t = time.perf_counter()
            loss, _ = pm(pm.shard_batch(ids), pm.shard_batch(mask))
            loss.backward()
            pm.finish_grad_sync()
            clip_grad_norm_(pm, 1.0)
            dt = time.perf_counter() - t
        meas = pm.comm.per_axis()
        pred = predict_payload(ModelShape.from_config(base.config), dims, batch=batch, seq=seq, clip=True)
        rows.append({"grid": dict(zip(("data", "x", "y", "z"), g)), "measured_bytes": meas,
                     "predicted_bytes": pred, "step_s": dt,
                     "max_rel_err": max(abs(meas[a] - pred[a]) / max(pred[a], 1) for a in meas)})
    if rank == 0:
        Path(out).write_text(json.dumps(rows))
    dist.destroy_process_group()


def payloads(preset: str, batch: int, seq: int, world: int, grids: list) -> list:
    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as d:
        out = os.path.join(d, "rows.json")
        mp.start_processes(_payload_worker, args=(world, port, grids, preset, batch, seq, out), nprocs=world,
                           join=True, start_method="spawn")
        return json.loads(Path(out).read_text())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--preset", default="tiny")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--world", type=int, default=4)
    ap.add_argument("--grids", default="1,2,2,1;2,1,1,2;1,1,2,2", help="data,x,y,z;... (product = --world)")
    ap.add_argument("--reduced", action="store_true", help="tiny, batch 4, seq 32, 3 repeats")
    a = ap.parse_args()
    if a.reduced:
        a.preset, a.batch, a.seq, a.repeats = "tiny", 4, 32, 3
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore")
    grids = [tuple(int(v) for v in g.split(",")) for g in a.grids.split(";")]
    res = {"preset": a.preset, "batch": a.batch, "seq": a.seq, "threads": 1,
           "step_time": step_times(a.preset, a.batch, a.seq, a.repeats),
           "payload": payloads(a.preset, a.batch, a.seq, a.world, grids)}
    print(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
