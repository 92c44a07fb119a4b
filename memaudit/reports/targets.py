"""Probed models memaudit did not train, in the same report as memaudit runs.

A `ProbedTarget` is a folder holding a probes.json written by `memaudit probe MODEL --out` (or
that file itself), with what is known of the model: where it came from (folder, cached hub id,
LoRA adapter and its base), the reference the attacks used, and its ε and unit when a privacy
ledger (privacy.json, memaudit's format) lies beside it, "unknown" otherwise. Nothing is
guessed: an outside model has no backend, so it is never called centralized or federated.

The report's first screen for such targets answers "what would an attacker learn from releasing
this model": per target, the release verdict (`memaudit.reports.verdict`: the strongest attack's
TPR at 1% FPR with its n, or "n too small"), the shift check's warning above all when it fired,
and a log-log ROC of that attack; every attack's AUC and TPR, exposure, extraction and PII below.
Targets are compared pairwise, by the same tests and in the same Holm family as the comparisons
between runs (`memaudit.reports.findings`), on membership by the strongest attack they share, and
only on the same units: a pair probed on other documents, or a model compared with its own
weights, is skipped with the reason. The report names a model by its hub id or its folder's name,
never by a path of the machine it was probed on.

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
from memaudit.probes.document import ProbesDoc, read_probes
from memaudit.probes.loaders import Privacy
from memaudit.reports.blocks import TargetPair, compared
from memaudit.reports.cells import METRICS, TESTABLE, Cell
from memaudit.reports.compare import compare_groups
from memaudit.reports.entries import Shift, TargetEntry, UnitScores
from memaudit.reports.probes_adapter import read_summary, roc_points, units_of
from memaudit.reports.verdict import Attack, release_verdict

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
    weights: str | None = None  # sha256 of the probed weights (probes.json's target)

    @property
    def privacy_text(self) -> str:
        if self.epsilon is None:
            return f"{UNKNOWN}: no privacy ledger beside {PROBES}"
        return f"epsilon = {self.epsilon:.3g} per {self.unit} (ledger), delta = {self.delta}"

    @classmethod
    def load(cls, path: Path) -> ProbedTarget:
        folder = path.parent
        doc = read_probes(path)
        priv = None
        if (folder / "privacy.json").is_file():
            priv = Privacy.from_json(read_json(folder / "privacy.json"), str(folder / "privacy.json"))
        t = doc.about
        name = folder.name if path.name == PROBES else path.stem
        return cls(id=name, path=path, model=t.model, source=t.source, base=t.base, reference=t.reference,
                   epsilon=None if priv is None else priv.epsilon,
                   unit=None if priv is None else priv.unit,
                   delta=None if priv is None else priv.delta, weights=t.weights_sha256)


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


def display_name(name: str | None) -> str | None:
    """A model as the report names it: a hub id as it is ("EleutherAI/pythia-160m"), a folder of
    the machine by its name alone ("/home/alice/models/gpt2" -> "gpt2").

    >>> display_name("/home/alice/models/gpt2/"), display_name("EleutherAI/pythia-160m")
    ('gpt2', 'EleutherAI/pythia-160m')
    """
    if not name:
        return name
    s = str(name).rstrip("/\\")
    windows = len(s) > 2 and s[1] == ":" and s[2] in "/\\"
    if s.startswith(("/", ".", "~", "\\")) or windows or "\\" in s or Path(s).exists():
        return s.replace("\\", "/").rsplit("/", 1)[-1] or s
    return s


MEMBERSHIP = "membership:"  # units of one attack's scores: `MEMBERSHIP + attack`
STRONGEST = "mia_strongest"  # the metric the pairs compare membership on


def _attack_units(doc: ProbesDoc) -> dict[str, dict[str, Any]]:
    """Per-document scores of every membership attack (members first), keyed `MEMBERSHIP + name`."""
    p = doc.get("membership")
    rows = p.membership_scores() if p is not None else []
    if not rows:
        return {}
    return {MEMBERSHIP + k: {"kind": "auc", "unit": "documents", "ids": [r.id for r in rows],
                             "values": [r.scores.get(k) for r in rows], "member": [bool(r.member) for r in rows]}
            for k in rows[0].scores if all(isinstance(r.scores.get(k), int | float) for r in rows)}


def _roc(units: dict[str, Any] | None, attack: Attack | None) -> dict[str, Any] | None:
    """The ROC of the verdict's attack, from its per-document scores."""
    if units is None or attack is None:
        return None
    u = UnitScores.of(units)
    pos = [v for v, m in zip(u.values, u.member, strict=True) if m]
    neg = [v for v, m in zip(u.values, u.member, strict=True) if not m]
    roc = roc_points(pos, neg, attack.auc.value)
    return None if roc is None else {"attack": attack.name, "n_pos": len(pos), "n_neg": len(neg), **roc}


