"""The TPU study's time plan (configs/study-tpu.yaml): each run's estimated seconds on one TPU v5e
chip, from the chip's measured figures in docs/results.md, packed into 30-minute machines.

    python scripts/study_tpu_plan.py [--config configs/study-tpu.yaml]

Prints JSON: per size, the fixed work every machine of that size repeats (nothing is kept between
machines: the public bases are pretrained again, the data prepared again), each point's training
and probing, and the machines (sessions) the points fill. An estimate, not a measurement: every
rate below is a measured one or is scaled from one by the model's FLOPs a token, and the
assumptions are named beside them.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

from memaudit.models.presets import param_count
from memaudit.sweep.config import load_sweep_config, plan_points, point_config
from memaudit.sweep.pretrain import pretrained_sizes, public_base_config

# ---- measured on one TPU v5e chip (docs/results.md, 2026-12-06)
CENTRAL_125M = 137_364  # tokens/s, non-private AdamW step, 8 x 512, MFU 0.458
DP_SLOWDOWN = 62.1 / 29.8  # DP-SGD per example at 125m: 2.08x; ELS and ULS assumed the same (ULS not measured)
FED_125M = 8 * 2 * 2 * 512 / 0.238  # tokens/s, FedAvg round, cohort 8 (DP-FedAvg: 0.99x)
FED_350M = 8 * 2 * 2 * 512 / 0.683
SCORE_125M = 340_000  # tokens/s, scoring with Min-K%++'s statistics
EXPOSURE_125M = 1.125 / 1e5  # seconds a candidate (the grouped path, 1.125 s a canary at 10^5
# candidates, 2026-12-07; the flat path's 1.64 s before)
COMPILE = {"tiny": 10.0, "125m": 15.0, "350m": 15.0}  # s a program (scanned layers: 9.7-14.5 s measured)
ULS_COMPILE_125M = 150.0  # s: the one ULS compile tried at 125m had not ended after ~150 s
# ---- measured on the chip, 2026-12-07 (the tiny study's third machine, commit 0c22875, docs/results.md)
TINY_PROBES = 28.3  # s: the most a tiny point's probe stages took over the 9 points (22.7-28.3 s;
# membership 14-16, extraction 3.1-8.2, PII 0.8-2.4, exposure 0.2-1.3); the first machine's 162 s
# was the host's n-gram test (np.isin) and blind shift check, both fixed
GENERATION_FLOOR = 8.2  # s: the most extraction's probe took at tiny (3.1-8.2 s), taken as the least
# any size spends on it
TINY_TRAIN = {"fed": 93.0 - 28.3, "dp": 149.0 - 28.3}  # s: a tiny point's whole time less its probes
# (federated points 86-93 s, centralized DP points 109-149 s); non-DP centralized: not measured
# ---- assumed (not measured on the chip)
MACHINE = 30 * 60  # s a machine is held
COMMAND = 600  # s a command may run
COMMAND_MARGIN = 30  # s a command spends starting Python and opening the chip
START = 130  # s until the first command runs (84-126 s measured) ...
INSTALL = 31  # ... and the wheels: carried, torch's CPU build and matplotlib from the machine (31 s measured)
DATA_PREP = 150  # s: the public and private corpora synthesized and tokenized once per machine
POINT_PREP = 30  # s a point: its data staged, the model loaded and exported
MODEL_LOAD = {"tiny": 5.0, "125m": 20.0, "350m": 40.0}  # s a probe stage loads and converts a model
DOC_TOKENS = 150  # tokens a synthetic message (112 words on average, measured on the CPU)
TINY_FLOOR = 0.05  # the tiny model is dispatch-bound on the chip: its seconds are taken as this
# fraction of 125m's (a guess: tiny has 1/56 of 125m's FLOPs a token)


def flops_ratio(size: str) -> float:
    """Training FLOPs a token against 125m's (6 N, N without the input embedding)."""
    return param_count(size, include_embedding=False) / param_count("125m", include_embedding=False)


def rate(size: str, what: str) -> float:
    """Tokens/s of `what` (central, dp, fed, score) at `size`: 125m's measured rate, scaled by FLOPs
    (350m's federated round is measured)."""
    if what == "fed" and size == "350m":
        return FED_350M
    base = {"central": CENTRAL_125M, "dp": CENTRAL_125M / DP_SLOWDOWN, "fed": FED_125M, "score": SCORE_125M}[what]
    if size == "tiny":
        return base / TINY_FLOOR
    return base / flops_ratio(size)


