"""Step time of the 4D-parallel model: the 1x1x1x1 grid against plain transformers, grids other than
(1,1,1,1) against their serial model, blocking against overlapped collectives (OAR only vs
OAR + ORS + OAG + bucketed data all-reduce), the communication each leaves exposed (step
time minus that of the same step with local no-op collectives), and the wire volume per (axis, kind) counted in
`Comm` against the planner (error per kind; target 0%). Prints JSON.

    python benchmarks/parallel_step.py --preset tiny --batch 8 --seq 64 --repeats 5
    python benchmarks/parallel_step.py --reduced      # quick check (CPU, gloo)
    python benchmarks/parallel_step.py --backend nccl --world 4 --grids "1,2,2,1;2,1,1,2"  # one GPU per rank

On CPU, gloo ranks share the machine's cores: with more ranks than cores the timings are
indicative only (the JSON says so), which is why a 2-rank world is timed as well.
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

OVERLAPPED = {"overlap": True, "overlap_reduce_scatter": True, "overlap_all_gather": True, "bucket_mb": 25.0}
BLOCKING = {"overlap": False}


def _data(vocab: int, batch: int, seq: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (batch, seq), generator=g), torch.ones(batch, seq, dtype=torch.bool)


def step_times(preset: str, batch: int, seq: int, repeats: int, warmup: int = 2, device: str = "cpu",
               bf16: bool = False) -> dict:
    """The serial model (plain transformers, one process) against the 1x1x1x1 parallel model."""
    import contextlib

    from memaudit.models.presets import build_model
    from memaudit.parallel.dims import ParallelDims
    from memaudit.parallel.parallelize import parallelize_llama
    from memaudit.train.losses import causal_lm_loss

    base = build_model(preset, seed=0).to(device)
    ids, mask = (t.to(device) for t in _data(base.config.vocab_size, batch, seq))
    plain = copy.deepcopy(base)
    par = parallelize_llama(copy.deepcopy(base), dims=ParallelDims())
    dev = torch.device(device)
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)

    def ac() -> contextlib.AbstractContextManager:
        return torch.autocast(dev.type, dtype=torch.bfloat16) if bf16 else contextlib.nullcontext()
    opt_p = torch.optim.AdamW(plain.parameters(), lr=1e-4)
    opt_q = torch.optim.AdamW(par.parameters(), lr=1e-4)

    def plain_step() -> None:
        with ac():
            loss = causal_lm_loss(plain(input_ids=ids).logits, ids, mask)
        opt_p.zero_grad()
        loss.backward()
        opt_p.step()

    def par_step() -> None:
        with ac():
            loss, _ = par(ids, mask)
        opt_q.zero_grad()
        loss.backward()
        par.finish_grad_sync()
        opt_q.step()

    times: dict[str, list[float]] = {"serial": [], "parallel_1111": []}
    for i in range(warmup + repeats):  # interleaved so load drifts hit both alike
        for name, fn in (("serial", plain_step), ("parallel_1111", par_step)):
            sync()
            t = time.perf_counter()
            fn()
            sync()
            if i >= warmup:
                times[name].append(time.perf_counter() - t)
    med = {k: statistics.median(v) for k, v in times.items()}
    return {"device": device, "bf16": bf16, "median_s": med, "all_s": times, "ratio": med["parallel_1111"] / med["serial"], "target_ratio": 1.05}


def _dry(comm: object) -> None:
    """Make `comm`'s collectives local no-ops with the right output shapes (timing only: the
    numbers are wrong), so step time minus dry step time is the communication left exposed."""
    def all_reduce(t, axis, *, op=None, async_op=False):
        return None

    def all_gather(shard, axis, *, async_op=False):
        out = shard.reshape(-1).repeat(comm.size(axis))
        return (out, None) if async_op else out

    def reduce_scatter(full, axis, *, async_op=False):
        flat = full.reshape(-1)
        out = flat[: flat.numel() // comm.size(axis)].clone()
        return (out, None) if async_op else out

    comm.all_reduce, comm.all_gather, comm.reduce_scatter = all_reduce, all_gather, reduce_scatter


def _grid_worker(rank: int, world: int, port: int, grids: list, preset: str, batch: int, seq: int,
                 repeats: int, backend: str, out: str) -> None:
    import torch.distributed as dist

    from memaudit.models.presets import build_model
    from memaudit.parallel.dims import ParallelDims, build_groups
    from memaudit.parallel.parallelize import parallelize_llama
    from memaudit.parallel.planner import ModelShape, predict_collectives

    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dev = torch.device("cuda", rank) if backend == "nccl" else torch.device("cpu")
    if backend == "nccl":
        torch.cuda.set_device(dev)
    dist.init_process_group(backend, rank=rank, world_size=world)
    base = build_model(preset, seed=0).to(dev)
    ids, mask = (t.to(dev) for t in _data(base.config.vocab_size, batch, seq))
    sync = torch.cuda.synchronize if backend == "nccl" else (lambda: None)
    rows = []
    for g in grids:
        dims = ParallelDims(data=g[0], x=g[1], y=g[2], z=g[3])
        pg = build_groups(dims)
        models = {k: parallelize_llama(copy.deepcopy(base), dims=dims, pg=pg, **o)
                  for k, o in (("blocking", BLOCKING), ("overlapped", OVERLAPPED), ("no_comm", OVERLAPPED))}
        _dry(models["no_comm"].comm)
        opts = {k: torch.optim.AdamW(m.parameters(), lr=1e-4) for k, m in models.items()}
        times: dict[str, list[float]] = {k: [] for k in models}
        for i in range(2 + repeats):
            for k, pm in models.items():
                dist.barrier()
                sync()
                t = time.perf_counter()
                with pm.comm.counting():
                    loss, _ = pm(pm.shard_batch(ids), pm.shard_batch(mask))
                    opts[k].zero_grad()
                    loss.backward()
                    pm.finish_grad_sync()
                opts[k].step()
                sync()
                if i >= 2:
                    times[k].append(time.perf_counter() - t)
        pm = models["overlapped"]
        pred = predict_collectives(ModelShape.from_config(base.config), dims, batch=batch, seq=seq,
                                   data_in_backward=True)
        err = {f"{a}/{k}": abs(int(pm.comm.bytes.get((a, k), 0)) - b) / b for (a, k), b in pred.items()}
        med = {k: statistics.median(v) for k, v in times.items()}
        rows.append({"grid": dict(zip(("data", "x", "y", "z"), g)), "median_s": med, "all_s": times,
                     "overlap_speedup": med["blocking"] / med["overlapped"],
                     "exposed_comm_s": {k: med[k] - med["no_comm"] for k in ("blocking", "overlapped")},
                     "wire_bytes": {f"{a}/{k}": float(w) for (a, k), w in sorted(pm.comm.wire.items())},
                     "volume_rel_err_by_kind": err, "max_volume_rel_err": max(err.values(), default=0.0),
                     "prefetch_hits": sum(m.gathered.hits for m in pm.hf.modules() if hasattr(m, "gathered")),
                     "buckets": pm.grad_sync.buckets_issued})
    if rank == 0:
        Path(out).write_text(json.dumps(rows))
    dist.destroy_process_group()


def grid_times(preset: str, batch: int, seq: int, world: int, grids: list, repeats: int, backend: str) -> list:
    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as d:
        out = os.path.join(d, "rows.json")
        mp.start_processes(_grid_worker, args=(world, port, grids, preset, batch, seq, repeats, backend, out),
                           nprocs=world, join=True, start_method="spawn")
        return json.loads(Path(out).read_text())


def _grids(spec: str, world: int) -> list[tuple[int, ...]]:
    grids = [tuple(int(v) for v in g.split(",")) for g in spec.split(";") if g]
    for g in grids:
        if len(g) != 4 or g[0] * g[1] * g[2] * g[3] != world:
            raise SystemExit(f"grid {g} is not data,x,y,z with product {world}")
    return grids


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="tiny")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--world", type=int, default=4)
    ap.add_argument("--grids", default="1,2,2,1;2,1,1,2;1,1,2,2", help="data,x,y,z;... (product = --world)")
    ap.add_argument("--small-world", type=int, default=2, help="also time this many ranks (0: skip)")
    ap.add_argument("--small-grids", default="2,1,1,1;1,1,1,2;1,2,1,1")
    ap.add_argument("--backend", default="gloo", choices=("gloo", "nccl"))
    ap.add_argument("--reduced", action="store_true", help="tiny, batch 8, seq 32, 3 repeats")
    a = ap.parse_args()
    if a.reduced:
        a.preset, a.batch, a.seq, a.repeats = "tiny", 8, 32, 3
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore")
    cores = os.cpu_count() or 1
    res: dict = {"preset": a.preset, "batch": a.batch, "seq": a.seq, "threads_per_rank": 1, "cpu_cores": cores,
                 "backend": a.backend, "repeats": a.repeats, "statistic": "median",
                 "serial_vs_1111": step_times(a.preset, a.batch, a.seq, a.repeats)}
    serial = res["serial_vs_1111"]["median_s"]["serial"]
    worlds = [(a.world, a.grids)] + ([(a.small_world, a.small_grids)] if a.small_world else [])
    for world, spec in worlds:
        rows = grid_times(a.preset, a.batch, a.seq, world, _grids(spec, world), a.repeats, a.backend)
        for r in rows:
            r["vs_serial"] = {k: v / serial for k, v in r["median_s"].items()}
        load = os.getloadavg()[0]
        res[f"world{world}"] = {"grids": rows, "load_avg_1min": load,
                                "indicative_only": a.backend == "gloo" and (world > cores or load > cores),
                                "note": f"{world} ranks on {cores} cores" if a.backend == "gloo" else "one GPU per rank"}
    print(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
