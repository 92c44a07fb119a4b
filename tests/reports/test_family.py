"""The report's one correction over typed tests (`memaudit.reports.family.correct`) against
corrections written out from their definitions, and the sections settled from its records."""

from __future__ import annotations

import json

import numpy as np
import pytest

from memaudit.probes.records import Cell, Test
from memaudit.reports import literature, scale
from memaudit.reports.blocks import Bucket, ExposureEntry, Section, SectionTest
from memaudit.reports.family import correct
from memaudit.reports.scale import ScaleSection, ScaleTest
from tests.reports.test_literature import _holm_oracle as _holm


def _bh(p: list[float]) -> list[float]:
    m = len(p)
    return [min(1.0, min(p[j] * m / (sum(p[k] <= p[j] for k in range(m))) for j in range(m) if p[j] >= p[i]))
            for i in range(m)]


def _tests(p: list[float]) -> list:
    """Tests of both kinds the report holds, alternating: between runs, and the literature section's."""
    return [Test(name="permutation", alternative="less", n_a=20, n_b=20, unit="documents", p_value=x)
            if i % 2 else SectionTest(test="Mann-Whitney U", p_value=x, n_a=10, n_b=60, unit="canaries")
            for i, x in enumerate(p)]


@pytest.mark.parametrize(("name", "oracle"), [("holm", _holm), ("benjamini-hochberg", _bh)])
def test_correct_matches_the_definition_and_returns_new_records(name, oracle):
    p = list(np.random.default_rng(0).uniform(0, 0.2, 11)) + [0.001, 0.001, 1.0]
    given = _tests(p)
    got = correct(given, name, alpha=0.1)
    assert [t.p_adjusted for t in got] == pytest.approx(oracle(p))
    assert [type(t) for t in got] == [type(t) for t in given] and [t.p_value for t in got] == p
    assert {(t.family, t.correction, t.alpha) for t in got} == {(len(p), name, 0.1)}
    assert all(t.p_adjusted is None and t.family is None for t in given)  # left as they were
    assert correct([]) == []


def test_an_unknown_correction_is_refused_by_name():
    with pytest.raises(ValueError, match="unknown correction 'bonferonni'; use one of"):
        correct(_tests([0.1]), "bonferonni")


def _literature() -> Section:
    bucket = Bucket(repetitions=4, owner_kind="user", effective_epsilon=32.0, rule="group privacy",
                    excess=Cell(value=1.2, interval=(0.5, 1.9), n=10, unit="canaries"),
                    test=SectionTest(test="U", p_value=0.01, n_a=10, n_b=60, unit="canaries"))
    small = Bucket(repetitions=1, owner_kind="user", note="n too small",
                   excess=Cell(value=0.1, n=4, unit="canaries", note="n too small"))
    trend = SectionTest(test="rho", rho=0.4, p_value=0.02, n_a=24, n_b=24, unit="canaries")
    return Section(exposure=[
        ExposureEntry(run="a", label="a", epsilon=8.0, trend=trend, buckets=[bucket, small]),
        ExposureEntry(run="b", label="b", epsilon=8.0, buckets=[bucket.replace(test=bucket.test.replace(p_value=0.3))])])


def test_literature_settles_from_the_corrected_records_in_the_order_of_its_tests():
    sec = _literature()
    tests = literature.tests_of(sec)
    assert [t.p_value for t in tests] == [0.02, 0.01, 0.3]  # trends first, then tested buckets
    # the section's tests in a family of 5 (two more tests elsewhere in the report)
    fixed = correct([*tests, *_tests([0.5, 0.6])])[:3]
    out = literature.settle(sec, fixed, 5)
    assert [t.p_adjusted for t in literature.tests_of(out)] == pytest.approx(_holm([0.02, 0.01, 0.3, 0.5, 0.6])[:3])
    assert [t.verdict for t in literature.tests_of(out)] == ["not shown", "shown", "not shown"]
    assert out.family == 5 and literature.passing(out) == 1
    said = ("canaries one user repeats 4 times (effective epsilon = 32, group privacy): excess exposure 1.20 "
            "[0.50, 1.90] bits over the references (n = 10 canaries)")
    assert [x for x in out.sentences if "excess exposure" in x] == [
        f"a, {said}, shown (Holm p = 0.05)", f"b, {said}, not shown (Holm p = 0.9)"]  # 0.01 x 5; 0.3 x 3
    assert out.exposure[0].buckets[1] == sec.exposure[0].buckets[1]  # an untested bucket as it was
    assert literature.tests_of(sec) == tests and sec.family is None  # `sec` left as it was
    with pytest.raises(ValueError, match="holds 3 tests, 2 given"):
        literature.settle(sec, fixed[:2], 5)


def _scale_test(comparison: str, p: float | None) -> ScaleTest:
    test = None if p is None else Test(name="exact McNemar", alternative="greater", n_a=20, n_b=20,
                                       unit="documents", p_value=p, scope="runs")
    return ScaleTest(comparison=comparison, metric="goldfish_exact", bucket="all", a="small", b="tiny",
                     value_a=0.5, value_b=0.1, verdict="n too small" if p is None else "not tested",
                     test=test, condition="centralized, no DP")


def test_scale_settles_verdicts_by_direction():
    t = _scale_test
    sec = ScaleSection(tests=[t("size", 0.001), t("goldfish", 0.002), t("size", None), t("size", 0.2)])
    out = scale.settle(sec, correct(scale.tests_of(sec)), 3)
    assert [x.verdict for x in out.tests] == ["more", "less", "n too small", "no difference shown"]
    assert [x.test.p_adjusted for x in out.tests if x.test] == pytest.approx(_holm([0.001, 0.002, 0.2]))
    assert scale.passing(out) == 2 and len(out.sentences) == 2 and all("over 3 tests" in s for s in out.sentences)


def test_a_section_read_from_report_json_settles_as_the_one_in_memory():
    """report.json's objects read back (`Section.of`, `ScaleSection.of`) give the same records, so a
    report corrected from its file says what the one corrected in memory says."""
    from memaudit.reports.write import json_safe

    for mod, kind, sec in ((literature, Section, _literature()),
                           (scale, ScaleSection, ScaleSection(tests=[_scale_test("size", 0.01),
                                                                     _scale_test("goldfish", None)]))):
        read = kind.of(json.loads(json.dumps(json_safe(sec))))
        assert read == sec and mod.tests_of(read) == mod.tests_of(sec)  # records all the way down
        fixed = correct(mod.tests_of(sec))
        assert json_safe(mod.settle(read, fixed, 4)) == json_safe(mod.settle(sec, fixed, 4))