def _attacks(doc: ProbesDoc) -> list[dict[str, Any]]:
    """Every membership attack's AUC and TPR cells, as probes.json holds them."""
    p = doc.get("membership")
    return [] if p is None else p.attack_json()


def target_entry(t: ProbedTarget) -> dict[str, Any]:
    """The report's entry for one probed target (report.json's `targets[]`)."""
    doc = read_probes(t.path)
    summary = read_summary(doc)
    attacks, units = _attacks(doc), {**units_of(doc), **_attack_units(doc)}
    entry = {
        "id": t.id, "model": display_name(t.model), "source": t.source or UNKNOWN,
        "base": display_name(t.base), "reference": display_name(t.reference), "weights_sha256": t.weights,
        "privacy": {"epsilon": UNKNOWN if t.epsilon is None else t.epsilon,
                    "unit": t.unit, "delta": t.delta, "text": t.privacy_text},
        "counts": doc.counts,
        "shift": doc.distribution_shift,
        "attacks": attacks,
        "leakage": summary.leakage,
        "probe_rows": summary.rows,
        "units": units,
    }
    v = release_verdict(entry)
    best = next((a for a in map(Attack.of, attacks) if a is not None and a.name == v.attack), None)
    return {**entry, "verdict": v.to_json(),
            "roc": _roc(units.get(MEMBERSHIP + best.name) if best else None, best)}


def same_units(ua: dict[str, Any], ub: dict[str, Any]) -> bool:
    """Both sides scored the same units (and, for an attack, with the same member labels)."""
    a, b = UnitScores.of(ua), UnitScores.of(ub)
    return dict(zip(a.ids, a.member or a.ids, strict=True)) == dict(zip(b.ids, b.member or b.ids, strict=True))


def comparison_attack(entries: list[dict[str, Any]]) -> str | None:
    """The membership attack the pairs are compared on: of those every target with membership
    scores has, the one furthest from chance (|AUC - 0.5|) in any target. One attack for every
    pair keeps one test per pair in the family."""
    targets = [TargetEntry.of(e) for e in entries]
    scored = [e for e in targets if any(k.startswith(MEMBERSHIP) for k in e.units or {})]
    if not scored:
        return None
    common = set.intersection(*({k[len(MEMBERSHIP):] for k in e.units if k.startswith(MEMBERSHIP)}
                                for e in scored))
    far = {a.attack: 0.0 for e in scored for a in e.each_attack() if a.attack in common}
    for e in scored:
        for a in e.each_attack():
            if a.attack in far and (a.auc or {}).get("value") is not None:
                far[a.attack] = max(far[a.attack], abs(Cell.from_json(a.auc).value - 0.5))
    return max(sorted(far), key=lambda k: far[k], default=None)


