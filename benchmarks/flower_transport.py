"""Each layer of memaudit's Flower transport on and off, on a secure-aggregation round; prints JSON.

    python benchmarks/flower_transport.py [--nodes 4] [--rounds 5] [--waves 3] [--variants ...]

memaudit's SuperLink and SuperNodes change how Flower moves messages in layers
(`memaudit.federated.flower.transport`). A layer stays only where it moves a round, so each is
measured where it matters: a memaudit training run (tiny Llama, secure aggregation, cohort 8) on
a one-machine federation of ``--nodes`` SuperNodes (`memaudit.federated.flower.deploy.
LocalFederation`), with every layer on (``all_on``) and with one layer off (``LAYER_off``: the
SuperLink and SuperNodes started with ``--transport-off LAYER``). Each run starts a federation of
its own and stops it after; the variants take turns within each wave, in an order rotated wave by
wave (ABCDE, BCDEA, ...), so a shared machine's load falls on all alike.

Per run: the rounds after the first (``round_seconds`` of the run's metrics, the first compiles),
their median; and the CPU seconds (user + system) per round of each process between the end of
the first round and the end of the last (``/proc``): the SuperLink (its own threads), the
ServerApp (the threads the run started in the SuperLink: memaudit's ServerApp is a thread of it,
with its JAX threads and heartbeat), each SuperNode with its descendants (its resident
process), and this benchmark (the submission). Per variant: the median over its runs of the
run medians (``round_s``), the spread of the run medians (min and max), the median CPU per round
of each process, and the ratio of each ``LAYER_off`` to ``all_on``. A layer moves a round when
a test says so (its spread alone is not read: a shared machine's load drifts between waves): the off run and the ``all_on`` run of each wave are a pair (the
same machine at the same time), and Wilcoxon's signed-rank test, one-sided (off slower), on the
waves' differences of run medians, Holm-adjusted over the layers measured in the run, gives
``p_round``; ``moves_round`` is adjusted p < 0.05. The same on every process's CPU seconds a round
together (``p_cpu``, ``moves_round_cpu``); a shift of CPU between processes within the same total
does not count. Where even the waves' most extreme outcome (``2**-waves``, times the layers for
Holm) could not reach 0.05, the answer is ``n too small`` (one layer needs 5 waves, three 7).

    python benchmarks/flower_transport.py --decide saved.json   # the decision again from saved runs
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import threading
import time
from pathlib import Path

from federated_round import _cpu_seconds

LAYERS = ("short_waits", "held_asks", "bundled")  # transport.OPTIONAL; lean_http measured and removed


def thread_cpu(pid: int) -> dict[int, float]:
    """CPU seconds (user + system) of each live thread of process ``pid`` (Linux ``/proc``)."""
    tick, out = os.sysconf("SC_CLK_TCK"), {}
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return out
    for tid in tids:
        try:
            with open(f"/proc/{pid}/task/{tid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        out[int(tid)] = (int(fields[11]) + int(fields[12])) / tick
    return out


def snapshot(procs: dict[str, int], link: int, before: set[int]) -> dict[str, float]:
    """Each process's CPU seconds so far, the SuperLink's split into the run's threads
    (``serverapp``: those not alive in ``before``) and its own."""
    out = _cpu_seconds(procs)
    run = sum(c for tid, c in thread_cpu(link).items() if tid not in before)
    out["serverapp"], out["superlink"] = run, out["superlink"] - run
    return out


def watch(metrics: Path, rounds: int, take: dict, procs: dict[str, int], link: int, before: set[int],
          stop: threading.Event) -> None:
    """Snapshots (`snapshot`) when the run's metrics hold its first round and its last."""
    while not stop.is_set():
        try:
            n = len(metrics.read_text().splitlines())
        except OSError:
            n = 0
        if n >= 1 and "first" not in take:
            take["first"] = snapshot(procs, link, before)
        if n >= rounds:
            take["last"] = snapshot(procs, link, before)
            return
        time.sleep(0.05)


def one_run(variant: str, root: Path, info: dict, ov: list[str], env: dict, rounds: int, tag: str) -> dict:
    from memaudit.config import load_config
    from memaudit.federated.flower.deploy import LocalFederation
    from memaudit.run.dispatch import dispatch
    from memaudit.rundir import RunDir

    off = [] if variant == "all_on" else [variant.removesuffix("_off")]
    with LocalFederation(root / f"fed-{variant}", info["partitions"], env=env, transport_off=off) as fed:
        flower = ["federated.runtime=flower", f"federated.flower.superlink={fed.address}"]
        procs = {"superlink": fed.superlink.pid, **{f"supernode_{i}": p.pid for i, p in enumerate(fed.nodes)}}
        run = root / f"{variant}-{tag}"
        before, take, stop = set(thread_cpu(fed.superlink.pid)), {}, threading.Event()
        watcher = threading.Thread(target=watch, args=(run / "metrics.jsonl", rounds, take, procs,
                                                       fed.superlink.pid, before, stop), daemon=True)
        watcher.start()
        t0 = time.perf_counter()
        dispatch(load_config(None, [*ov, *flower]), RunDir(run), resume=False)
        wall = time.perf_counter() - t0
        stop.set()
        watcher.join()
    lines = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    timed = [m["round_seconds"] for m in lines[1:]]
    cpu = ({k: (take["last"][k] - take["first"][k]) / len(timed) for k in take["last"]}
           if "first" in take and "last" in take else {})
    return {"round_s": statistics.median(timed), "rounds_s": timed, "run_s": wall, "cpu_s_per_round": cpu}


