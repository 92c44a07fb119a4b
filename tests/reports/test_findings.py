import math

import numpy as np
import pytest

from memaudit.probes.records import Cell, Test
from memaudit.reports import findings
from memaudit.reports.build import SCHEMA, comparisons
from memaudit.reports.cells import FINDING, format_cell
from memaudit.reports.schema import validate_report
from tests.reports._fixtures import auc_units, cell, run


def _report(runs):
    rep = {"schema": SCHEMA, "memaudit_version": "t", "runs": runs, "comparisons": comparisons(runs)}
    rep["comparisons"] = findings.adjust(rep)  # generate() leaves its input as it was
    rep["findings"] = findings.generate(rep)
    return rep


def _backend_pair(fed_shift, par_shift, seed=0):
    return [
        run("par-eps4", "centralized", 4.0, mia=cell(0.5, 0.05), unit="example",
            units={"mia_auc": auc_units(par_shift, seed=seed)}),
        run("fed-eps4", "federated", 4.0, mia=cell(0.5, 0.05), unit="user",
            units={"mia_auc": auc_units(fed_shift, seed=seed + 1)}),
    ]


@pytest.mark.parametrize(
    "fed, par, verdict, phrase",
    [
        (0.0, 1.5, "less", "federated leaks less than centralized"),
        (1.5, 0.0, "more", "federated leaks more than centralized"),
        (0.0, 0.0, "no difference shown", "no difference shown between federated and centralized"),
    ],
)
def test_backend_sentence_follows_the_test(fed, par, verdict, phrase):
    rep = _report(_backend_pair(fed, par))
    leak = rep["runs"][0]["leakage"]
    leak["mia_auc"] = leak["mia_auc"].replace(value=0.5 + par / 3)  # shown values only
    sents = [s for s in rep["findings"]["sentences"] if s["group"] == "backend"]
    assert len(sents) == 1
    s = sents[0]
    assert s["verdict"] == verdict and phrase in s["text"]
    assert "in these runs" in s["text"] and "epsilon = 4" in s["text"]
    assert s["test"] == "paired AUC permutation" and s["n"] == [200, 200]
    assert s["correction"] == "holm" and "Holm-adjusted p" in s["text"]
    # the one-line form in report.json says the same verdict as the sentence
    short_verdict = {"less": "leaks less", "more": "leaks more"}.get(verdict, verdict)
    assert f"federated vs centralized, MIA AUC: {short_verdict} (n = 200/200 documents, Holm p = " in s["short"]
    assert (verdict == "no difference shown") == ("no difference shown" in s["short"])


def test_overlapping_intervals_no_longer_decide_and_untested_cells_state_nothing():
    """Defect 1: cells without per-unit scores (no test possible) give no finding at all, even
    when their intervals are far apart."""
    runs = [
        run("par-eps4", "centralized", 4.0, mia=cell(0.9, 0.01), unit="example"),
        run("fed-eps4", "federated", 4.0, mia=cell(0.5, 0.01), unit="user"),
    ]
    rep = _report(runs)
    assert [s for s in rep["findings"]["sentences"] if s["kind"] == "comparison"] == []
    assert rep["comparisons"].matched[0].metrics["mia_auc"].test is None


def test_dp_and_goldfish_effects_are_one_sided_and_corrected():
    runs = [
        run("par-inf", "centralized", math.inf, mia=cell(0.9, 0.02), units={"mia_auc": auc_units(2.0)}),
        run("par-inf-gf", "centralized", math.inf, mia=cell(0.6, 0.02), goldfish=True,
            units={"mia_auc": auc_units(0.3, seed=1)}),
        run("par-eps1", "centralized", 1.0, mia=cell(0.5, 0.02), unit="example",
            units={"mia_auc": auc_units(0.0, seed=2)}),
    ]
    rep = _report(runs)
    texts = " | ".join(s["text"] for s in rep["findings"]["sentences"])
    assert "with Goldfish loss leaks less than without" in texts
    assert "with DP at epsilon = 1 leaks less than without" in texts
    tests = [c.test.to_json() for e in rep["comparisons"].effects for c in e.metrics.values()]
    assert all(t["alternative"] == "less" and t["family"] == 2 for t in tests)


