"""Test helper: a run's metrics lines with the sensitive ones of a DP run merged back in."""

from __future__ import annotations

import json
from pathlib import Path


def merged_metrics(run: str | Path) -> list[dict]:
    """metrics.jsonl, each line updated with sensitive_metrics.jsonl's line of the same step
    or round (a DP run keeps the statistics of the private data there)."""
    run = Path(run)

    def read(name: str) -> list[dict]:
        p = run / name
        return [json.loads(ln) for ln in p.read_text().splitlines() if ln.strip()] if p.exists() else []

    public, sensitive = read("metrics.jsonl"), read("sensitive_metrics.jsonl")
    if not sensitive:
        return public
    key = "round" if "round" in public[0] else "step"
    by = {m[key]: m for m in sensitive}
    return [{**m, **by.get(m[key], {})} for m in public]
