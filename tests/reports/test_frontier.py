"""The comparison at matched utility, the frontier, group privacy per canary bucket, the first
screen's findings, and legible plots (issue 16, items 3-5)."""

import itertools
import math

import pytest

from memaudit.probes.records import Cell
from memaudit.reports import findings
from memaudit.reports.build import SCHEMA, build_report, comparisons
from memaudit.reports.frontier import matched_utility
from memaudit.reports.schema import validate_report
from tests.reports._fixtures import auc_units, cell, run, write_run_dir


@pytest.fixture(autouse=True)
def _close_figures():
    yield
    import matplotlib.pyplot as plt

    plt.close("all")


def _report(runs, tolerance=0.1):
    rep = {"schema": SCHEMA, "memaudit_version": "t", "runs": runs,
           "comparisons": comparisons(runs, utility_tolerance=tolerance)}
    rep["findings"] = findings.generate(rep)
    return rep


def _pair(par_ppl, fed_ppl, *, par_shift=1.5, fed_shift=0.0, eps=(8.0, 8.0)):
    return [
        run("par", "centralized", eps[0], mia=cell(0.8, 0.05), unit="example", ppl=par_ppl,
            units={"mia_auc": auc_units(par_shift)}),
        run("fed", "federated", eps[1], mia=cell(0.5, 0.05), unit="user", ppl=fed_ppl,
            units={"mia_auc": auc_units(fed_shift, seed=1)}),
    ]


# ----------------------------------------------------------------------------- matched utility
def test_close_utilities_give_a_verdict_with_its_test():
    rep = _report(_pair(100.0, 105.0))  # |log ratio| = 0.049 <= 0.1
    mu = rep["comparisons"].matched_utility
    assert mu.status == "pairs" and len(mu.pairs) == 1
    assert mu.pairs[0].log_ratio == pytest.approx(math.log(105 / 100))
    s = [x for x in rep["findings"]["sentences"] if x["group"] == "matched_utility"]
    assert len(s) == 1 and s[0]["verdict"] == "less"
    assert "At matched utility (holdout perplexity 100 vs 105" in s[0]["text"]
    assert s[0]["test"] == "paired AUC permutation" and s[0]["correction"] == "holm"
    # one family: the matched-epsilon comparison of the same two runs is the same test, one entry
    assert s[0]["family"] == 1
    # units differ (example vs user): the finding says so in one line
    assert "units differ" in s[0]["caveat"]
    assert rep["findings"]["headline"][0]["group"] == "matched_utility"
    assert rep["findings"]["matched_pairs"] == [
        ("par (epsilon = 8 per example, perplexity 100) vs fed (epsilon = 8 per user, perplexity 105): "
         "federated leaks less on MIA AUC")]


def test_utilities_apart_give_no_pair_and_no_verdict():
    """Ranges overlap (50-100 vs 70-140) but no two runs are within 0.1: no verdict, and the
    closest pair with its distance is named."""
    runs = _pair(50.0, 70.0)
    runs += [run("par2", "centralized", 2.0, mia=cell(0.6, 0.05), unit="example", ppl=100.0,
                 units={"mia_auc": auc_units(0.5, seed=2)}),
             run("fed2", "federated", 2.0, mia=cell(0.5, 0.05), unit="user", ppl=140.0,
                 units={"mia_auc": auc_units(0.0, seed=3)})]
    rep = _report(runs)
    mu = rep["comparisons"].matched_utility
    assert mu.status == "no pair" and mu.pairs == []
    assert mu.message.startswith("no run pair within |log perplexity ratio| <= 0.1; no verdict")
    # oracle: the closest pair by brute force over every centralized x federated pair
    best = min(itertools.product([50, 100], [70, 140]), key=lambda p: abs(math.log(p[0] / p[1])))
    assert mu.closest["log_ratio"] == pytest.approx(abs(math.log(best[0] / best[1])))
    assert not [s for s in rep["findings"]["sentences"] if s["group"] == "matched_utility"]
    # a wider stated tolerance pairs them
    wide = _report(runs, tolerance=0.4)["comparisons"].matched_utility
    assert wide.status == "pairs" and len(wide.pairs) == 2


