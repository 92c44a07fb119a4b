"""One FedAvg round four ways, side by side; prints JSON.

Variants (same model, same tokens, same optimizers):

- ``program``: memaudit's federated program (`memaudit.federated.algorithms.fedavg`) with the
  default ``federated_map`` strategy (``"auto"``: on CPU the clients' local training runs
  one client after the other inside the compiled program, ``lax.map``; on accelerators
  ``vmap``), clients sharded over a ``clients`` mesh axis when there is more than one device;
  its default aggregator, the weighted mean, sums the deltas inside the loop over the clients;
- ``program_vmap`` / ``program_scan``: the same program with ``map_strategy="vmap"`` (all
  clients batched: per-client weights make every matmul a batched matmul) or ``"scan"``
  (``--strategies`` picks which of these extra variants run);
- ``program_padded``: ``program`` with the same clients packed into twice the clients dim (absent
  slots with no data and weight 0, as a Poisson round's capacity padding, dealt evenly over
  the devices): the absent slots skip local training (also on a ``clients`` mesh axis, where
  each device loops over its own clients in a ``shard_map``), so this should cost about what
  ``program`` costs;
- ``client_loop``: a Python loop over the cohort calling one jitted local-training function per
  client, then the mean delta and the server step;
- ``centralized``: data-parallel SGD, ``local_steps`` steps of the cohort's cohort x batch
  sequences each (the same tokens), sharded over the devices like the clients (a ``shard_map``
  over the ``clients`` axis, the gradient averaged every step): what a centralized step on the
  round's tokens costs, the limit the round is compared with (``*_vs_centralized``, and
  ``program_vs_drjax``);
- ``drjax``: the same round written with ``drjax`` (if installed: ``pip install drjax``).

Model: a 1.31M-parameter causal "MLP language model" in plain JAX (token embedding 512 x 256,
causal running-mean context mixing, two residual ReLU MLP blocks 256 -> 1152 -> 256, tied
output embedding). Each variant runs ``--repeats`` timed rounds after one warm-up (compile)
round; the variants take turns within each repeat (a shared machine's load hits all alike);
the JSON holds medians of wall seconds (``*_s``) and of this process's CPU seconds
(``*_cpu_s``: on a machine shared with other jobs the steadier measure of the work a variant
does), their ratios to the centralized limit, and the XLA compiles of each variant during its
warm-up round and during the timed rounds (0: no recompilation between rounds).

A second table, ``layouts``, is model parallelism inside the clients: a FedAvg round of the
Flax Llama (memaudit's own, `memaudit.models.flax_llama`) at growing widths on a 1-D
``clients`` mesh over all d devices (every device holds whole models) beside a 2-D
(clients d/2, model 2) mesh whose attention and MLP kernels are split over ``model``
(``PARTITION_RULES``): per-device memory of the compiled round (XLA's memory analysis:
arguments, outputs, temporaries), the server parameters held per device, and the median round
time. ``--layouts`` adds this table, ``--layouts-only`` runs only it.

Measured (jax 0.10.2, XLA:CPU, a 2-core machine shared with other jobs, load average about
13: the CPU seconds are the steadier figure; medians):

- ``program_padded`` / ``program`` on a 2-device ``clients`` axis (cohort 8 in 16 slots, 5
  repeats): 0.96x wall, 1.00x CPU with the ``shard_map`` client loop; 1.87x wall, 1.92x CPU
  with the former vmap over the device shards (the absent slots' skip was a select there).
- ``centralized`` as the limit (cohort 8 on 8 host devices, ``XLA_FLAGS=
  --xla_force_host_platform_device_count=8``, 5 repeats; 2026-12-03, load average 14-20):
  the former variant (one jitted loop over unsharded tokens) took 30.0 s wall, 10.25 s CPU
  against the round's 3.51 s / 1.26 s, a "limit" 8.5x slower than what it bounds; the
  data-parallel one takes 3.19 s / 1.25 s, and the round (``program``) 3.36 s / 1.21 s: 1.06x
  wall, 0.96x CPU of the limit; drjax 4.94 s / 1.41 s, the round 0.68x wall, 0.86x CPU of it.
- ``layouts`` (8 fake devices, Flax Llama with 2 layers, 8 heads, 4 kv heads, vocab 512,
  intermediate 4 x hidden; cohort 8, 16 sequences of 64 per client, 4 local steps of 4;
  3 repeats), per device, MiB, 1-D (clients 8) vs 2-D (clients 4, model 2):

  ======  ========  ================  ================  ===============  ===========
  hidden  params    server params     arguments         temporaries      round s
  ======  ========  ================  ================  ===============  ===========
  128     0.62M     2.38 vs 1.44      2.39 vs 1.46      12.4 vs 8.9      1.78 vs 0.94
  256     2.23M     8.50 vs 4.75      8.51 vs 4.77      21.9 vs 17.6     6.62 vs 6.26
  512     8.39M     32.0 vs 17.0      32.0 vs 17.0      50.2 vs 43.7     15.1 vs 15.8
  ======  ========  ================  ================  ===============  ===========

  Total per device (arguments + outputs + temporaries): 17.2 vs 11.8, 38.9 vs 27.1,
  114.2 vs 77.7 MiB. The embeddings, norms and lm_head stay replicated, so the server
  parameters per device fall to 53-61 % of the model rather than 50 %. Round times on 8 fake
  devices over 2 shared cores say little about real devices.

A third table, ``flower`` (``--flower``), is the runtime: the same memaudit training run (tiny
Llama, FedAvg) with ``federated.runtime=jax`` and ``federated.runtime=flower`` on a one-machine
federation (a SuperLink and ``--flower-nodes`` SuperNodes as processes on 127.0.0.1,
`memaudit.federated.flower.deploy.LocalFederation`): the median ``round_seconds`` the trainer
records (rounds after the first, which compiles), and their ratio. A Flower round pays a
``flwr-clientapp`` process per message and node (Python and JAX start-up, the client stage's
module read back from ``jax.export`` and XLA's persistent cache), the messages through the
SuperLink, and the server stages. Measured 2026-12-01 (flwr 1.42.0, jax 0.10.2, 2 shared cores,
load average about 9; tiny preset, 16 users, cohort 8 fixed, sequences of 64, 4 local steps of 4,
2 SuperNodes; median of rounds 2-4): 2.40 s a round in JAX, 13.55 s on Flower, a ratio of 5.6.
The table also runs both with secure aggregation (``privacy.secure_aggregation.enabled``,
clip 1.0): on Flower the protocol's clients run on the SuperNodes, four more message exchanges
a round (advertise, share keys, masked input, unmask), each a new ``flwr-clientapp`` process per
node. Measured 2026-12-01 (same set-up, load average about 4, median of rounds 2-4): in JAX
1.41 s a round, with secure aggregation 2.24 s; on Flower 9.45 s, with secure aggregation
43.4 s (19.4x in-JAX secure aggregation, 4.6x plain Flower: the process start-ups of the four
exchanges dominate); the secure-aggregation runs' weights equal (max difference 0.0).

Since 2026-12-03 each SuperNode answers through a resident process (`memaudit.federated.flower.node`);
``--flower-per-message`` adds the same two Flower runs with a ``flwr-clientapp`` process doing
each message's work, side by side. Measured 2026-12-03 (2 cores, nothing else running, median
of rounds 2-4): in JAX 0.87 s and 1.48 s with secure aggregation; Flower with resident nodes
5.81 s and 32.5 s; a process per message 9.19 s and 45.4 s (resident 1.58x and 1.40x faster).
The rest is Flower 1.42's polling (docs/flower.md, "What a round costs"; dated figures in docs/results.md). Measured 2026-12-04 with node-shaped
stages (same set-up): 2 SuperNodes 8.59 s against 0.89 s in JAX, 32.9 s against 1.44 s with
secure aggregation; 4 SuperNodes 13.9 s against 0.84 s, 37.7 s against 1.22 s (weights equal);
2 SuperNodes over 8 rounds (``--flower-rounds 8``, median of rounds 2-8) 7.19 s against 1.30 s
and 32.9 s against 1.41 s.

Since 2026-12-04 ``LocalFederation`` starts memaudit's SuperLink and SuperNodes
(`memaudit.federated.flower.supernode`: one long-lived ClientApp process, Flower's waits made
polls); ``--flower-own-supernode`` adds the same two runs on Flower's own ``flower-supernode``,
side by side. Measured 2026-12-04 (2 SuperNodes, ``--flower-rounds 10``, median of rounds 2-10,
2 cores, nothing else running): in JAX 0.96 s and 1.90 s with secure aggregation; memaudit's
SuperNodes 1.92 s (2.0x) and 7.11 s (3.7x); Flower's own 5.32 s (5.5x) and 30.9 s (16.3x):
2.8x and 4.3x faster; the secure runs' weights equal (0.0).

Since 2026-12-05 the weights travel once for all the nodes of an exchange (one shared record)
and a node sends one masked vector, its users' masked inputs added up. Measured 2026-12-05 (2
SuperNodes, ``--flower-rounds 10``): before, in JAX 0.79 s and 1.08 s, on Flower 1.63 s (2.07x)
and 6.11 s (5.66x); after, in JAX 0.76 s and 1.06 s, on Flower 1.42 s (1.88x) and 3.91 s
(3.69x); the secure runs' weights equal (0.0). Later that day, with secure aggregation's encoder
off BLAS, the SuperNode's looks at its own memory every 0.01 s and secure aggregation's arrays in
ordinary pages (docs/flower.md, "What a round costs"; dated figures in docs/results.md; ``--flower-rounds 10``, median of rounds 2-10): 2 SuperNodes, in JAX 0.88 s
and 1.20 s, on Flower 1.47 s (1.68x) and 3.04 s (2.54x); 4 SuperNodes, in JAX 0.84 s and 1.20 s,
on Flower 4.67 s and 6.72 s. The ``*_warm_*`` keys are the median of the rounds in which no node
ran a stage module new to it (the round's ``nodes_compiling`` is 0): 2 SuperNodes 1.43 s (1.63x)
and 3.01 s (2.51x), 4 SuperNodes 2.14 s (2.55x) and 4.72 s (3.94x).

Since the afternoon of 2026-12-05 a payload over 1 MiB travels as an Array of raw bytes, not a
ConfigRecord value (`memaudit.federated.flower.messages`; docs/flower.md, "What a round costs"; dated figures in docs/results.md). Warm medians the same
afternoon, before and after: 2 SuperNodes 1.456 s and 1.540 s (two runs) against 1.352 s,
1.404 s and 1.352 s (three runs, 1.54-1.66x), secure 3.235 s and 3.904 s against 3.011 s,
3.160 s and 2.930 s (2.40-2.63x); 4 SuperNodes 1.972 s against 1.942 s (2.23x), secure 4.904 s
against 4.605 s (3.56x).

Held asks (`memaudit.federated.flower.transport.longpoll`; docs/flower.md, "What a round costs"; dated figures in docs/results.md), interleaved pairs the
same day, before (8d8106c) and after: 2 SuperNodes 1.428 s, 1.445 s and 1.293 s against
1.303 s (1.58x), 1.336 s (1.54x) and 1.257 s; secure 3.019 s, 3.042 s and 2.741 s against
2.474 s (2.13x), 2.735 s (2.30x) and 2.443 s (2.03x); 4 SuperNodes 1.777 s against 1.771 s,
secure 6.295 s against 4.011 s. A baseline from a worktree runs from that worktree's directory
(``cd WORKTREE && PYTHONPATH=. python benchmarks/federated_round.py ...``): the SuperLink,
SuperNodes and ServerApp are ``python -m`` processes, which import memaudit from their working
directory first.

Since the evening of 2026-12-05 memaudit's SuperNode and SuperLink run their SuperExecs, and the
SuperLink each run's ServerApp, as threads of their own process, calling Flower's runtime
handlers on their own state rather than the runtime API over HTTP
(`memaudit.federated.flower.transport.localruntime`; docs/flower.md, "What a round costs"; dated figures in docs/results.md). Warm medians, interleaved pairs
on 2 SuperNodes: the SuperNode's change alone 1.348, 1.316, 1.269 s against 1.276 s (1.42x),
1.226 s (1.36x), 1.134 s (1.37x); secure 2.624, 2.702, 2.553 s against 2.353 s (1.86x), 2.355 s
(1.86x), 2.145 s (1.84x); then the SuperLink's too: 1.160, 1.190 s against 1.007 s (1.23x),
1.057 s (1.22x); secure 2.321, 2.237 s against 1.671 s (1.48x), 1.721 s (1.39x). The table also
runs DP-FedAvg with secure aggregation (``privacy.noise_multiplier=1.0``, user level, the
noise drawn from the run's key so that the two runtimes' weights can be compared:
``dp_secagg_max_weight_diff``); its warm keys are ``flower_dp_secagg_warm_*``.

Late on 2026-12-05 a node's stage modules keep one width for the run (its steady capacity,
`memaudit.federated.flower.manifest.steady_node_capacity`) and secure aggregation clips a node's
rows in numpy (docs/flower.md, "What a round costs"; dated figures in docs/results.md). 4 SuperNodes, before: every round's median 3.19 s and
3.17 s, warm (4 of 9 rounds) 1.477 s (1.68x) and 1.367 s (1.56x); secure 4.24 s and 4.28 s,
warm 2.841 s (2.22x) and 2.907 s (2.48x); DP 5.20 s and 5.06 s, warm 2.535 s (1.99x) and
2.568 s (1.94x). After, every round warm: 1.427 s (1.63x) and 1.397 s (1.52x), secure 2.738 s
(2.33x) and 2.634 s (2.08x), DP 2.811 s (2.16x) and 2.725 s (1.93x); a run of the three
variants 59.7 s and 54.5 s before, 40.5 s and 39.5 s after. 2 SuperNodes, before and after:
1.060 s (1.17x) and 1.118 s (1.11x), secure 1.729 s (1.41x) and 1.859 s (1.45x), DP 1.904 s
(1.44x) and 1.869 s (1.31x); the runs 35.4 s and 27.6 s. The in-JAX run of this table is in the
benchmark's process: run it without ``XLA_FLAGS`` device counts, as the SuperNodes run (1
device); with 8 host devices its secure runs' weights differed from the nodes' (0.00033, DP
0.0499): XLA's CPU code for the model's gradient differs with the host device count (8.4e-9 in
one gradient of ``tiny``), and secure aggregation's rounding turns such a difference into whole
quantisation steps (docs/flower.md, "Secure aggregation and distributed DP").

Since 2026-12-06 memaudit's SuperNode pulls a message and pushes its reply in one Fleet request
each from memaudit's SuperLink (`memaudit.federated.flower.transport.bundle`; docs/flower.md, "What a round costs"; dated figures in docs/results.md);
``--flower-unbundled`` adds the FedAvg and secure runs with Flower's nine requests a message
(``--fleet flower``), on a federation of their own, and ``bundled_speedup*`` their ratio.
Measured 2026-12-06 (``--flower-rounds 10``, warm, 9 of 9 rounds): 4 SuperNodes, four runs,
FedAvg 1.22-1.26x the in-JAX round, secure 1.28-1.32x, DP and secure 1.24-1.31x; Flower's
requests in the same runs 1.31-1.35x and 1.52-1.59x (bundled 1.05-1.11x and 1.16-1.23x faster);
2 SuperNodes 1.03x, 1.09x, 1.09x.

Since 2026-12-06 the table's in-JAX and Flower runs take turns on one federation, over
``--flower-waves`` waves (default 2; in even waves the in-JAX run of a variant first, in odd ones
the Flower run), so a shared machine's load falls on both sides alike; the round medians pool the
waves' rounds. ``cpu_s`` is each run's CPU seconds (user + system, first round included) per
process, the median over the waves: ``benchmark`` (this process and the children it waited for:
the in-JAX run, or the Flower run's submission), ``superlink`` (with the Flower run's ServerApp,
a thread of it) and each ``supernode_i`` (each process with its descendants, from ``/proc``;
during an in-JAX run the federation only idles); ``flower*_cpu_vs_jax*`` is the ratio of their totals, the measure a
shared host can give. ``max_weight_diff`` is plain FedAvg's largest weight difference between
wave 0's in-JAX and Flower runs (the secure runs': ``secagg_max_weight_diff``,
``dp_secagg_max_weight_diff``). ``--reduced`` runs 3 rounds a run.

A fourth table, ``node-shapes`` (``--node-shapes``, alone), is the partitioned FedAvg round on
nodes in this process, the cohort's clients dealt evenly: every node running the cohort's client
stages against each running the stages shaped for its own slots
(`memaudit.federated.flower.partition.node_stages`), interleaved, plus the bytes a node's
secure-aggregation client phase takes in and gives out. Measured 2026-12-04 (cohort 16, seq 64,
2 cores, median of 3): node-shaped/cohort-shaped round time 1.03, 0.98, 1.00, 0.95, 0.92 on 1,
2, 4, 8, 16 nodes; the client phase per node 85.3 MiB -> 45.1, 25.1, 15.0, 10.0 MiB; weights
equal (0.0). docs/results.md ("Stages shaped for the node") has the table.

    python benchmarks/federated_round.py --node-shapes  # the node-shapes table alone
    python benchmarks/federated_round.py --flower-only  # the Flower table alone
    python benchmarks/federated_round.py                # cohorts 8 and 32, seq 64
    python benchmarks/federated_round.py --reduced      # a quick, smaller run
    XLA_FLAGS=--xla_force_host_platform_device_count=8 \
        python benchmarks/federated_round.py --layouts-only
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import export

from memaudit.federated.algorithms import fedavg, masked_mean_loss
from memaudit.federated.cohorts import ClientData

VOCAB, DIM, HIDDEN, BLOCKS = 512, 256, 1152, 2


def init_params(seed: int = 0) -> dict:
    k = iter(jax.random.split(jax.random.PRNGKey(seed), 2 + 2 * BLOCKS))
    params = {"embed": jax.random.normal(next(k), (VOCAB, DIM)) * 0.02}
    for b in range(BLOCKS):
        params[f"up{b}"] = jax.random.normal(next(k), (DIM, HIDDEN)) * DIM**-0.5
        params[f"up{b}_b"] = jnp.zeros(HIDDEN)
        params[f"down{b}"] = jax.random.normal(next(k), (HIDDEN, DIM)) * HIDDEN**-0.5 * 0.5
        params[f"down{b}_b"] = jnp.zeros(DIM)
    params["out_b"] = jnp.zeros(VOCAB)
    return params


def loss_fn(params, batch):
    """Next-token cross-entropy per sequence; batch["tokens"] (B, L) int32."""
    tokens = batch["tokens"]
    h = params["embed"][tokens[:, :-1]]  # (B, L-1, DIM)
    steps = jnp.arange(1, h.shape[1] + 1, dtype=h.dtype)[None, :, None]
    h = h + jnp.cumsum(h, axis=1) / steps  # causal running-mean context
    for b in range(BLOCKS):
        z = jax.nn.relu(h @ params[f"up{b}"] + params[f"up{b}_b"])  # (B, L-1, HIDDEN)
        h = h + z @ params[f"down{b}"] + params[f"down{b}_b"]
    logits = h @ params["embed"].T + params["out_b"]  # (B, L-1, VOCAB)
    nll = -jnp.take_along_axis(jax.nn.log_softmax(logits), tokens[:, 1:, None], -1)[..., 0]
    return nll.mean(axis=1), None  # (B,)


class _CompileCounter:
    """Counts XLA backend compiles (``jax.monitoring``), to show rounds reuse one executable."""

    EVENT = "/jax/core/compile/backend_compile_duration"

    def __init__(self):
        self.count = 0
        jax.monitoring.register_event_duration_secs_listener(self._on_event)

    def _on_event(self, event, duration, **kwargs):
        del duration, kwargs
        if event == self.EVENT:
            self.count += 1


def _interleaved(runners: dict, repeats: int, compiles: _CompileCounter) -> dict[str, dict]:
    """Median wall and CPU seconds per call, and compiles during the timed calls; variants take
    turns so a shared machine's load hits all alike."""
    wall: dict[str, list[float]] = {k: [] for k in runners}
    cpu: dict[str, list[float]] = {k: [] for k in runners}
    timed_compiles = dict.fromkeys(runners, 0)
    for _ in range(repeats):
        for name, fn in runners.items():
            n0, c0, t0 = compiles.count, time.process_time(), time.perf_counter()
            fn()
            wall[name].append(time.perf_counter() - t0)
            cpu[name].append(time.process_time() - c0)
            timed_compiles[name] += compiles.count - n0
    return {k: {"wall": statistics.median(wall[k]), "cpu": statistics.median(cpu[k]),
                "timed_compiles": timed_compiles[k]} for k in runners}