def probe_seconds(cfg, p) -> float:
    """The point's probes: measured at tiny; at the other sizes its documents scored by the model
    and the base (the reference), the canaries' exposure candidates, the model load and at least
    tiny's generation (extraction's decoding, which the chip runs dispatch-bound)."""
    if p.model == "tiny":
        return TINY_PROBES + MODEL_LOAD["tiny"]
    run = point_config(cfg, p)
    d = run.data
    docs = d.synth.users * d.synth.docs_per_user
    canaries = 2 * d.canaries.per_setting * len(d.canaries.repetitions) * len(d.canaries.owners)
    scale = TINY_FLOOR if p.model == "tiny" else flops_ratio(p.model)
    scoring = 2 * docs * DOC_TOKENS / rate(p.model, "score")
    exposure = canaries * cfg.probe.exposure_samples * EXPOSURE_125M * scale
    return scoring + exposure + MODEL_LOAD[p.model] + GENERATION_FLOOR


def train_seconds(cfg, p) -> float:
    run = point_config(cfg, p)
    kind = "fed" if p.backend == "federated" else ("dp" if run.privacy.enabled else "central")
    if p.model == "tiny" and kind in TINY_TRAIN:
        return TINY_TRAIN[kind]
    compile_s = COMPILE[p.model]
    if kind == "dp" and run.privacy.user_sampling == "uls" and p.model != "tiny":
        compile_s = ULS_COMPILE_125M * (1 if p.model == "125m" else 1.5)
    return p.tokens_seen / rate(p.model, kind) + compile_s + POINT_PREP


def plan(config: str) -> dict:
    cfg = load_sweep_config(config)
    points = plan_points(cfg)
    usable = MACHINE - START - INSTALL
    out: dict = {"config": config, "usable_seconds_a_machine": usable, "sizes": {}}
    tokenizer_size = pretrained_sizes(cfg, points)[0]
    for size in cfg.grid.models:
        mine = [p for p in points if p.model == size]
        bases = {}
        for s in dict.fromkeys([tokenizer_size, size]):
            t = public_base_config(cfg, size=s)
            tokens = t.train.steps * t.train.batch_size * t.data.seq_len
            bases[s] = {"tokens": tokens, "tokens_per_parameter": round(tokens / param_count(s), 3),
                        "seconds": round(tokens / rate(s, "central") + COMPILE[s])}
        reference_probes = probe_seconds(cfg, mine[0])
        fixed = DATA_PREP + sum(b["seconds"] for b in bases.values()) + reference_probes
        rows = [{"point": p.name, "train_s": round(train_seconds(cfg, p)), "probe_s": round(probe_seconds(cfg, p))}
                for p in mine]
        # --stop-after: a command of COMMAND seconds stops starting work when what may be in
        # flight (a point's probes, or one stretch of 50 steps) would no longer end inside it
        stretch = max(r["train_s"] for r in rows) / 3
        stop_after = COMMAND - COMMAND_MARGIN - max(max(r["probe_s"] for r in rows), stretch)
        machines, current = [], []
        for r in sorted(rows, key=lambda r: -(r["train_s"] + r["probe_s"])):
            load = fixed + sum(x["train_s"] + x["probe_s"] for x in current) + r["train_s"] + r["probe_s"]
            if current and load > usable:
                machines.append(current)
                current = []
            current.append(r)
        machines.append(current)
        out["sizes"][size] = {
            "public_bases": bases, "fixed_s_a_machine": round(fixed), "points": rows,
            "stop_after_s": round(stop_after),
            "machines": [{"points": [r["point"] for r in m], "seconds": (sec := round(
                fixed + sum(r["train_s"] + r["probe_s"] for r in m))), "fits": sec <= usable,
                "commands_at_least": math.ceil(sec / (COMMAND - COMMAND_MARGIN))} for m in machines],
        }
        out["sizes"][size]["fits_one_machine"] = len(machines) == 1 and machines[0] and \
            out["sizes"][size]["machines"][0]["fits"]
    out["sessions"] = sum(len(v["machines"]) for v in out["sizes"].values())
    out["lira_k4_extra_s_a_machine"] = {
        s: round(4 * (4_915_200 / rate(s, "central") + COMPILE[s] + POINT_PREP)) for s in cfg.grid.models}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default=str(Path(__file__).resolve().parents[1] / "configs" / "study-tpu.yaml"))
    print(json.dumps(plan(ap.parse_args().config), indent=1))


if __name__ == "__main__":
    main()