def test_utilities_too_far_apart_say_so():
    """The issue's case: perplexity 68 centralized, 772 federated."""
    mu = _report(_pair(68.0, 772.0))["comparisons"].matched_utility
    assert mu.status == "disjoint" and mu.pairs == []
    assert "no verdict" in mu.message and "too far apart" in mu.message
    assert "centralized perplexity 68" in mu.message and "federated 772" in mu.message


def test_pairs_are_one_to_one_and_closest_first():
    runs = _pair(100.0, 103.0)
    runs.append(run("fed-b", "federated", 2.0, mia=cell(0.5, 0.05), unit="user", ppl=101.0,
                    units={"mia_auc": auc_units(0.0, seed=5)}))
    mu = matched_utility(runs, 0.1)
    assert [p.runs for p in mu.pairs] == [["par", "fed-b"]]


def test_pairs_at_equal_guarantees_come_before_closer_pairs_at_unequal_ones():
    """The quickstart's runs of 2026-12-05: centralized epsilon 8 (perplexity 166.2) lay closer to
    federated epsilon 2 (169.7) than to federated epsilon 8 (158.9), and the closest-first pairing
    compared 8 with 2 and 2 with 8, although both equal-epsilon pairs lay within the tolerance."""
    ppl = {("centralized", math.inf): 130.2, ("federated", math.inf): 127.6, ("centralized", 8.0): 166.2,
           ("centralized", 2.0): 173.6, ("federated", 8.0): 158.9, ("federated", 2.0): 169.7}
    runs = [run(f"{b[:3]}-{e}", b, e, mia=cell(0.5, 0.05), unit=None if math.isinf(e) else "user", ppl=p,
                units={"mia_auc": auc_units(0.0, seed=i)}) for i, ((b, e), p) in enumerate(ppl.items())]
    for r in runs:  # as the ledger recomputes them: a hair below the target
        r["privacy"]["epsilon"] -= 1e-5 * r["privacy"]["epsilon"] if r["privacy"]["target_epsilon"] else 0
    mu = matched_utility(runs, 0.1)
    assert sorted(p.runs for p in mu.pairs) == [["cen-2.0", "fed-2.0"], ["cen-8.0", "fed-8.0"],
                                                      ["cen-inf", "fed-inf"]]
    # an unequal pair is still made where no equal one is within the tolerance
    mu = matched_utility([r for r in runs if r["id"] not in ("cen-8.0", "fed-2.0")], 0.1)
    assert sorted(p.runs for p in mu.pairs) == [["cen-2.0", "fed-8.0"], ["cen-inf", "fed-inf"]]


@pytest.mark.parametrize("tol", [0.0, -1.0, math.inf, math.nan])
def test_bad_tolerance_is_one_line(tol):
    with pytest.raises(ValueError, match="utility tolerance .* must be a positive"):
        matched_utility(_pair(1.0, 1.0), tol)


def test_base_and_goldfish_runs_are_never_paired():
    runs = _pair(100.0, 300.0)
    runs.append(run("base", "centralized", math.inf, mia=cell(0.5, 0.05), ppl=302.0, role="public-base"))
    runs.append(run("par-gf", "centralized", math.inf, mia=cell(0.5, 0.05), ppl=299.0, goldfish=True))
    assert matched_utility(runs, 0.1).status == "disjoint"


# ----------------------------------------------------------------------------- frontier
def test_frontier_points_per_backend_with_the_base_as_origin():
    runs = [run(f"par-{e}", "centralized", e, mia=cell(v, 0.02), unit="example", ppl=p)
            for e, v, p in ((math.inf, 0.9, 50.0), (8.0, 0.7, 80.0), (2.0, 0.55, 150.0))]
    runs += [run(f"fed-{e}", "federated", e, mia=cell(v, 0.02), unit="user", ppl=p)
             for e, v, p in ((math.inf, 0.6, 90.0), (2.0, 0.5, 200.0))]
    runs.append(run("base", "centralized", math.inf, mia=cell(0.5, 0.02), ppl=400.0, role="public-base"))
    fr = comparisons(runs).frontier
    assert fr.origin.run == "base" and fr.origin.perplexity == 400.0
    m = fr.metrics["mia_auc"]
    assert [s.label for s in m.series] == ["centralized", "federated"]
    par = m.series[0].points
    assert [p.epsilon for p in par] == [2.0, 8.0, math.inf]  # strongest guarantee first
    assert [(p.perplexity, p.value) for p in par] == [(150.0, 0.55), (80.0, 0.7), (50.0, 0.9)]
    assert m.n_points == 5 and not m.all_zero
    # the base is the origin, not a grid point: no matched-epsilon or DP-effect group holds it
    comp = comparisons(runs)
    assert all("base" not in c.test.get("runs", []) for b in comp.effects + comp.matched
               for c in b.metrics.values() if c.test)