def _block(tree):
    return jax.block_until_ready(tree)


def bench_program(params, data, args, mesh, strategy="auto"):
    algo = fedavg(
        loss_fn, client_optimizer=optax.sgd(0.1), server_optimizer=optax.sgd(1.0),
        local_steps=args.local_steps, batch_size=args.batch, mesh=mesh, map_strategy=strategy,
    )
    state = algo.init(params)
    key = jax.random.PRNGKey(0)
    return lambda: _block(algo.round(state, data, key)[0].params)


def _local_train(params, tokens, key, local_steps, batch):
    opt = optax.sgd(0.1)

    def step(carry, k):
        p, s = carry
        idx = jax.random.choice(k, tokens.shape[0], (batch,), replace=False)
        mask = jnp.ones(batch)
        g = jax.grad(lambda p: masked_mean_loss(loss_fn, p, {"tokens": tokens[idx]}, mask))(p)
        u, s = opt.update(g, s, p)
        return (optax.apply_updates(p, u), s), None

    (p, _), _ = jax.lax.scan(step, (params, opt.init(params)), jax.random.split(key, local_steps))
    return jax.tree.map(jnp.subtract, p, params)


def bench_client_loop(params, data, args):
    local = jax.jit(lambda p, t, k: _local_train(p, t, k, args.local_steps, args.batch))
    server = jax.jit(lambda p, deltas: jax.tree.map(
        lambda x, *d: x + sum(d) / len(d), p, *deltas))
    tokens = [data.examples["tokens"][i] for i in range(args.cohort)]
    keys = jax.random.split(jax.random.PRNGKey(0), args.cohort)

    def round_():
        deltas = [local(params, tokens[i], keys[i]) for i in range(args.cohort)]
        return _block(server(params, deltas))

    return round_


