"""Build report.json from run directories: manifest, ledger, metrics and probes.

The report reads only what earlier stages wrote (run.json, privacy.json, metrics.jsonl,
probes.json). Every epsilon is recomputed from the ledger's events.
"""

from __future__ import annotations

import math
import os
import statistics
from collections import defaultdict
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from memaudit import __version__
from memaudit.backends import CENTRALIZED, report_rank
from memaudit.data.prepare import verify_run_data
from memaudit.errors import MemauditError
from memaudit.io import read_json, read_jsonl
from memaudit.probes.document import read_probes
from memaudit.probes.loaders import RunInfo
from memaudit.probes.weights import weights_mismatch
from memaudit.reports import findings as findings_mod
from memaudit.reports.blocks import (
    Compared,
    Comparisons,
    CurvePoint,
    CurveSeries,
    EffectBlock,
    MatchedBlock,
    SamplingBlock,
    Spread,
    compared,
)
from memaudit.reports.cells import METRICS, TESTABLE
from memaudit.reports.compare import compare_groups, nominal_epsilon, pool
from memaudit.reports.entries import (
    DataSummary,
    Mitigation,
    ModelSummary,
    PrivacySummary,
    RunEntry,
    TargetEntry,
    Utility,
    entries,
)
from memaudit.reports.frontier import (
    DEFAULT_TOLERANCE,
    PUBLIC_BASE,
    check_tolerance,
    frontier,
    matched_utility,
)
from memaudit.reports.group import group_privacy
from memaudit.reports.literature import literature_section
from memaudit.reports.probes_adapter import read_summary, settle_rows, units_of
from memaudit.reports.scale import scale_section
from memaudit.reports.targets import find_targets, is_memaudit_run, target_comparisons, target_entry
from memaudit.rundir import RunDir

SCHEMA = "memaudit.report/1"


def find_runs(paths: list[str | os.PathLike], *, allow_none: bool = False) -> list[RunDir]:
    """Run directories among `paths` (each a run, or a folder holding runs, e.g. a sweep); a
    run.json that memaudit did not write (no backend, no config) marks a probed outside model
    (`memaudit.reports.targets`), not a run."""
    runs: list[RunDir] = []
    for p in paths:
        p = Path(p)
        if not p.exists():
            raise MemauditError(f"'{p}' does not exist; pass run directories written by `memaudit train`")
        rd = RunDir(p)
        if rd.is_run():
            if is_memaudit_run(p):
                runs.append(rd)
            continue
        found = sorted({m.parent for m in p.rglob("run.json") if is_memaudit_run(m.parent)})
        runs.extend(RunDir(f) for f in found)
    if not runs and not allow_none:
        raise MemauditError(
            f"no runs found under {', '.join(str(p) for p in paths)}; pass directories written by "
            "`memaudit train` or `memaudit sweep`, or folders holding the probes.json of "
            "`memaudit probe MODEL --out FOLDER/probes.json`"
        )
    return runs


@dataclass(frozen=True, kw_only=True)
class LedgerFigures:
    """What the report states of a run's ledger, recomputed from its events
    (`memaudit.privacy.ledger.ledger_summary`): ε at δ per `unit` (inf and no unit without a
    ledger), the group bound per user, the ε per document, and against whom it holds."""

    epsilon: float = math.inf
    unit: str | None = None
    delta: float | None = None
    per_user: dict[str, Any] | None = None
    noise_multiplier: float | None = None
    accounting: str | None = None
    adjacency: list[str] = field(default_factory=list)
    assumes_hidden: list[str] = field(default_factory=list)
    server_epsilon: float | None = None
    server_note: str | None = None
    void_if_seed_known: bool = False
    protects: dict[str, Any] | None = None
    document: dict[str, Any] | None = None

    @classmethod
    def of_ledger(cls, raw: Any, summary: dict[str, Any]) -> LedgerFigures:
        """From privacy.json (`raw`) and its `ledger_summary`."""
        raw = raw if isinstance(raw, dict) else {}
        pu = raw.get("per_user") or None
        if pu is not None:
            pu = {"max_sequences_per_user": raw.get("max_sequences_per_user") or pu.get("k"),
                  "epsilon": pu.get("epsilon"), "delta": pu.get("delta"), "vacuous": bool(pu.get("vacuous"))}
        return cls(epsilon=float(summary["epsilon"]), unit=raw.get("unit"), delta=raw.get("delta"), per_user=pu,
                   noise_multiplier=raw.get("noise_multiplier"),
                   accounting=raw.get("accountant_note") or raw.get("adjacency"),
                   adjacency=summary["adjacency"], assumes_hidden=summary["assumes_hidden"],
                   server_epsilon=summary["server_epsilon"], server_note=summary["server_note"],
                   void_if_seed_known=summary["void_if_seed_known"], protects=summary["protects"],
                   document=_document(summary["document"]))


