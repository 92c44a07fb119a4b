"""Findings: sentences generated from the numbers and tests in report.json, never typed by hand.

A difference is stated only from a test on the runs' units (canaries, documents, users): paired
where the two runs share their units, one-sided for "does the treatment leak less?", two-sided
between backends, and with Holm's correction across every test of the report. A finding between
two single runs speaks of "these runs"; one about configurations needs several seeds per point
and a test over seeds. Every sentence carries its test, n, p-value and adjusted p-value; a cell
that could not be tested (no per-unit scores) gives no finding. The audit epsilon is a one-sided
lower bound and is only compared as such, with the ledger's epsilon.

Backends are compared three ways, all in one Holm family: at matched utility (real runs within
the stated perplexity tolerance, `memaudit.reports.frontier`), at matched nominal epsilon (with
the caveat that the units differ) and as DP/Goldfish effects within a backend (with a caveat when
the treated run learned less). The first screen (`headline`) holds at most six findings that pass
the rules; every "no difference shown" comparison is kept as one short line (`no_difference`),
with the smallest difference its test could have seen at 80% power (`memaudit.probes.power`).

References:
  Holm. A simple sequentially rejective multiple test procedure. Scand. J. Statist. 1979.
  Thakkar et al. Understanding unintended memorization in federated learning. 2020.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from memaudit.backends import CENTRALIZED
from memaudit.probes.power import FLOOR_MARGIN, POWER, minimum_detectable_effect
from memaudit.probes.stats import compare_units
from memaudit.reports import literature, scale
from memaudit.reports.blocks import BLOCKS, Comparisons, Section, Sentence, comparisons_of
from memaudit.reports.cells import (
    FINDING,
    METRICS,
    NO_DIFFERENCE,
    SHORT,
    Cell,
    Test,
    format_cell,
    number,
    verdict,
)
from memaudit.reports.entries import entries
from memaudit.reports.family import ALPHA, CORRECTION, correct


# Headline leakage metrics: key -> (label, unit, higher_is_leakier)
def _fmt_eps(e: float | None) -> str:
    return "no DP (epsilon = inf)" if e is None or math.isinf(e) else f"epsilon = {e:g}"


# the report's comparison blocks in the order their tests enter the family (`blocks.BLOCKS`): a
# test stated in two blocks (a matched-epsilon pair within the utility tolerance is also a
# matched-utility pair) belongs to the first, and its sentence is said there
SAME_TEST = "same_test_as"  # on a repeated test: the block whose entry of the same test is the family's

Slot = tuple[str, int, str]
"""Where a test stands in the comparisons: the block's kind, its index there and the metric."""


def _every_test(comp: Comparisons):
    """Every (slot, test) of the comparisons, repeats included, in the family's order."""
    for name in BLOCKS:
        for i, block in enumerate(comp.blocks(name)):
            for key, c in block.metrics.items():
                if c.test is not None:
                    yield (name, i, key), c.test


def same_test_key(key: str, t: Test) -> tuple | None:
    """What makes two entries one test: the same two runs (in either order for a two-sided test),
    metric, units and alternative. None for a test over seeds (no runs named): never merged."""
    if not t.runs or not t.over_runs:
        return None
    pair = tuple(sorted(t.runs)) if t.alternative == "two-sided" else t.runs
    return (pair, key, t.unit, t.alternative, t.name)


def _family_slots(comp: Comparisons) -> list[Slot]:
    """The slot of every distinct test of the comparisons, in a fixed order: a test that two blocks
    state counts once (its first entry; the other repeats it, `_repeats`)."""
    seen: set[tuple] = set()
    out = []
    for slot, t in _every_test(comp):
        ident = same_test_key(slot[2], t)
        if ident is not None and ident in seen:
            continue
        if ident is not None:
            seen.add(ident)
        out.append(slot)
    return out


def _repeats(comp: Comparisons) -> list[tuple[Slot, Slot]]:
    """(the repeat's slot, the family's entry's slot) for each test stated twice."""
    first: dict[tuple, Slot] = {}
    out = []
    for slot, t in _every_test(comp):
        ident = same_test_key(slot[2], t)
        if ident is None:
            continue
        if ident in first:
            out.append((slot, first[ident]))
        else:
            first[ident] = slot
    return out