def _same_model(a: TargetEntry, b: TargetEntry) -> bool:
    """The same weights (by their sha256), or, where a probes.json names none, the same score on
    every unit of every metric: a model compared with itself, whose test could only say p = 1."""
    if a.weights_sha256 and b.weights_sha256:
        return a.weights_sha256 == b.weights_sha256
    ua, ub = a.units or {}, b.units or {}
    shared = [k for k in ua if k in ub]
    return bool(shared) and all((sa := UnitScores.of(ua[k])).ids == (sb := UnitScores.of(ub[k])).ids
                                and sa.values == sb.values for k in shared)


def _skip_reason(a: TargetEntry, b: TargetEntry, unmatched: list[str]) -> str:
    """Why a pair has no test: the same model, or no metric on the same units."""
    if _same_model(a, b):
        return "the same model (the same weights, or the same score on every unit): nothing to compare"
    if not unmatched:
        return "no metric measured on both"
    ua, ub = (UnitScores.of(e.units_of(unmatched[0])) for e in (a, b))
    shared = len(set(ua.ids) & set(ub.ids))
    return (f"not probed on the same {ua.unit} ({len(ua.ids):,} and {len(ub.ids):,}, "
            f"{shared:,} in common): a comparison needs the same units, so probe both on one "
            "members/non-members set")


def target_comparisons(entries: list[dict[str, Any]]) -> list[TargetPair]:
    """Each pair of targets, tested two-sided on each metric both measured on the same units:
    membership on the strongest attack the models share (`comparison_attack`, one for every pair,
    key `STRONGEST`, the attack named in the cell), the other headline metrics as they are. A pair
    of the same model, or with no metric on the same units, is listed with `skipped` (why) and no
    test. Sets `units[STRONGEST]` on the entries (the report's refinements of a test read it)."""
    attack = comparison_attack(entries)
    targets = [TargetEntry.of(e) for e in entries]  # each holds its entry's units, to add to
    for e in targets:  # the units the tests (and the report's refinements) read under the key
        if attack and MEMBERSHIP + attack in e.units:
            e.units[STRONGEST] = e.units[MEMBERSHIP + attack]
    by_attack = {e.id: e.attack_aucs() for e in targets}
    keys = [STRONGEST] + [k for k in METRICS if TESTABLE.get(k, True) and k != "mia_auc"]
    out = []
    for i, a in enumerate(targets):
        for b in targets[i + 1:]:
            pair = [a.id, b.id]
            if _same_model(a, b):
                out.append(TargetPair(targets=pair, skipped=_skip_reason(a, b, [])))
                continue
            cells, unmatched = {}, []
            for key in keys:
                ua, ub = (e.units_of(key) for e in (a, b))
                ca, cb = ((by_attack[e.id].get(attack) for e in (a, b)) if key == STRONGEST
                          else (a.cell(key), b.cell(key)))
                if not (ca and cb and ua and ub):
                    continue
                if not same_units(ua, ub):
                    unmatched.append(key)
                    continue
                cells[key] = compared(("a", ca), ("b", cb), compare_groups([a], [b], key, "two-sided"),
                                      **({"attack": attack} if key == STRONGEST else {}))
            if cells:
                out.append(TargetPair(targets=pair, metrics=cells))
            else:
                out.append(TargetPair(targets=pair, skipped=_skip_reason(a, b, unmatched)))
    return out


def epsilon_of(entry: dict[str, Any] | TargetEntry) -> float:
    e = TargetEntry.of(entry).privacy.epsilon
    return math.inf if e == UNKNOWN else float(e)


def input_text(entry: dict[str, Any]) -> str:
    """What fitting the context did: documents windowed (cut, in an older probes.json), prefix
    lengths dropped."""
    c = TargetEntry.of(entry).counts or {}
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
    shift = TargetEntry.of(entry).shift or Shift()
    if shift.flagged:
        parts.append(f"WARNING: {shift.note}")
    elif shift.auc is not None:
        parts.append(f"no distribution shift found (blind AUC {shift.auc:.2f})")
    return "; ".join(parts) or "all scored"
