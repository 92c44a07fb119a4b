"""The CPU probe path, before and after, side by side: two source trees of memaudit (the old one a
git worktree of an earlier commit), each timed in its own process, in alternating order.

Three workloads:

- `quickstart RUN`: the probe stage of a tiny run with the quickstart's probe settings
  (`memaudit.probes.runner.run_probes`, benchmarks/probe_breakdown.py's QUICKSTART), per probe.
- `sweep SWEEP_DIR --config CONFIG`: a whole sweep's probe stage (the quickstart's: every point
  with its public base as the membership reference), each run of `SWEEP_DIR/runs` probed in turn
  under the sweep's own settings (`memaudit.sweep.point.point_probe_config`) with a fresh cache
  of what the points share where the tree has one (`memaudit.probes.score_cache`: the public
  base's scores, kept by its own run, and the split's shift check); nothing is written into
  SWEEP_DIR.
- `outside`: the README's outside audit at GPT-2-124M's shape (768 wide, 12 layers, 50,257-token
  vocabulary; random weights: throughput does not depend on them) as a LoRA adapter with its
  base as the reference: `memaudit probe ADAPTER --members --nonmembers --probes membership`.
  Builds the models once (in --workdir), then times the probe on --docs members and as many
  non-members, and reports tokens scored per second (both models' tokens) and that rate carried
  to 1,000 + 1,000 documents of the same length (scoring time is linear in tokens).

Prints JSON: per variant the medians and every repeat, the ratio of each median to the first
variant's, and the load average before and after (the machine's other work slows every part:
compare ratios; absolute seconds hold only for the load printed beside them).

    git worktree add --detach /tmp/memaudit-old cbdbc7c
    python benchmarks/probe_cpu.py quickstart RUN --old /tmp/memaudit-old --repeats 3
    python benchmarks/probe_cpu.py outside --old /tmp/memaudit-old --docs 100 --repeats 3
    python benchmarks/probe_cpu.py sweep SWEEP_DIR --config configs/quickstart.yaml --old OLD --threads 1
    python benchmarks/probe_cpu.py quickstart RUN --old OLD --variants new,old,new:jax --threads 1
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parents[1]
GPT2_124M = {"n_embd": 768, "n_layer": 12, "n_head": 12, "vocab_size": 50257, "n_positions": 1024}


def _cpu_per_probe() -> dict[str, float]:
    """Each probe's CPU seconds (all threads) beside its wall time, filled in as probes run."""
    from memaudit.probes import runner

    probe_cpu: dict[str, float] = {}
    for name, fn in list(runner.REGISTRY.items()):
        def timed(ctx, fn=fn, name=name):
            c0 = time.process_time()
            try:
                return fn(ctx)
            finally:
                probe_cpu[name] = round(probe_cpu.get(name, 0.0) + time.process_time() - c0, 2)
        runner.REGISTRY[name] = timed
    return probe_cpu


def _worker_quickstart(run: str, probes: str | None) -> dict:
    sys.path.insert(0, str(HERE / "benchmarks"))
    from probe_breakdown import QUICKSTART

    from memaudit.config import ProbeConfig
    from memaudit.probes.runner import parse_probes, run_probes
    from memaudit.probes.targets import resolve_target

    kw = {"probes": parse_probes(probes)} if probes else {}
    settings = ProbeConfig(device="cpu", **{**QUICKSTART, **kw})
    settings = settings.model_copy(update=_overrides())
    probe_cpu = _cpu_per_probe()
    t0, c0 = time.perf_counter(), time.process_time()
    res = run_probes(resolve_target(run), settings,
                     engine=os.environ.get("PROBE_CPU_ENGINE", "torch"))
    return {"total_s": time.perf_counter() - t0, "cpu_s": time.process_time() - c0,
            "probe_s": {k: round(v, 2) for k, v in res.document["timings"].items()},
            "probe_cpu_s": probe_cpu}


def _worker_sweep(sweep: str, config: str) -> dict:
    """Every run of a sweep folder probed in turn (the public base first, as the sweep does), a
    fresh reference-score cache shared by the runs where this tree has one."""
    import inspect
    import tempfile

    from memaudit.probes.runner import run_probes
    from memaudit.probes.targets import resolve_target
    from memaudit.rundir import RunDir
    from memaudit.sweep.config import load_sweep_config
    from memaudit.sweep.point import point_probe_config

    cfg = load_sweep_config(config, [])
    runs = sorted((Path(sweep) / "runs").iterdir(), key=lambda p: (p.name != "public-base", p.name))
    cached = "cache" in inspect.signature(run_probes).parameters
    probe_cpu = _cpu_per_probe()
    per_run, probe_s = {}, {}
    with tempfile.TemporaryDirectory() as tmp:
        t0, c0 = time.perf_counter(), time.process_time()
        for rd in runs:
            settings = point_probe_config(cfg, RunDir(rd)).model_copy(update=_overrides())
            r0 = time.process_time()
            kw = {"cache": Path(tmp), "keep_target_scores": rd.name == "public-base"} if cached else {}
            res = run_probes(resolve_target(rd), settings, **kw)
            per_run[rd.name] = round(time.process_time() - r0, 2)
            for k, v in res.document["timings"].items():
                probe_s[k] = round(probe_s.get(k, 0.0) + v, 2)
        total, cpu = time.perf_counter() - t0, time.process_time() - c0
    return {"total_s": total, "cpu_s": cpu, "probe_s": probe_s, "probe_cpu_s": probe_cpu,
            "run_cpu_s": per_run, "runs": len(runs), "reference_cache": cached}