def bench_centralized(params, data, args, mesh):
    """Data-parallel SGD over the round's tokens: ``local_steps`` steps of the cohort's
    ``cohort x batch`` sequences (step t takes each client's sequences t*batch ... (t+1)*batch),
    sharded over the devices as the clients are (each device the sequences of its clients),
    the gradient averaged over the devices every step. The same tokens, model, optimizer and
    sharding as the round, without its per-client copies of the model: the limit."""
    opt = optax.sgd(0.1)
    tokens = data.examples["tokens"]  # (cohort, examples, seq)
    cohort, steps, batch = tokens.shape[0], args.local_steps, args.batch
    if steps * batch > tokens.shape[1]:
        raise ValueError(f"--local-steps x --batch = {steps * batch} exceeds --examples "
                         f"{tokens.shape[1]}; give each client more sequences")
    per_step = tokens[:, : steps * batch].reshape(cohort, steps, batch, -1).swapaxes(0, 1)
    per_step = per_step.reshape(steps, cohort * batch, -1)  # (steps, cohort x batch, seq), clients' rows in order
    k = 1 if mesh is None else mesh.devices.size

    def train(p, batches):  # batches: this device's (steps, rows, seq)
        def step(carry, t):
            p, s = carry
            g = jax.grad(lambda p: loss_fn(p, {"tokens": t})[0].mean())(p)
            if k > 1:
                g = jax.lax.pmean(g, "clients")  # the data-parallel gradient all-reduce
            u, s = opt.update(g, s, p)
            return (optax.apply_updates(p, u), s), None

        return jax.lax.scan(step, (p, opt.init(p)), batches)[0][0]

    if k == 1:
        run = jax.jit(train)
    else:
        P = jax.sharding.PartitionSpec
        run = jax.jit(jax.shard_map(train, mesh=mesh, in_specs=(P(), P(None, "clients")),
                                    out_specs=P(), check_vma=False))
        per_step = jax.device_put(per_step, jax.sharding.NamedSharding(mesh, P(None, "clients")))
        params = jax.device_put(params, jax.sharding.NamedSharding(mesh, P()))
    return lambda: _block(run(params, per_step))