def test_no_signal_runs_give_no_finding_after_correction():
    """Null check: 10 backend pairs without any difference; Holm keeps every one unclaimed."""
    runs = []
    for i in range(10):
        eps = float(i + 1)
        runs += [
            run(f"par-{i}", "centralized", eps, mia=cell(0.5, 0.05), unit="example",
                units={"mia_auc": auc_units(0.3, seed=10 * i)}),
            run(f"fed-{i}", "federated", eps, mia=cell(0.5, 0.05), unit="user",
                units={"mia_auc": auc_units(0.3, seed=10 * i + 1)}),
        ]
    rep = _report(runs)
    sents = rep["findings"]["sentences"]
    assert len(sents) == 10 and all(s["verdict"] == "no difference shown" for s in sents)
    assert all(s["family"] == 10 for s in sents)


def test_report_from_few_units_states_no_finding_without_test_n_and_correction():
    """Acceptance: runs with 2 canaries per bucket and few documents. Every stated finding has
    its test, n, p-value, adjusted p-value and correction; none is a difference."""
    rng = np.random.default_rng(0)

    def exp_units(vals):
        return {"kind": "mean", "unit": "canaries", "ids": ["c10", "c11"], "values": vals}

    def mia(seed):
        r = np.random.default_rng(seed)
        return {"kind": "auc", "unit": "documents", "ids": [f"d{i}" for i in range(8)],
                "values": r.normal(size=8).tolist(), "member": [True] * 4 + [False] * 4}

    runs = []
    for backend in ("centralized", "federated"):
        for eps in (math.inf, 8.0, 2.0):
            few = cell(float(rng.uniform(0, 3)), 0.0, n=2, unit="canaries")
            few.update(ci_low=None, ci_high=None, note="n too small")
            r = run(f"{backend}-{eps}", backend, eps, mia=cell(0.5, 0.1, n=4),
                    unit=None if math.isinf(eps) else ("example" if backend == "centralized" else "user"),
                    units={"exposure_top": exp_units(rng.uniform(0, 3, 2).tolist()),
                           "mia_auc": mia(int(eps if not math.isinf(eps) else 0) + len(backend))})
            r["leakage"]["exposure_top"] = Cell.from_json(few)
            runs.append(r)
    rep = _report(runs)
    validate_report({k: v for k, v in rep.items()})
    sents = [s for s in rep["findings"]["sentences"] if s["kind"] == "comparison"]
    assert sents, "the comparisons are still reported, as 'no difference shown'"
    for s in sents:
        assert s["verdict"] == "no difference shown", s["text"]
        for key in ("test", "n", "p_value", "p_adjusted", "correction", "family", "unit"):
            assert s[key] is not None
        assert "n too small" in s["text"] or s["metric"] == "mia_auc"
    # the schema refuses a difference stated without its test
    bad = dict(rep)
    bad["findings"] = {**rep["findings"], "sentences": [{"kind": "comparison", "text": "x", "verdict": "less",
                                                         "metric": "mia_auc", "test": "t", "n": [1, 1]}]}
    with pytest.raises(ValueError, match="findings"):
        validate_report(bad)


def test_audit_is_a_lower_bound_against_the_ledger():
    runs = [run("par-eps4", "centralized", 4.0, mia=cell(0.5, 0.02), unit="example"),
            run("fed-eps4", "federated", 4.0, mia=cell(0.5, 0.02), unit="user")]
    runs[0]["leakage"]["audit_epsilon"] = Cell.from_json({"value": 0.4, "ci_low": None, "ci_high": None,
                                                          "ceiling": 3.49, "n": 200, "confidence": 0.95})
    runs[1]["leakage"]["audit_epsilon"] = Cell.from_json({"value": 5.0, "ci_low": None, "ci_high": None,
                                                          "ceiling": 6.0, "n": 200, "confidence": 0.95})
    rep = _report(runs)
    audit = [s for s in rep["findings"]["sentences"] if s["kind"] == "audit"]
    assert "epsilon >= 0.4 at 95% confidence (one-sided)" in audit[0]["text"]
    assert audit[0]["verdict"] == "consistent" and audit[1]["verdict"] == "more"
    assert "audit_epsilon" not in rep["comparisons"].matched[0].metrics


