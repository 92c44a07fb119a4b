"""Where `memaudit probe RUN` spends its time: per-probe wall time (probes.json's timings) and, under
cProfile, the share of the model's forward passes, tokenization, decoding and the statistics.

Prints JSON. The machine's load average is printed beside (a shared machine slows every part).
--compare runs the probe stage once per variant in alternating order (--repeats) and reports
medians and ratios against the first variant; variants: `base` (as shipped), `threads1`
(torch on one thread), `threads2` (two).

    python benchmarks/probe_breakdown.py RUN_DIR [--probes exposure,membership]
    python benchmarks/probe_breakdown.py RUN_DIR --compare base,threads1 --repeats 3
"""

from __future__ import annotations

import argparse
import cProfile
import json
import os
import pstats
import statistics
import time

# configs/quickstart.yaml's probe section
QUICKSTART = {"batch_size": 32, "probes": ("exposure", "extraction", "membership", "user_inference",
                                           "pii"),
              "extraction_ks": (32,), "nd_samples": 64, "pii_max_items": 200}
PARTS = {  # label -> (file suffix, function name) whose cumulative time is reported
    "model_forward": ("transformers/models/llama/modeling_llama.py", "forward"),
    "tokenize": ("memaudit/probes/targets.py", "plain"),
    "tokenize_split": ("memaudit/probes/targets.py", "encode_split"),
    "token_logprobs": ("memaudit/probes/scoring.py", "token_logprobs"),
    "decode": ("memaudit/probes/scoring.py", "decode"),
    "bootstrap_stats": ("memaudit/probes/stats.py", "attack_summary"),
    "shift_check": ("memaudit/probes/shift.py", "blind_check"),
    "load_model": ("memaudit/probes/scoring.py", "load_causal_lm"),
    "fit_windows": ("memaudit/probes/runner.py", "fit_windows"),
}


def _run(run_dir: str, probes: str | None, threads: int | None, profile: bool,
         engine: str = "torch"):
    import torch

    from memaudit.config import ProbeConfig
    from memaudit.probes.runner import parse_probes, run_probes
    from memaudit.probes.targets import resolve_target

    if threads:
        torch.set_num_threads(threads)
    kw = {"probes": parse_probes(probes)} if probes else {}
    settings = ProbeConfig(device="cpu", **{**QUICKSTART, **kw})
    t = resolve_target(run_dir)
    prof = cProfile.Profile() if profile else None
    t0 = time.perf_counter()
    if prof:
        prof.enable()
    res = run_probes(t, settings, engine=engine)
    if prof:
        prof.disable()
    return time.perf_counter() - t0, res.document["timings"], prof


def _parts(prof) -> dict[str, float]:
    st = pstats.Stats(prof)
    out = {}
    for label, (suffix, fn) in PARTS.items():
        cum = [v[3] for (f, _l, name), v in st.stats.items() if f.endswith(suffix) and name == fn]
        out[label] = round(max(cum), 2) if cum else 0.0  # recursive entries: the outermost
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("run")
    ap.add_argument("--probes", default=None)
    ap.add_argument("--compare", default=None, help="variants, comma-separated")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--engine", default="torch", help="torch or jax (the breakdown's engine)")
    args = ap.parse_args()
    out = {"benchmark": "probe_breakdown", "run": args.run, "cpus": os.cpu_count(),
           "load_avg_before": os.getloadavg()[0]}
    if not args.compare:
        import torch

        out["torch_threads"] = torch.get_num_threads()
        # one probe at a time, a JSON line each as it finishes (a loaded machine may not see the
        # end); membership and user inference each score the documents again here
        names = (args.probes or ",".join(QUICKSTART["probes"])).split(",")
        for name in names:
            total, timings, prof = _run(args.run, name, None, True, args.engine)
            print(json.dumps({"probe": name, "engine": args.engine, "total_s": round(total, 2),
                              "probe_s": round(timings[name], 2), "parts_s": _parts(prof),
                              "load_avg": os.getloadavg()[0]}), flush=True)
    else:
        variants = args.compare.split(",")
        threads = {"base": None, "threads1": 1, "threads2": 2}
        times: dict[str, list[float]] = {v: [] for v in variants}
        for r in range(args.repeats):
            for v in variants if r % 2 == 0 else variants[::-1]:
                times[v].append(_run(args.run, args.probes, threads[v], False)[0])
        med = {v: statistics.median(x) for v, x in times.items()}
        out.update(medians_s={v: round(m, 2) for v, m in med.items()},
                   ratio_vs_first={v: round(m / med[variants[0]], 3) for v, m in med.items()},
                   all_s={v: [round(x, 2) for x in xs] for v, xs in times.items()})
    out["load_avg_after"] = os.getloadavg()[0]
    print(json.dumps(out))


if __name__ == "__main__":
    main()