# FLOOR_MARGIN (memaudit.probes.power, whose detectable effects assume it): a refined test's
# smallest p-value is alpha / (FLOOR_MARGIN * family)


def _units(report: dict[str, Any]) -> dict[str, Mapping[str, Any]]:
    """Each run's and probed model's per-unit scores, by its id."""
    return {r.id: r.units or {} for r in entries(report.get("runs", []) + report.get("targets", []))}


def _refine_floors(report: dict[str, Any], tests: Mapping[Slot, Test], slots: list[Slot], family: int) -> dict[Slot, Test]:
    """A Monte-Carlo permutation p-value cannot fall below 1 / (B + 1). Where that floor, not the
    data, would keep a test from passing the correction over `family` tests (floor * family >=
    alpha), the test is re-run on the same units with enough permutations that its floor is
    alpha / (FLOOR_MARGIN * family). Only tests at their floor are re-run, so the cost stays small.
    Returns the re-run tests by slot.
    """
    units = _units(report)
    need = math.ceil(FLOOR_MARGIN * family / ALPHA)
    out = {}
    for slot in slots:
        test, key = tests[slot], slot[2]
        if (test.p_floor is None or not test.over_runs or test.p_floor * family < ALPHA
                or test.p_value > test.p_floor * (1 + 1e-9)):
            continue
        ua, ub = (units.get(rid, {}).get(key) for rid in (test.runs or ("", "")))
        if ua and ub:
            again = compare_units(ua, ub, alternative=test.alternative, n_perm=need)
            out[slot] = test.replace(p_value=again.p_value, p_floor=again.p_floor, estimate=again.estimate)
    return out


def _detectable(report: dict[str, Any], tests: Mapping[Slot, Test], slots: list[Slot],
                family: int) -> dict[Slot, Test]:
    """Beside each comparison of two runs that shows no difference, the smallest difference its
    test could have seen with 80% power at the strictest Holm step, alpha / family (an effect that
    size passes the correction whatever the other tests say): the test's `mde`, from
    `memaudit.probes.power.minimum_detectable_effect` on the same units. Tests over seeds get none
    (their n is the seeds). Returns those tests by slot."""
    units = _units(report)
    out = {}
    for slot in slots:
        t, key = tests[slot], slot[2]
        if verdict(t, ALPHA) != NO_DIFFERENCE or not t.over_runs or not t.runs:
            continue
        ua, ub = (units.get(rid, {}).get(key) for rid in t.runs)
        if ua and ub:
            out[slot] = t.replace(mde=minimum_detectable_effect(ua, ub, alternative=t.alternative,
                                                                alpha=ALPHA / family))
    return out


def _with_tests(comp: Comparisons, tests: Mapping[Slot, Test]) -> Comparisons:
    """The comparisons with `tests` in their slots, each such metric's verdict from its test."""
    def block(name: str, i: int, b):
        return b.replace(metrics={k: c.replace(test=t, verdict=verdict(t, ALPHA))
                                  if (t := tests.get((name, i, k))) is not None else c
                                  for k, c in b.metrics.items()})
    return comp.with_blocks({name: [block(name, i, b) for i, b in enumerate(comp.blocks(name))] for name in BLOCKS})


def mde_amount(mde: Mapping[str, Any], metric: str) -> str | None:
    """A minimum detectable effect in the metric's units ("0.061 AUC points"); None when no
    difference within the metric's range would be seen."""
    if not math.isfinite(mde["value"]):
        return None
    unit = mde.get("unit") or METRICS[metric][1]
    return number(mde["value"]) + (f" {unit}" if unit else "")


def mde_text(t: Test, metric: str) -> str | None:
    """"could have seen 0.061 AUC points" for a test that carries its minimum detectable effect."""
    if not t.mde:
        return None
    amount = mde_amount(t.mde, metric)
    if amount is None:
        return (f"could have seen none within range (too few units for {POWER:.0%} power at the "
                "family's level)")
    return f"could have seen {amount} ({POWER:.0%} power)"


