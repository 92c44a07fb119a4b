"""Hand-built report inputs for report tests (no training needed)."""

from __future__ import annotations

import math
from typing import Any

import numpy as np


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
        role: str | None = None) -> dict[str, Any]:
    dp = not math.isinf(eps)
    if ppl is None:  # by default the backends are far from matched utility, as in the runs
        ppl = 20.0 if backend == "parallel" else 200.0
    return {
        "id": rid, "path": f"/runs/{rid}", "backend": backend, "status": "complete", "seed": 0, "audit": False,
        "role": role, "group_privacy": [],
        "model": {"preset": "tiny", "params": 1787008},
        "data": {"fingerprint": "abc123", "users": 51, "sequences": 400},
        "privacy": {
            "mechanism": ("DP-SGD" if backend == "parallel" else "DP-FedAvg") if dp else "none",
            "description": "test", "epsilon": eps, "target_epsilon": eps if dp else None,
            "noise_multiplier": 1.0 if dp else None, "delta": 1e-5 if dp else None,
            "unit": unit if dp else None, "per_user": None, "per_user_text": "n/a",
        },
        "mitigation": {"goldfish": goldfish},
        "utility": {"holdout_loss": math.log(ppl), "holdout_perplexity": ppl},
        "noise_per_round": [],
        "leakage": {"mia_auc": mia},
        "probes_summary": {"membership_roc": {"fpr": [0.0, 0.01, 0.1, 1.0], "tpr": [0.0, 0.05, 0.3, 1.0], "auc": mia["value"]}},
        "probe_rows": [{"probe": "membership", "metric": "loss AUC", **mia}],
        "samples": samples or [],
        "units": units or {},
    }
