"""The report on outside models as a new user gets it (issue 68, item 6): a verdict per model
that a release manager acts on, the shift warning first, a log-log ROC per model, pairs compared
on the strongest attack and only on the same documents, no path of the user's machine."""

from __future__ import annotations

import json
import re

import pytest

from memaudit.reports.build import build_report
from memaudit.reports.write import write_report
from tests.reports._outside import HOME, four_models


@pytest.fixture(scope="module")
def outside(tmp_path_factory):
    """The four models' report, written once: (report.json as built, html, md, report.json text)."""
    root = tmp_path_factory.mktemp("outside")
    rep = build_report(four_models(root / "in"))
    paths = write_report(rep, root / "report")
    return rep, paths["html"].read_text(), paths["md"].read_text(), paths["json"].read_text(), paths


def _targets(rep):
    return {t["id"]: t for t in rep["targets"]}


def test_header_counts_probed_models(outside):
    _rep, html, md, _js, _p = outside
    for page in (html, md):
        assert "4 probed models" in page
        assert "0 run(s)" not in page


def test_no_runs_sections_without_runs(outside):
    """A report of outside models only has no empty runs table."""
    _rep, html, md, _js, _p = outside
    assert "<h2>Runs</h2>" not in html and "## Runs" not in md
    assert "Per-run details" not in html and "Per-run details" not in md


def test_shift_warning_leads_the_page(outside):
    """The shift check fired for the two GPT-2 folders: the warning comes before anything else,
    with its AUC and what it means, in HTML and Markdown."""
    _rep, html, md, _js, _p = outside
    body = html.split("<body>", 1)[1]
    assert body.lstrip().startswith('<div id="shift-warning"')
    warning = body.split("</div>", 1)[0]
    assert "not IID" in warning and "AUC 0.88" in warning and "suspect" in warning
    assert "gpt2-support-ft, gpt2-support-ft-again" in warning and "pythia-ft" not in warning
    assert md.startswith("> **WARNING: the split is not IID")
    assert md.index("WARNING") < md.index("# memaudit report")


def test_verdict_states_the_strongest_attack_at_one_percent_fpr(outside):
    """Per model one verdict: the attack with the highest TPR at 1% FPR, its rate, interval and
    n; report.json, HTML and Markdown say the same sentence."""
    from memaudit.reports.verdict import Level

    rep, html, md, js, _p = outside
    t = _targets(rep)
    best = max((a for a in t["pythia-ft"]["attacks"]), key=lambda a: a["tpr_at_fpr"]["0.01"]["value"])
    v = t["pythia-ft"]["verdict"]
    assert v["attack"] == best["attack"] == "min_k" and v["level"] == Level.LEAKS
    assert v["tpr"]["value"] == best["tpr_at_fpr"]["0.01"]["value"]
    rate = f"{100 * v['tpr']['value']:.2g}%"
    assert f"picks out {rate} [" in v["evidence"] and "at 1% false positives" in v["evidence"]
    assert "n = 1,000 members, 1,000 non-members" in v["evidence"]
    assert "strongest of 5 attacks" in v["evidence"]
    assert v["sentence"].startswith("pythia-ft: leaks membership.")
    assert v["evidence"] in html.replace("&#39;", "'") and v["evidence"] in md
    assert json.loads(js)["targets"][1]["verdict"]["sentence"] == v["sentence"]


def test_verdict_says_n_too_small_below_ten_over_fpr_negatives():
    """200 non-members cannot support a rate at 1% FPR (it needs 1,000): the verdict says
    "n too small" and falls back on the strongest AUC, never printing the rate."""
    from memaudit.reports.verdict import Level, release_verdict

    auc = {"value": 0.7, "ci_low": 0.65, "ci_high": 0.75, "n": 200, "unit": "documents", "n_pos": 200, "n_neg": 200}
    rate = {"value": 0.2, "ci_low": 0.1, "ci_high": 0.3, "n": 200, "unit": "documents"}  # an old probes.json's
    entry = {"id": "m", "privacy": {"epsilon": "unknown"}, "shift": None,
             "attacks": [{"attack": "loss", "auc": auc, "tpr_at_fpr": {"0.01": rate}},
                         {"attack": "zlib", "auc": {**auc, "value": 0.6, "ci_low": 0.55}, "tpr_at_fpr": {}}]}
    v = release_verdict(entry)
    assert v.attack == "loss" and v.tpr is not None and v.level is Level.LEAKS
    assert "n too small (needs >= 1,000 non-members)" in v.evidence and "20%" not in v.sentence
    assert v.headline == "leaks membership on average"
    assert "at least 1,000 non-members" in release_verdict(
        {**entry, "attacks": [{"attack": "loss", "auc": {**auc, "ci_low": 0.45}, "tpr_at_fpr": {}}]}).next_step