def _ledger_epsilon(rd: RunDir) -> LedgerFigures:
    if not rd.privacy_path.is_file():
        return LedgerFigures()
    raw = read_json(rd.privacy_path, what="privacy ledger")
    # lazy: dp_accounting (~1.5 s) only when called; this module imports without it
    from memaudit.privacy.ledger import ledger_summary

    try:  # recomputed from the serialised events; no stored-number fallback
        summary = ledger_summary(raw if isinstance(raw, dict) else None)
    except (ValueError, KeyError, TypeError) as e:
        raise MemauditError(f"'{rd.privacy_path}' holds a privacy ledger this version cannot "
                            f"interpret ({type(e).__name__}); re-run training to rewrite it") from None
    return LedgerFigures.of_ledger(raw, summary)


def _document(doc: dict[str, Any] | None) -> dict[str, Any] | None:
    """The ledger's per-document ε (example-level runs), reduced to the tightest accountant's."""
    if doc is None:
        return None
    known = [v for v in (doc.get("epsilon") or {}).values() if v is not None]
    return {"max_sequences_per_document": doc.get("max_sequences_per_document"),
            "epsilon": min(known) if known else None, "composed_as": doc.get("composed_as")}


def _sequences_epsilon(rd: RunDir):
    """ε at the ledger's δ for k training sequences as one event (a canary's k copies), from the
    ledger's events (`PrivacyLedger.group_epsilon`)."""
    # lazy: dp_accounting (~1.5 s) only when called; this module imports without it
    from memaudit.privacy.ledger import PrivacyLedger

    led = PrivacyLedger.from_json(read_json(rd.privacy_path, what="privacy ledger"))
    return led.group_epsilon


def _unit_text(priv: LedgerFigures) -> str:
    """What the ε is per, in the run's description: the unit and its contribution bound."""
    protects = priv.protects or {}
    name = protects.get("unit") or priv.unit
    return f"per {name}" + (f" ({protects['contribution_bound']})" if protects.get("contribution_bound") else "")


def _document_text(priv: LedgerFigures) -> str:
    """An example-level run's ε per document (up to m sequences), or that m is unknown."""
    doc = priv.document
    if doc is None:
        return ""
    if doc.get("epsilon") is None:
        return "; per document: unknown (" + str(doc.get("composed_as")) + ")"
    m = doc["max_sequences_per_document"]
    return f"; epsilon = {doc['epsilon']:.4g} per document (up to {m} sequence{'s' if m > 1 else ''})"


def _server_view(priv: LedgerFigures) -> str:
    """The ledger's second view: what the guarantee is against the aggregation server."""
    eps, note = priv.server_epsilon, priv.server_note
    if eps is None or (isinstance(eps, float) and math.isinf(eps)):
        return "no DP guarantee" + (f" ({note})" if note else "")
    return f"epsilon = {eps:.4g}" + (f" ({note})" if note else "")


def mechanism_label(info: RunInfo) -> str:
    """What trained the run, as the report names it: none, DP-SGD (ELS | ULS), DP-FedAvg + SecAgg, ..."""
    if not info.dp:
        return "none"
    if info.backend == CENTRALIZED:  # per user: which sampling (ELS or ULS) is part of the name
        return "DP-SGD" + (f" ({info.user_sampling.upper()})" if info.user_sampling else "")
    name = "distributed DP" if info.dp_mechanism == "distributed" else "DP-FedAvg"
    if info.secure_aggregation:
        name += " + SecAgg"
    if info.adaptive_clipping:
        name += " (adaptive clip)"
    return name


