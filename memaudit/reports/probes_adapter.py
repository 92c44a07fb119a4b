"""Map probes.json onto the report's headline leakage cells, plot data and table rows."""

from __future__ import annotations

from typing import Any


def summarize_probes(probes: dict[str, Any], *, show_secrets: bool = False) -> dict[str, Any]:
    return {"leakage": {}, "plots": {}, "rows": [], "samples": []}