def test_caveats_mention_units_and_audit_ceiling():
    runs = [
        run("par-eps4", "centralized", 4.0, mia=cell(0.5, 0.02), unit="example"),
        run("fed-eps4", "federated", 4.0, mia=cell(0.5, 0.02), unit="user"),
    ]
    runs[0]["privacy"]["per_user"] = {"max_sequences_per_user": 12, "vacuous": True}
    runs[1]["leakage"]["audit_epsilon"] = Cell.from_json({"value": 0.4, "ci_low": None, "ci_high": None,
                                                          "ceiling": 3.49, "n": 200})
    rep = {"runs": runs}
    cav = " ".join(findings.caveats(rep))
    assert "vacuous" in cav and "12 sequences" in cav
    assert "3.49" in cav
    assert "one training sequence" in cav


def test_the_unit_caveat_names_the_document_and_its_m_where_known():
    runs = [run(f"par-{i}", "parallel", 4.0, mia=cell(0.5, 0.02), unit="example") for i in range(3)]
    runs.append(run("fed", "federated", 4.0, mia=cell(0.5, 0.02), unit="user"))
    runs[0]["privacy"]["document"] = {"max_sequences_per_document": 3, "epsilon": 9.5, "composed_as": "..."}
    runs[1]["privacy"]["document"] = {"max_sequences_per_document": 1, "epsilon": 4.0, "composed_as": "..."}
    runs[2]["privacy"]["document"] = None  # a run whose data predates the count
    by_run = {c.split(":")[0]: c for c in findings.caveats({"runs": runs}) if "per packed training sequence" in c}
    assert set(by_run) == {"Run par-0", "Run par-1", "Run par-2"}  # example-level runs only
    assert "up to 3 sequences" in by_run["Run par-0"] and "epsilon = 9.5" in by_run["Run par-0"]
    assert "also the epsilon per document" in by_run["Run par-1"]
    assert "unknown" in by_run["Run par-2"] and "no epsilon per document" in by_run["Run par-2"]


def test_several_seeds_are_tested_over_seeds_as_configurations():
    runs = []
    for s in range(4):
        runs.append(run(f"par-{s}", "centralized", 4.0, mia=cell(0.80 + 0.01 * s, 0.02), unit="example",
                        units={"mia_auc": auc_units(1.5, seed=s)}))
        runs.append(run(f"fed-{s}", "federated", 4.0, mia=cell(0.55 + 0.01 * s, 0.02), unit="user",
                        units={"mia_auc": auc_units(0.2, seed=10 + s)}))
        runs[-1]["seed"] = runs[-2]["seed"] = s
    rep = _report(runs)
    t = rep["comparisons"].matched[0].metrics["mia_auc"].test.to_json()
    assert t["scope"] == "configurations" and t["unit"] == "seeds" and t["n_a"] == 4
    s = next(x for x in rep["findings"]["sentences"] if x["kind"] == "comparison")
    assert "for these configurations" in s["text"]
    # 4 vs 4 seeds: the smallest two-sided permutation p is 2/70, so the difference is shown
    assert s["verdict"] == "less"


def test_the_count_of_passing_tests_is_not_the_headline_cap():
    """Eight Goldfish effects pass (one at each of eight DP levels, eight distinct findings); the
    first screen shows six of them and says eight pass (the first version printed the headline's
    length, 6, as the number of tests that pass)."""
    from memaudit.reports.snapshots import render_block

    runs = []
    for e in range(1, 9):
        runs += [run(f"par-eps{e}", "centralized", float(e), mia=cell(0.9, 0.02), unit="example",
                     units={"mia_auc": auc_units(2.0, seed=e)}),
                 run(f"par-eps{e}-gf", "centralized", float(e), mia=cell(0.5, 0.02), unit="example", goldfish=True,
                     units={"mia_auc": auc_units(0.0, seed=100 + e)})]
    rep = _report(runs)
    f = rep["findings"]
    assert f["passing"] == 8 and len(f["headline"]) == findings.MAX_HEADLINE == 6 and f["covered"] == 6
    text = render_block("t", rep)
    assert f"8 of {f['tests']} tests pass" in text and "the report's first screen says 6 of them in 6 findings" in text