def _per_user_text(priv: LedgerFigures) -> str:
    if priv.unit is None or math.isinf(priv.epsilon):
        return "no guarantee"
    if priv.unit == "user":
        return f"epsilon = {priv.epsilon:.3g} per user"
    pu = priv.per_user or {}
    k = pu.get("max_sequences_per_user")
    if pu.get("vacuous"):
        return f"vacuous for a user with {k} sequences"
    if pu.get("epsilon") is not None:
        return f"epsilon = {pu['epsilon']:.3g} for a user with {k} sequences"
    return "per sequence only"


def _train_users(rd: RunDir) -> int | None:
    meta = rd.data_dir / "meta.json"
    if not meta.is_file():
        return None
    users = read_json(meta).get("users", {}).get("train")
    return len(users) if isinstance(users, list) else None


def _holdout_perplexity(info: RunInfo, metrics: list[dict[str, Any]]) -> float | None:
    """run.json's final holdout perplexity, else the last one metrics.jsonl evaluated."""
    if info.final_holdout_perplexity is not None:
        return info.final_holdout_perplexity
    vals = [v for r in metrics if isinstance(v := r.get("holdout_perplexity"), int | float)]
    return float(vals[-1]) if vals else None


def _canaries(rd: RunDir) -> dict[str, Any] | None:
    """canaries.json for its counts only (repetitions, owner kind, owners): secrets stay there."""
    if not rd.canaries_path.is_file():
        return None
    raw = read_json(rd.canaries_path, what="canaries")
    return raw if isinstance(raw, dict) else None