def test_next_step_names_a_dp_target_whose_bound_rules_out_the_attack(outside):
    from memaudit.reports.verdict import FPR, Level, dp_cap, proposed_epsilon

    rep, *_ = outside
    v = _targets(rep)["pythia-ft"]["verdict"]
    eps = proposed_epsilon(v["tpr"]["ci_low"])
    assert dp_cap(eps, FPR) < v["tpr"]["ci_low"]  # the proposed ε rules out what was seen
    assert f"DP at ε = {eps:g} per user" in v["next_step"] and f"privacy.target_epsilon: {eps:g}" in v["next_step"]
    assert _targets(rep)["qwen-notes-ft"]["verdict"]["level"] == Level.NO_SIGNAL
    shifted = _targets(rep)["gpt2-support-ft"]["verdict"]
    assert shifted["level"] == Level.SUSPECT and "IID split" in shifted["next_step"]


def test_model_with_a_ledger_states_its_bound():
    from memaudit.reports.verdict import release_verdict

    auc = {"value": 0.52, "ci_low": 0.5, "ci_high": 0.54, "n": 2000, "n_pos": 2000, "n_neg": 2000}
    v = release_verdict({"id": "dp", "privacy": {"epsilon": 1.0}, "attacks": [
        {"attack": "loss", "auc": auc, "tpr_at_fpr": {"0.01": {"value": 0.011, "ci_low": 0.006, "ci_high": 0.02}}}]})
    assert "ε = 1 (ledger)" in v.next_step and "2.7%" in v.next_step


def test_one_log_log_roc_per_model(outside):
    """Each model's card holds its ROC (the verdict's attack) on log-log axes."""
    from memaudit.reports.plots import target_roc_figure

    rep, html, _md, _js, _p = outside
    for i, t in enumerate(rep["targets"], 1):
        assert t["roc"]["attack"] == t["verdict"]["attack"]
        fig = target_roc_figure(t)
        ax = fig.axes[0]
        assert ax.get_xscale() == "log" and ax.get_yscale() == "log"
        card = html.split(f'id="verdict-{i}"', 1)[1].split('class="card', 1)[0]
        assert f'data-plot="roc:{t["id"]}"' in card and "<svg" in card


def test_pairs_compare_the_strongest_attack_on_the_same_documents_only(outside):
    """Before: every pair compared on the loss attack, even on different document sets, and a
    model against its own weights ("could have seen 1.38e-07 AUC points"). Now: membership on the
    strongest attack, pairs on different documents or the same weights skipped, saying why."""
    rep, html, md, _js, _p = outside
    pairs = {tuple(p.targets): p for p in rep["comparisons"].targets}
    tested = pairs[("pythia-ft", "qwen-notes-ft")]
    assert list(tested.metrics) == ["mia_strongest"]
    cell = tested.metrics["mia_strongest"]
    assert cell.attack == "min_k" and cell.test.paired and cell.test.n_a == 2000
    assert "mia_auc" not in tested.metrics
    same = pairs[("gpt2-support-ft", "gpt2-support-ft-again")]
    assert same.metrics == {} and "the same model" in same.skipped
    other = pairs[("gpt2-support-ft", "pythia-ft")]
    assert other.metrics == {} and "not probed on the same documents" in other.skipped
    assert sum(1 for p in pairs.values() if p.metrics) == 1
    assert rep["findings"]["tests"] == 1
    assert "e-0" not in md and "the same model" in md and "not probed on the same documents" in html
    assert "MIA AUC (strongest attack): min" in html


def test_no_path_of_the_users_machine(outside):
    """Folders appear by their names, hub ids as they are; never /home/alice/...."""
    rep, html, md, js, _p = outside
    for page in (html, md, js):
        assert HOME not in page and "/home/" not in page
    t = _targets(rep)
    assert t["gpt2-support-ft"]["base"] == "gpt2" and t["pythia-ft"]["base"] == "EleutherAI/pythia-160m"
    assert t["pythia-ft"]["model"] == "EleutherAI/pythia-160m-ft"
    assert "path" not in t["qwen-notes-ft"]


def test_pages_escape_model_names(tmp_path):
    """A folder name is the user's text: escaped in the verdict cards and the Markdown list."""
    from tests.reports._outside import probes_doc, write_probes

    name = "m<img src=x onerror=alert(1)>"
    write_probes(tmp_path / "in" / name, probes_doc(model="m", source="folder", base=None, n_members=30,
                                                    n_nonmembers=30, strength={"loss": 1.0}))
    paths = write_report(build_report([tmp_path / "in"]), tmp_path / "r")
    html, md = paths["html"].read_text(), paths["md"].read_text()
    assert "<img" not in html and "<img" not in md
    assert re.search(r"m&lt;img src=x onerror=alert\(1\)&gt;: (leaks|no membership)", html)