def adjust_report(report: dict[str, Any], correction: str = CORRECTION) -> dict[str, Any]:
    """The report with one correction over every test it states, as a new dict (`report` and its
    records are left as they were): the backend comparisons, the scale section's and the literature
    section's tests are one Holm family, as the report and the README say. Each test gets its
    adjusted p-value and the family's size; each comparison its verdict
    (`memaudit.reports.cells.verdict`); the sections their verdicts and sentences (`scale.settle`,
    `literature.settle`). A test stated in two blocks is one entry of the family (`same_test_key`);
    its repeat gets the same numbers and `SAME_TEST`. Tests whose permutation floor alone would
    decide are refined first (`_refine_floors`). Adjusting an adjusted report again gives the same report.

    The correction itself is `memaudit.reports.family.correct`, over the typed tests: the
    comparisons' `Test`s, then the sections' (`scale.tests_of`, `literature.tests_of`). The
    comparisons (`memaudit.reports.blocks.Comparisons`) and the sections are records: each comes
    back new with its corrected tests."""
    comp = comparisons_of(report)
    sections = _sections(report)
    others = [t for _key, mod, sec in sections for t in mod.tests_of(sec)]
    tests = dict(_every_test(comp))
    slots = _family_slots(comp)
    family = len(slots) + len(others)
    tests.update(_refine_floors(report, tests, slots, family))
    fixed = correct([tests[s] for s in slots] + others, correction, ALPHA)
    tests.update(zip(slots, fixed, strict=False))
    rest = iter(fixed[len(slots):])
    settled = {key: mod.settle(sec, [next(rest) for _ in mod.tests_of(sec)], family) for key, mod, sec in sections}
    tests.update(_detectable(report, tests, slots, family))
    for slot, first in _repeats(comp):  # one test, one entry: a repeat says the same
        t, entry = tests[slot], tests[first]
        same = {k: getattr(entry, k) for k in ("p_value", "p_floor", "estimate", "p_adjusted", "correction",
                                               "family", "alpha", "mde") if k in entry.to_json()}
        if t.runs != entry.runs:  # a two-sided test stated with its runs the other way round
            same["estimate"] = -entry.estimate
        tests[slot] = t.replace(**same, **{SAME_TEST: first[0]})
    return {**report, **settled, "comparisons": _with_tests(comp, tests)}


def _sections(report: dict[str, Any]) -> list[tuple[str, Any, Any]]:
    """(key, module, section record) for the report's sections that hold tests of their own: the
    scale section (`memaudit.reports.scale.ScaleSection`) and the literature section
    (`memaudit.reports.blocks.Section`), read as such where a report holds their JSON objects."""
    return [(key, mod, kind.of(report[key])) for key, mod, kind in
            (("scale", scale, scale.ScaleSection), ("literature", literature, Section)) if report.get(key)]


def _section_passing(report: dict[str, Any]) -> int:
    """Tests of the sections that pass the report's correction."""
    return sum(mod.passing(sec) for _key, mod, sec in _sections(report))


def adjust(report: dict[str, Any], correction: str = CORRECTION) -> Comparisons:
    """The report's comparisons as `adjust_report` corrects them (with every test of the report)."""
    return comparisons_of(adjust_report(report, correction))


def _test_text(t: Test) -> str:
    return (f"{_test_core(t)}, p = {t.p_value:.3g}, {t.correction.capitalize()}-adjusted p = "
            f"{t.p_adjusted:.3g} over {t.family} tests")


