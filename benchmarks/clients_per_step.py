"""FedAvg and DP-FedAvg rounds with k clients per step of the clients' loop, side by side.

``federated.clients_per_step`` (`memaudit.federated.algorithms.fedavg`'s ``clients_per_step``)
runs k clients vmapped in each step of the scan strategy's loop over the cohort, the sum (and
DP-FedAvg's clipping) still inside the loop. This script compiles one round per (algorithm, k)
on the same tiny Flax Llama and the same random tokens, then times the rounds interleaved (each
repeat runs every variant once, in turn) and prints one JSON object: per variant the median
seconds of a warm round, XLA's memory of the compiled round, and the ratio to k = 1 of the same
algorithm. On an accelerator `benchmarks/federated_chip.py --only steps` measures the same
variants at the chip's presets.

    python benchmarks/clients_per_step.py                       # tiny preset, cohort 8, CPU
    python benchmarks/clients_per_step.py --ks 1 2 4 8 --repeats 9

Measured 2026-12-06 on the CPU (2 cores shared with other jobs, load about 20; tiny preset,
1.79M params, cohort 8, sequence 32, 2 local steps of 2, 7 interleaved repeats, ``--seq 32``):
FedAvg k = 1 / 2 / 4: 0.63 / 5.65 / 7.23 s a round (8.95x and 11.45x k = 1), XLA's memory
0.029 / 0.046 / 0.079 GiB; DP-FedAvg 0.95 / 6.08 / 6.51 s (6.39x, 6.83x), 0.040 / 0.048 /
0.080 GiB; the weights within 4e-9 of k = 1. On XLA CPU a batched matmul with per-client
weights runs as a loop of small GEMMs, so k = 1 stays the CPU's choice; k > 1 is for a chip
whose matmul units one client leaves idle, measured there with `federated_chip.py --only steps`.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax

from memaudit.federated.aggregators import mean_aggregator
from memaudit.federated.algorithms import fedavg
from memaudit.federated.cohorts import ClientData
from memaudit.federated.dp import dp_fedavg
from memaudit.federated.trainer import make_loss_fn
from memaudit.models.flax_llama import FlaxLlama, FlaxLlamaConfig, init_params
from memaudit.models.precision import resolve_policy


def compiled_gib(compiled) -> float:
    mem = compiled.memory_analysis()
    return round((mem.argument_size_in_bytes + mem.output_size_in_bytes + mem.temp_size_in_bytes
                  - mem.alias_size_in_bytes) / 2**30, 4)


def variant(model, params, data, args, *, dp: bool, k: int):
    """A compiled round of FedAvg (or DP-FedAvg) with k clients a step, and its compile seconds."""
    agg = dp_fedavg(mean_aggregator(), clip=0.1, noise_multiplier=1.0,
                    expected_cohort=float(args.cohort)) if dp else None
    algo = fedavg(make_loss_fn(model), client_optimizer=optax.sgd(0.1), server_optimizer=optax.sgd(1.0),
                  local_steps=args.local_steps, batch_size=args.batch, aggregator=agg,
                  weighting="uniform" if dp else "examples", map_strategy="scan", clients_per_step=k)
    state = algo.init(params)
    key = jax.random.key(0)
    t0 = time.perf_counter()
    compiled = algo.jitted.lower(state, data, key).compile()
    compile_s = time.perf_counter() - t0
    new, _ = compiled(state, data, key)
    return compiled, state, key, compile_s, np.asarray(jax.tree.leaves(new.params)[0], np.float32)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="tiny")
    ap.add_argument("--cohort", type=int, default=8)
    ap.add_argument("--ks", type=int, nargs="+", default=[1, 2, 4])
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--local-steps", type=int, default=2)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=7)
    args = ap.parse_args(argv)
    cfg = FlaxLlamaConfig.from_preset(args.preset, policy=resolve_policy("float32"))
    model, params = FlaxLlama(cfg), jax.jit(lambda: init_params(cfg, seed=0))()
    ids = np.random.default_rng(0).integers(0, cfg.vocab_size, (args.cohort, args.local_steps * args.batch, args.seq),
                                            dtype=np.int32)
    data = ClientData({"input_ids": jnp.asarray(ids), "attention_mask": jnp.ones(ids.shape, jnp.int32)},
                      jnp.ones(ids.shape[:2], jnp.float32))
    variants, rows = {}, {}
    for dp in (False, True):
        for k in args.ks:
            name = f"{'dp_fedavg' if dp else 'fedavg'}_k{k}"
            compiled, state, key, compile_s, first = variant(model, params, data, args, dp=dp, k=k)
            variants[name] = (compiled, state, key)
            rows[name] = {"k": k, "compile_s": round(compile_s, 2), "compiled_gib": compiled_gib(compiled),
                          "first_leaf": first}
    times = {name: [] for name in variants}
    for _ in range(args.repeats + 1):  # the first pass warms every variant and is not kept
        for name, (compiled, state, key) in variants.items():
            t0 = time.perf_counter()
            jax.block_until_ready(compiled(state, data, key)[0].params)
            times[name].append(time.perf_counter() - t0)
    out = {}
    for name, row in rows.items():
        base = name.rsplit("_k", 1)[0] + "_k1"
        med = statistics.median(times[name][1:])
        row["round_s"] = round(med, 4)
        if base in rows:
            row["vs_k1"] = round(med / statistics.median(times[base][1:]), 3)
            # the same round: k only regroups the sum over the clients (float rounding)
            row["max_abs_diff_vs_k1"] = float(np.max(np.abs(row["first_leaf"] - rows[base]["first_leaf"])))
        out[name] = {k: v for k, v in row.items() if k != "first_leaf"}
    print(json.dumps({"benchmark": "clients_per_step", "backend": jax.default_backend(),
                      "device": jax.devices()[0].device_kind, "cpus": len(jax.devices("cpu")),
                      "machine": platform.machine(), "jax": jax.__version__, "preset": args.preset,
                      "params": int(sum(x.size for x in jax.tree.leaves(params))), "cohort": args.cohort,
                      "seq": args.seq, "local_steps": args.local_steps, "batch": args.batch,
                      "repeats": args.repeats, "interleaved": True, "variants": out}, indent=1))


if __name__ == "__main__":
    main()
