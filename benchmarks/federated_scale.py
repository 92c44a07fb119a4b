"""FAX's shapes rehearsed: one FedAvg round of memaudit's Flax Llama per (preset, cohort,
clients x model mesh, client strategy), beside a centralized step on the same tokens; prints JSON.

For every point: the median round time and its share per client (flat as the cohort grows
when the clients run in parallel over the ``clients`` axis), the compiled round's memory per
device (XLA's memory analysis: arguments + outputs + temporaries - aliased), and the model
FLOPs utilisation relative to a centralized step on the same tokens (``vs_centralized``: the
centralized time over the round's, 1.0 = the round runs its tokens as fast as data-parallel
SGD on the same mesh; below 1.0 is the cost of per-client model copies and of the round's
structure). Client strategies: ``scan`` (one client after the other: ``lax.map`` on one
device, a ``shard_map`` over the ``clients`` axis on a mesh) and ``vmap`` (all clients
batched), `memaudit.federated.federated_map`.

The centralized step is data-parallel SGD, ``local_steps`` steps of the cohort's
``cohort x batch`` sequences, the batch sharded over ``clients`` and the kernels over ``model``
as the round's server parameters are (`memaudit.federated.sharding.server_shardings`).

    # the reduced CPU form (8 host devices; minutes on 2 cores)
    XLA_FLAGS=--xla_force_host_platform_device_count=8 python benchmarks/federated_scale.py --reduced
    # the full form (a GPU node or a large host)
    python benchmarks/federated_scale.py --presets 125m 350m --cohorts 8 16 32 64 \\
        --meshes 8x1 4x2 2x4 --seq 256

Round times on fake host devices sharing a few cores measure the work, not the parallel speed
of real devices: read the per-device memory and the ratios, not the seconds.

Measured (``--reduced``: tiny preset, 1.79M parameters, 8 host devices on 2 cores shared with
other jobs, load average 14-20, jax 0.10.2, 2026-12-03; 2 repeats, so the seconds are noisy):

  ======  =====  ========  ===============  =================  ===================
  cohort  mesh   strategy  round s (/cl.)   MiB per device     vs centralized
  ======  =====  ========  ===============  =================  ===================
  8       8x1    scan      1.80 (0.225)     28.2               1.20
  8       8x1    vmap      1.65 (0.206)     32.9               1.31
  8       4x2    scan      1.12 (0.140)     28.4               1.25
  8       4x2    vmap      2.00 (0.250)     44.5               0.70
  8       2x4    scan      3.05 (0.381)     25.4               0.96
  8       2x4    vmap      4.67 (0.584)     71.4               0.63
  16      8x1    scan      2.65 (0.166)     35.0               0.93
  16      8x1    vmap      4.62 (0.289)     53.7               0.53
  16      4x2    scan      2.52 (0.158)     28.4               1.54
  16      4x2    vmap      5.53 (0.346)     79.5               0.70
  16      2x4    scan      7.22 (0.451)     25.4               1.21
  16      2x4    vmap      8.29 (0.518)     133.8              1.05
  ======  =====  ========  ===============  =================  ===================

The scan strategy's memory per device stays flat as the cohort doubles (one client's
activations at a time); vmap's grows with it (1.6-1.9x).

At full size (2026-12-04, 8 host devices on 2 cores, nothing else running; scan strategy, one
local step of one 32-token sequence a client, one timed repeat after a warm-up):

    python benchmarks/federated_scale.py --presets 125m --cohorts 8 16 32 64 --meshes 8x1 \
        --strategies scan --seq 32 --examples 1 --local-steps 1 --batch 1 --repeats 1
    (350m: --presets 350m --cohorts 8 16 --meshes 2x4; on 8x1 it needs 4.3 GB per device x 8)

  ======  ======  ====  ===============  ==============  ===================  ==========
  preset  cohort  mesh  round s (/cl.)   MiB per device  centralized s (MiB)  GFLOP/s
  ======  ======  ====  ===============  ==============  ===================  ==========
  125m    8       8x1   8.31 (1.04)      1,535           8.17 (1,427)         23.2
  125m    16      8x1   9.31 (0.58)      1,538           7.93 (1,427)         41.3
  125m    32      8x1   14.8 (0.46)      1,538           9.39 (1,427)         52.2
  125m    64      8x1   25.2 (0.39)      1,538           12.3 (1,432)         61.0
  350m    8       2x4   18.3 (2.29)      1,686           14.6 (1,565)         29.4
  350m    16      2x4   29.5 (1.85)      1,686           16.7 (1,567)         36.4
  ======  ======  ====  ===============  ==============  ===================  ==========

Memory per device is flat from cohort 8 to 64 (scan). The round is a fixed cost plus a cost per
client: 5.9 s + 0.30 s a client for 125m (the line through cohorts 8 and 64 predicts 10.7 s and
15.6 s at 16 and 32, measured 9.3 and 14.8), 7.1 s + 1.40 s a client for 350m; the fixed part
(the server's update and the round's copies of the weights) is why the time per client falls
as the cohort grows, and why the round falls behind the centralized step on the same tokens
(0.98 of its speed at cohort 8, 0.49 at 64: the centralized step's batch grows without a
per-client copy). `--plan` models the GPU round as its FLOPs at an assumed MFU: the per-client
part, which at the seeds' shapes (512 clients x 8 steps x 8 x 512 tokens) dwarfs the fixed one.

The client strategies at 125m, memory per device from `--plan 125m:8 125m:16 125m:64 --meshes 8x1
2x4 --strategies scan vmap --seq 32 --examples 1 --local-steps 1 --batch 1` (compiled, not run:
vmap's rounds do not fit this host's 23 GB for 8 devices, and a run of them was killed):

  ======  ====  ==========  ==========
  cohort  mesh  scan MiB    vmap MiB
  ======  ====  ==========  ==========
  8       8x1   1,535       1,474
  16      8x1   1,538       1,986
  64      8x1   1,538       5,466
  8       2x4   873         1,948
  16      2x4   873         3,379
  64      2x4   873         13,635
  ======  ====  ==========  ==========

Scan (`shard_map` over the clients axis, `lax.map` within a device) keeps one client's working
set per device at any cohort; vmap holds every client of a device at once, so its memory grows
with the clients per device: on 8x1 from 1,474 MiB at one client a device (cohort 8, as scan) to
5,466 at 8, on 2x4 from 1,948 MiB at 4 clients a device to 13,635 at 32.

Both strategies run at 125m where vmap fits this host (2026-12-05, 8 host devices on 2 cores,
nothing else running, median of 2 rounds, one call per cohort and mesh: `--presets 125m
--cohorts C --meshes M --strategies scan vmap --seq 32 --examples 1 --local-steps 1 --batch 1
--repeats 2`; the centralized step is timed once a call, so compare within a call):

  ======  ====  ========  ===============  ==============  ==============  ==============
  cohort  mesh  strategy  round s (/cl.)   MiB per device  centralized s   vs centralized
  ======  ====  ========  ===============  ==============  ==============  ==============
  8       8x1   scan      13.9 (1.74)      1,535           13.3            0.96
  8       8x1   vmap      10.1 (1.26)      1,474           13.3            1.32
  16      8x1   scan      14.6 (0.91)      1,538           10.2            0.70
  16      8x1   vmap      14.3 (0.89)      1,986           10.2            0.71
  8       2x4   scan      7.12 (0.89)      873             3.81            0.54
  8       2x4   vmap      12.3 (1.54)      1,948           3.81            0.31
  ======  ====  ========  ===============  ==============  ==============  ==============

At one client a device (cohort 8 on 8x1) vmap is scan without the loop and is faster; at two
(cohort 16) they tie and vmap holds 1.3x the memory; on 2x4, four clients a device, vmap takes
1.7x scan's time and 2.2x its memory (XLA's analysis of the round that ran, the same figures as
the plan's above). vmap at cohort 64 (5,466 MiB a device on 8x1, 13,635 on 2x4) exceeds this host.

`--plan` (the round compiled from shapes; 8 devices, float32 weights, scan, the seeds' seq 512,
8 local steps of 8 sequences; time at 40% of 8 x 989 TFLOP/s):

  ======  ======  ====  =========================  =========================  ==========
  preset  cohort  mesh  GiB per device, FedAvg     GiB per device, FedAdam    round s
  ======  ======  ====  =========================  =========================  ==========
  1b      512     8x1   40.5                       49.9                       36.5
  1b      512     4x2   23.7                       29.3                       36.5
  1b      512     2x4   15.5                       18.8                       36.5
  1b      512     1x8   11.5                       13.6                       36.5
  8b      128     8x1   166.0                      225.9                      64.9
  8b      128     4x2   98.9                       132.8                      64.9
  8b      128     2x4   65.3                       86.2                       64.9
  8b      128     1x8   48.6                       62.9                       64.9
  ======  ======  ====  =========================  =========================  ==========

(`--plan 1b:512 8b:128 --meshes 8x1 4x2 2x4 1x8 --strategies scan --seq 512 --examples 64
--local-steps 8 --batch 8`, and again with `--server-optimizer adam`; 16-27 s of compiling a
round here.) An 80 GB GPU (74.5 GiB) runs 1B x 512 on every mesh with either server optimizer;
8B x 128 from 2x4 on under FedAvg and only on 1x8 under FedAdam (as configs/paper-scale.yaml
trains). An H200 (about 139 GiB visible to JAX) also runs 8B on 4x2, under FedAdam with 6 GiB to
spare; no GPU holds 8B with a whole copy of the weights per device (8x1). The figures are the CPU
compiler's; a GPU run of configs/paper-scale.yaml is what checks them.
"""

