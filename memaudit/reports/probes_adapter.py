"""Map probes.json (schema 1) onto the report: headline leakage cells, plot data, table rows.

Extracted member text shown in the report is looked up by document id in the run's
data/documents.jsonl (probes.json keeps ids, not text); canary secrets are never shown
unless asked.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from memaudit.probes.context import context_count, context_measure
from memaudit.probes.document import AttackSummary, ExposureScore, ProbesDoc, ProbeSection
from memaudit.probes.records import Cell
from memaudit.reports.blocks import Section, SectionTest
from memaudit.reports.entries import Record

MAX_ROC_POINTS = 200
MAX_SAMPLES = 5
SAMPLE_CHARS = 400
LOSS = "loss"  # the membership attack whose AUC is the headline (`mia_auc`)


@dataclass
class Summary:
    """What a probes.json gives the report: headline cells by metric (`leakage`), plot data by
    plot, the probe table's rows, and the extracted member documents (their ids and lengths;
    their text, `samples`, only with --show-secrets). Filled by one handler per probe."""

    leakage: dict[str, Cell | None] = field(default_factory=dict)
    plots: dict[str, Any] = field(default_factory=dict)
    rows: list[dict[str, Any]] = field(default_factory=list)
    samples: list[str] = field(default_factory=list)
    extracted_members: list[dict[str, Any]] = field(default_factory=list)

    def row(self, probe: str, metric: str, **cells: Any) -> None:
        """A row of the probe table: the probe, the metric, its cells."""
        self.rows.append({"probe": probe, "metric": metric, **cells})

    @property
    def measured(self) -> dict[str, Cell]:
        """The headline cells that have a value."""
        return {k: v for k, v in self.leakage.items() if v is not None}


def _stat(c: Cell | None, **extra: Any) -> Cell | None:
    """A probes.json cell as the report's: value, interval, n, unit and note (why no interval),
    `extra` (the metric's context), both classes of an attack's AUC and a lower bound's count;
    None without a value."""
    if c is None or c.value is None:
        return None
    both = c.n_pos is not None and c.n_neg is not None  # an attack's AUC: both classes
    return Cell(value=c.value, interval=c.interval, n=c.n, unit=c.unit, note=c.note, extra=extra,
                n_pos=c.n_pos if both else None, n_neg=c.n_neg if both else None,
                # a mean of exposures at the estimator's ceiling (`at_ceiling`)
                lower_bound=c.lower_bound, ceiling_units=c.ceiling_units if c.lower_bound else None)


def _row(c: Cell | None) -> dict[str, Any]:
    """A table row's cells; a cell without a value keeps its note ("needs >= 1000 ...")."""
    got = _stat(c)
    if got is not None:
        return got.to_json()
    if c is None:
        return {"value": None, "ci_low": None, "ci_high": None, "n": None, "unit": None, "note": "not measured"}
    return {"value": None, "ci_low": None, "ci_high": None, "n": c.n, "unit": c.unit, "note": c.note or "not measured"}


def at_ceiling(cell: Cell | None, k: int) -> Cell | None:
    """`cell` (a mean over canaries) when `k` of its canaries sit at the sampling estimator's
    ceiling: every one of them ranks above all sampled candidates, so its exposure, and the
    mean, are lower bounds. The cell keeps its value as a bound and drops its interval (whose
    upper end would be the estimator's ceiling, not the data's); the note says how many."""
    if cell is None or not k:
        return cell
    return cell.replace(interval=None, lower_bound=True, ceiling_units=int(k),
                        note=f"a lower bound: {k} of {cell.n} canaries rank above every sampled candidate")


def _ceiling_row(s: Cell | None, k: int) -> dict[str, Any]:
    """A table row's cells of a probes.json mean over canaries, `k` of them at the ceiling."""
    c = at_ceiling(_stat(s), k)
    return _row(s) if c is None else c.to_json()


def _units(kind: str, unit: str, ids, values, **extra) -> dict[str, Any] | None:
    ids, values = list(ids), list(values)
    if not ids:
        return None
    return {"kind": kind, "unit": unit, "ids": ids, "values": values, **extra}


def units_of(probes: ProbesDoc | dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Per-unit scores behind each headline metric, for the tests between runs (no text, no
    secrets): ids and values of canaries, documents, users or PII items."""
    doc = probes if isinstance(probes, ProbesDoc) else ProbesDoc.from_json(probes)
    out: dict[str, dict[str, Any] | None] = {}
    if (p := doc.get("exposure")) is not None:
        scores = p.exposure_scores()
        rows = [r for r in scores if r.role == "inserted"]
        refs = [r.exposure for r in scores if r.role == "reference"]
        top = max((r.repetitions for r in rows), default=None)
        if top is not None and refs:
            base = float(np.mean(refs))
            sel = [r for r in rows if r.repetitions == top]
            out["exposure_top"] = _units("mean", "canaries", [r.id for r in sel], [r.exposure - base for r in sel],
                                         lower_bound=[r.lower_bound for r in sel])
        every = [r for r in scores if r.role in ("inserted", "reference")]
        out["exposure_canaries"] = _units(
            "exposure", "canaries", [r.id for r in every], [r.exposure for r in every],
            role=[r.role for r in every], repetitions=[int(r.repetitions or 0) for r in every],
            owner_kind=[str(r.owner_kind or "user") for r in every],
            lower_bound=[r.lower_bound for r in every])
    if (p := doc.get("extraction")) is not None:
        disc = p.discoverable_scores()
        if disc:
            k = min(r.k for r in disc)
            sel = [r for r in disc if r.k == k]
            out["extraction_exact"] = _units("binary", "documents", [r.id for r in sel],
                                             [float(r.exact) for r in sel])
        can = p.canary_scores()
        out["canary_completion"] = _units("binary", "canaries", [r.id for r in can], [float(r.greedy) for r in can])
    if (p := doc.get("membership")) is not None and (rows := p.membership_scores()) and rows[0].loss is not None:
        out["mia_auc"] = _units("auc", "documents", [r.id for r in rows], [r.loss for r in rows],
                                member=[bool(r.member) for r in rows])
    if (p := doc.get("user_inference")) is not None and (users := p.user_scores()):
        out["user_mia_auc"] = _units("auc", "users", [r.user for r in users], [r.score for r in users],
                                     member=[bool(r.training_user) for r in users])
    if (p := doc.get("pii")) is not None:
        sel = [r for r in p.pii_scores() if r.group == "training_users"]
        ids = [f"{r.doc}:{r.type}:{i}" for i, r in enumerate(sel)]
        out["pii_extraction"] = _units("binary", "PII items", ids, [float(r.extracted) for r in sel])
    return {k: v for k, v in out.items() if v is not None}


def roc_points(pos: list[float], neg: list[float], auc: float | None) -> dict[str, Any] | None:
    # lazy: scikit-learn (~4 s) only when called; this module imports without it
    from sklearn.metrics import roc_curve

    if not pos or not neg:
        return None
    y = np.r_[np.ones(len(pos)), np.zeros(len(neg))]
    fpr, tpr, _ = roc_curve(y, np.r_[pos, neg])
    if len(fpr) > MAX_ROC_POINTS:  # keep the low-FPR end dense: it is what log-log axes show
        idx = np.unique(np.r_[np.geomspace(1, len(fpr) - 1, MAX_ROC_POINTS).astype(int), 0, len(fpr) - 1])
        fpr, tpr = fpr[idx], tpr[idx]
    return {"fpr": fpr.round(6).tolist(), "tpr": tpr.round(6).tolist(), "auc": auc}


def _ceiling_counts(scores: list[ExposureScore]) -> dict[tuple[int, str | None], int]:
    """Inserted canaries at the estimator's ceiling per (repetitions, owner kind), and per
    repetitions alone under owner None."""
    out: dict[tuple[int, str | None], int] = {}
    for r in scores:
        if r.role == "inserted" and r.lower_bound:
            rep = int(r.repetitions or 0)
            for key in ((rep, None), (rep, str(r.owner_kind or "user"))):
                out[key] = out.get(key, 0) + 1
    return out


def _exposure(p: ProbeSection, out: Summary) -> None:
    s = p.exposure()
    reps = sorted(s.by_repetitions, key=int)
    ceiling = _ceiling_counts(p.exposure_scores())
    if reps:
        b = s.by_repetitions[reps[-1]]
        # the excess over the run's references: the quantity the tests between runs compare
        top = b.excess or b.all
        out.leakage.update(exposure_top=at_ceiling(
            _stat(top, repetitions=int(reps[-1]), max_exposure=s.max_exposure, excess=b.excess is not None),
            ceiling.get((int(reps[-1]), None), 0)))
    by_owner: dict[str, list] = {}
    for r in reps:
        for owner, st in s.by_repetitions[r].by_owner.items():
            if st is not None and st.value is not None:
                by_owner.setdefault(owner, []).append(
                    {"repetitions": int(r), **at_ceiling(_stat(st), ceiling.get((int(r), owner), 0)).to_json()})
    out.plots.update(exposure_by_repetition=by_owner)
    out.row("exposure", f"max possible (log2|R|, {s.method})", value=s.max_exposure, ci_low=None, ci_high=None)
    for name, cell in (("inserted", s.inserted), ("references", s.references)):
        if cell is not None:
            out.row("exposure", f"mean exposure, {name} canaries", **_row(cell))
    for r in reps:
        b, k = s.by_repetitions[r], ceiling.get((int(r), None), 0)
        out.row("exposure", f"exposure, {r} repetitions (bits)", **_ceiling_row(b.all, k))
        if b.excess is not None and (t := b.test) is not None:
            # the raw p: a report corrects over its one family (`settle_rows`), never over buckets
            out.row("exposure", _excess_label(r, t.name, t.p_value, None), **_ceiling_row(b.excess, k),
                    **{FAMILY_TEST: {"repetitions": int(r), "p_value": t.p_value, "test": t.name}})
    test = s.inserted_vs_references
    if test is not None and test.p_value is not None:
        out.row("exposure", f"inserted vs references p-value ({test.name})", value=test.p_value,
                ci_low=None, ci_high=None)


FAMILY_TEST = "family_test"  # on a row whose test the report's one family may hold (`settle_rows`)


@dataclass(frozen=True, kw_only=True)
class FamilyMark(Record):
    """A probe row's bucket test, until the report's one correction settles its label."""

    repetitions: int | None = None
    p_value: float | None = None
    test: str | None = None


def _excess_label(reps: str | int, test: str, p: float, family: SectionTest | None) -> str:
    """A bucket's excess row: its test and p-value, either Holm-adjusted over the report's one
    family (`family`: the family's entry of the same test) or said to be unadjusted."""
    head = f"excess over references, {reps} repetitions (bits; {test}, p = {p:.3g}"
    if family is None:
        return head + " unadjusted; the report's tests are corrected in one Holm family)"
    return (head + f", Holm-adjusted p = {family.p_adjusted:.3g} over the report's "
            f"{family.family} tests)")


def settle_rows(rows: list[dict[str, Any]], run: str, literature: Section | Mapping[str, Any] | None
                ) -> list[dict[str, Any]]:
    """Run `run`'s probe table `rows` after the report's one correction, as new rows without their
    `FAMILY_TEST` marks: a row whose test the family holds -- the literature section's bucket of
    the same run and repetitions, where that bucket is all of them (one owner kind) and its p-value
    is the row's -- states the family's adjusted p; every other row keeps its p, labelled
    unadjusted. `rows` are left as they were."""
    exposure = [e for e in Section.of(literature).exposure_entries() if e.run == run]
    buckets = [b for e in exposure for b in e.each_bucket()]
    out = []
    for row in rows or []:
        if FAMILY_TEST not in row:
            out.append(row)
            continue
        ref = FamilyMark.of(row[FAMILY_TEST])
        same = [b for b in buckets if b.repetitions == ref.repetitions]
        t = same[0].test if len(same) == 1 else None
        held = (t is not None and t.p_adjusted is not None
                and abs(t.p_value - ref.p_value) <= 1e-9 * max(1.0, ref.p_value))
        out.append({**{k: v for k, v in row.items() if k != FAMILY_TEST},
                    "metric": _excess_label(ref.repetitions, ref.test, ref.p_value, t if held else None)})
    return out


def _extraction(p: ProbeSection, out: Summary, docs: dict[str, str] | None, show_secrets: bool = False) -> None:
    s = p.extraction()
    ks = sorted(s.discoverable, key=int)
    if ks:
        out.leakage.update(extraction_exact=_stat(s.discoverable[ks[0]].exact, prefix_len=int(ks[0])))
    rows = []
    for k in ks:
        d = s.discoverable[k]
        for name, cell in d.rates.items():
            if cell is not None:
                out.row("extraction", f"{name} rate, k={k}", **_row(cell))
        for bucket, exact in d.exact_by_repeats.items():
            if exact is not None and exact.value is not None:
                rows.append({"prefix_len": int(k), "repeats": int(bucket.split("-")[0]), "bucket": bucket,
                             **_row(exact)})
    out.plots.update(extraction_by_repeats=rows)
    if s.canary_greedy is not None:
        out.leakage.update(canary_completion=_stat(s.canary_greedy))
        out.row("extraction", "canary secret completed (greedy)", **_row(s.canary_greedy))
    for name, rate in s.non_discoverable.items():
        if rate is not None:
            out.row("extraction", f"non-discoverable memorised in top by {name}", **_row(rate))
    if docs:
        seen = []
        for r in sorted(p.discoverable_scores(), key=lambda r: -r.repeats):
            if r.exact and r.id in docs and r.id not in seen:
                seen.append(r.id)
            if len(seen) >= MAX_SAMPLES:
                break
        # a member document is private text (PII included): its id and length only, unless
        # the report is asked for secrets (`memaudit report --show-secrets`)
        out.extracted_members = [{"id": i, "length": len(docs[i])} for i in seen]
        if show_secrets:
            out.samples = [docs[i][:SAMPLE_CHARS] for i in seen]


def _attack(name: str, label: str, summ: AttackSummary | None, out: Summary, key: str) -> None:
    if summ is None or summ.auc is None:
        return
    out.leakage[key] = _stat(summ.auc)
    out.row(name, f"{label} AUC", **_row(summ.auc))
    for fpr, st in summ.tpr_at_fpr.items():
        out.row(name, f"{label} TPR at {float(fpr):g} FPR", **_row(st))


def _membership(p: ProbeSection, out: Summary) -> None:
    attacks = p.attacks()
    for attack, summ in attacks.items():
        if attack == LOSS:
            _attack("membership", "loss attack", summ, out, "mia_auc")
        else:
            out.row("membership", f"{attack} attack AUC", **_row(summ.auc))
    rows = p.membership_scores()
    if rows and rows[0].loss is not None:
        pos = [r.loss for r in rows if r.member]
        neg = [r.loss for r in rows if not r.member]
        loss = attacks.get(LOSS)
        out.plots.update(membership_roc=roc_points(pos, neg, None if loss is None or loss.auc is None
                                                   else loss.auc.value))


def _users(p: ProbeSection, out: Summary) -> None:
    s = p.attack()
    _attack("user_inference", "user inference", s, out, "user_mia_auc")
    rows = p.user_scores()
    pos = [r.score for r in rows if r.training_user]
    neg = [r.score for r in rows if not r.training_user]
    out.plots.update(user_roc=roc_points(pos, neg, None if s is None or s.auc is None else s.auc.value))


def _pii(p: ProbeSection, out: Summary) -> None:
    s = p.pii()
    for group, cells in s.groups.items():
        for name, cell in cells.items():
            if cell is not None:
                out.row("pii", f"{name.replace('_', ' ')}, {group.replace('_', ' ')}", **_row(cell))
    if s.training_extraction is not None:
        out.leakage.update(pii_extraction=_stat(s.training_extraction))


def _audit(p: ProbeSection, out: Summary) -> None:
    s = p.audit()
    extra = {"kind": "one-sided lower bound", "confidence": s.confidence,
             "ceiling": s.ceiling, "guesses": s.r, "correct": s.v,
             "ledger_epsilon": s.ledger_eps, "canaries": s.canaries,
             "score": s.score, "all_thresholds": s.all_thresholds,
             "gdp_estimate": s.gdp_estimate}
    out.leakage.update(audit_epsilon=Cell(
        value=s.eps_lower_bound, n=s.m, unit="audit canaries", extra=extra,
        keys=("value", "ci_low", "ci_high", "kind", "confidence", "n", "unit", *list(extra)[2:])))
    out.row("audit", f"epsilon lower bound (r={s.r}, v={s.v}, p={s.p})", value=s.eps_lower_bound,
            ci_low=None, ci_high=None)
    out.row("audit", f"ceiling: the most m = {s.m} canaries can show at delta = {s.delta}", value=s.ceiling,
            ci_low=None, ci_high=None)


def _member_texts(run_dir: str | Path | None) -> dict[str, str] | None:
    if run_dir is None:
        return None
    path = Path(run_dir) / "data" / "documents.jsonl"
    if not path.is_file():
        return None
    texts = {}
    with open(path, encoding="utf-8") as f:
        for line in f:
            if line.strip():
                r = json.loads(line)
                if r.get("kind", "doc") == "doc" and r.get("role") == "member":  # never canaries
                    texts[str(r["id"])] = r["text"]
    return texts


def read_summary(probes: ProbesDoc | dict[str, Any], *, run_dir: str | Path | None = None,
                 show_secrets: bool = False) -> Summary:
    """The report's reading of a probes.json (`Summary`): the extracted member documents' text
    (`samples`) only with `show_secrets`, their ids and lengths always."""
    out = Summary()
    doc = probes if isinstance(probes, ProbesDoc) else ProbesDoc.from_json(probes)
    handlers = {
        "exposure": _exposure,
        "membership": _membership,
        "user_inference": _users,
        "pii": _pii,
        "audit": _audit,
    }
    for name, fn in handlers.items():
        if (p := doc.get(name)) is not None:
            fn(p, out)
    if (p := doc.get("extraction")) is not None:
        _extraction(p, out, _member_texts(run_dir), show_secrets)
    c = doc.counts
    if c.get("context") and context_count(c):  # documents longer than the context: windowed, counted
        out.row("input", f"{context_measure(c)} (of {c['documents']} documents)", value=context_count(c),
                ci_low=None, ci_high=None)
    for name, probe in doc.probes.items():
        if probe.skipped:
            out.row(name, f"skipped: {probe.skipped}", value=None, ci_low=None, ci_high=None)
    out.leakage = out.measured
    return out


def summarize_probes(probes: ProbesDoc | dict[str, Any], *, run_dir: str | Path | None = None,
                     show_secrets: bool = False) -> dict[str, Any]:
    """`read_summary` as {'leakage': {metric: cell}, 'plots': {...}, 'rows': [...], 'samples':
    [text, ...], 'extracted_members': [{id, length}, ...]}."""
    s = read_summary(probes, run_dir=run_dir, show_secrets=show_secrets)
    return {"leakage": s.leakage, "plots": s.plots, "rows": s.rows, "samples": s.samples,
            "extracted_members": s.extracted_members}
