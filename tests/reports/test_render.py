import json

import pytest

from memaudit.reports import findings
from memaudit.reports.build import SCHEMA, comparisons
from memaudit.reports.schema import validate_report
from memaudit.reports.write import load_report, rerender, write_report
from tests.reports._fixtures import auc_units, cell, run

XSS = ['<script>alert(1)</script>', '"><img src=x onerror=alert(1)>']


def make_report():
    runs = [
        run("par-eps4", "centralized", 4.0, mia=cell(0.8, 0.02), unit="example", samples=XSS,
            units={"mia_auc": auc_units(1.5)}),
        run("fed-eps4", "federated", 4.0, mia=cell(0.55, 0.02), unit="user",
            units={"mia_auc": auc_units(0.2, seed=1)}),
        run("par-inf", "centralized", float("inf"), mia=cell(0.95, 0.02), units={"mia_auc": auc_units(2.5, seed=2)}),
    ]
    rep = {"schema": SCHEMA, "memaudit_version": "t", "runs": runs, "comparisons": comparisons(runs)}
    rep["findings"] = findings.generate(rep)
    for r in runs:
        r.pop("units")
    return rep


def test_written_report_validates_and_escapes(tmp_path):
    paths = write_report(make_report(), tmp_path)
    raw = json.loads(paths["json"].read_text())
    validate_report(raw)
    html = paths["html"].read_text()
    md = paths["md"].read_text()
    for bad in XSS:
        assert bad not in html and bad not in md
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in html
    assert "<svg" in html and "http://" not in html.replace("http://www.w3.org", "")
    assert "federated leaks less than centralized" in md


def test_rerender_from_json_alone(tmp_path):
    paths = write_report(make_report(), tmp_path / "a")
    html1 = paths["html"].read_text()
    other = rerender(paths["json"], tmp_path / "b")
    assert other["html"].read_text() == html1
    assert other["md"].read_text() == paths["md"].read_text()
    assert load_report(paths["json"])["runs"][2]["privacy"]["epsilon"] == float("inf")


def test_schema_rejects_broken_report():
    rep = json.loads(json.dumps(make_report(), default=str))
    del rep["runs"][0]["leakage"]
    import pytest

    with pytest.raises(ValueError, match="schema"):
        validate_report(rep)


@pytest.mark.parametrize("reproducible", [False, True])
def test_privacy_description_states_both_views_from_the_ledger(tmp_path, reproducible):
    """The report's privacy line comes from the ledger's events: the ε against the released
    model with its adjacency and what it assumes hidden, the view from the server (none under
    central DP), and a void mark when the keys came from train.seed."""
    import json

    from memaudit.privacy.ledger import PrivacyLedger
    from memaudit.privacy.mechanisms import SampledGaussian
    from memaudit.reports.build import _ledger_epsilon, _server_view
    from memaudit.rundir import RunDir

    led = PrivacyLedger(unit="user", delta=1e-5, reproducible_randomness=reproducible)
    mech = SampledGaussian(name="DP-FedAvg", unit="user", noise_multiplier=1.0, population=100, expected=10)
    for _ in range(5):
        led.record_mechanism(mech)
    (tmp_path / "privacy.json").write_text(json.dumps(led.to_json()))
    priv = _ledger_epsilon(RunDir(tmp_path))
    assert 0 < priv.epsilon < float("inf") and priv.adjacency == ["add/remove"]
    assert priv.assumes_hidden  # amplification assumes the sample is hidden
    assert _server_view(priv).startswith("no DP guarantee")
    assert priv.void_if_seed_known is reproducible


def test_report_without_utilities_renders_without_a_frontier(tmp_path):
    """Runs that recorded no holdout perplexity (e.g. a foreign Hugging Face model): no frontier
    plot, a line saying why, and no matched-utility verdict."""
    runs = [
        run("par-inf", "centralized", float("inf"), mia=cell(0.9, 0.02), units={"mia_auc": auc_units(2.0)}),
        run("fed-inf", "federated", float("inf"), mia=cell(0.6, 0.02), units={"mia_auc": auc_units(0.3, seed=1)}),
    ]
    for r in runs:
        r["utility"]["holdout_perplexity"] = None
    rep = {"schema": SCHEMA, "memaudit_version": "t", "runs": runs, "comparisons": comparisons(runs)}
    rep["findings"] = findings.generate(rep)
    paths = write_report(rep, tmp_path)
    html = paths["html"].read_text()
    assert "No frontier" in html and 'data-plot="frontier"' not in html
    assert rep["comparisons"].matched_utility.status == "no runs"
    assert "no matched-utility comparison" in paths["md"].read_text()


def test_auc_cell_names_both_classes():
    """An attack's AUC cell says how many members and non-members it rests on, so it agrees with
    the paired test's n (their sum) instead of showing only the smaller class."""
    from memaudit.probes.stats import attack_summary
    from memaudit.reports.cells import PAGE, README, format_cell
    from memaudit.reports.probes_adapter import summarize_probes

    rng = __import__("numpy").random.default_rng(0)
    summ = attack_summary(rng.normal(1, 1, 40), rng.normal(0, 1, 12), unit="documents")
    probes = {"schema": 1, "probes": {"membership": {"status": "ok", "summary": {"loss": summ.to_json()}, "scores": []}}}
    c = summarize_probes(probes)["leakage"]["mia_auc"]
    assert (c.n, c.n_pos, c.n_neg) == (12, 40, 12)
    for text in (format_cell(c, PAGE), format_cell(c, README)):
        assert "n = 40 members + 12 non-members documents" in text