from __future__ import annotations

import argparse
import json
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from timing import median_seconds  # benchmarks/timing.py, beside this script

from memaudit.federated.algorithms import fedavg
from memaudit.federated.cohorts import ClientData
from memaudit.federated.sharding import server_shardings
from memaudit.federated.trainer import make_loss_fn
from memaudit.models.flax_llama import FlaxLlama, FlaxLlamaConfig, init_params, kernel_axes

P = jax.sharding.PartitionSpec


def _mesh(spec: str) -> jax.sharding.Mesh:
    c, m = (int(v) for v in spec.split("x"))
    if c * m != len(jax.devices()):
        raise SystemExit(f"mesh {spec} needs {c * m} devices, there are {len(jax.devices())}; "
                         "set XLA_FLAGS=--xla_force_host_platform_device_count=N")
    return jax.make_mesh((c, m), ("clients", "model"), axis_types=(jax.sharding.AxisType.Auto,) * 2)


def _memory_mib(compiled) -> float:
    mem = compiled.memory_analysis()
    return (mem.argument_size_in_bytes + mem.output_size_in_bytes + mem.temp_size_in_bytes
            - mem.alias_size_in_bytes) / 2**20


def _server_optimizer(args):
    """FedAvg's server step (SGD at 1.0) or FedAdam's (its two moments: two more model-sized
    states on the server, sharded as the weights are)."""
    return optax.adam(1e-3) if args.server_optimizer == "adam" else optax.sgd(1.0)


