"""The report's scale section (memaudit/reports/scale.py) from constructed run directories.

Two sizes x Goldfish off/on; probes.json written with the probes' own pure result functions
(exposure_result, discoverable_result, goldfish_result) from chosen per-unit outcomes, so the
section's cells, tests and Holm correction can be checked against scipy and a hand count.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from memaudit.probes.exposure import exposure_result
from memaudit.probes.extraction import discoverable_result
from memaudit.probes.goldfish import goldfish_result
from memaudit.probes.targets import Doc
from memaudit.reports.build import build_report
from memaudit.reports.write import write_report

PARAMS = {"tiny": 1_787_008, "small": 9_000_000}
# member documents: 20 seen once, 4 twice (too few for a test), 20 seen eight times
DOCS = ([Doc(id=f"a{i}", text="", repeats=1) for i in range(20)]
        + [Doc(id=f"b{i}", text="", repeats=2) for i in range(4)]
        + [Doc(id=f"c{i}", text="", repeats=8) for i in range(20)])


def probes_doc(memorized: int, seed: int) -> dict:
    """probes.json of a run that extracts the first `memorized` of the 8x documents exactly."""
    rng = np.random.default_rng(seed)
    exact = {d.id: d.repeats == 8 and int(d.id[1:]) < memorized for d in DOCS}
    rouge = {d.id: 1.0 if exact[d.id] else float(rng.uniform(0.05, 0.3)) for d in DOCS}
    disc = discoverable_result({8: [(d, [1] if exact[d.id] else [0], [1]) for d in DOCS]},
                               n_docs=len(DOCS), n_boot=100)
    rows = [{"id": d.id, "kind": "doc", "repeats": d.repeats, "prompt_tokens": 40,
             "truncated": False, "exact": exact[d.id], "rouge_l": rouge[d.id]} for d in DOCS]
    gold = goldfish_result(rows, n_units={"doc": len(DOCS), "canary": 0}, m=50, min_prompt=32,
                           n_boot=100)
    # 2 canaries at 1 and at 4 repetitions, 50 references, a space of 1000 candidates
    items = ([(f"k{i}", "inserted", (1, 1, 4, 4)[i], "user") for i in range(4)]
             + [(f"r{i}", "reference", 0, None) for i in range(50)])
    exp = exposure_result(rng.normal(0, 1, len(items)), rng.normal(0, 1, 1000), items,
                          space_size=1000, method="enumeration", n_boot=100)
    return {"schema": 1, "target": {}, "settings": {}, "probes": {
        "exposure": exp, "extraction": {"summary": {"discoverable": disc["summary"]},
                                        "scores": {"discoverable": disc["scores"]}},
        "goldfish_extraction": gold}}


def make_run(root, name: str, preset: str, goldfish: bool, memorized: int, seed: int = 0):
    rd = root / name
    rd.mkdir()
    manifest = {"status": "complete", "backend": "parallel", "data_fingerprint": "f" * 16,
                "config": {"model": {"preset": preset}, "train": {"seed": 0, "goldfish":
                                                                  {"enabled": goldfish}}},
                "result": {"parameters": PARAMS[preset], "steps": 10, "final_holdout_loss": 3.0,
                           "final_holdout_perplexity": 20.0}}
    (rd / "run.json").write_text(json.dumps(manifest))
    (rd / "probes.json").write_text(json.dumps(probes_doc(memorized, seed)))
    return rd


@pytest.fixture(scope="module")
def study(tmp_path_factory):
    root = tmp_path_factory.mktemp("scale")
    # the small model extracts 18 of the 20 documents seen 8 times, the tiny one 2; Goldfish
    # brings the small model down to 2, and leaves the tiny one at 2 (no signal: no finding)
    runs = [make_run(root, "tiny", "tiny", False, 2), make_run(root, "small", "small", False, 18),
            make_run(root, "tiny-gf", "tiny", True, 2, seed=1),
            make_run(root, "small-gf", "small", True, 2, seed=2)]
    report = build_report(runs)
    return report, write_report(report, root / "report")


def _test(sec, comparison, a, b, metric, bucket):
    [t] = [t for t in sec.tests if (t.comparison, t.a, t.b, t.metric, t.bucket) == (comparison, a, b, metric, bucket)]
    return t


def test_section_tables_cells_and_n_too_small(study):
    report, _ = study
    sec = report["scale"]
    assert sec.sizes == ["tiny (1.79M)", "small (9M)"]
    tables = {t.metric: t for t in sec.tables}
    assert set(tables) == {"exposure", "extraction_exact", "goldfish_exact", "goldfish_rouge_l"}
    ge = tables["goldfish_exact"]
    assert ge.buckets == ["all", "1", "2-3", "8-15"]
    assert [(r.size, r.goldfish) for r in ge.rows] == [
        ("tiny (1.79M)", False), ("tiny (1.79M)", True), ("small (9M)", False), ("small (9M)", True)]
    small = ge.rows[2].cells
    assert small["8-15"].value == pytest.approx(18 / 20) and small["8-15"].n == 20
    assert small["all"].value == pytest.approx(18 / 44)
    assert small["2-3"].n == 4 and small["2-3"].note == "n too small"
    assert small["2-3"].ci_low is None
    assert tables["exposure"].buckets == ["1", "4"]
    assert tables["exposure"].rows[0].cells["4"].note == "n too small"
    # comparisons with 2 canaries or 4 documents a side are not tested, and say why
    t = _test(sec, "size", "small (9M)", "tiny (1.79M)", "exposure", "4")
    assert t.verdict == "n too small" and t.test is None
    t = _test(sec, "size", "small (9M)", "tiny (1.79M)", "goldfish_exact", "2-3")
    assert t.verdict == "n too small" and t.test is None


def test_differences_are_holm_adjusted_tests(study):
    from scipy.stats import binomtest

    report, paths = study
    sec = report["scale"]
    tested = [t for t in sec.tests if t.test is not None]
    # 4 comparisons (2 size pairs, 2 Goldfish pairs) x 3 document metrics x 3 testable buckets,
    # corrected in one family with the report's other tests (the literature section's trends)
    assert len(tested) == 36 and sec.family == report["findings"]["tests"] == 38
    size = _test(sec, "size", "small (9M)", "tiny (1.79M)", "goldfish_exact", "8-15").test
    assert size.name == "exact McNemar" and size.paired and size.n_a == 20
    assert size.p_value == pytest.approx(binomtest(16, 16, 0.5, alternative="greater").pvalue)
    # Holm: the smallest p-value of m tests is multiplied by m; adjusted p-values never decrease
    ps = sorted(t.test.p_value for t in tested)
    adj = sorted(t.test.p_adjusted for t in tested)
    assert adj[0] >= min(1.0, 36 * ps[0]) and all(t.test.family == 38 for t in tested)
    assert all(a >= p for a, p in zip(adj, ps, strict=True))
    assert size.p_adjusted < 0.05
    assert _test(sec, "size", "small (9M)", "tiny (1.79M)", "goldfish_exact", "8-15").verdict == "more"
    gf = _test(sec, "goldfish", "small (9M) + Goldfish", "small (9M)", "goldfish_exact", "8-15")
    assert gf.verdict == "less" and gf.test.alternative == "less"
    # the same outcomes with and without Goldfish on the tiny model: no difference claimed
    null = _test(sec, "goldfish", "tiny (1.79M) + Goldfish", "tiny (1.79M)", "goldfish_exact", "8-15")
    assert null.verdict == "no difference shown" and null.test.p_value == 1.0
    assert null.test.p_adjusted >= 0.05
    # documents seen once are never extracted by any run: nothing to claim there
    assert _test(sec, "size", "small (9M)", "tiny (1.79M)", "extraction_exact", "1").verdict == (
        "no difference shown")
    assert all("holm p" in s and "over 38 tests" in s for s in sec.sentences)
    md = paths["md"].read_text()
    assert "## Memorization against model size and Goldfish loss" in md and "n too small" in md
    assert "holm p" in md and "Goldfish protocol: m = 50 tokens" in md
    assert 'id="scale"' in paths["html"].read_text()


def test_section_absent_for_one_size_without_goldfish(tmp_path):
    runs = [make_run(tmp_path, "a", "tiny", False, 2), make_run(tmp_path, "b", "tiny", False, 18, 1)]
    report = build_report(runs)
    assert "scale" not in report
    paths = write_report(report, tmp_path / "report")
    assert "model size and Goldfish" not in paths["md"].read_text()
    # Goldfish alone (one size) is enough for the section
    runs.append(make_run(tmp_path, "c", "tiny", True, 2, 2))
    assert build_report(runs)["scale"].sizes == ["tiny (1.79M)"]