def bench_drjax(params, data, args, mesh):
    try:
        import drjax
    except ImportError:
        return None
    import logging

    logging.getLogger("absl").setLevel(logging.ERROR)  # "no clients axis" notes on one device
    n = args.cohort

    @jax.jit
    @drjax.program(placements={"clients": n})
    def round_(p, tokens, keys):
        p_c = drjax.broadcast(p, mesh=mesh)
        deltas = drjax.map_fn(
            lambda p_i, t_i, k_i: _local_train(p_i, t_i, k_i, args.local_steps, args.batch),
            (p_c, tokens, keys), mesh=mesh,
        )
        mean = drjax.reduce_mean(deltas)
        return jax.tree.map(jnp.add, p, mean)

    keys = jax.random.split(jax.random.PRNGKey(0), n)
    tokens = data.examples["tokens"]
    if mesh is not None:  # drjax's map wants its clients-placed inputs sharded like its broadcast
        clients = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("clients"))
        tokens, keys = jax.device_put(tokens, clients), jax.device_put(keys, clients)
    return lambda: _block(round_(params, tokens, keys))


def _llama_round(width: int, mesh, args) -> dict:
    """Per-device memory and round time of one FedAvg round of a Flax Llama of ``width``."""
    from memaudit.federated.sharding import model_axis_size, server_shardings
    from memaudit.federated.trainer import make_loss_fn
    from memaudit.models.flax_llama import FlaxLlama, FlaxLlamaConfig, init_params, kernel_axes

    cfg = FlaxLlamaConfig(vocab_size=512, hidden_size=width, intermediate_size=4 * width,
                          num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=4)
    model = FlaxLlama(cfg)
    params = init_params(cfg, seed=0)
    n = args.layout_cohort
    rng = np.random.default_rng(0)
    ids = rng.integers(0, cfg.vocab_size, (n, args.examples, args.seq), dtype=np.int32)
    clients = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("clients"))
    data = ClientData(jax.device_put({"input_ids": ids, "attention_mask": np.ones_like(ids)},
                                     clients),
                      jax.device_put(np.ones((n, args.examples), np.float32), clients))
    algo = fedavg(make_loss_fn(model), client_optimizer=optax.sgd(0.1),
                  server_optimizer=optax.sgd(1.0), local_steps=args.local_steps,
                  batch_size=args.batch, mesh=mesh)
    state = algo.init(params)
    state = jax.device_put(state, server_shardings(state, mesh, kernel_axes))
    key = jax.random.PRNGKey(0)
    with jax.set_mesh(mesh):
        compiled = algo.jitted.lower(state, data, key).compile()
        times = []
        for _ in range(args.repeats + 1):  # the first call warms up
            t0 = time.perf_counter()
            _block(compiled(state, data, key)[0].params)
            times.append(time.perf_counter() - t0)
    mem = compiled.memory_analysis()
    dev0 = jax.devices()[0]
    held = sum(s.data.nbytes for x in jax.tree.leaves(state.params)
               for s in x.addressable_shards if s.device == dev0)
    mib = 2.0**20
    return {"mesh": dict(zip(mesh.axis_names, (int(a) for a in mesh.axis_sizes))),
            "model_axis": model_axis_size(mesh),
            "params": int(sum(x.size for x in jax.tree.leaves(params))),
            "param_mib": sum(x.nbytes for x in jax.tree.leaves(params)) / mib,
            "server_params_per_device_mib": held / mib,
            "per_device_argument_mib": mem.argument_size_in_bytes / mib,
            "per_device_output_mib": mem.output_size_in_bytes / mib,
            "per_device_temp_mib": mem.temp_size_in_bytes / mib,
            "per_device_total_mib": (mem.argument_size_in_bytes + mem.output_size_in_bytes
                                     + mem.temp_size_in_bytes - mem.alias_size_in_bytes) / mib,
            "round_s": statistics.median(times[1:])}