def _round(model, params, ids, mesh, strategy: str, args) -> dict:
    n = ids.shape[0]
    clients = jax.sharding.NamedSharding(mesh, P("clients"))
    data = ClientData(jax.device_put({"input_ids": ids, "attention_mask": np.ones_like(ids)}, clients),
                      jax.device_put(np.ones(ids.shape[:2], np.float32), clients))
    algo = fedavg(make_loss_fn(model), client_optimizer=optax.sgd(0.1), server_optimizer=_server_optimizer(args),
                  local_steps=args.local_steps, batch_size=args.batch, mesh=mesh, map_strategy=strategy)
    state = algo.init(params)
    state = jax.device_put(state, server_shardings(state, mesh, kernel_axes))
    key = jax.random.PRNGKey(0)
    with jax.set_mesh(mesh):
        compiled = algo.jitted.lower(state, data, key).compile()
        round_s = median_seconds(lambda: jax.block_until_ready(compiled(state, data, key)[0].params), args.repeats, warmup=1)
    return {"round_s": round_s, "round_s_per_client": round_s / n, "memory_per_device_mib": _memory_mib(compiled)}


def flops_per_token(cfg: FlaxLlamaConfig, n_params: int, seq: int) -> float:
    """Training FLOPs per token: 6 N for the matmuls of the forward and backward passes plus
    12 L h s for attention's scores and values (Chowdhery et al. 2022, PaLM, appendix B)."""
    return 6.0 * n_params + 12.0 * cfg.num_hidden_layers * cfg.hidden_size * seq