def summary(runs: list[dict]) -> dict:
    meds = [r["round_s"] for r in runs]
    cpus = [r["cpu_s_per_round"] for r in runs if r["cpu_s_per_round"]]
    per = {k: statistics.median(c[k] for c in cpus) for k in cpus[0]} if cpus else {}
    return {"round_s": statistics.median(meds), "round_s_min": min(meds), "round_s_max": max(meds),
            "run_medians_s": meds, "cpu_s_per_round": {**per, "total": sum(per.values())},
            "run_cpu_totals_s": [sum(c.values()) for c in cpus]}


ALPHA = 0.05


def decide(table: dict, runs: dict[str, list[dict]]) -> None:
    """Each ``LAYER_off`` row of ``table`` gets its ratios to ``all_on`` and whether it moves a round
    (see the module's docstring): paired by wave, Wilcoxon one-sided, Holm over the layers."""
    from scipy.stats import wilcoxon

    from memaudit.probes.stats import holm

    base, offs = runs.get("all_on"), [v for v in table if v != "all_on"]
    if base is None or not offs:
        return
    total = lambda r: sum(r["cpu_s_per_round"].values())
    raw: dict[str, list[float]] = {"round": [], "cpu": []}
    for v in offs:
        row, on = table[v], table["all_on"]
        row["off_vs_on"] = row["round_s"] / on["round_s"]
        row["cpu_total_off_vs_on"] = row["cpu_s_per_round"]["total"] / on["cpu_s_per_round"]["total"]
        pairs = list(zip(runs[v], base))
        row["waves"] = len(pairs)
        for key, value in (("round", lambda r: r["round_s"]), ("cpu", total)):
            d = [value(a) - value(b) for a, b in pairs if key == "round" or (a["cpu_s_per_round"] and b["cpu_s_per_round"])]
            row[f"{key}_differences_s"] = d
            raw[key].append(float(wilcoxon(d, alternative="greater").pvalue) if len(d) >= 2 else 1.0)
    for key, name in (("round", "moves_round"), ("cpu", "moves_round_cpu")):
        for v, p, adj in zip(offs, raw[key], holm(raw[key])):
            table[v][f"p_{key}"], table[v][f"p_{key}_holm"] = p, adj
            floor = len(offs) * 2.0 ** -table[v]["waves"]  # the smallest adjusted p these waves allow
            table[v][name] = "n too small" if floor >= ALPHA else bool(adj < ALPHA)


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nodes", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=5, help="rounds a run (the first is not timed)")
    ap.add_argument("--waves", type=int, default=3, help="runs of each variant, interleaved")
    ap.add_argument("--variants", nargs="+", default=["all_on", *(f"{x}_off" for x in LAYERS)])
    ap.add_argument("--out", default=None, help="also write the JSON here")
    ap.add_argument("--decide", default=None, help="no runs: the decision again from this saved JSON")
    args = ap.parse_args(argv)
    if args.decide:
        saved = json.loads(Path(args.decide).read_text())
        decide(saved["variants"], saved["runs"])
        print(json.dumps({v: {k: x for k, x in row.items() if not isinstance(x, (list, dict))}
                          for v, row in saved["variants"].items()}, indent=1))
        return saved
    from memaudit.config import load_config
    from memaudit.federated.flower.nodes import write_partitions

    ov = ["backend=federated", "data.synth.users=16", "data.synth.docs_per_user=4", "data.seq_len=64",
          "data.canaries.repetitions=[1,2]", f"federated.rounds={args.rounds}", "federated.cohort=8",
          "federated.sampling=fixed", "federated.local_steps=4", "federated.local_batch_size=4",
          "federated.server_optimizer=fedavg", "federated.eval_every=1000", "federated.checkpoint_every=1000",
          "federated.mesh_clients=1", "train.eval_batches=1", "federated.flower.insecure=true",
          "privacy.secure_aggregation.enabled=true", "privacy.clip=1.0"]
    root = Path(tempfile.mkdtemp(prefix="memaudit-bench-transport-"))
    info = write_partitions(load_config(None, ov), root / "parts", args.nodes)
    ov.append(f"data.tokenizer={info['tokenizer']}")
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=1"}
    runs: dict[str, list[dict]] = {v: [] for v in args.variants}
    order = []
    for wave in range(args.waves):
        k = wave % len(args.variants)
        for v in args.variants[k:] + args.variants[:k]:
            order.append(v)
            runs[v].append(one_run(v, root, info, ov, env, args.rounds, f"w{wave}"))
            print(json.dumps({"wave": wave, "variant": v, **runs[v][-1]}), flush=True)  # a run, as it ends
    table = {v: summary(r) for v, r in runs.items()}
    decide(table, runs)
    out = {"benchmark": "flower_transport", "model": "tiny Llama (memaudit preset)", "nodes": args.nodes,
           "cohort": 8, "secure_aggregation": True, "rounds_per_run": args.rounds,
           "rounds_timed_per_run": args.rounds - 1, "runs_per_variant": args.waves, "order": order,
           "statistic": "per variant: median over runs of each run's median round seconds (min, max of "
                        "those), median over runs of CPU seconds per round of each process; a layer "
                        "moves a round by Wilcoxon's signed-rank test paired by wave, one-sided, "
                        "Holm over the layers, adjusted p < 0.05",
           "variants": table, "runs": runs}
    text = json.dumps(out, indent=1)
    print(text)
    if args.out:
        tmp = Path(args.out).with_suffix(".tmp")
        tmp.write_text(text)
        tmp.replace(args.out)
    return out


if __name__ == "__main__":
    main()
