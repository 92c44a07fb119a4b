import math

import pytest

from memaudit.reports import findings
from memaudit.reports.build import SCHEMA, comparisons
from tests.reports._fixtures import cell, run


def _report(fed_mia, par_mia):
    runs = [
        run("par-eps4", "parallel", 4.0, mia=par_mia, unit="example"),
        run("fed-eps4", "federated", 4.0, mia=fed_mia, unit="user"),
    ]
    rep = {"schema": SCHEMA, "memaudit_version": "t", "runs": runs, "comparisons": comparisons(runs)}
    rep["findings"] = findings.generate(rep)
    return rep


@pytest.mark.parametrize(
    "fed, par, verdict, phrase",
    [
        (cell(0.52, 0.02), cell(0.80, 0.03), "less", "federated leaks less than centralized"),
        (cell(0.90, 0.02), cell(0.60, 0.03), "more", "federated leaks more than centralized"),
        (cell(0.62, 0.05), cell(0.60, 0.05), "same", "no difference shown between federated and centralized"),
    ],
)
def test_backend_sentence_follows_the_numbers(fed, par, verdict, phrase):
    rep = _report(fed, par)
    sents = [s for s in rep["findings"]["sentences"] if s["group"] == "backend" and "mia_auc" in s["metrics"]]
    assert len(sents) == 1
    assert sents[0]["verdict"] == verdict
    assert phrase in sents[0]["text"]
    assert "epsilon = 4" in sents[0]["text"]
    if verdict == "same":
        assert "within the confidence intervals" in sents[0]["text"]
        assert "membership-inference AUC" in sents[0]["text"]


def test_compare_touching_intervals_is_same():
    assert findings.compare(cell(0.5, 0.1), cell(0.7, 0.1)) == "same"
    assert findings.compare(cell(0.5, 0.1), cell(0.71, 0.1)) == "less"
    assert findings.compare(None, cell(0.7, 0.1)) == "n/a"


def test_dp_and_goldfish_effects():
    runs = [
        run("par-inf", "parallel", math.inf, mia=cell(0.9, 0.02)),
        run("par-inf-gf", "parallel", math.inf, mia=cell(0.6, 0.02), goldfish=True),
        run("par-eps1", "parallel", 1.0, mia=cell(0.5, 0.02), unit="example"),
    ]
    rep = {"schema": SCHEMA, "memaudit_version": "t", "runs": runs, "comparisons": comparisons(runs)}
    sents = findings.generate(rep)["sentences"]
    texts = " | ".join(s["text"] for s in sents)
    assert "with Goldfish loss leaks less than without" in texts
    assert "with DP at epsilon = 1 leaks less than without" in texts


def test_caveats_mention_units_and_audit_ceiling():
    runs = [
        run("par-eps4", "parallel", 4.0, mia=cell(0.5, 0.02), unit="example"),
        run("fed-eps4", "federated", 4.0, mia=cell(0.5, 0.02), unit="user"),
    ]
    runs[0]["privacy"]["per_user"] = {"max_sequences_per_user": 12, "vacuous": True}
    runs[1]["leakage"]["audit_epsilon"] = {"value": 0.4, "ci_low": None, "ci_high": None, "ceiling": 3.49, "guesses": 100}
    rep = {"runs": runs}
    cav = " ".join(findings.caveats(rep))
    assert "vacuous" in cav and "12 sequences" in cav
    assert "3.49" in cav
    assert "one training sequence" in cav