def round_flops(cfg: FlaxLlamaConfig, n_params: int, cohort: int, args) -> float:
    """A FedAvg round's training FLOPs: every client's local steps on its batches."""
    return flops_per_token(cfg, n_params, args.seq) * cohort * args.local_steps * args.batch * args.seq


def _abstract_round(model, cfg, cohort: int, mesh, strategy: str, args) -> dict:
    """The round compiled from shapes alone (nothing allocated, nothing run): XLA's memory per
    device, for shapes too large to run here (the 1b and 8b presets at the seeds' cohorts)."""
    params = jax.eval_shape(lambda: init_params(cfg, seed=0))
    algo = fedavg(make_loss_fn(model), client_optimizer=optax.sgd(0.1), server_optimizer=_server_optimizer(args),
                  local_steps=args.local_steps, batch_size=args.batch, mesh=mesh, map_strategy=strategy)
    state = jax.eval_shape(algo.init, params)
    state = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), state,
                         server_shardings(state, mesh, kernel_axes))
    clients = jax.sharding.NamedSharding(mesh, P("clients"))
    ids = jax.ShapeDtypeStruct((cohort, args.examples, args.seq), jnp.int32, sharding=clients)
    data = ClientData({"input_ids": ids, "attention_mask": ids},
                      jax.ShapeDtypeStruct((cohort, args.examples), jnp.float32, sharding=clients))
    key = jax.eval_shape(lambda: jax.random.PRNGKey(0))
    t0 = time.perf_counter()
    with jax.set_mesh(mesh):
        compiled = algo.jitted.lower(state, data, key).compile()
    return {"memory_per_device_mib": _memory_mib(compiled), "compile_s": time.perf_counter() - t0}


def plan(args) -> list[dict]:
    """`--plan PRESET:COHORT ...`: each round's memory per device (XLA, from shapes) on each mesh,
    its FLOPs, and its time on `--devices` GPUs of `--peak-tflops` at `--mfu` (an assumption,
    stated in the output; a CPU point's achieved rate is no guide to a GPU's)."""
    rows = []
    for item in args.plan:
        preset, cohort = item.split(":")
        cfg = FlaxLlamaConfig.from_preset(preset)
        params = jax.eval_shape(lambda cfg=cfg: init_params(cfg, seed=0))
        n_params = int(sum(np.prod(x.shape) for x in jax.tree.leaves(params)))
        flops = round_flops(cfg, n_params, int(cohort), args)
        seconds = flops / (args.devices * args.peak_tflops * 1e12 * args.mfu)
        for spec in args.meshes:
            mesh = _mesh(spec)
            for strategy in args.strategies:
                r = _abstract_round(FlaxLlama(cfg), cfg, int(cohort), mesh, strategy, args)
                rows.append({"preset": preset, "params": n_params, "cohort": int(cohort), "mesh": spec,
                             "strategy": strategy, **r, "round_tflop": flops / 1e12,
                             "round_s_at_assumed_mfu": seconds})
    return rows


