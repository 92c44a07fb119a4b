"""Hand-built report inputs for report tests (no training needed)."""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from memaudit.backends import backend_name
from memaudit.probes.records import Cell


def cell(v: float, half: float, n: int = 200, unit: str = "documents") -> dict[str, Any]:
    return {"value": v, "ci_low": v - half, "ci_high": v + half, "n": n, "unit": unit}


def auc_units(shift: float, n: int = 100, seed: int = 0) -> dict[str, Any]:
    """Per-document loss scores of n members (shifted up by `shift`) and n non-members; the same
    document ids in every run, so runs compare paired."""
    rng = np.random.default_rng(seed)
    vals = np.r_[rng.normal(shift, 1, n), rng.normal(0, 1, n)]
    return {"kind": "auc", "unit": "documents", "ids": [f"d{i}" for i in range(2 * n)],
            "values": vals.tolist(), "member": [True] * n + [False] * n}


def run(rid: str, backend: str, eps: float, *, mia: dict, goldfish: bool = False, unit: str | None = None,
        samples: list[str] | None = None, units: dict | None = None, ppl: float | None = None,
        role: str | None = None, user_sampling: str | None = None) -> dict[str, Any]:
    dp = not math.isinf(eps)
    if ppl is None:  # by default the backends are far from matched utility, as in the runs
        ppl = 20.0 if backend_name(backend) == "centralized" else 200.0
    return {
        "id": rid, "path": f"/runs/{rid}", "backend": backend, "status": "complete", "seed": 0, "audit": False,
        "role": role, "group_privacy": [],
        "model": {"preset": "tiny", "params": 1787008},
        "data": {"fingerprint": "abc123", "users": 51, "sequences": 400},
        "privacy": {
            "mechanism": ("DP-SGD" if backend_name(backend) == "centralized" else "DP-FedAvg") if dp else "none",
            "description": "test", "epsilon": eps, "target_epsilon": eps if dp else None,
            "noise_multiplier": 1.0 if dp else None, "delta": 1e-5 if dp else None,
            "unit": unit if dp else None, "per_user": None, "per_user_text": "n/a",
            "user_sampling": user_sampling if dp else None,
        },
        "mitigation": {"goldfish": goldfish},
        "utility": {"holdout_loss": math.log(ppl), "holdout_perplexity": ppl},
        "noise_per_round": [],
        "leakage": {"mia_auc": Cell.from_json(mia)},
        "probes_summary": {"membership_roc": {"fpr": [0.0, 0.01, 0.1, 1.0], "tpr": [0.0, 0.05, 0.3, 1.0], "auc": mia["value"]}},
        "probe_rows": [{"probe": "membership", "metric": "loss AUC", **mia}],
        "samples": samples or [],
        "units": units or {},
    }


# ----------------------------------------------------------------------------- run directories
def _mean_cell(vals: list[float], unit: str = "canaries") -> dict[str, Any]:
    v = float(np.mean(vals))
    return {"value": v, "ci_low": None, "ci_high": None, "n": len(vals), "unit": unit, "note": "n too small"}


def write_run_dir(path, backend: str, *, ppl: float, role: str | None = None,
                  dp: tuple[float, int, int, int] | None = None, exposure_shift: float = 0.0,
                  mia_shift: float = 0.0, canaries: list[tuple[str, int, str, int]] | None = None,
                  seed: int = 0):
    """A complete run directory as train + probe would leave it, without training.

    dp: (noise multiplier, population, expected batch, steps) recorded as a real ledger of the
    backend's unit; canaries: (id, repetitions, owner kind, owners); exposure of canary c is
    its repetitions x `exposure_shift` bits above the references (1.4 bits).
    """
    import json
    from pathlib import Path

    from memaudit.privacy.ledger import PrivacyLedger
    from memaudit.privacy.mechanisms import SampledGaussian

    path = Path(path)
    path.mkdir(parents=True)
    unit = "example" if backend_name(backend) == "centralized" else "user"  # `parallel`: an old run
    cfg = {"backend": backend, "model": {"preset": "tiny"}, "train": {"seed": seed},
           "privacy": {"noise_multiplier": dp[0] if dp else None}}
    manifest = {"status": "complete", "backend": backend, "config": cfg, "data_fingerprint": "f" * 16,
                "result": {"steps": 10, "final_holdout_loss": math.log(ppl), "final_holdout_perplexity": ppl}}
    if role:
        manifest["role"] = role
    (path / "run.json").write_text(json.dumps(manifest))
    if dp:
        sigma, population, expected, steps = dp
        led = PrivacyLedger(unit=unit, delta=1e-5)
        mech = SampledGaussian(name="DP-SGD" if unit == "example" else "DP-FedAvg", unit=unit,
                               noise_multiplier=sigma, population=population, expected=expected)
        for _ in range(steps):
            led.record_mechanism(mech)
        (path / "privacy.json").write_text(json.dumps(led.to_json()))
    canaries = canaries or [("c0", 1, "user", 1), ("c1", 4, "user", 1), ("c2", 4, "spread", 4),
                            ("c3", 16, "user", 1)]
    (path / "canaries.json").write_text(json.dumps({"inserted": [
        {"id": cid, "secret": "0000", "text": "x", "repetitions": r, "owner_kind": kind,
         "users": [f"u{i}" for i in range(owners)]} for cid, r, kind, owners in canaries], "references": []}))
    (path / "metrics.jsonl").write_text(json.dumps({"step": 10, "loss": 3.0, "holdout_perplexity": ppl}) + "\n")
    ref = 1.4
    ins = [{"id": cid, "role": "inserted", "repetitions": r, "owner_kind": kind,
            "exposure": ref + r * exposure_shift} for cid, r, kind, _ in canaries]
    refs = [{"id": f"r{i}", "role": "reference", "repetitions": 0, "owner_kind": None, "exposure": ref}
            for i in range(4)]
    by_rep = {}
    for r in sorted({c["repetitions"] for c in ins}):
        group = [c for c in ins if c["repetitions"] == r]
        b = {"all": _mean_cell([c["exposure"] for c in group]),
             "excess": _mean_cell([c["exposure"] - ref for c in group])}
        for kind in sorted({c["owner_kind"] for c in group}):
            b[kind] = _mean_cell([c["exposure"] for c in group if c["owner_kind"] == kind])
        by_rep[str(r)] = b
    mia = auc_units(mia_shift, n=60, seed=seed)
    scores = [{"id": i, "loss": v, "member": m} for i, v, m in zip(mia["ids"], mia["values"], mia["member"],
                                                                    strict=True)]
    from memaudit.probes.stats import roc_auc

    vals, mem = np.asarray(mia["values"]), np.asarray(mia["member"])
    auc = roc_auc(vals[mem], vals[~mem])
    probes = {"schema": 1, "target": {}, "settings": {}, "probes": {
        "exposure": {"summary": {"method": "enumeration", "max_exposure": 13.3, "by_repetitions": by_rep},
                     "scores": ins + refs},
        "membership": {"summary": {"loss": {"auc": {"value": auc, "ci_low": auc - 0.1, "ci_high": auc + 0.1,
                                                    "n": 120, "unit": "documents"}}}, "scores": scores},
    }}
    (path / "probes.json").write_text(json.dumps(probes))
    return path