def test_all_zero_metric_is_flagged_and_not_drawn():
    from memaudit.reports.plots import all_figures, plot_notes

    runs = _pair(100.0, 300.0)
    for r in runs:
        r["leakage"]["extraction_exact"] = Cell.from_json(cell(0.0, 0.0, n=50))
        r["probes_summary"]["extraction_by_repeats"] = [
            {"prefix_len": 32, "repeats": k, "bucket": str(k), "value": 0.0} for k in (1, 2, 4)]
    rep = _report(runs)
    assert rep["comparisons"].frontier.metrics["extraction_exact"].all_zero
    figs = all_figures(rep)
    assert "extraction" not in figs
    titles = [ax.get_title() for ax in figs["frontier"].axes]
    assert "Exact extraction" not in titles and "Membership inference" in titles
    notes = plot_notes(rep)
    assert len(notes) == 1 and notes[0].startswith("None extracted, so not drawn: exact extraction (0 in")


# ----------------------------------------------------------------------------- group privacy
def test_effective_epsilon_per_bucket_from_the_ledger(tmp_path):
    """Example-level: the r copies as one event at the run's delta (the ledger's mixture PLD,
    checked against an independent PLD in tests/privacy/test_repeated_canary_epsilon.py; r x eps
    only for r = 1); user-level: eps (one owner), k x eps at the lemma's delta' (k owners). By hand
    from each run's ledger, whose epsilon agrees with dp_accounting's RDP accountant."""
    import dp_accounting

    from memaudit.privacy.ledger import PrivacyLedger

    write_run_dir(tmp_path / "par", "centralized", ppl=80.0, dp=(1.0, 400, 16, 50))
    write_run_dir(tmp_path / "fed", "federated", ppl=90.0, dp=(1.0, 51, 8, 30))
    write_run_dir(tmp_path / "base", "centralized", ppl=400.0, role="public-base")
    rep = build_report([tmp_path])
    validate_report(rep)
    by = {r["id"]: r for r in rep["runs"]}
    for rid, (z, n, b, t) in {"par": (1.0, 400, 16, 50), "fed": (1.0, 51, 8, 30)}.items():
        acc = dp_accounting.rdp.RdpAccountant()
        acc.compose(dp_accounting.PoissonSampledDpEvent(b / n, dp_accounting.GaussianDpEvent(z)), t)
        assert 0 < by[rid]["privacy"]["epsilon"] <= acc.get_epsilon(1e-5) + 1e-9
    hand = {  # (repetitions, owner kind) -> group size under example- and user-level DP
        (1, "user"): (1, 1), (4, "user"): (4, 1), (4, "spread"): (4, 4), (16, "user"): (16, 1)}
    for rid, col in (("par", 0), ("fed", 1)):
        eps = by[rid]["privacy"]["epsilon"]
        rows = {(g["repetitions"], g["owner_kind"]): g for g in by[rid]["group_privacy"]}
        assert set(rows) == set(hand)
        led = PrivacyLedger.load(tmp_path / rid / "privacy.json")
        for key, sizes in hand.items():
            k = sizes[col]
            if rid == "par" and k > 1:
                assert rows[key]["effective_epsilon"] == pytest.approx(led.group_epsilon(k), rel=1e-12)
                assert rows[key]["effective_epsilon"] > k * eps and rows[key]["effective_delta"] == 1e-5
                continue
            assert rows[key]["effective_epsilon"] == pytest.approx(sizes[col] * eps, rel=1e-12)
            assert rows[key]["effective_delta"] == pytest.approx(min(1.0, k * math.exp((k - 1) * eps) * 1e-5))
    assert all(g["effective_epsilon"] == 0.0 for g in by["base"]["group_privacy"])
    assert by["base"]["privacy"]["epsilon"] == 0.0 and by["base"]["role"] == "public-base"
    # shown in the report, beside the bucket's exposure; no secret reaches it
    from memaudit.reports.write import write_report

    paths = write_report(rep, tmp_path / "report")
    md, html = paths["md"].read_text(), paths["html"].read_text()
    par16 = PrivacyLedger.load(tmp_path / "par" / "privacy.json").group_epsilon(16)
    assert f"effective epsilon {par16:.4g}" in md and f"effective epsilon {par16:.4g}" in html
    assert "Group privacy" in md and "0000" not in md.replace("0.000", "")


