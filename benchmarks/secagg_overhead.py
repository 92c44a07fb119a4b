"""Cost of secure aggregation per round, next to plain aggregation and a whole FedAvg round.

Measures, for each cohort size n, model size d and neighbour graph (full = SecAgg,
sparse = SecAgg+):

- ``plain_s``: the jitted ``mean_aggregator`` on (n, d) float32 deltas;
- ``secure_s``: ``secure_aggregation(mean_aggregator())``: clip, quantise, the whole
  protocol between n client objects and a server object (X25519, Shamir, AEAD, masks),
  decode (only where n * d <= --max-wrapper-elems; otherwise only the protocol);
- ``protocol_s``: ``run_round`` alone on pre-quantised uint32 inputs;
- the PRG's mask throughput (AES-256-CTR keystream added mod 2^32) as a fraction of the
  machine's raw AES-256-CTR throughput, both for a large buffer (memory-bound) and a
  cache-sized buffer (AES compute bound);
- a whole FedAvg round (``memaudit.federated.algorithms.fedavg``) on a 1M-parameter linear
  model with and without secure aggregation, if that module is importable.

Prints one JSON object.

    python benchmarks/secagg_overhead.py                 # cohorts 16 64, 1M and 10M params
    python benchmarks/secagg_overhead.py --reduced       # fewer cases, 1 repeat
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time

import numpy as np


def _time(fn, repeats: int) -> float:
    out = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return statistics.median(out)


def prg_throughput(d: int, repeats: int) -> dict:
    from memaudit.federated.secagg import prg

    acc = np.zeros(d, dtype=np.uint32)
    prg.add_mask(acc, os.urandom(32), +1)  # warm buffers
    mask_s = min(_time(lambda: prg.add_mask(acc, os.urandom(32), +1), 1) for _ in range(repeats))
    buf = prg._scratch(d)
    expand_s = min(_time(lambda: prg._keystream_into(os.urandom(32), buf, d), 1) for _ in range(repeats))
    raw_large = prg.raw_aes_ctr_throughput(4 * d, repeats)
    raw_cache = prg.raw_aes_ctr_throughput(1 << 16, 50)
    mask_bps = 4 * d / mask_s
    return {"words": d, "expand_GBps": 4 * d / expand_s / 1e9,
            "expand_fraction_of_raw_large": 4 * d / expand_s / raw_large, "mask_add_GBps": mask_bps / 1e9, "raw_aes_ctr_large_GBps": raw_large / 1e9,
            "raw_aes_ctr_cache_GBps": raw_cache / 1e9, "fraction_of_raw_large": mask_bps / raw_large,
            "fraction_of_raw_cache": mask_bps / raw_cache}


def aggregation_case(n: int, d: int, graph: str, repeats: int, max_wrapper_elems: int) -> dict:
    import jax
    import jax.numpy as jnp

    from memaudit.federated.aggregators import mean_aggregator
    from memaudit.federated.secagg import run_round
    from memaudit.federated.secagg.aggregator import secure_aggregation

    out: dict = {"cohort": n, "params": d, "graph": graph}
    rng = np.random.default_rng(0)
    q = rng.integers(0, 2**20, size=(n, d), dtype=np.uint32)
    t0 = time.perf_counter()
    res = run_round(q, neighbours=graph)
    out["protocol_s"] = time.perf_counter() - t0
    out["degree"] = res.degree
    out["bytes_up_per_client"] = res.bytes_up / n
    if repeats > 1:
        out["protocol_s"] = min(out["protocol_s"], _time(lambda q=q: run_round(q, neighbours=graph), repeats - 1))
    q = None  # free the inputs before the wrapper's own copies
    if n * d <= max_wrapper_elems:
        deltas = jnp.asarray(rng.normal(size=(n, d)).astype(np.float32) * 1e-3)
        w = jnp.ones(n)
        plain = jax.jit(mean_aggregator().aggregate)
        jax.block_until_ready(plain(deltas, w, None, None).update)
        out["plain_s"] = _time(lambda: jax.block_until_ready(plain(deltas, w, None, None).update), max(repeats, 3))
        agg = secure_aggregation(mean_aggregator(), clip=1.0, neighbours=graph, seed=0)
        st = agg.init(None)
        out["secure_s"] = _time(lambda: agg.aggregate(deltas, w, st, jax.random.key(0)), repeats)
        out["secure_over_plain"] = out["secure_s"] / out["plain_s"]
    return out


def federated_round(n: int, repeats: int) -> dict:
    try:
        import jax
        import jax.numpy as jnp
        import optax

        from memaudit.federated.aggregators import mean_aggregator
        from memaudit.federated.algorithms import fedavg
        from memaudit.federated.cohorts import ClientData
        from memaudit.federated.secagg.aggregator import secure_aggregation
    except ImportError as e:
        return {"skipped": f"federated algorithms module not importable: {e}"}

    k = 1000  # params: a (1000, 1000) linear map = 1M
    def loss_fn(params, batch):
        pred = batch["x"] @ params["w"]
        return jnp.sum((pred - batch["y"]) ** 2, axis=-1), {}

    rng = np.random.default_rng(0)
    data = ClientData({"x": jnp.asarray(rng.normal(size=(n, 8, k)), jnp.float32),
                       "y": jnp.asarray(rng.normal(size=(n, 8, k)), jnp.float32)}, jnp.ones((n, 8)))
    params = {"w": jnp.zeros((k, k), jnp.float32)}
    out = {"cohort": n, "params": k * k}
    for name, agg in (("plain", mean_aggregator()),
                      ("secure_full", secure_aggregation(mean_aggregator(), clip=10.0, neighbours="full", seed=0)),
                      ("secure_sparse", secure_aggregation(mean_aggregator(), clip=10.0, neighbours="sparse", seed=0))):
        alg = fedavg(loss_fn, client_optimizer=optax.sgd(1e-4), server_optimizer=optax.sgd(1.0),
                     local_steps=2, batch_size=4, aggregator=agg, weighting="uniform")
        state = alg.init(params)
        state, _ = alg.round(state, data, jax.random.key(0))  # compile
        jax.block_until_ready(state.params)

        def one(alg=alg, state=state):
            s, _ = alg.round(state, data, jax.random.key(1))
            jax.block_until_ready(s.params)
        out[f"{name}_round_s"] = _time(one, repeats)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cohorts", type=int, nargs="+", default=[16, 64])
    ap.add_argument("--params", type=float, nargs="+", default=[1e6, 1e7])
    ap.add_argument("--graphs", nargs="+", default=["full", "sparse"])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--max-wrapper-elems", type=float, default=2**28,
                    help="run the full wrapper (with float deltas) only up to n*d elements")
    ap.add_argument("--reduced", action="store_true", help="1 repeat; the 64 x 10M full graph only as protocol")
    ap.add_argument("--skip", nargs="*", default=[], help="cases to skip as n:d:graph, e.g. 64:10000000:full")
    args = ap.parse_args()
    repeats = 1 if args.reduced else args.repeats
    result = {"machine": {"platform": platform.platform(), "cpus": os.cpu_count(),
                          "load_avg": os.getloadavg()},
              "prg": prg_throughput(int(max(args.params)), max(repeats, 3)), "aggregation": [],
              "skipped": []}
    for n in args.cohorts:
        for d in (int(p) for p in args.params):
            for g in args.graphs:
                tag = f"{n}:{d}:{g}"
                if tag in args.skip:
                    result["skipped"].append(tag)
                    continue
                result["aggregation"].append(aggregation_case(n, d, g, repeats, int(args.max_wrapper_elems)))
                print(json.dumps(result["aggregation"][-1]), flush=True, file=__import__("sys").stderr)
    result["federated_round"] = federated_round(min(args.cohorts), repeats)
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