def test_one_treatment_at_several_levels_is_one_first_screen_entry():
    """DP at eight levels, each leaking less than the same non-DP run: the first version gave the
    first screen six near-identical sentences ("with DP at epsilon = 8 leaks less ...", "= 7",
    ...) and hid the rest; now one entry names every level with its cell, and the matched-epsilon
    backend finding still gets its own line."""
    from memaudit.reports.snapshots import render_block

    runs = [run("par-inf", "centralized", math.inf, mia=cell(0.9, 0.02), units={"mia_auc": auc_units(2.0)})]
    runs += [run(f"par-eps{e}", "centralized", float(e), mia=cell(0.5, 0.02), unit="example",
                 units={"mia_auc": auc_units(0.0, seed=e)}) for e in range(1, 9)]
    runs += [run("fed-inf", "federated", math.inf, mia=cell(0.5, 0.02), units={"mia_auc": auc_units(0.0, seed=50)})]
    rep = _report(runs)
    f = rep["findings"]
    assert f["passing"] == 9 and f["covered"] == 9 and len(f["headline"]) == 2
    dp, backend = f["headline"]
    assert dp["covers"] == 8 and backend["covers"] == 1 and backend["group"] == "backend"
    assert dp["text"] == ("centralized, in these runs: with DP at each of epsilon = 8, 7, 6, 5, 4, 3, 2, 1 "
                          "(8 levels) leaks less than without on membership-inference AUC (loss attack)")
    effects = {e.epsilon: e.metrics["mia_auc"] for e in rep["comparisons"].effects}
    for e in range(1, 9):  # every level's own cell, from the comparison it came from
        c = effects[float(e)].side("treated")
        assert f"epsilon = {e}: {format_cell(c, FINDING, '')}" in dp["evidence"]
    p_max = max(c.test.p_adjusted for c in effects.values())
    assert dp["evidence"].endswith(f"Holm-adjusted p <= {p_max:.3g} over {f['tests']} tests")
    assert "paired AUC permutation test" in dp["evidence"] and "at each level" in dp["evidence"]
    text = render_block("t", rep)
    assert "9 of 9 tests pass" in text and "(8 levels)" in text
    validate_report(rep)


def test_a_strong_auc_difference_passes_in_a_large_family():
    """A paired AUC permutation test with 1999 permutations cannot return p < 1/2000; over 103
    tests Holm then needs p < 0.05/103, so the strongest membership difference could never pass
    on its own (the first version: 'no difference shown' for AUC 0.92 vs 0.5). Tests at their
    floor are re-run with enough permutations; the null ones stay unclaimed."""
    runs = [run("par-inf", "centralized", math.inf, mia=cell(0.9, 0.02), units={"mia_auc": auc_units(2.0)}),
            run("par-eps1", "centralized", 1.0, mia=cell(0.5, 0.02), unit="example",
                units={"mia_auc": auc_units(0.0, seed=1)}),
            run("fed-inf", "federated", math.inf, mia=cell(0.5, 0.02), units={"mia_auc": auc_units(0.0, seed=2)})]
    runs += [run(f"fed-eps{e}", "federated", float(e), mia=cell(0.5, 0.02), unit="user",
                 units={"mia_auc": auc_units(0.0, seed=10 + e)}) for e in range(1, 101)]
    rep = _report(runs)
    f = rep["findings"]
    assert f["tests"] == 103
    comp = rep["comparisons"]
    strong = [c.test.to_json() for block in comp.matched + comp.effects for c in block.metrics.values()
              if c.test and "par-inf" in c.test.runs]
    assert len(strong) == 2 and all(t["p_value"] < 0.05 / 103 and t["p_adjusted"] < 0.05 for t in strong)
    assert f["passing"] == 2  # the 101 null comparisons stay unclaimed