def bench_layouts(args) -> list[dict]:
    """The ``layouts`` table: 1-D (clients d) beside 2-D (clients d/2, model 2), per width."""
    d = len(jax.devices())
    if d < 2 or d % 2:
        return []
    auto = (jax.sharding.AxisType.Auto,) * 2
    meshes = [jax.make_mesh((d, 1), ("clients", "model"), axis_types=auto),
              jax.make_mesh((d // 2, 2), ("clients", "model"), axis_types=auto)]
    return [{"hidden": w, **{f"{m.axis_sizes[0]}x{m.axis_sizes[1]}": _llama_round(w, m, args)
                             for m in meshes}} for w in args.widths]


def padded(data: ClientData, capacity: int, shards: int = 1) -> ClientData:
    """The same cohort in a clients dim of ``capacity``: absent slots, no data, mask 0.

    The present clients are dealt round-robin over ``shards`` equal blocks of the clients dim
    (the device shards of a ``clients`` mesh axis), so that each device gets its share of the
    work and of the absent slots; appended at the end, all the absent slots would land on the
    last devices, which then idle while the first ones train.
    """
    n = jax.tree.leaves(data.examples)[0].shape[0]
    m = capacity // shards
    slots = np.array([(i % shards) * m + i // shards for i in range(n)])

    def grow(x):
        out = np.zeros((capacity,) + x.shape[1:], x.dtype)
        out[slots] = x
        return out

    return ClientData(jax.tree.map(grow, data.examples), grow(data.mask))


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cohorts", type=int, nargs="+", default=[8, 32])
    ap.add_argument("--local-steps", type=int, default=4)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--examples", type=int, default=16, help="sequences per client")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--reduced", action="store_true", help="seq 32, 3 repeats")
    ap.add_argument("--strategies", nargs="*", default=["vmap"], choices=["vmap", "scan"],
                    help="extra program variants with this federated_map strategy")
    ap.add_argument("--widths", type=int, nargs="+", default=[128, 256, 512],
                    help="hidden sizes of the Flax Llama in the layouts table")
    ap.add_argument("--layout-cohort", type=int, default=8, help="clients in the layouts table")
    ap.add_argument("--layouts", action="store_true", help="add the layouts table")
    ap.add_argument("--layouts-only", action="store_true", help="only the layouts table")
    ap.add_argument("--flower", action="store_true", help="add the Flower runtime table")
    ap.add_argument("--flower-only", action="store_true", help="only the Flower runtime table")
    ap.add_argument("--flower-nodes", type=int, default=2, help="SuperNodes in the Flower table")
    ap.add_argument("--flower-rounds", type=int, default=4, help="rounds of each Flower-table run")
    ap.add_argument("--flower-waves", type=int, default=2,
                    help="waves of the Flower table: in each, an in-JAX and a Flower run of each variant in turn")
    ap.add_argument("--flower-per-message", action="store_true",
                    help="also the Flower runs without the nodes' resident processes, side by side")
    ap.add_argument("--flower-own-supernode", action="store_true",
                    help="also the Flower runs on Flower's own flower-supernode (a flwr-clientapp process "
                         "per message, its 3 s poll), side by side with memaudit's SuperNode")
    ap.add_argument("--flower-unbundled", action="store_true",
                    help="also the Flower runs with memaudit's SuperNodes making Flower's nine Fleet requests "
                         "a message (--fleet flower), side by side with the bundled two")
    ap.add_argument("--flower-hbc", action="store_true",
                    help="add a Flower run with the honest-but-curious secure-aggregation protocol")
    ap.add_argument("--node-shapes", action="store_true",
                    help="only the node-shapes table: the partitioned round on nodes in this process, "
                         "their stages shaped for the cohort and for the slots each node hosts")
    ap.add_argument("--node-counts", type=int, nargs="+", default=[1, 2, 4, 8],
                    help="nodes in the node-shapes table (the cohort's clients dealt evenly)")
    args = ap.parse_args(argv)
    if args.reduced:
        args.seq, args.repeats = 32, 3
        args.flower_rounds = min(args.flower_rounds, 3)
    if args.node_shapes:
        out = bench_node_shapes(args)
        print(json.dumps(out, indent=2))
        return out
    if args.layouts_only or args.flower_only:
        args.cohorts = []
    params = init_params()
    n_params = sum(x.size for x in jax.tree.leaves(params))
    devices = jax.devices()
    mesh = None
    if len(devices) > 1:
        mesh = jax.make_mesh((len(devices),), ("clients",),
                             axis_types=(jax.sharding.AxisType.Explicit,))
    results = []
    compiles = _CompileCounter()
    for cohort in args.cohorts:
        args.cohort = cohort
        rng = np.random.default_rng(cohort)
        tokens = rng.integers(0, VOCAB, size=(cohort, args.examples, args.seq), dtype=np.int32)
        data = ClientData({"tokens": tokens}, np.ones((cohort, args.examples), np.float32))
        row = {"cohort": cohort}
        with jax.set_mesh(mesh) if mesh is not None else _null():
            runners = {
                "centralized": bench_centralized(params, data, args, mesh),
                "program": bench_program(params, data, args, mesh),
                "program_padded": bench_program(params, padded(data, 2 * cohort, len(devices)),
                                                args, mesh),
                **{f"program_{st}": bench_program(params, data, args, mesh, st)
                   for st in args.strategies},
                "client_loop": bench_client_loop(params, data, args),
                "drjax": bench_drjax(params, data, args, mesh),
            }
            runners = {k: v for k, v in runners.items() if v is not None}
            warmup_compiles = {}
            for name, fn in runners.items():  # the warm-up round compiles
                n0 = compiles.count
                fn()
                warmup_compiles[name] = compiles.count - n0
            stats = _interleaved(runners, args.repeats, compiles)
        for k, st in stats.items():
            row[f"{k}_s"], row[f"{k}_cpu_s"] = st["wall"], st["cpu"]
        for k in stats:
            if k != "centralized":
                row[f"{k}_vs_centralized"] = row[f"{k}_s"] / row["centralized_s"]
                row[f"{k}_cpu_vs_centralized"] = row[f"{k}_cpu_s"] / row["centralized_cpu_s"]
        if "drjax_s" in row:
            row["program_vs_drjax"] = row["program_s"] / row["drjax_s"]
            row["program_cpu_vs_drjax"] = row["program_cpu_s"] / row["drjax_cpu_s"]
        row["compiles"] = {k: {"warmup": warmup_compiles[k], "timed": stats[k]["timed_compiles"]}
                           for k in stats}
        results.append(row)
    out = {
        "benchmark": "federated_round",
        "model": "MLP causal LM (plain JAX)", "params": int(n_params),
        "local_steps": args.local_steps, "batch": args.batch, "seq": args.seq,
        "repeats": args.repeats,
        "statistic": "median seconds per round: wall (*_s) and this process's CPU (*_cpu_s)",
        "devices": [str(d) for d in devices], "backend": jax.default_backend(),
        "jax": jax.__version__, "program_map_strategy": _auto_strategy(),
        "results": results,
        "layouts": bench_layouts(args) if args.layouts or args.layouts_only else [],
        "flower": bench_flower(args) if args.flower or args.flower_only else None,
    }
    print(json.dumps(out, indent=2))
    return out


def _max_abs_diff(a, b) -> float:
    """The largest absolute difference of two pytrees' leaves."""
    return max(float(jnp.max(jnp.abs(x - y))) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True))


def _io_mib(module: bytes) -> float:
    """A client stage's arguments and results, MiB (what a node holds to run it)."""
    e = export.deserialize(bytearray(module))
    return sum(np.prod(a.shape) * np.dtype(a.dtype).itemsize for a in [*e.in_avals, *e.out_avals]) / 2**20


def bench_node_shapes(args) -> dict:
    """The partitioned FedAvg round (`memaudit.federated.flower.execute.run_plan`) on nodes in
    this process, each hosting an even share of the cohort: every node running the cohort's
    client stage (zero rows for the other nodes' clients) against each running the stage shaped
    for its own slots (`memaudit.federated.flower.partition.node_stages`). Times are the whole
    round: the nodes' stages one after the other (as one host runs them), the server's stages."""
    from memaudit.federated.flower.execute import LocalNodes, NodeExecutor, run_plan
    from memaudit.federated.flower.manifest import MAP_STRATEGY, node_capacity
    from memaudit.federated.flower.partition import compile_plan, node_stages, retrace

    cohort = args.cohorts[0]
    placed = {"[1].examples['tokens']": "tokens", "[1].mask": "example_mask"}
    rng = np.random.default_rng(cohort)
    tokens = rng.integers(0, VOCAB, size=(cohort, args.examples, args.seq), dtype=np.int32)
    algo = fedavg(loss_fn, client_optimizer=optax.sgd(0.1), server_optimizer=optax.sgd(1.0),
                  local_steps=args.local_steps, batch_size=args.batch, map_strategy=MAP_STRATEGY)
    state, key = algo.init(init_params()), jax.random.PRNGKey(0)
    struct = ClientData({"tokens": jax.ShapeDtypeStruct(tokens.shape, np.int32)},
                        jax.ShapeDtypeStruct((cohort, args.examples), np.float32))
    args_ = (state, struct, key)
    plan = compile_plan(algo.program, args_, placed, cohort)
    want = algo.program(state, ClientData({"tokens": tokens}, np.ones((cohort, args.examples), np.float32)), key)[0]
    # secure aggregation's client phase: each client's delta stays on its node (resident rows)
    from memaudit.federated.algorithms import make_client_phase

    phase = make_client_phase(loss_fn, optax.sgd(0.1), local_steps=args.local_steps, batch_size=args.batch,
                              map_strategy=MAP_STRATEGY)
    phase_args = (state.params, struct, key)
    phase_plan = compile_plan(phase, phase_args, placed, cohort, resident=(".deltas",))
    compiles = _CompileCounter()
    rows = []
    for n_nodes in args.node_counts:
        blocks = np.array_split(np.arange(cohort), n_nodes)
        executors = {i: NodeExecutor([f"u{s}" for s in b], {"tokens": tokens[b], "example_mask": np.ones((len(b), args.examples), np.float32)})
                     for i, b in enumerate(blocks)}
        assignment = {i: [(int(s), f"u{s}") for s in b] for i, b in enumerate(blocks)}
        k = node_capacity(max(len(b) for b in blocks))
        t0 = time.perf_counter()
        shaped = node_stages(plan, retrace(algo.program, args_, placed, k)) if k < cohort else None
        trace_s = time.perf_counter() - t0
        results = {}

        def run(use, results=results, executors=executors, assignment=assignment, shaped=shaped):
            (got, _), _ = run_plan(plan, args_, LocalNodes(executors), assignment, round=0,
                                   node_stages=(lambda _n, _h: shaped) if use else None)
            results[use] = _block(got.params)

        runners = {"cohort_shaped": lambda: run(False), "node_shaped": lambda: run(True)}
        for fn in runners.values():
            fn()  # each node compiles its module
        stats = _interleaved(runners, args.repeats, compiles)
        diff = _max_abs_diff(results[True], results[False])
        ref = _max_abs_diff(results[True], want.params)
        stage = phase_plan.client_stages[0].index
        phase_shaped = node_stages(phase_plan, retrace(phase, phase_args, placed, k)) if k < cohort else None
        rows.append({"nodes": n_nodes, "node_capacity": k if shaped is not None else cohort,
                     "secagg_client_phase_io_mib": {
                         "cohort_shaped": _io_mib(phase_plan.modules[stage]),
                         "node_shaped": _io_mib((phase_shaped or phase_plan).modules[stage])},
                     "cohort_shaped_s": stats["cohort_shaped"]["wall"], "node_shaped_s": stats["node_shaped"]["wall"],
                     "ratio": stats["node_shaped"]["wall"] / stats["cohort_shaped"]["wall"],
                     "node_shaped_trace_s": trace_s, "max_weight_diff": diff, "max_diff_vs_in_jax": ref})
    return {"benchmark": "federated_round --node-shapes", "model": "MLP causal LM (plain JAX)",
            "cohort": cohort, "local_steps": args.local_steps, "batch": args.batch, "seq": args.seq,
            "examples": args.examples, "repeats": args.repeats, "map_strategy": MAP_STRATEGY,
            "statistic": "median wall seconds per round, variants interleaved", "devices": len(jax.devices()),
            "jax": jax.__version__, "results": rows}


def bench_flower(args) -> dict:
    """In-JAX and Flower training runs on the same data, interleaved over ``--flower-waves``
    waves; median round seconds after the first, CPU seconds of each process a run, and the
    weights of wave 0's in-JAX and Flower runs compared."""
    import tempfile
    from pathlib import Path

    from memaudit.config import load_config
    from memaudit.federated.flower.deploy import LocalFederation
    from memaudit.federated.flower.nodes import write_partitions
    from memaudit.run.dispatch import dispatch
    from memaudit.rundir import RunDir

    ov = ["backend=federated", "data.synth.users=16", "data.synth.docs_per_user=4", "data.seq_len=64",
          "data.canaries.repetitions=[1,2]",
          f"federated.rounds={args.flower_rounds}", "federated.cohort=8", "federated.sampling=fixed",
          "federated.local_steps=4", "federated.local_batch_size=4", "federated.server_optimizer=fedavg",
          "federated.eval_every=1000", "federated.checkpoint_every=1000", "federated.mesh_clients=1",
          "train.eval_batches=1", "federated.flower.insecure=true"]
    root = Path(tempfile.mkdtemp(prefix="memaudit-bench-flower-"))
    secagg = ["privacy.secure_aggregation.enabled=true", "privacy.clip=1.0"]
    # user-level DP-FedAvg, noise on the server drawn from the run's key (reproducible: the two
    # runtimes' weights are compared; such a run's epsilon is void against whoever knows the seed)
    dp = [*secagg, "privacy.noise_multiplier=1.0", "privacy.reproducible_randomness=true"]
    hbc = ["privacy.secure_aggregation.mode=honest_but_curious"]
    # the SuperNodes' stage manifest allows every run (the same data)
    info = write_partitions(load_config(None, ov), root / "parts", args.flower_nodes,
                            variants=[load_config(None, [*ov, *secagg]), load_config(None, [*ov, *dp])])
    ov.append(f"data.tokenizer={info['tokenizer']}")

    def rounds(run: Path, warm: bool = False) -> list[float]:
        """Round seconds after the first; ``warm``: only the rounds in which no node ran a stage
        module new to its process (``nodes_compiling`` 0: no node compiled a stage shape)."""
        # under DP a round's timing is a statistic of the private data: memaudit writes it to the
        # run's 0600 sensitive_metrics.jsonl, which the benchmark, the run's owner, reads
        path = run / "sensitive_metrics.jsonl"
        path = path if path.is_file() else run / "metrics.jsonl"
        lines = [json.loads(x) for x in path.read_text().splitlines()][1:]
        return [m["round_seconds"] for m in lines if not (warm and m.get("nodes_compiling", 0))]

    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=1"}
    variants = {"": [], "_secagg": secagg, "_dp_secagg": dp}
    runs: dict[str, list[Path]] = {}  # kind ("jax_secagg", "flower", ...) -> its runs, wave by wave
    cpu: dict[str, list[dict[str, float]]] = {}  # kind -> per run: process -> CPU seconds
    walls: dict[str, list[float]] = {}
    with LocalFederation(root / "federation", info["partitions"], env=env) as fed:
        flower = ["federated.runtime=flower", f"federated.flower.superlink={fed.address}"]
        procs = {"superlink": fed.superlink.pid, **{f"supernode_{i}": p.pid for i, p in enumerate(fed.nodes)}}
        # in-JAX and Flower runs take turns (jax, flower in even waves, flower, jax in odd ones), so
        # that a shared machine's load falls on both sides alike
        for wave in range(args.flower_waves):
            for suffix, extra in variants.items():
                for side in (("jax", "flower") if wave % 2 == 0 else ("flower", "jax")):
                    kind = f"{side}{suffix}"
                    run = root / f"{kind}-w{wave}"
                    before = _cpu_seconds(procs)
                    t0 = time.perf_counter()
                    dispatch(load_config(None, [*ov, *extra, *(flower if side == "flower" else [])]), RunDir(run),
                             resume=False)
                    walls.setdefault(kind, []).append(time.perf_counter() - t0)
                    after = _cpu_seconds(procs)
                    cpu.setdefault(kind, []).append({k: after[k] - before[k] for k in after})
                    runs.setdefault(kind, []).append(run)

    def pair(suffix: str, **federation) -> None:  # the plain and the secure run on one federation
        with LocalFederation(root / f"federation{suffix}", info["partitions"], env=env, **federation) as fed:
            flower = ["federated.runtime=flower", f"federated.flower.superlink={fed.address}"]
            dispatch(load_config(None, [*ov, *flower]), RunDir(root / f"flower{suffix}"), resume=False)
            dispatch(load_config(None, [*ov, *secagg, *flower]), RunDir(root / f"flower_secagg{suffix}"),
                     resume=False)

    if args.flower_per_message:  # a process, not the node's resident one, does each message's work
        pair("_per_message", resident=False)
    if args.flower_own_supernode:  # Flower's own SuperNode and SuperExec
        pair("_own_supernode", flower_supernode=True)
    if args.flower_unbundled:  # memaudit's SuperNodes with Flower's Fleet requests
        pair("_unbundled", bundled=False)
    if args.flower_hbc:  # the honest-but-curious protocol (no consistency round, no signatures)
        hcfg = load_config(None, [*ov, *secagg, *hbc])  # on nodes whose manifest holds its policy
        hinfo = write_partitions(hcfg, root / "parts_hbc", args.flower_nodes)
        with LocalFederation(root / "federation_hbc", hinfo["partitions"], env=env) as fed:
            flower = ["federated.runtime=flower", f"federated.flower.superlink={fed.address}"]
            dispatch(load_config(None, [*ov, *secagg, *hbc, *flower]), RunDir(root / "flower_secagg_hbc"),
                     resume=False)
    kinds = ("jax", "flower", "jax_secagg", "flower_secagg", "jax_dp_secagg", "flower_dp_secagg",
             *(("flower_secagg_hbc",) if args.flower_hbc else ()),
             *(("flower_per_message", "flower_secagg_per_message") if args.flower_per_message else ()),
             *(("flower_own_supernode", "flower_secagg_own_supernode") if args.flower_own_supernode else ()),
             *(("flower_unbundled", "flower_secagg_unbundled") if args.flower_unbundled else ()))
    def rounds_of(kind: str, warm: bool = False) -> list[float]:
        return [r for run in runs.get(kind, [root / kind]) for r in rounds(run, warm)]

    med = {k: statistics.median(rounds_of(k)) for k in kinds}
    warm = {k: rounds_of(k, warm=True) for k in ("flower", "flower_secagg", "flower_dp_secagg")}
    warm_med = {k: statistics.median(v) for k, v in warm.items() if v}
    def side(suffix: str, speedup: str) -> dict:  # a pair's rounds against in-JAX and memaudit's default
        a, b = f"flower{suffix}", f"flower_secagg{suffix}"
        return {f"{a}_round_s": med[a], f"{a}_vs_jax": med[a] / med["jax"], f"{b}_round_s": med[b],
                f"{b}_vs_jax_secagg": med[b] / med["jax_secagg"], speedup: med[a] / med["flower"],
                f"{speedup}_secagg": med[b] / med["flower_secagg"]}

    def weight_diff(suffix: str, wave: int = 0) -> float:  # a wave's in-JAX run against its Flower run
        a, b = (_safetensors(runs[f"{side}{suffix}"][wave]) for side in ("jax", "flower"))
        return max(float(np.max(np.abs(a[k] - b[k]))) for k in a)

    def cpu_table(kind: str) -> dict:  # median over the waves of each process's CPU seconds a run
        per = {p: statistics.median(c[p] for c in cpu[kind]) for p in cpu[kind][0]}
        return {**per, "total": statistics.median(sum(c.values()) for c in cpu[kind])}

    cpu_med = {k: cpu_table(k) for k in cpu}
    return {"model": "tiny Llama (memaudit preset)", "nodes": args.flower_nodes, "cohort": 8,
            "rounds_timed": args.flower_rounds - 1, "waves": args.flower_waves,
            "order": "in-JAX and Flower runs interleaved: jax, flower in even waves, flower, jax in odd ones",
            "jax_round_s": med["jax"],
            "flower_round_s": med["flower"], "flower_vs_jax": med["flower"] / med["jax"],
            "flower_run_s": statistics.median(walls["flower"]), "jax_run_s": statistics.median(walls["jax"]),
            "jax_secagg_round_s": med["jax_secagg"],
            "flower_secagg_round_s": med["flower_secagg"],
            "flower_secagg_vs_jax_secagg": med["flower_secagg"] / med["jax_secagg"],
            "flower_secagg_vs_flower": med["flower_secagg"] / med["flower"],
            "jax_dp_secagg_round_s": med["jax_dp_secagg"], "flower_dp_secagg_round_s": med["flower_dp_secagg"],
            "flower_dp_secagg_vs_jax_dp_secagg": med["flower_dp_secagg"] / med["jax_dp_secagg"],
            # CPU seconds of a whole run (its first round's compiles included), per process: this
            # one (and the processes it waited for) and the federation's (each process with its
            # descendants; the ServerApp is a thread of the SuperLink; during an in-JAX run the
            # federation only idles)
            "cpu_s": cpu_med,
            **{f"{k}_cpu_vs_{k.replace('flower', 'jax')}": cpu_med[k]["total"] / cpu_med[k.replace("flower", "jax")]["total"]
               for k in ("flower", "flower_secagg", "flower_dp_secagg")},
            "max_weight_diff": weight_diff(""),
            "max_weight_diff_by_wave": [weight_diff("", w) for w in range(args.flower_waves)],
            "secagg_max_weight_diff": weight_diff("_secagg"),
            "dp_secagg_max_weight_diff": weight_diff("_dp_secagg"),
            # the in-JAX runs' host devices; the SuperNodes run on 1 (weights equal at 1)
            "jax_devices": len(jax.devices()),
            # the rounds in which no node compiled a stage shape (in JAX every round after the first is)
            **{f"{k}_warm_rounds": len(v) for k, v in warm.items()},
            **{f"{k}_warm_round_s": m for k, m in warm_med.items()},
            **{f"{k}_warm_vs_{k.replace('flower', 'jax')}": m / med[k.replace("flower", "jax")]
               for k, m in warm_med.items()},
            **(side("_per_message", "resident_speedup") if args.flower_per_message else {}),
            **(side("_own_supernode", "memaudit_supernode_speedup") if args.flower_own_supernode else {}),
            **(side("_unbundled", "bundled_speedup") if args.flower_unbundled else {}),
            **({"flower_secagg_hbc_round_s": med["flower_secagg_hbc"],
                "flower_secagg_vs_hbc": med["flower_secagg"] / med["flower_secagg_hbc"]} if args.flower_hbc else {})}


def _cpu_seconds(roots: dict[str, int]) -> dict[str, float]:
    """CPU seconds (user + system) so far of this process (``benchmark``: its threads and the
    children it waited for) and of each process in ``roots`` with its live descendants and the
    children they waited for (Linux ``/proc``; a process gone is 0)."""
    self_, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    out = {"benchmark": self_.ru_utime + self_.ru_stime + children.ru_utime + children.ru_stime}
    tick = os.sysconf("SC_CLK_TCK")
    stats: dict[int, tuple[int, float]] = {}  # pid -> (parent pid, CPU seconds)
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        # fields from the state on: ppid is 2nd, utime stime cutime cstime 12th-15th
        stats[int(entry)] = (int(fields[1]), sum(int(x) for x in fields[11:15]) / tick)
    kids: dict[int, list[int]] = {}
    for pid, (ppid, _) in stats.items():
        kids.setdefault(ppid, []).append(pid)
    for name, root in roots.items():
        total, todo = 0.0, [root] if root in stats else []
        while todo:
            pid = todo.pop()
            total += stats[pid][1]
            todo.extend(kids.get(pid, ()))
        out[name] = total
    return out


def _safetensors(run) -> dict:
    from safetensors.numpy import load_file

    return load_file(str(run / "model" / "model.safetensors"))


def _auto_strategy() -> str:
    """What ``map_strategy="auto"`` picks for the local-training map on this backend."""
    from memaudit.federated.primitives import resolve_map_strategy

    return resolve_map_strategy(lambda w, x: x @ w, (jnp.ones((2, 3, 3)), jnp.ones((2, 3))),
                                "auto")


class _null:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


if __name__ == "__main__":
    main()