def _noise_rows(metrics: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The federated rounds where fewer clients survived than were sampled: their noise."""
    rows = []
    for r in metrics:
        survivors, cohort = r.get("survivors"), r.get("cohort")
        if survivors is not None and cohort is not None and survivors < cohort:
            rows.append({"round": r.get("round"), "survivors": survivors, "effective_noise": r.get("effective_noise")})
    return rows


def _description(mech: str, info: RunInfo, priv: LedgerFigures) -> str:
    """The run's guarantee in one line: against the released model, against the server."""
    if not info.dp:
        return mech
    return (f"{mech}, sigma = {priv.noise_multiplier}, delta = {priv.delta}; against the "
            f"released model: epsilon = {priv.epsilon:.4g} {_unit_text(priv)}"
            + (f" ({', '.join(priv.adjacency)} adjacency)" if priv.adjacency else "")
            + _document_text(priv)
            + (f", assuming hidden: {', '.join(priv.assumes_hidden)}" if priv.assumes_hidden else "")
            + "; against the server: " + _server_view(priv)
            + ("; VOID against anyone who knows train.seed (privacy.reproducible_randomness)"
               if priv.void_if_seed_known else ""))


def read_run(rd: RunDir, *, show_secrets: bool = False) -> RunEntry:
    """The run's entry, from its files: run.json, privacy.json, metrics.jsonl, probes.json."""
    manifest = rd.read_manifest()
    info = RunInfo.from_manifest(manifest, str(rd.path / "run.json"))
    role = manifest.get("role") if isinstance(manifest, dict) else None
    if rd.data_dir.is_dir():
        verify_run_data(rd)  # probes of a run whose data was replaced measure nothing of this model
    if not rd.probes_path.is_file():
        raise MemauditError(
            f"run '{rd.path}' has no probes.json; run `memaudit probe {rd.path}` first"
        )
    probes = read_probes(rd.probes_path)  # one line if malformed
    if weights_mismatch(probes, rd.model_dir):  # probed, then trained again: other weights measured
        raise MemauditError(f"'{rd.probes_path}' measured other weights than the model in "
                            f"'{rd.model_dir}' (the run was trained again after it was probed); run "
                            f"`memaudit probe {rd.path}` again")
    priv = _ledger_epsilon(rd)
    mech = mechanism_label(info)
    if role == PUBLIC_BASE:  # trained on public text only: no private record reaches it
        mech = "none (public base)"
        priv = replace(priv, epsilon=0.0, unit=None, document=None, protects=None)
    metrics = read_jsonl(rd.metrics_path)
    summary = read_summary(probes, run_dir=rd.path, show_secrets=show_secrets)
    result = manifest.get("result") if isinstance(manifest, dict) else None
    return RunEntry(
        id=rd.path.name, path=str(rd.path), role=role, backend=info.backend, status=rd.status(), seed=info.seed,
        audit=bool(info.audit_canaries),
        # the centralized backend's engine (torch or jax) as run.json's result names it; None before it did
        model=ModelSummary(preset=info.preset, params=info.parameters, trained=info.trained,
                           engine=(result or {}).get("engine"), upload_bytes_per_client_per_round=info.upload_bytes),
        data=DataSummary(fingerprint=info.data_fingerprint[:12], users=_train_users(rd),
                         sequences=info.train_sequences),
        privacy=PrivacySummary(
            mechanism=mech, description=_description(mech, info, priv), epsilon=priv.epsilon,
            target_epsilon=info.target_epsilon, noise_multiplier=priv.noise_multiplier, delta=priv.delta,
            unit=priv.unit, user_sampling=info.user_sampling, per_user=priv.per_user, document=priv.document,
            per_user_text="not trained on private data" if role == PUBLIC_BASE else _per_user_text(priv)),
        group_privacy=group_privacy(
            _canaries(rd), epsilon=priv.epsilon, unit=priv.unit, delta=priv.delta,
            exposure_by_repetition=summary.plots.get("exposure_by_repetition"),
            sequences_epsilon=_sequences_epsilon(rd) if priv.unit == "example" else None),
        mitigation=Mitigation(goldfish=info.goldfish),
        utility=Utility(holdout_loss=info.final_holdout_loss,
                        holdout_perplexity=_holdout_perplexity(info, metrics)),
        noise_per_round=_noise_rows(metrics),
        leakage=summary.leakage, probes_summary=summary.plots, probe_rows=summary.rows,
        samples=summary.samples, extracted_members=summary.extracted_members,
        units=units_of(probes),  # per-unit scores for the tests between runs; dropped from report.json
    )


def run_entry(rd: RunDir, *, show_secrets: bool = False) -> dict[str, Any]:
    """The run's object of report.json (`read_run`), its per-unit scores included until the
    report drops them."""
    return read_run(rd, show_secrets=show_secrets).with_units()


# ----------------------------------------------------------------------------- comparisons
def _unit(r: RunEntry, eps: float) -> str | None:
    """The privacy unit a DP run protects (None without DP)."""
    return None if math.isinf(eps) else r.privacy.unit


def finetune(run: dict[str, Any] | RunEntry) -> str:
    """What a report run trained: "full", or its LoRA label ("lora(r=8, q_proj,v_proj)")."""
    return RunEntry.of(run).model.finetune


def _sampling(r: RunEntry, eps: float) -> str | None:
    """A centralized per-user DP run's sampling ("els" or "uls"); None otherwise."""
    return None if math.isinf(eps) else r.privacy.user_sampling


def _algorithm(sampling: str | None) -> str:
    return f", {sampling.upper()}" if sampling else ""


def _groups(runs: list[RunEntry]) -> dict[tuple, list[RunEntry]]:
    """Runs by (backend, nominal epsilon, Goldfish, privacy unit, fine-tuning, user sampling):
    runs of one configuration (seeds) pool; runs protecting different units, or the same unit by
    different algorithms (ELS, ULS), never do."""
    g: dict[tuple, list[RunEntry]] = defaultdict(list)
    for r in runs:
        if r.audit or r.role == PUBLIC_BASE:  # the base is the frontier's origin, not a point
            continue
        eps = nominal_epsilon(r)
        g[(r.backend, eps, r.mitigation.goldfish, _unit(r, eps), r.model.finetune, _sampling(r, eps))].append(r)
    return g


def _mean_ppl(rs: list[RunEntry]) -> float | None:
    ppl = [r.utility.holdout_perplexity for r in rs if r.utility.holdout_perplexity is not None]
    return statistics.fmean(ppl) if ppl else None


def _curves(groups: dict[tuple, list[RunEntry]], runs: list[RunEntry]) -> list[CurveSeries]:
    """Utility (and the lead leakage metric) against epsilon per backend, pooled over seeds."""
    curves = []
    lead = next((k for k in ("exposure_top", "mia_auc") if any(r.cell(k) for r in runs)), None)
    by_label: dict[str, list] = defaultdict(list)
    for (backend, eps, gf, unit, ft, smp), rs in groups.items():
        lbl = (backend
               + (f" (user-level DP{_algorithm(smp)})" if backend == CENTRALIZED and unit == "user" else "")
               + (" + Goldfish" if gf else "")
               + (" + LoRA" if ft != "full" else ""))
        ppl = [r.utility.holdout_perplexity for r in rs if r.utility.holdout_perplexity is not None]
        leak = [r.cell(lead).value for r in rs if lead and r.cell(lead)]
        if not ppl:
            continue
        by_label[lbl].append(CurvePoint(
            epsilon=eps,
            perplexity=Spread(mean=statistics.fmean(ppl), std=statistics.stdev(ppl) if len(ppl) > 1 else 0.0),
            leakage=Spread(mean=statistics.fmean(leak) if leak else float("nan"),
                           std=statistics.stdev(leak) if len(leak) > 1 else 0.0),
            n_seeds=len(rs)))
    for lbl, pts in sorted(by_label.items()):
        curves.append(CurveSeries(label=lbl, points=pts, leakage_label=METRICS[lead][0] if lead else "leakage"))
    return curves


def comparisons(runs: list[dict[str, Any]], *, utility_tolerance: float = DEFAULT_TOLERANCE) -> Comparisons:
    """Matched-epsilon backend pairs (two-sided tests), backend pairs at matched utility (two-sided,
    only between real runs within `utility_tolerance`), treatment effects against their baseline
    (one-sided: does the treatment leak less?), each metric with its test; and the frontier."""
    runs = entries(runs)
    groups = _groups(runs)
    metrics = [k for k in METRICS if TESTABLE.get(k, True)]

    def cells(a: list, b: list, names: tuple[str, str], alternative: str) -> dict[str, Compared]:
        """Per metric both sides pooled (`names`: their sides) and the test of side a against b,
        where both sides measured it."""
        out = {}
        for key in metrics:
            pa, pb = pool([r.cell(key) for r in a]), pool([r.cell(key) for r in b])
            if pa and pb:
                out[key] = compared((names[0], pa), (names[1], pb), compare_groups(a, b, key, alternative))
        return out

    matched = []
    # each federated full fine-tune against every centralized one at its nominal epsilon: per user
    # (equal guarantees; ULS, then ELS) first, per example (units differ) after
    for (backend, eps, gf, unit, ft, _smp), fed in sorted(groups.items(),
                                                         key=lambda kv: (kv[0][1], str(kv[0][3]))):
        if backend != "federated" or gf or ft != "full":
            continue
        cands = [(u, s, rs) for (bk, e, g, u, f, s), rs in groups.items()
                 if bk == CENTRALIZED and e == eps and not g and f == "full"]
        for par_unit, smp, par in sorted(cands, key=lambda c: (c[0] != unit, str(c[0]), str(c[1]) != "uls")):
            matched.append(MatchedBlock(
                epsilon=eps, units={CENTRALIZED: par_unit, "federated": unit},
                algorithm={CENTRALIZED: smp.upper() if smp else None, "federated": None},
                equal_guarantee=par_unit == unit, metrics=cells(fed, par, MatchedBlock.SIDES, "two-sided"),
                perplexity={CENTRALIZED: _mean_ppl(par), "federated": _mean_ppl(fed)}))
    # the two centralized user-level algorithms against each other at each epsilon (two-sided):
    # ULS vs ELS, at the same guarantee and compute (Charles et al. 2024's comparison)
    samplings = []
    for (backend, eps, gf, unit, ft, smp), uls in sorted(groups.items(), key=lambda kv: (kv[0][1], kv[0][4])):
        els = groups.get((backend, eps, gf, unit, ft, "els"))
        if backend != CENTRALIZED or smp != "uls" or not els:
            continue
        samplings.append(SamplingBlock(epsilon=eps, unit=unit, goldfish=gf, finetune=ft,
                                       metrics=cells(uls, els, SamplingBlock.SIDES, "two-sided"),
                                       perplexity={"uls": _mean_ppl(uls), "els": _mean_ppl(els)}))
    effects = []
    for (backend, eps, gf, unit, ft, smp), rs in sorted(
            groups.items(), key=lambda kv: (report_rank(kv[0][0]), kv[0][1], kv[0][2], str(kv[0][3]), kv[0][4],
                                            str(kv[0][5]))):
        label = backend
        if backend == CENTRALIZED and unit == "user":
            label += f" (user-level DP{_algorithm(smp)})"
        base = None
        if ft != "full":  # LoRA against the full fine-tune at the same epsilon and unit
            base, name = groups.get((backend, eps, gf, unit, "full", smp)), f"LoRA fine-tuning ({ft})"
            label += f" at {'no DP' if math.isinf(eps) else f'epsilon = {eps:g}'}"
        elif gf:
            base, name = groups.get((backend, eps, False, unit, ft, smp)), "Goldfish loss"
            label += f" at {'no DP' if math.isinf(eps) else f'epsilon = {eps:g}'}"
        elif not math.isinf(eps):
            base, name = groups.get((backend, math.inf, False, None, ft, None)), f"DP at epsilon = {eps:g}"
        if not base:
            continue
        effects.append(EffectBlock(backend=backend, backend_label=label, treatment=name, epsilon=eps, unit=unit,
                                   metrics=cells(rs, base, EffectBlock.SIDES, "less"),
                                   perplexity={"treated": _mean_ppl(rs), "baseline": _mean_ppl(base)}))
    return Comparisons(matched=matched, samplings=samplings, effects=effects, curves=_curves(groups, runs),
                       matched_utility=matched_utility(runs, utility_tolerance), frontier=frontier(runs))


def build_report(paths: list[str | os.PathLike], *, show_secrets: bool = False,
                 utility_tolerance: float = DEFAULT_TOLERANCE) -> dict[str, Any]:
    """report.json's content over the runs under `paths`; `utility_tolerance` is the largest
    |log holdout-perplexity ratio| at which a centralized and a federated run count as matched."""
    check_tolerance(utility_tolerance)
    rds = find_runs(paths, allow_none=True)
    targets = [target_entry(t) for t in find_targets(paths)]
    if not rds and not targets:
        find_runs(paths)  # refuses, naming what to pass
    missing = [str(rd.path) for rd in rds if not rd.probes_path.is_file()]
    if missing:
        raise MemauditError(
            f"{len(missing)} run(s) have no probes.json ({', '.join(missing[:3])}"
            f"{', ...' if len(missing) > 3 else ''}); run `memaudit probe RUN_DIR` on each first"
        )
    typed = [read_run(rd, show_secrets=show_secrets) for rd in rds]
    runs = [r.with_units() for r in typed]
    comp = comparisons(typed, utility_tolerance=utility_tolerance)
    if targets:  # outside models: their own section, compared with each other (one Holm family)
        comp = comp.replace(targets=target_comparisons(targets))
    # memorization vs model size x Goldfish (reports/scale.py, issue 20): only when runs differ
    scale = scale_section(typed)
    # the effects the literature reports, by the section's own tests (reports/literature.py)
    lit = literature_section(typed)
    report: dict[str, Any] = {
        "schema": SCHEMA, "memaudit_version": __version__, "runs": runs, "comparisons": comp,
        **({"targets": targets} if targets else {}), **({"scale": scale} if scale is not None else {}),
        **({"literature": lit} if lit is not None else {}),
    }
    # one Holm family over every test of the report; report.json keeps the adjusted p-values
    adjusted = findings_mod.adjust_report(report)
    lit = adjusted.get("literature")
    # the findings from the adjusted tests (adjusting again changes nothing); the probe tables'
    # p-values: the one family's, or unadjusted; the per-unit scores dropped
    return {**adjusted, "findings": findings_mod.generate(adjusted),
            "runs": [replace(r, probe_rows=settle_rows(r.probe_rows, r.id, lit)).to_json() for r in typed],
            **({"targets": [{**{k: v for k, v in t.items() if k != "units"},
                             "probe_rows": settle_rows(te.probe_rows, te.id, lit)}
                            for t, te in zip(targets, map(TargetEntry.of, targets), strict=True)]}
               if targets else {})}