def test_the_learned_less_caveat_follows_which_side_learned_less():
    """The over-trained tier's DP runs at epsilon 1000, 100 and 32 all leak less than the non-DP
    run, at holdout perplexity 81, 186 and 239 against 194. The report said of every level "a model
    that learned less also leaks less", also of the one that predicts the holdout text far better
    (81) and of the one within the utility tolerance (186). The confound applies only where the run
    that leaks less has the worse perplexity."""
    runs = [run("par-inf", "centralized", math.inf, mia=cell(0.9, 0.02), units={"mia_auc": auc_units(2.0)}, ppl=194.0)]
    runs += [run(f"par-eps{e}", "centralized", float(e), mia=cell(0.5, 0.02), unit="example", ppl=p,
                 units={"mia_auc": auc_units(0.0, seed=e)}) for e, p in ((1000, 81.0), (100, 186.0), (32, 239.0))]
    rep = _report(runs)
    f = rep["findings"]
    by_eps = {s["series"]["epsilon"]: s for s in f["sentences"] if s.get("series")}
    assert "learned less" in by_eps[32.0]["caveat"] and "239 with DP" in by_eps[32.0]["caveat"]
    assert by_eps[100.0]["caveat"] is None  # |log(186 / 194)| = 0.04 <= 0.1
    better = by_eps[1000.0]["caveat"]
    assert "learned less" not in better and "predicts the holdout text better" in better
    (entry,) = f["headline"]
    assert entry["covers"] == 3
    assert "learned less" in entry["caveat"] and "epsilon = 32" in entry["caveat"]
    assert "epsilon = 1000" in entry["caveat"] and "predicts the holdout text better" in entry["caveat"]
    assert "epsilon = 100 " not in entry["caveat"] and "epsilon = 1000, 100" not in entry["caveat"]
    assert "epsilon = 100: " in entry["evidence"] and "matched utility" in entry["evidence"]
    validate_report(rep)


def test_generate_leaves_its_input_unchanged():
    """generate() returns the findings and adjusts a copy of the comparisons: the report it reads
    keeps its unadjusted tests and "not tested" verdicts (it used to write both into its input)."""
    import copy

    runs = _backend_pair(0.0, 1.5)
    rep = {"schema": SCHEMA, "memaudit_version": "t", "runs": runs, "comparisons": comparisons(runs)}
    before = copy.deepcopy(rep)
    f = findings.generate(rep)
    assert rep == before
    assert f["tests"] == 1 and f["sentences"][0]["verdict"] == "less"
    adjusted = findings.adjust(rep)
    assert rep == before and adjusted.matched[0].metrics["mia_auc"].verdict == "less"
    assert findings.adjust({**rep, "comparisons": adjusted}) == adjusted  # adjusting again changes nothing


def test_verdict_is_a_function_of_the_adjusted_test():
    from memaudit.reports.cells import Test, verdict

    t = {"name": "paired AUC permutation", "n_a": 50, "n_b": 50, "unit": "documents", "p_value": 0.001}
    assert verdict(Test(alternative="two-sided", estimate=0.1, **t), 0.05) == "not tested"
    assert verdict(Test(alternative="two-sided", estimate=0.1, p_adjusted=0.01, **t), 0.05) == "more"
    assert verdict(Test(alternative="two-sided", estimate=-0.1, p_adjusted=0.01, **t), 0.05) == "less"
    assert verdict(Test(alternative="less", estimate=0.1, p_adjusted=0.01, **t), 0.05) == "less"
    assert verdict(Test(alternative="less", estimate=-0.1, p_adjusted=0.05, **t), 0.05) == "no difference shown"


def test_no_difference_says_what_difference_its_test_could_have_seen():
    """A comparison without a finding carries its minimum detectable effect, on the same units, at
    80% power and the strictest Holm step (alpha / family); its short line states it."""
    from memaudit.probes.power import minimum_detectable_effect

    rep = _report(_backend_pair(0.0, 0.0))
    (s,) = [s for s in rep["findings"]["sentences"] if s["group"] == "backend"]
    assert s["verdict"] == "no difference shown"
    (t,) = [c.test.to_json() for m in rep["comparisons"].matched for c in m.metrics.values() if c.test]
    runs = {r["id"]: r for r in rep["runs"]}
    ua, ub = (runs[rid]["units"]["mia_auc"] for rid in t["runs"])
    expect = minimum_detectable_effect(ua, ub, alternative=t["alternative"], alpha=0.05 / t["family"])
    assert t["mde"] == expect and expect["unit"] == "AUC points" and 0 < expect["value"] < 0.5
    assert f"could have seen {findings.number(expect['value'])} AUC points (80% power)" in s["short"]
    assert rep["findings"]["no_difference"] == [s["short"]]
    # a comparison that shows a difference carries none
    shown = _report(_backend_pair(0.0, 1.5))
    assert all(c.test.mde is None for m in shown["comparisons"].matched for c in m.metrics.values())


def _tested(**more) -> Test:
    return Test(name="paired AUC permutation", alternative="two-sided", n_a=50, n_b=50, unit="documents",
                p_value=0.5, **more)