# ----------------------------------------------------------------------------- first screen
def test_no_difference_comparisons_collapse_to_one_line_each():
    runs = []
    for i in range(8):
        runs += [run(f"par-{i}", "centralized", float(i + 1), mia=cell(0.5, 0.05), unit="example",
                     units={"mia_auc": auc_units(0.3, seed=10 * i)}),
                 run(f"fed-{i}", "federated", float(i + 1), mia=cell(0.5, 0.05), unit="user",
                     units={"mia_auc": auc_units(0.3, seed=10 * i + 1)})]
    rep = _report(runs)
    nd = rep["findings"]["no_difference"]
    assert len(nd) == 8 and rep["findings"]["headline"] == []
    for line in nd:
        assert "\n" not in line and len(line) < 200 and "no difference shown" in line
        assert "Holm p =" in line and "n = 200/200 documents" in line
    from memaudit.reports.render import render_markdown

    md = render_markdown(rep)
    assert "No comparison passes the statistical rules" in md
    assert md.count("\n- At epsilon = ") == 16  # 8 one-liners + 8 full sentences further down


def test_headline_holds_at_most_six_passing_findings_with_caveats():
    runs = []
    for i in range(8):
        runs += [run(f"par-{i}", "centralized", float(i + 1), mia=cell(0.8, 0.05), unit="example",
                     units={"mia_auc": auc_units(2.0, seed=10 * i)}),
                 run(f"fed-{i}", "federated", float(i + 1), mia=cell(0.5, 0.05), unit="user",
                     units={"mia_auc": auc_units(0.0, seed=10 * i + 1)})]
    rep = _report(runs)
    validate_report(rep)
    head = rep["findings"]["headline"]
    assert len(head) == 6 and all(h["verdict"] == "less" for h in head)
    assert all(h["caveat"].startswith("units differ") for h in head)
    assert all("Holm-adjusted p" in h["evidence"] for h in head)


# ----------------------------------------------------------------------------- legible plots
def _overlaps(boxes):
    return [(a, b) for a, b in itertools.combinations(boxes, 2) if a[1].overlaps(b[1])]


@pytest.mark.parametrize("ppls", [(60.0, 800.0), (95.0, 105.0), (2.0, 3.9), (5.0, 50000.0)])
def test_log_axis_tick_labels_do_not_overlap(ppls):
    """Every labelled tick of every axis of every plot, as matplotlib draws it: no two labels
    overlap, and minor ticks carry no label (the issue's "2x10^0 3x10^0 4x10^0 6x10^0")."""
    from memaudit.reports.plots import all_figures

    lo, hi = ppls
    runs = [run(f"par-{e}", "centralized", e, mia=cell(0.6, 0.05), unit="example", ppl=p)
            for e, p in ((math.inf, lo), (8.0, math.sqrt(lo * hi)), (2.0, hi))]
    runs += [run(f"fed-{e}", "federated", e, mia=cell(0.55, 0.05), unit="user", ppl=p * 1.3)
             for e, p in ((math.inf, lo), (2.0, hi))]
    figs = all_figures(_report(runs))
    assert {"frontier", "utility", "membership_roc"} <= set(figs)
    for name, fig in figs.items():
        fig.canvas.draw()
        renderer = fig.canvas.get_renderer()
        for ax in fig.axes:
            for axis, lim in ((ax.xaxis, ax.get_xlim()), (ax.yaxis, ax.get_ylim())):
                assert all(not t.label1.get_text() for t in axis.get_minor_ticks()), (name, axis)
                lo_, hi_ = sorted(lim)
                boxes = [(t.label1.get_text(), t.label1.get_window_extent(renderer))
                         for t in axis.get_major_ticks()
                         if t.label1.get_visible() and t.label1.get_text() and lo_ <= t.get_loc() <= hi_]
                assert not _overlaps(boxes), (name, [b[0] for b in boxes])
                assert not any("times" in b[0] or "^" in b[0] for b in boxes), (name, [b[0] for b in boxes])
        for ax in fig.axes:
            assert ax.get_xlabel() and ax.get_ylabel(), (name, ax.get_title())  # units on every axis
            assert len(ax.get_legend_handles_labels()[0]) <= 7  # <= 6 series (+ chance/base)