@dataclass(frozen=True, kw_only=True)
class Finding:
    """One comparison's sentence: what it claims (`verdict` of side a against side b), the
    numbers and the test behind it; `series` when it is one level of a treatment effect."""

    group: str
    metric: str
    claim: str
    evidence: str
    short: str
    caveat: str | None
    verdict: str
    context: str
    test: Test
    text: str
    series: dict[str, Any] | None = None

    @property
    def passes(self) -> bool:
        return self.verdict in ("less", "more")

    def to_json(self) -> dict[str, Any]:
        t = self.test
        return {"kind": "comparison", "group": self.group, "metric": self.metric, "metrics": [self.metric],
                "claim": self.claim, "evidence": self.evidence, "short": self.short, "caveat": self.caveat,
                "verdict": self.verdict, "context": self.context, "scope": t.scope or "runs",
                "test": t.name, "n": [t.n_a, t.n_b], "unit": t.unit,
                "p_value": t.p_value, "p_adjusted": t.p_adjusted,
                "correction": t.correction, "family": t.family, "text": self.text,
                **({"series": self.series} if self.series else {})}


def _finding(metric: str, sides: tuple[Cell | None, Cell | None], t: Test, left: str, right: str, context: str,
             group: str, cav: str | None, series: dict[str, Any] | None) -> Finding:
    label, unit, _ = METRICS[metric]
    a, b = (format_cell(side, FINDING, unit) for side in sides)
    v = verdict(t, t.alpha if t.alpha is not None else ALPHA)
    scope = "for these configurations" if t.scope == "configurations" else "in these runs"
    nums = f"{a} vs {b}; {_test_text(t)}"
    if v in ("less", "more"):
        claim = f"{context}, {scope}: {left} leaks {v} than {right} on {label}"
    else:
        claim = f"{context}, {scope}: no difference shown between {left} and {right} on {label}"
    seen = mde_text(t, metric)
    said = f"leaks {v}" if v in ("less", "more") else v
    short = (f"{context}: {left} vs {right}, {SHORT[metric]}: {said} (n = {t.n_a}/{t.n_b} "
             f"{t.unit}, {t.correction.capitalize()} p = {t.p_adjusted:.2g}{'; ' + seen if seen else ''})")
    if series:
        series = {**series, "key": (group, series["backend_label"], series["treatment"], metric, v, t.scope or "runs", t.name),
                  "treated": a, "baseline": b, "test_text": _test_core(t)}
    return Finding(group=group, metric=metric, claim=claim, evidence=nums, short=short, caveat=cav, verdict=v,
                   context=context, test=t, text=f"{claim} ({nums}).", series=series)