def test_the_matched_pair_line_states_the_smallest_differences_it_could_have_seen():
    pair = {"runs": ["par", "fed"], "epsilon": [2.0, 8.0], "units": ["example", "user"], "perplexity": [100.0, 104.0],
            "metrics": {"mia_auc": {"verdict": "no difference shown",
                                    "test": _tested(mde={"value": 0.0612, "unit": "AUC points"})},
                        "exposure_top": {"verdict": "no difference shown",
                                         "test": _tested(mde={"value": float("inf"), "unit": None})},
                        "extraction_exact": {"verdict": "less", "test": _tested()}}}
    (line,) = findings.pair_lines({"comparisons": {"matched_utility": {"pairs": [pair]}}})
    assert "federated leaks less on exact extraction" in line
    assert ("no difference shown on 2 metrics (the smallest differences these tests could have seen, 80% power: "
            "MIA AUC 0.0612 AUC points, exposure (top reps) none within its range (too few units))") in line


def test_centralized_per_user_meets_federated_at_equal_guarantees_and_never_pools_with_per_example():
    """Centralized DP-SGD at epsilon 8 per example and per user, federated at 8 per user: two
    comparisons, the per-user one first and at equal guarantees (no units caveat); the two
    centralized configurations are never pooled as seeds of one; each has its own DP effect."""
    runs = [
        run("par-inf", "centralized", math.inf, mia=cell(0.7, 0.05), units={"mia_auc": auc_units(1.0, seed=1)}),
        run("par-ex", "centralized", 8.0, mia=cell(0.5, 0.05), unit="example", units={"mia_auc": auc_units(0.0, seed=2)}),
        run("par-user", "centralized", 8.0, mia=cell(0.5, 0.05), unit="user", units={"mia_auc": auc_units(0.0, seed=3)}),
        run("fed-user", "federated", 8.0, mia=cell(0.5, 0.05), unit="user", units={"mia_auc": auc_units(0.0, seed=4)}),
    ]
    rep = _report(runs)
    matched = rep["comparisons"].matched
    assert [(m.units["centralized"], m.equal_guarantee) for m in matched] == [("user", True), ("example", False)]
    assert [m.metrics["mia_auc"].test.runs for m in matched] == [("fed-user", "par-user"), ("fed-user", "par-ex")]
    sents = [s for s in rep["findings"]["sentences"] if s["group"] == "backend"]
    equal, differ = (next(s for s in sents if n in s["text"]) for n in ("per user on both", "example vs user units"))
    assert equal["caveat"] is None or "units differ" not in equal["caveat"]
    assert "units differ" in differ["caveat"]
    effects = {(e.backend_label, e.unit) for e in rep["comparisons"].effects}
    assert effects == {("centralized", "example"), ("centralized (user-level DP)", "user")}