def test_nice_log_ticks():
    from memaudit.reports.plots import nice_log_ticks

    assert nice_log_ticks(60, 800) == [100.0, 200.0, 500.0]
    assert nice_log_ticks(2, 3.9) == [2.0, 3.0]
    assert len(nice_log_ticks(1e-6, 1e6)) <= 6
    # narrower than one step of the finest grid: evenly spaced ticks inside the range (the
    # quickstart's frontier, 111-202 once padded, showed one label: its rounded low end, 110, lay
    # outside the axis)
    assert nice_log_ticks(95, 105) == [95.0, 100.0, 105.0]
    assert nice_log_ticks(111, 202) == [125.0, 150.0, 175.0, 200.0]
    for lo, hi in ((111, 202), (0.31, 0.42), (1001, 1009), (95, 105)):
        t = nice_log_ticks(lo, hi)
        assert 3 <= len(t) <= 6 and all(lo <= x <= hi for x in t), (lo, hi, t)
    with pytest.raises(ValueError, match="positive"):
        nice_log_ticks(0, 1)


def test_many_runs_become_small_multiples():
    from memaudit.reports.plots import MAX_SERIES, all_figures

    runs = []
    for i in range(9):
        r = run(f"par-{i}", "centralized", float(i + 1), mia=cell(0.6, 0.05), unit="example", ppl=50.0 + i)
        r["probes_summary"]["exposure_by_repetition"] = {
            "user": [{"repetitions": k, "value": 1.0 + k / 8, "ci_low": None, "ci_high": None} for k in (1, 4, 16)]}
        runs.append(r)
    figs = all_figures(_report(runs))
    for name in ("exposure", "membership_roc"):
        axes = [a for a in figs[name].axes if a.get_visible()]
        assert len(axes) >= 2, name
        assert all(len(a.get_legend_handles_labels()[0]) <= MAX_SERIES for a in axes), name


def test_report_command_takes_a_tolerance_and_refuses_a_bad_one(tmp_path, capsys):
    """`memaudit report --utility-tolerance`: a wider tolerance pairs runs the default does not;
    a non-positive one is one line and exit 2, before anything is written."""
    import json

    from memaudit.cli import main

    write_run_dir(tmp_path / "runs" / "par", "centralized", ppl=100.0, mia_shift=1.0)
    write_run_dir(tmp_path / "runs" / "fed", "federated", ppl=130.0, mia_shift=0.2)
    assert main(["report", str(tmp_path / "runs"), "--out", str(tmp_path / "a")]) == 0
    mu = json.loads((tmp_path / "a" / "report.json").read_text())["comparisons"]["matched_utility"]
    assert mu["status"] == "disjoint"
    assert main(["report", str(tmp_path / "runs"), "--out", str(tmp_path / "b"), "--utility-tolerance", "0.3"]) == 0
    mu = json.loads((tmp_path / "b" / "report.json").read_text())["comparisons"]["matched_utility"]
    assert mu["status"] == "pairs" and mu["tolerance"] == 0.3
    capsys.readouterr()
    assert main(["report", str(tmp_path / "runs"), "--out", str(tmp_path / "c"), "--utility-tolerance", "0"]) == 2
    err = capsys.readouterr().err
    assert "utility tolerance 0" in err and err.count("\n") == 1
    assert not (tmp_path / "c").exists()


def test_epsilon_labels_of_crowded_points_do_not_overlap():
    """Labels of nearby points go to the first free side; with no free side a label is left out
    and counted (the figure's title says so), never drawn over another."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from memaudit.reports.plots import _place_labels

    fig, ax = plt.subplots(figsize=(4, 3))
    ax.set_xlim(0, 10)
    ax.set_ylim(0, 10)
    crowd = [(5.0, 5.0, f"e={i}", None) for i in range(9)]  # nine labels on one spot
    skipped = _place_labels(ax, crowd)
    fig.canvas.draw()
    boxes = [t.get_window_extent() for t in ax.texts]
    assert len(boxes) + skipped == 9 and len(boxes) >= 4 and skipped >= 3  # the four corners at least
    for i, a in enumerate(boxes):
        for b in boxes[i + 1:]:
            assert not a.overlaps(b), (a, b)
    plt.close(fig)