def _worker_outside(workdir: str) -> dict:
    from memaudit.cli import main

    w = Path(workdir)
    out = w / f"probes-{os.getpid()}.json"
    probe_cpu = _cpu_per_probe()
    t0, c0 = time.perf_counter(), time.process_time()
    rc = main(["probe", str(w / "adapter"), "--out", str(out), "--members",
               str(w / "members.jsonl"), "--nonmembers", str(w / "nonmembers.txt"), "--probes",
               "membership", "--device", "cpu", "--bootstrap", "100"])
    total, cpu = time.perf_counter() - t0, time.process_time() - c0
    doc = json.loads(out.read_text())
    out.unlink()
    return {"rc": rc, "total_s": total, "cpu_s": cpu, "probe_cpu_s": probe_cpu,
            "probe_s": {k: round(v, 2) for k, v in doc["timings"].items()}}


def build_outside(workdir: Path, docs: int, words: int) -> dict:
    """GPT-2-124M-shaped base + LoRA adapter (random), members and non-members, in workdir."""
    import numpy as np
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import GPT2Config, GPT2LMHeadModel

    sys.path.insert(0, str(HERE))
    from tests.probes.outside_models import _texts, bpe_tokenizer

    rng = np.random.default_rng(0)
    tok = bpe_tokenizer(_texts(rng, 400))
    members, nonmembers = _texts(rng, docs, words), _texts(rng, docs, words)
    if not (workdir / "adapter").exists():
        torch.manual_seed(0)
        cfg = GPT2Config(**GPT2_124M, bos_token_id=tok.eos_token_id, eos_token_id=tok.eos_token_id)
        base = GPT2LMHeadModel(cfg)
        base.save_pretrained(workdir / "base")
        tok.save_pretrained(workdir / "base")
        ft = get_peft_model(GPT2LMHeadModel.from_pretrained(workdir / "base"),
                            LoraConfig(r=8, target_modules=["c_attn"], fan_in_fan_out=True,
                                       task_type="CAUSAL_LM"))
        ft.save_pretrained(workdir / "adapter")
    (workdir / "members.jsonl").write_text("".join(json.dumps({"id": f"m{i}", "text": t}) + "\n"
                                                   for i, t in enumerate(members)))
    (workdir / "nonmembers.txt").write_text("\n".join(nonmembers) + "\n")
    n_tokens = sum(len(tok(t)["input_ids"]) + 1 for t in members + nonmembers)
    return {"documents": 2 * docs, "tokens_per_model": n_tokens,
            "mean_tokens_per_document": round(n_tokens / (2 * docs), 1)}


def _overrides() -> dict:
    return json.loads(os.environ.get("PROBE_CPU_SETTINGS", "{}"))


def _time(tree: Path, args: list[str], threads: int | None, settings: dict,
          engine: str = "torch") -> dict:
    env = {**os.environ, "PYTHONPATH": str(tree), "PROBE_CPU_SETTINGS": json.dumps(settings),
           "PROBE_CPU_ENGINE": engine}
    env.pop("OMP_NUM_THREADS", None)
    if threads:  # both trees on this many threads (the new one reads it; torch's default too)
        env["OMP_NUM_THREADS"] = str(threads)
        if threads == 1:  # XLA's CPU client too (the jax engine): one thread, no Eigen pool
            env["XLA_FLAGS"] = "--xla_cpu_multi_thread_eigen=false intra_op_parallelism_threads=1"
    p = subprocess.run([sys.executable, __file__, "--worker", *args], env=env, cwd=tree,
                       capture_output=True, text=True, check=False)
    if p.returncode != 0:
        raise SystemExit(f"the worker in {tree} failed:\n{p.stderr[-2000:]}")
    return json.loads(p.stdout.strip().splitlines()[-1])