def test_els_and_uls_never_pool_and_each_meets_federated_and_the_other():
    """Centralized per user by ELS and by ULS at epsilon 8 with federated at 8 per user: the two
    algorithms are two configurations (never seeds of one); each meets federated at equal
    guarantees (ULS first), ULS meets ELS in a two-sided test of its own, counted in the one
    Holm family; each has its own DP effect against the one non-DP run."""
    runs = [
        run("par-inf", "centralized", math.inf, mia=cell(0.7, 0.05), units={"mia_auc": auc_units(1.0, seed=1)}),
        run("par-els", "centralized", 8.0, mia=cell(0.5, 0.05), unit="user", user_sampling="els",
            units={"mia_auc": auc_units(1.5, seed=2)}),
        run("par-uls", "centralized", 8.0, mia=cell(0.5, 0.05), unit="user", user_sampling="uls",
            units={"mia_auc": auc_units(0.0, seed=3)}),
        run("fed-user", "federated", 8.0, mia=cell(0.5, 0.05), unit="user", units={"mia_auc": auc_units(0.0, seed=4)}),
    ]
    rep = _report(runs)
    matched = rep["comparisons"].matched
    assert [(m.algorithm["centralized"], m.equal_guarantee) for m in matched] == [("ULS", True), ("ELS", True)]
    assert [m.metrics["mia_auc"].test.runs for m in matched] == [("fed-user", "par-uls"), ("fed-user", "par-els")]
    (smp,) = rep["comparisons"].samplings
    t = smp.metrics["mia_auc"].test.to_json()
    assert t["runs"] == ["par-uls", "par-els"] and t["alternative"] == "two-sided" and smp.epsilon == 8.0
    # ELS was given the stronger member signal: ULS leaks less, and the sentence says which is which
    (s,) = [s for s in rep["findings"]["sentences"] if s["group"] == "sampling"]
    assert s["verdict"] == "less" and "ULS leaks less than ELS" in s["text"] and "epsilon = 8 per user" in s["text"]
    fams = {s["family"] for s in rep["findings"]["sentences"]}
    assert fams == {rep["findings"]["tests"]}  # one family over every test, the ULS-ELS test included
    backend = [s["text"] for s in rep["findings"]["sentences"] if s["group"] == "backend"]
    assert any("centralized (ULS)" in t for t in backend) and any("centralized (ELS)" in t for t in backend)
    effects = {e.backend_label for e in rep["comparisons"].effects}
    assert effects == {"centralized (user-level DP, ELS)", "centralized (user-level DP, ULS)"}
    from memaudit.reports.literature import run_label

    assert {run_label(r) for r in runs[1:3]} == {"centralized (ELS), epsilon = 8 per user",
                                                        "centralized (ULS), epsilon = 8 per user"}
    series = {s.label for s in rep["comparisons"].frontier.metrics["mia_auc"].series}
    assert series == {"centralized", "centralized (ELS)", "federated"}  # no line drawn from ELS to ULS
    curves = {c.label for c in rep["comparisons"].curves}
    assert {"centralized (user-level DP, ELS)", "centralized (user-level DP, ULS)"} <= curves
    validate_report(rep)


def test_a_test_in_two_sections_is_one_entry_of_the_family():
    """Issue 68, item 2: a federated and a centralized run at the same epsilon and within the
    utility tolerance are compared at matched epsilon and at matched utility, by the same test on
    the same units. It is one test of the Holm family, counted once, with one sentence."""
    runs = [
        run("par-eps4", "centralized", 4.0, mia=cell(0.5, 0.05), unit="user", ppl=100.0,
            units={"mia_auc": auc_units(1.5, seed=0)}),
        run("fed-eps4", "federated", 4.0, mia=cell(0.5, 0.05), unit="user", ppl=101.0,
            units={"mia_auc": auc_units(0.0, seed=1)}),
    ]
    rep = _report(runs)
    comp = rep["comparisons"]
    (m,) = comp.matched
    (pair,) = comp.matched_utility.pairs
    ta, tb = m.metrics["mia_auc"].test.to_json(), pair.metrics["mia_auc"].test.to_json()
    assert ta["runs"] == tb["runs"]  # the same pair of runs, metric and units: the same test
    assert ta["family"] == tb["family"] == rep["findings"]["tests"] == 1
    assert ta["p_adjusted"] == tb["p_adjusted"] == ta["p_value"]
    sents = [s for s in rep["findings"]["sentences"] if s["kind"] == "comparison"]
    assert len(sents) == 1 and sents[0]["group"] == "matched_utility"
    assert rep["findings"]["passing"] == 1


def test_an_exposure_test_that_cannot_reach_its_level_says_none_within_range():
    """Issue 68, item 1: where the sign-flip test's smallest p-value lies above alpha / family
    (here 5 canaries, two-sided 2^-4 = 0.0625 against 0.05 / 2; in the quickstart's family of 66,
    10 canaries), the report stated a finite effect it "could have seen", which the test finds 0%
    of the time. It says none is within range."""
    rng = np.random.default_rng(4)
    runs = _backend_pair(0.0, 0.0)
    ids = [f"c{i}" for i in range(5)]
    for r, shift in zip(runs, (0.0, 0.1), strict=True):
        vals = rng.normal(1.0 + shift, 1.0, 5)
        r["units"]["exposure_top"] = {"kind": "mean", "unit": "canaries", "ids": ids, "values": vals.tolist()}
        r["leakage"]["exposure_top"] = Cell(value=float(vals.mean()), n=5, unit="canaries", note="n too small")
    rep = _report(runs)
    (s,) = [s for s in rep["findings"]["sentences"] if s["metric"] == "exposure_top"]
    assert s["verdict"] == "no difference shown"
    assert "could have seen none within range" in s["short"] and "bits" not in s["short"].split("Holm p")[1]