def _centralized(model, params, ids, mesh, args) -> dict:
    """Data-parallel SGD on the round's tokens (see the module docstring)."""
    loss_fn, opt = make_loss_fn(model), optax.sgd(0.1)
    n, steps, b = ids.shape[0], args.local_steps, args.batch
    batches = ids[:, : steps * b].reshape(n, steps, b, -1).swapaxes(0, 1).reshape(steps, n * b, -1)

    def train(p, batches):
        def step(carry, t):
            p, s = carry
            g = jax.grad(lambda p: loss_fn(p, {"input_ids": t, "attention_mask": jnp.ones_like(t)})[0].mean())(p)
            u, s = opt.update(g, s, p)
            return (optax.apply_updates(p, u), s), None

        return jax.lax.scan(step, (p, opt.init(p)), batches)[0][0]

    batches = jax.device_put(batches, jax.sharding.NamedSharding(mesh, P(None, "clients")))
    params = jax.device_put(params, server_shardings(params, mesh, kernel_axes))
    with jax.set_mesh(mesh):
        compiled = jax.jit(train).lower(params, batches).compile()
        s = median_seconds(lambda: jax.block_until_ready(compiled(params, batches)), args.repeats, warmup=1)
    return {"centralized_s": s, "centralized_memory_per_device_mib": _memory_mib(compiled)}


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--presets", nargs="+", default=["125m", "350m"])
    ap.add_argument("--cohorts", type=int, nargs="+", default=[8, 16, 32, 64])
    ap.add_argument("--meshes", nargs="+", default=["8x1", "4x2", "2x4"], help="clients x model")
    ap.add_argument("--strategies", nargs="+", default=["scan", "vmap"], choices=["scan", "vmap"])
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--examples", type=int, default=8, help="sequences per client")
    ap.add_argument("--local-steps", type=int, default=2)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--reduced", action="store_true",
                    help="tiny preset, cohorts 8 and 16, sequences of 32, 2 repeats (a CPU rehearsal)")
    ap.add_argument("--plan", nargs="+", default=None, metavar="PRESET:COHORT",
                    help="compile these rounds from shapes only (memory per device) and model their time")
    ap.add_argument("--devices", type=int, default=8, help="--plan: GPUs the round runs on")
    ap.add_argument("--peak-tflops", type=float, default=989.0,
                    help="--plan: one GPU's dense bf16 peak (H100/H200 SXM: 989)")
    ap.add_argument("--mfu", type=float, default=0.4, help="--plan: assumed model FLOPs utilisation")
    ap.add_argument("--server-optimizer", choices=["sgd", "adam"], default="sgd",
                    help="sgd: FedAvg; adam: FedAdam, as configs/paper-scale.yaml trains")
    args = ap.parse_args(argv)
    if args.plan:
        out = {"benchmark": "federated_scale_plan", "devices_compiled_for": len(jax.devices()),
               "jax": jax.__version__, "seq": args.seq, "examples": args.examples,
               "local_steps": args.local_steps, "batch": args.batch, "server_optimizer": args.server_optimizer,
               "assumed": {"gpus": args.devices, "peak_tflops": args.peak_tflops, "mfu": args.mfu,
                           "flops_per_token": "6 N + 12 L h s (PaLM, appendix B)"},
               "statistic": "memory per device from XLA's memory analysis of the round compiled from shapes "
                            "(float32 weights, CPU backend); time = round FLOPs / (GPUs x peak x MFU)",
               "results": plan(args)}
        print(json.dumps(out, indent=2))
        return out
    if args.reduced:
        args.presets, args.cohorts, args.seq, args.repeats = ["tiny"], [8, 16], 32, 2
    if args.local_steps * args.batch > args.examples:
        raise SystemExit("--local-steps x --batch must be <= --examples (the centralized step's tokens)")
    rows = []
    for preset in args.presets:
        cfg = FlaxLlamaConfig.from_preset(preset)
        model, params = FlaxLlama(cfg), init_params(cfg, seed=0)
        n_params = int(sum(x.size for x in jax.tree.leaves(params)))
        for cohort in args.cohorts:
            ids = np.random.default_rng(cohort).integers(0, cfg.vocab_size, (cohort, args.examples, args.seq),
                                                         dtype=np.int32)
            for spec in args.meshes:
                mesh = _mesh(spec)
                base = _centralized(model, params, ids, mesh, args)
                for strategy in args.strategies:
                    r = _round(model, params, ids, mesh, strategy, args)
                    flops = round_flops(cfg, n_params, cohort, args)
                    rows.append({"preset": preset, "params": n_params, "cohort": cohort, "mesh": spec,
                                 "strategy": strategy if strategy == "vmap" or mesh.shape["clients"] == 1
                                 else "scan (shard_map over clients)", **r, **base,
                                 "vs_centralized": base["centralized_s"] / r["round_s"],
                                 "round_tflop": flops / 1e12, "achieved_gflops": flops / r["round_s"] / 1e9})
    out = {"benchmark": "federated_scale", "devices": len(jax.devices()), "backend": jax.default_backend(),
           "jax": jax.__version__, "seq": args.seq, "examples": args.examples, "local_steps": args.local_steps,
           "batch": args.batch, "repeats": args.repeats,
           "statistic": "median seconds per round; memory per device from XLA's memory analysis",
           "results": rows}
    print(json.dumps(out, indent=2))
    return out


if __name__ == "__main__":
    main()