def test_first_screen_in_chromium_fits_and_holds_the_verdicts(outside, tmp_path):
    """Chromium at 1280 x 800: nothing is wider than the window (before: a 1,556 px table with
    the warning in its last column, off-screen), the shift warning sits above everything, and
    every model's verdict and ROC are within the first 800 px. `MEMAUDIT_WRITE_GOLDEN=1` saves
    the first screen as docs/images/outside-report.png (shown in README.md, "Audit your own model")."""
    import os
    from pathlib import Path

    from PIL import Image

    from memaudit.io import atomic_write_bytes
    from tests.reports.browser import FIRST_SCREEN, chromium_path, page_layout

    assert chromium_path(), "Chromium is missing: scripts/install_browser.sh installs it"
    rep, _html, _md, _js, paths = outside
    n = len(rep["targets"])
    cards = [f"#verdict-{i}" for i in range(1, n + 1)] + [f"#plot-roc-{i}" for i in range(1, n + 1)]
    shot = tmp_path / "first-screen.png"
    seen = page_layout(paths["html"], ["#shift-warning", "h1", *cards], first_screen=shot)
    assert seen["page_errors"] == []
    assert seen["too_wide"] == [] and seen["scroll_width"] <= FIRST_SCREEN["width"], seen["too_wide"][:5]
    at = seen["at"]
    assert 0 <= at["#shift-warning"]["top"] < at["h1"]["top"]
    assert "AUC 0.88" in at["#shift-warning"]["text"]
    for sel in cards:
        assert at[sel] is not None and at[sel]["bottom"] <= FIRST_SCREEN["height"], (sel, at[sel])
    texts = " ".join(at[f"#verdict-{i}"]["text"] for i in range(1, n + 1))
    for t in rep["targets"]:
        assert t["verdict"]["headline"] in texts
    assert "1% false positives" in texts and "n too small" in texts
    picture = Path(__file__).parents[2] / "docs" / "images" / "outside-report.png"
    if os.environ.get("MEMAUDIT_WRITE_GOLDEN") == "1":  # 64 colours: a small PNG for the docs
        small = tmp_path / "small.png"
        Image.open(shot).convert("RGB").quantize(colors=64).save(small, optimize=True)
        atomic_write_bytes(picture, small.read_bytes())
    assert Image.open(picture).size == (FIRST_SCREEN["width"], FIRST_SCREEN["height"])


def test_runs_beside_probed_models_keep_their_sections(tmp_path):
    """A memaudit run and a probed model in one report: the header counts both, the run's
    sections stay, and the model's verdict comes first."""
    from tests.reports._fixtures import write_run_dir
    from tests.reports._outside import probes_doc, write_probes

    write_run_dir(tmp_path / "in" / "run-a", "centralized", ppl=50, mia_shift=1.0)
    write_probes(tmp_path / "in" / "outside", probes_doc(model="m", source="folder", base=None, n_members=40,
                                                         n_nonmembers=40, strength={"loss": 1.0}))
    paths = write_report(build_report([tmp_path / "in"]), tmp_path / "r")
    html, md = paths["html"].read_text(), paths["md"].read_text()
    assert "1 probed model · 1 run" in html and "1 probed model · 1 run" in md
    assert "<h2>Runs</h2>" in html and "## Runs" in md and "<h3>run-a</h3>" in html
    assert html.index('id="verdict-1"') < html.index("<h2>Runs</h2>")
    assert 'id="shift-warning"' not in html


def test_the_same_scores_without_weights_are_one_model(tmp_path):
    """An older probes.json names no weights: the same model probed twice shows as the same
    score on every document, and is not tested against itself."""
    from tests.reports._outside import probes_doc, write_probes

    doc = probes_doc(model="m", source="folder", base=None, n_members=30, n_nonmembers=30,
                     strength={"loss": 1.0})
    doc["target"].pop("weights_sha256")
    write_probes(tmp_path / "one", doc)
    write_probes(tmp_path / "two", doc)
    rep = build_report([tmp_path / "one", tmp_path / "two"])
    (pair,) = rep["comparisons"].targets
    assert pair.metrics == {} and "the same model" in pair.skipped
    assert rep["findings"]["no_difference"] == []


def test_the_terminal_says_the_pages_verdict(tmp_path):
    """`memaudit report` prints each model's verdict as the page states it (the attack chosen by
    its rate at 1% FPR), not a second choice of attack by AUC."""
    from typer.testing import CliRunner

    from memaudit.cli import app

    folders = four_models(tmp_path / "in")
    res = CliRunner().invoke(app, ["report", *map(str, folders), "--out", str(tmp_path / "rep")])
    assert res.exit_code == 0, res.output
    rep = json.loads((tmp_path / "rep" / "report.json").read_text())
    said = " ".join(res.output.split())
    for t in rep["targets"]:
        assert " ".join(t["verdict"]["sentence"].split()) in said, t["id"]
    assert str(HOME) not in res.output