def _sentences(block, left: str, right: str, context: str, group: str,
               caveat: str | Callable[[str], str | None] | None = None,
               series: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    """One finding per tested metric of `block` (a block of `memaudit.reports.blocks`: side a is
    `left`, side b `right`). `caveat` may depend on the verdict (`left`'s: less, more or no
    difference shown). `series` (treatment effects): what the findings of one backend and
    treatment at several levels share, so the first screen can say them once."""
    out = []
    for metric, cell in block.metrics.items():
        t = cell.test
        if t is None or t.p_adjusted is None:
            continue  # no per-unit scores: no test, so no finding
        if t.extra.get(SAME_TEST):
            continue  # the same test is said where the family counts it
        v = verdict(t, t.alpha if t.alpha is not None else ALPHA)
        cav = caveat(v) if callable(caveat) else caveat
        out.append(_finding(metric, block.sides(cell), t, left, right, context, group, cav, series).to_json())
    return out


def _test_core(t: Test) -> str:
    """The test without its p-values: what every level of a series shares."""
    on = f" on {t.statistic}" if t.statistic else ""
    return f"{t.name} test{on}, {t.sides}, n = {t.n_a} and {t.n_b} {t.unit}"


def _tolerance(report: dict[str, Any]) -> float | None:
    return comparisons_of(report).matched_utility.tolerance


def _utility_relation(a: float | None, b: float | None, tol: float | None) -> str | None:
    """'matched' within the tolerance, else 'worse' or 'better' for side a (its perplexity is
    higher or lower than b's); None when either is unknown."""
    if a is None or b is None or tol is None or a <= 0 or b <= 0:
        return None
    if abs(math.log(a) - math.log(b)) <= tol:
        return "matched"
    return "worse" if a > b else "better"


LEARNED_LESS = "a model that learned less also leaks less"
LEARNED_MORE = "the run that leaks less predicts the holdout text better, so learning less does not explain it"


def _utility_caveat(ppl: tuple[float | None, float | None], names: tuple[str, str], tol: float | None,
                    verdict: str | None = None) -> str | None:
    """One line when the two sides are not at matched utility. The leakage gap may be a learning
    gap only where the side that leaks less (`verdict` is side a's: less or more) has the worse
    perplexity; where it has the better one, the line says so instead."""
    a, b = ppl
    rel = _utility_relation(a, b, tol)
    if rel in (None, "matched"):
        return None
    head = f"not at matched utility (holdout perplexity {a:.4g} {names[0]} vs {b:.4g} {names[1]})"
    leaks_less = {"less": "a", "more": "b"}.get(verdict or "")
    better = "a" if rel == "better" else "b"
    return f"{head}: {LEARNED_MORE if leaks_less == better else LEARNED_LESS}"


UNIT_CAVEAT = ("units differ: centralized epsilon protects one training sequence, federated epsilon "
               "one user's whole contribution")


def backend_findings(report: dict[str, Any]) -> list[dict[str, Any]]:
    """Federated vs centralized at each matched epsilon (two-sided): at equal guarantees where the
    centralized runs protect users too, with the units caveat where they protect sequences."""
    out = []
    for m in comparisons_of(report).matched:
        ppl = m.perplexities()
        eps = m.epsilon
        fed_unit, cen_unit = m.side_units()
        same = math.isinf(eps) or cen_unit == fed_unit

        def cav(verdict: str, ppl: tuple = ppl, same: bool = same) -> str | None:
            u = _utility_caveat(ppl, ("federated", "centralized"), _tolerance(report), verdict)
            return u if same else UNIT_CAVEAT + ("; " + u if u else "")

        where = _fmt_eps(eps) + ("" if math.isinf(eps) else
                                 f" per {fed_unit} on both sides" if same else
                                 f" ({cen_unit} vs {fed_unit} units)")
        alg = m.algorithm_of(CENTRALIZED)
        out += _sentences(m, "federated", "centralized" + (f" ({alg})" if alg else ""),
                          f"At {where}", "backend", cav)
    return out


def sampling_findings(report: dict[str, Any]) -> list[dict[str, Any]]:
    """Centralized DP per user, ULS (users sampled, each user's gradient clipped) against ELS
    (examples sampled, each clipped) at the same epsilon per user and compute (two-sided)."""
    out = []
    for m in comparisons_of(report).samplings or []:
        ppl = m.perplexities()

        def cav(verdict: str, ppl: tuple = ppl) -> str | None:
            return _utility_caveat(ppl, ("ULS", "ELS"), _tolerance(report), verdict)

        where = f"At {_fmt_eps(m.epsilon)} per user, centralized" + (" + Goldfish" if m.goldfish else "")
        if m.finetune != "full":
            where += f" with LoRA ({m.finetune})"
        out += _sentences(m, "ULS", "ELS", where, "sampling", cav)
    return out


def utility_findings(report: dict[str, Any]) -> list[dict[str, Any]]:
    """Federated vs centralized between real runs at matched utility (two-sided)."""
    out = []
    mu = comparisons_of(report).matched_utility
    for pair in mu.each_pair():
        (ep, ef), (up, uf) = pair.epsilon, pair.units
        side = {None: "no DP"}
        left = f"federated ({side.get(uf) or f'epsilon = {ef:.3g} per {uf}'})"
        right = f"centralized ({side.get(up) or f'epsilon = {ep:.3g} per {up}'})"
        context = (f"At matched utility (holdout perplexity {pair.perplexity[0]:.4g} vs "
                   f"{pair.perplexity[1]:.4g}, |log ratio| = {pair.log_ratio:.2g} <= {mu.tolerance:g})")
        cav = UNIT_CAVEAT if (up, uf) == ("example", "user") else (
            "one side has no DP guarantee" if (up is None) != (uf is None) else None)
        out += _sentences(pair, left, right, context, "matched_utility", cav)
    return out


def effect_findings(report: dict[str, Any]) -> list[dict[str, Any]]:
    """Whether DP or Goldfish loss leaks less than the matching baseline (one-sided)."""
    out = []
    for eff in comparisons_of(report).effects:
        name = eff.treatment
        ppl = eff.perplexities()

        def cav(verdict: str, ppl: tuple = ppl, name: str = name) -> str | None:
            return _utility_caveat(ppl, (f"with {name}", "without"),
                                   _tolerance(report), verdict)

        dp = name.startswith("DP at")
        series = {"backend_label": eff.backend_label, "treatment": "DP" if dp else name,
                  "level": _fmt_eps(eff.epsilon) if dp else None, "epsilon": eff.epsilon,
                  "perplexity": list(ppl), "tolerance": _tolerance(report)}
        out += _sentences(eff, f"with {name}", "without",
                          f"{eff.backend_label}, {name}", "effect", cav, series)
    return out


def target_findings(report: dict[str, Any]) -> list[dict[str, Any]]:
    """Probed outside models against each other (two-sided), on the units they share."""
    out = []
    for block in comparisons_of(report).targets or []:
        a, b = block.targets
        out += _sentences(block, a, b, f"Models {a} vs {b}", "targets")
    return out


def audit_findings(report: dict[str, Any]) -> list[dict[str, Any]]:
    """The audit bound as what it is: epsilon >= X at a stated confidence, against the ledger."""
    out = []
    for r in entries(report.get("runs", [])):
        a = r.cell("audit_epsilon")
        if not a or a.value is None:
            continue
        conf = a.extra.get("confidence") or 0.95
        led = r.privacy.epsilon
        bound = f"epsilon >= {number(a.value)} at {conf:.0%} confidence (one-sided)"
        if led is not None and not math.isinf(led) and a.value > led:
            verdict, text = "more", (f"Run {r.id}: the one-run audit shows {bound}, above the "
                                     f"ledger's epsilon = {number(led)}: the accounting or the "
                                     "implementation does not hold in this run.")
        else:
            verdict, text = "consistent", (f"Run {r.id}: the one-run audit shows {bound}"
                                           + (f", consistent with the ledger's epsilon = {number(led)}"
                                              if led is not None and not math.isinf(led) else "")
                                           + "; a lower bound, not an estimate.")
        out.append({"kind": "audit", "group": "audit", "metric": "audit_epsilon",
                    "metrics": ["audit_epsilon"], "verdict": verdict, "context": r.id,
                    "test": "one-run audit (Steinke et al. 2023)", "n": [a.n],
                    "unit": "audit canaries", "confidence": conf, "text": text})
    return out


def caveats(report: dict[str, Any]) -> list[str]:
    out = []
    runs = entries(report.get("runs", []))
    for r in runs:
        audit = r.cell("audit_epsilon")
        if audit and audit.extra.get("ceiling") is not None:
            out.append(
                f"Run {r.id}: the one-run audit's {audit.n} canaries can certify at most "
                f"epsilon = {number(audit.extra['ceiling'])} at the run's delta (the best over every r); its lower "
                f"bound {number(audit.value)} is a floor, not an estimate of the true epsilon."
            )
        if r.privacy.unit == "example" and not math.isinf(r.privacy.epsilon):
            out.append(document_caveat(r.id, r.privacy.document))
        per_user = r.privacy.per_user or {}
        if r.privacy.unit == "example" and per_user.get("max_sequences_per_user", 1) > 1:
            k = per_user["max_sequences_per_user"]
            if per_user.get("vacuous"):
                out.append(
                    f"Run {r.id}: epsilon is per training sequence; a user with {k} sequences is only "
                    "covered by a group-privacy bound that is vacuous here, so the guarantee says little "
                    "about users."
                )
            else:
                out.append(
                    f"Run {r.id}: epsilon is per training sequence; for a user with {k} sequences the "
                    f"group-privacy bound is epsilon = {number(per_user.get('epsilon'))}."
                )
    if any(r.privacy.unit == "user" for r in runs) and any(r.privacy.unit == "example" for r in runs):
        out.append(
            "Centralized epsilon protects one training sequence, federated epsilon one user's whole "
            "contribution: equal nominal epsilons are not equal guarantees."
        )
    return out


def document_caveat(run_id: str, doc: dict[str, Any] | None) -> str:
    """An example-level run's unit: a training sequence, and what that means for a document."""
    head = f"Run {run_id}: epsilon is per packed training sequence"
    m = (doc or {}).get("max_sequences_per_document")
    if m is None:
        return (head + "; how many sequences one document spans is unknown (the data was prepared before "
                "memaudit counted it), so there is no epsilon per document.")
    if m == 1:
        return head + "; no document crosses a sequence boundary, so it is also the epsilon per document."
    eps = doc.get("epsilon")
    return (head + f"; a document spans up to {m} sequences, and per document the ledger composes epsilon = "
            f"{number(eps) if eps is not None else 'unknown'} (a mixture of Gaussians over its {m} sequences).")


def pair_lines(report: dict[str, Any]) -> list[str]:
    """One line per matched-utility pair: the two runs, their guarantees and utilities, and what
    the tests (already adjusted) showed."""
    out = []
    for pair in comparisons_of(report).matched_utility.each_pair():
        sides = []
        for rid, eps, unit, ppl in zip(pair.runs, pair.epsilon, pair.units, pair.perplexity, strict=True):
            g = "no DP" if unit is None else f"epsilon = {eps:.3g} per {unit}"
            sides.append(f"{rid} ({g}, perplexity {ppl:.4g})")
        shown = [f"federated leaks {c.verdict} on {SHORT[k]}" for k, c in pair.metrics.items()
                 if c.verdict in ("less", "more")]
        same = {k: c for k, c in pair.metrics.items() if c.verdict == NO_DIFFERENCE}
        seen = [f"{SHORT[k]} {mde_amount(c.test.mde, k) or 'none within its range (too few units)'}"
                for k, c in same.items() if c.test and c.test.mde]
        what = "; ".join(shown + ([f"no difference shown on {len(same)} metric{'s' if len(same) != 1 else ''}"
                                   + (f" (the smallest differences these tests could have seen, {POWER:.0%} power: "
                                      f"{', '.join(seen)})" if seen else "")] if same else []))
        out.append(f"{sides[0]} vs {sides[1]}: {what or 'not tested (no per-unit scores)'}")
    return out


MAX_HEADLINE = 6
GROUP_ORDER = {"targets": -1, "matched_utility": 0, "effect": 1, "audit": 2, "backend": 3, "sampling": 4}


def headline(sentences: list[dict[str, Any]], limit: int = MAX_HEADLINE) -> list[dict[str, Any]]:
    """The first screen's findings: the differences that pass the statistical rules (Holm-adjusted
    p < alpha on a test of the runs' units or seeds) and audits above the ledger, at most `limit`:
    matched-utility comparisons first, then treatment effects, then matched epsilon; smallest
    adjusted p first within each. One treatment's findings on one metric at several privacy levels
    (DP at each epsilon against the same non-DP run, the same verdict) are one entry that names
    every level and gives each level's cell: five near-identical sentences would bury the rest."""
    passing = [s for s in map(Sentence.of, sentences) if s.passes]
    passing.sort(key=lambda s: (GROUP_ORDER.get(s.group, 9), s.p_adjusted))
    entries: list[list[Sentence]] = []
    by_key: dict[Any, list[Sentence]] = {}
    for s in passing:
        key = tuple(s.series.key) if s.series is not None and s.series.level is not None else None  # only DP levels merge
        if key in by_key:
            by_key[key].append(s)
            continue
        entries.append([s])
        if key is not None:
            by_key[key] = entries[-1]
    out = []
    for group in entries[:limit]:
        s = group[0]
        if len(group) == 1:
            out.append({"text": s.text if s.claim is None else s.claim, "evidence": s.evidence or s.test,
                        "caveat": s.caveat, "verdict": s.verdict, "group": s.group,
                        "metric": s.metric, "covers": 1})
        else:
            out.append(_series_entry(group))
    return out


def _series_entry(group: list[Sentence]) -> dict[str, Any]:
    """One first-screen entry for a treatment's passing findings at several levels."""
    group = sorted(group, key=lambda s: -(s.series.epsilon or 0.0))
    s0, ser = group[0], group[0].series
    label = METRICS[s0.metric][0]
    levels = ", ".join(s.series.level.removeprefix("epsilon = ") for s in group)
    scope = "for these configurations" if s0.scope == "configurations" else "in these runs"
    text = (f"{ser.backend_label}, {scope}: with DP at each of epsilon = {levels} ({len(group)} levels) "
            f"leaks {s0.verdict} than without on {label}")
    rel = {id(s): _utility_relation(*s.series.perplexity, s.series.tolerance) for s in group}

    def level_cell(s: Sentence) -> str:
        t, b = s.series.perplexity
        tag = f" (matched utility: perplexity {t:.4g} vs {b:.4g})" if rel[id(s)] == "matched" else ""
        return f"{s.series.level}: {s.series.treated}{tag}"

    cells = "; ".join(level_cell(s) for s in group)
    p_max = max(s.p_adjusted for s in group)
    evidence = (f"{cells}; without DP {ser.baseline}; {ser.test_text} at each level, "
                f"{s0.correction.capitalize()}-adjusted p <= {p_max:.3g} over {s0.family} tests")
    return {"text": text, "evidence": evidence, "caveat": _series_caveat(group, rel), "verdict": s0.verdict,
            "group": s0.group, "metric": s0.metric, "covers": len(group)}


def _series_caveat(group: list[Sentence], rel: dict[int, str | None]) -> str | None:
    """The levels not at matched utility, by which side learned less (`_utility_caveat`), in one
    line; the baseline's perplexity is the same for every level."""
    parts = []
    less = group[0].verdict == "less"  # the treatment is the side that leaks less
    for side in ("worse", "better"):
        sel = [s for s in group if rel[id(s)] == side]
        if not sel:
            continue
        ts = sorted(s.series.perplexity[0] for s in sel)
        levels = ", ".join(s.series.level.removeprefix("epsilon = ") for s in sel)
        span = f"{ts[0]:.4g}" if len(ts) == 1 else f"{ts[0]:.4g} to {ts[-1]:.4g}"
        reason = LEARNED_LESS if (side == "worse") == less else LEARNED_MORE
        parts.append(f"not at matched utility at epsilon = {levels} (holdout perplexity {span} with DP vs "
                     f"{sel[0].series.perplexity[1]:.4g} without): {reason}")
    if any(rel[id(s)] is None for s in group):  # utilities unknown: keep what each finding said
        parts += [s.caveat for s in group if rel[id(s)] is None and s.caveat]
    return "; ".join(dict.fromkeys(parts)) or None



def generate(report: dict[str, Any]) -> dict[str, Any]:
    """The findings section: {'sentences', 'headline', 'passing', 'no_difference', 'caveats',
    'correction', 'tests', 'alpha'}, from the report's comparisons adjusted (`adjust`) on a copy:
    `report` is left as it was. `passing` counts every finding that passes the rules; the headline
    shows at most MAX_HEADLINE of them. `no_difference` holds one short line per comparison that
    showed no difference."""
    rep = adjust_report(report)
    family = len(_family_slots(comparisons_of(rep))) + sum(len(mod.tests_of(sec)) for _key, mod, sec in _sections(rep))
    sentences = (target_findings(rep) + utility_findings(rep) + backend_findings(rep)
                 + sampling_findings(rep) + effect_findings(rep) + audit_findings(rep))
    # the sections' passing tests too: "N of M tests pass" counts over the one family
    read = [Sentence.of(s) for s in sentences]
    passing = sum(s.passes for s in read) + _section_passing(rep)
    head = headline(sentences)
    return {"sentences": sentences, "headline": head, "passing": passing,
            "covered": sum(h["covers"] for h in head),
            "matched_pairs": pair_lines(rep),
            "no_difference": [s.short for s in read if s.verdict == NO_DIFFERENCE],
            "caveats": caveats(rep), "correction": CORRECTION, "tests": family, "alpha": ALPHA}
