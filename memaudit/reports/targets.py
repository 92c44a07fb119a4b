"""Probed models memaudit did not train, in the same report as memaudit runs.

A `ProbedTarget` is a folder holding a probes.json written by `memaudit probe MODEL --out` (or
that file itself), with what is known of the model: where it came from (folder, cached hub id,
LoRA adapter and its base), the reference the attacks used, and its ε and unit when a privacy
ledger (privacy.json, memaudit's format) lies beside it, "unknown" otherwise. Nothing is
guessed: an outside model has no backend, so it is never called centralized or federated.

The report's first screen for such targets answers "what would an attacker learn from releasing
this model": per target, every membership attack's AUC and TPR at low FPR (with the negatives it
needs), exposure, extraction and PII. Targets are compared pairwise on the units they share, by
the same tests and in the same Holm family as the comparisons between runs
(`memaudit.reports.findings`).

References:
    Carlini et al. 2022, "Membership Inference Attacks From First Principles" (TPR at low FPR).
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from memaudit.errors import MemauditError
from memaudit.io import read_json
from memaudit.probes.loaders import Privacy, ProbesDoc
from memaudit.reports.cells import METRICS, TESTABLE
from memaudit.reports.compare import compare_groups
from memaudit.reports.probes_adapter import summarize_probes, units_of

PROBES = "probes.json"
UNKNOWN = "unknown"


@dataclass(frozen=True, kw_only=True)
class ProbedTarget:
    """An outside model's probes and what is known of it (None: not known)."""

    id: str
    path: Path  # the probes.json
    model: str | None
    source: str | None  # folder | hub | adapter
    base: str | None
    reference: str | None
    epsilon: float | None
    unit: str | None
    delta: float | None

    @property
    def privacy_text(self) -> str:
        if self.epsilon is None:
            return f"{UNKNOWN}: no privacy ledger beside {PROBES}"
        return f"epsilon = {self.epsilon:.3g} per {self.unit} (ledger), delta = {self.delta}"

    @classmethod
    def load(cls, path: Path) -> ProbedTarget:
        folder = path.parent
        doc = ProbesDoc.from_json(read_json(path), str(path))
        priv = None
        if (folder / "privacy.json").is_file():
            priv = Privacy.from_json(read_json(folder / "privacy.json"), str(folder / "privacy.json"))
        t = doc.target
        name = folder.name if path.name == PROBES else path.stem
        return cls(id=name, path=path, model=t.get("model"), source=t.get("source"),
                   base=t.get("base"), reference=t.get("reference"),
                   epsilon=None if priv is None else priv.epsilon,
                   unit=None if priv is None else priv.unit,
                   delta=None if priv is None else priv.delta)


def is_memaudit_run(folder: Path) -> bool:
    """A run.json that memaudit wrote (a backend or a config); a stub is not a run."""
    m = folder / "run.json"
    if not m.is_file():
        return False
    try:
        obj = read_json(m)
    except (ValueError, OSError):
        return True  # a damaged run.json is the run loader's to refuse, in its words
    return not isinstance(obj, dict) or "backend" in obj or "config" in obj


def find_targets(paths: list[str | os.PathLike]) -> list[ProbedTarget]:
    """Probed outside models among `paths`: a probes.json file, or folders holding one that
    are not memaudit runs (searched below a folder too)."""
    found: list[Path] = []
    for p in map(Path, paths):
        if p.is_file() and p.suffix == ".json":
            found.append(p)
        elif p.is_dir():
            found += sorted(f for f in p.rglob(PROBES) if not is_memaudit_run(f.parent))
    seen, out = set(), []
    for f in found:
        if f.resolve() not in seen:
            seen.add(f.resolve())
            out.append(ProbedTarget.load(f))
    ids = [t.id for t in out]
    if len(set(ids)) != len(ids):
        dup = next(i for i in ids if ids.count(i) > 1)
        raise MemauditError(f"two probed targets are both named '{dup}'; give their folders "
                            "different names")
    return out


def _attacks(doc: ProbesDoc) -> list[dict[str, Any]]:
    """Every membership attack's AUC and TPR cells, as probes.json holds them."""
    p = doc.get("membership")
    if p is None:
        return []
    out = []
    for name, s in p.summary.items():
        if isinstance(s, dict) and "auc" in s:
            out.append({"attack": name, "auc": s["auc"], "tpr_at_fpr": s.get("tpr_at_fpr") or {}})
    return out


def target_entry(t: ProbedTarget) -> dict[str, Any]:
    """The report's entry for one probed target (report.json's `targets[]`)."""
    raw = read_json(t.path)
    doc = ProbesDoc.from_json(raw, str(t.path))
    summary = summarize_probes(doc)
    return {
        "id": t.id, "path": str(t.path), "model": t.model, "source": t.source or UNKNOWN,
        "base": t.base, "reference": t.reference,
        "privacy": {"epsilon": UNKNOWN if t.epsilon is None else t.epsilon,
                    "unit": t.unit, "delta": t.delta, "text": t.privacy_text},
        "counts": raw.get("counts") or {},
        "shift": (raw.get("checks") or {}).get("distribution_shift"),
        "attacks": _attacks(doc),
        "leakage": summary["leakage"],
        "probe_rows": summary["rows"],
        "units": units_of(doc),
    }


def target_comparisons(entries: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each pair of targets, each headline metric both have, tested two-sided on their units."""
    out = []
    for i, a in enumerate(entries):
        for b in entries[i + 1:]:
            cells = {}
            for key in METRICS:
                if not TESTABLE.get(key, True):
                    continue
                ca, cb = a["leakage"].get(key), b["leakage"].get(key)
                if ca and cb:
                    cells[key] = {"a": ca, "b": cb, "verdict": "not tested",
                                  "test": compare_groups([a], [b], key, "two-sided")}
            if cells:
                out.append({"targets": [a["id"], b["id"]], "metrics": cells})
    return out


def best_attack(entry: dict[str, Any]) -> dict[str, Any] | None:
    """The attack with the highest AUC (what the first screen leads with)."""
    scored = [a for a in entry["attacks"] if (a["auc"] or {}).get("value") is not None]
    return max(scored, key=lambda a: a["auc"]["value"], default=None)


def epsilon_of(entry: dict[str, Any]) -> float:
    e = entry["privacy"]["epsilon"]
    return math.inf if e == UNKNOWN else float(e)


def input_text(entry: dict[str, Any]) -> str:
    """What fitting the context did: documents windowed (cut, in an older probes.json), prefix
    lengths dropped."""
    c = entry.get("counts") or {}
    parts = []
    if "documents_windowed" in c:  # every token scored, in strided windows of the context
        parts.append(f"{c['documents_windowed']} of {c['documents']} documents scored in "
                     f"windows of {c['context']} tokens"
                     + (", the reference's context" if c.get("reference_context") else ""))
    elif c.get("context"):  # a probes.json written before windows: documents were cut
        parts.append(f"{c['documents_truncated']} of {c['documents']} documents cut to "
                     f"{c['context']} tokens")
    if c.get("extraction_ks_dropped"):
        parts.append(f"prefix lengths {', '.join(map(str, c['extraction_ks_dropped']))} beyond the "
                     "target's context")
    shift = entry.get("shift") or {}
    if shift.get("flagged"):
        parts.append(f"WARNING: {shift['note']}")
    elif shift.get("auc") is not None:
        parts.append(f"no distribution shift found (blind AUC {shift['auc']:.2f})")
    return "; ".join(parts) or "all scored"