def main() -> None:
    if "--worker" in sys.argv:
        kind, *rest = sys.argv[sys.argv.index("--worker") + 1 :]
        res = (_worker_quickstart(rest[0], rest[1] if len(rest) > 1 else None) if kind == "quickstart"
               else _worker_sweep(rest[0], rest[1]) if kind == "sweep" else _worker_outside(rest[0]))
        print(json.dumps(res))
        return
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("workload", choices=["quickstart", "sweep", "outside"])
    ap.add_argument("run", nargs="?", help="quickstart: the tiny run directory; sweep: the sweep folder")
    ap.add_argument("--config", default="configs/quickstart.yaml", help="sweep: the sweep's config")
    ap.add_argument("--old", required=True, help="the old source tree (a git worktree)")
    ap.add_argument("--new", default=str(HERE), help="the new source tree (default: this one)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--probes", default=None, help="quickstart: comma-separated probes")
    ap.add_argument("--docs", type=int, default=100, help="outside: members (and non-members)")
    ap.add_argument("--words", type=int, default=14, help="outside: words per document")
    ap.add_argument("--workdir", default="/tmp/memaudit-probe-cpu", help="outside: model folder")
    ap.add_argument("--threads", type=int, default=None,
                    help="OMP_NUM_THREADS for both trees (default: each tree's own choice); with "
                         "1, CPU seconds measure the work whatever the machine's load")
    ap.add_argument("--variants", default="new,old",
                    help="comma-separated TREE or TREE:ENGINE (trees old, new; engines torch, jax, "
                         "auto), e.g. new,old,new:jax; ratios are against old")
    ap.add_argument("--set", default="{}", help="quickstart: JSON of probe settings to override, "
                    "e.g. a smaller workload on a loaded machine")
    a = ap.parse_args()
    trees = {"old": Path(a.old).resolve(), "new": Path(a.new).resolve()}
    out: dict = {"benchmark": "probe_cpu", "workload": a.workload, "cpus": os.cpu_count(),
                 "trees": {k: str(v) for k, v in trees.items()},
                 "commits": {k: subprocess.run(["git", "-C", str(v), "rev-parse", "--short", "HEAD"],
                                               capture_output=True, text=True, check=False).stdout.strip()
                             for k, v in trees.items()}}
    if a.workload == "quickstart":
        if not a.run:
            ap.error("quickstart needs the run directory")
        args = ["quickstart", str(Path(a.run).resolve())] + ([a.probes] if a.probes else [])
    elif a.workload == "sweep":
        if not a.run:
            ap.error("sweep needs the sweep folder")
        args = ["sweep", str(Path(a.run).resolve()), str(Path(a.config).resolve())]
    else:
        w = Path(a.workdir)
        w.mkdir(parents=True, exist_ok=True)
        out["outside"] = build_outside(w, a.docs, a.words)
        args = ["outside", str(w.resolve())]
    out["load_avg_before"] = os.getloadavg()
    variants = a.variants.split(",")
    runs: dict[str, list[dict]] = {k: [] for k in variants}
    for r in range(a.repeats):  # new, old, old, new, ...: drift in the load falls on both
        for name in (variants if r % 2 == 0 else variants[::-1]):
            tree, _, engine = name.partition(":")
            res = _time(trees[tree], args, a.threads, json.loads(a.set), engine or "torch")
            res["load_avg"] = os.getloadavg()[0]
            runs[name].append(res)
            print(json.dumps({"variant": name, "repeat": r, **res}), file=sys.stderr, flush=True)
    med = {k: statistics.median(x["total_s"] for x in v) for k, v in runs.items()}
    cpu = {k: statistics.median(x["cpu_s"] for x in v) for k, v in runs.items()}
    per_probe = {k: {p: round(statistics.median(x["probe_s"][p] for x in v), 2)
                     for p in v[0]["probe_s"]} for k, v in runs.items()}
    per_probe_cpu = {k: {p: round(statistics.median(x["probe_cpu_s"][p] for x in v), 2)
                         for p in v[0]["probe_cpu_s"]} for k, v in runs.items()}
    out.update(
        median_total_s={k: round(m, 2) for k, m in med.items()},
        median_probe_s=per_probe,
        median_cpu_s={k: round(m, 2) for k, m in cpu.items()},
        median_probe_cpu_s=per_probe_cpu,
        threads=a.threads, settings=json.loads(a.set),
        runs={k: [{"total_s": round(x["total_s"], 2), "cpu_s": round(x["cpu_s"], 2),
                   "probe_s": x["probe_s"], "probe_cpu_s": x.get("probe_cpu_s"),
                   "load_avg": round(x["load_avg"], 2)} for x in v] for k, v in runs.items()},
        load_avg_after=os.getloadavg(),
    )
    if "old" in runs:  # ratios against the old tree, when it ran (--variants new alone times one tree)
        out.update(
            probe_cpu_ratio_old_over={k: {p: round(per_probe_cpu["old"][p] / max(v, 1e-9), 3)
                                          for p, v in c.items()} for k, c in per_probe_cpu.items()},
            cpu_ratio_old_over={k: round(cpu["old"] / c, 3) for k, c in cpu.items()},
            ratio_old_over={k: {"total": round(med["old"] / med[k], 3),
                                **{p: round(per_probe["old"][p] / max(per_probe[k][p], 1e-9), 3)
                                   for p in per_probe[k]}} for k in runs})
    if a.workload == "outside":
        toks = 2 * out["outside"]["tokens_per_model"]  # the target and its base
        for k in runs:  # wall time under this load, and CPU seconds (one thread: a quiet
            # core's wall time, at most: other processes only slow a core's caches)
            for label, sec in (("wall", per_probe[k]["membership"]),
                               ("cpu", per_probe_cpu.get(k, {}).get("membership"))):
                if sec:
                    out.setdefault(f"tokens_per_{label}_s", {})[k] = round(toks / sec, 1)
                    out.setdefault(f"membership_{label}_s_at_1000_plus_1000", {})[k] = round(
                        sec * 1000 / a.docs, 1)
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
