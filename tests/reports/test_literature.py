"""The literature-effects section on constructed runs: its numbers against brute-force oracles."""

from __future__ import annotations

import math

import numpy as np
import pytest

from memaudit.probes.records import Cell
from memaudit.reports import findings
from memaudit.reports.build import SCHEMA, comparisons
from memaudit.reports.group import group_privacy
from memaudit.reports.literature import audit_sentences, literature_section
from memaudit.reports.schema import validate_report
from memaudit.reports.write import write_report
from tests.reports._fixtures import auc_units, cell, run

REPS, OWNERS, PER = (1, 4, 16), ("user", "spread"), 10


def _canaries() -> dict:
    out, k = [], 0
    for r in REPS:
        for o in OWNERS:
            for _ in range(PER):
                users = [f"u{k}"] if o == "user" else [f"u{k}-{i}" for i in range(r)]
                out.append({"id": f"c{k}", "repetitions": r, "owner_kind": o, "users": users})
                k += 1
    return {"inserted": out}


def _exposure_units(slope: float, seed: int, per: int = PER) -> dict:
    """60 inserted canaries whose exposure is slope x log2(repetitions) above 60 references."""
    rng = np.random.default_rng(seed)
    ids, vals, role, reps, owner = [], [], [], [], []
    k = 0
    for r in REPS:
        for o in OWNERS:
            for _ in range(per):
                ids.append(f"c{k}")
                vals.append(1.4 + slope * math.log2(r) + rng.normal(0, 0.3))
                role.append("inserted")
                reps.append(r)
                owner.append(o)
                k += 1
    for i in range(60):
        ids.append(f"r{i}")
        vals.append(1.4 + rng.normal(0, 0.3))
        role.append("reference")
        reps.append(0)
        owner.append("user")
    return {"kind": "exposure", "unit": "canaries", "ids": ids, "values": vals, "role": role,
            "repetitions": reps, "owner_kind": owner}


def _losses(mean: float, seed: int, n: int = 50) -> dict:
    """Membership units: n members and the same n holdout documents (ids h*) at per-token loss `mean`."""
    rng = np.random.default_rng(seed)
    u = auc_units(0.0, n=n, seed=seed)
    u["ids"] = [f"m{i}" for i in range(n)] + [f"h{i}" for i in range(n)]
    u["values"] = list(-(mean + rng.normal(0, 0.2, 2 * n)))
    return u


def _run(rid, backend, eps, *, slope, loss, seed, unit=None, role=None, audit=None, leakage=None,
         audit_info=None):
    r = run(rid, backend, eps, mia=cell(0.6, 0.05), unit=unit, role=role,
            units={"exposure_canaries": _exposure_units(slope, seed), "mia_auc": _losses(loss, seed)})
    r["group_privacy"] = group_privacy(_canaries(), epsilon=eps if math.isfinite(eps) else math.inf,
                                       unit=r["privacy"]["unit"], delta=r["privacy"]["delta"])
    if audit is not None:
        r["audit"] = True
        r["leakage"]["audit_epsilon"] = Cell.from_json(
            {"value": audit, "ci_low": None, "ci_high": None, "n": 256, "unit": "audit canaries", "ceiling": 2.5,
             "confidence": 0.95, **(audit_info or {})})
    r["leakage"].update({k: Cell.from_json(c) for k, c in (leakage or {}).items()})
    return r


@pytest.fixture(scope="module")
def runs():
    ext = {"extraction_exact": {"value": 3 / 300, "ci_low": 0.002, "ci_high": 0.03, "n": 300, "unit": "documents"},
           "pii_extraction": {"value": 0.0, "ci_low": 0.0, "ci_high": 0.02, "n": 200, "unit": "PII items"}}
    return [
        _run("base", "centralized", 0.0, slope=0.0, loss=10.0, seed=0, role="public-base"),
        _run("par-inf", "centralized", math.inf, slope=1.5, loss=5.0, seed=1, leakage=ext),
        _run("par-eps8", "centralized", 8.0, slope=0.8, loss=7.0, seed=2, unit="example"),
        _run("fed-inf", "federated", math.inf, slope=0.5, loss=6.0, seed=3),
        _run("fed-eps8", "federated", 8.0, slope=0.0, loss=9.0, seed=4, unit="user"),
        _run("par-inf-audit", "centralized", math.inf, slope=1.5, loss=5.0, seed=5, audit=0.9,
             audit_info={"canaries": "document", "score": "min_k", "guesses": 64, "correct": 61}),
        _run("par-eps2-audit", "centralized", 2.0, slope=0.0, loss=8.0, seed=6, unit="example", audit=0.1),
    ]


def _holm_oracle(p: list[float]) -> list[float]:
    """Holm step-down adjusted p-values, written out from the definition."""
    m, order = len(p), sorted(range(len(p)), key=lambda i: p[i])
    adj, run_max = [0.0] * m, 0.0
    for rank, i in enumerate(order):
        run_max = max(run_max, min(1.0, (m - rank) * p[i]))
        adj[i] = run_max
    return adj


def test_buckets_trend_and_holm_family(runs):
    from scipy.stats import mannwhitneyu

    sec = literature_section(runs)
    ex = {e.run: e for e in sec.exposure}
    assert set(ex) == {"par-inf", "par-eps8", "fed-inf", "fed-eps8"}  # no base, no audit runs
    tests = [e.trend for e in sec.exposure] + [b.test for e in sec.exposure for b in e.buckets]
    assert sec.family == len(tests) == 4 + 4 * 6
    assert [t.p_adjusted for t in tests] == pytest.approx(_holm_oracle([t.p_value for t in tests]))
    # each bucket's U test and excess against a direct computation on the units
    u = runs[1]["units"]["exposure_canaries"]
    refs = [v for v, r in zip(u["values"], u["role"], strict=True) if r == "reference"]
    top = [v for v, r, k, o in zip(u["values"], u["role"], u["repetitions"], u["owner_kind"], strict=True)
           if r == "inserted" and k == 16 and o == "user"]
    b = next(b for b in ex["par-inf"].buckets if (b.repetitions, b.owner_kind) == (16, "user"))
    assert b.test.p_value == pytest.approx(mannwhitneyu(top, refs, alternative="greater").pvalue)
    assert b.excess.value == pytest.approx(np.mean(top) - np.mean(refs))
    assert b.excess.ci_low < b.excess.value < b.excess.ci_high and b.excess.n == 10
    assert ex["par-inf"].trend.verdict == "shown" and ex["fed-eps8"].trend.verdict == "not shown"
    # group privacy on the same user-owned canaries: 16 x 8 under example-level DP, 8 under user-level
    eff = {e.run: next(b for b in e.buckets if (b.repetitions, b.owner_kind) == (16, "user"))
           for e in sec.exposure}
    assert eff["par-eps8"].effective_epsilon == 128 and eff["fed-eps8"].effective_epsilon == 8
    assert eff["par-eps8"].test.verdict == "shown" and eff["fed-eps8"].test.verdict == "not shown"
    assert any("one user repeats 16 times (effective epsilon = 128" in s for s in sec.sentences)


def test_too_few_canaries_are_not_tested(runs):
    r = _run("few", "centralized", math.inf, slope=1.5, loss=5.0, seed=9)
    r["units"]["exposure_canaries"] = _exposure_units(1.5, 9, per=4)
    sec = literature_section([r])
    (e,) = sec.exposure
    assert all(b.test is None and b.note == "n too small" and b.excess.ci_low is None for b in e.buckets)
    assert sec.family == 1  # the trend over all 24 canaries is still a test


def test_extraction_audit_and_dp_learns(runs):
    sec = literature_section(runs)
    (x,) = [x for x in sec.extraction if x.run == "par-inf"]
    exact, pii = (x.metrics[k].to_json() for k in ("extraction_exact", "pii_extraction"))
    assert exact["k"] == 3 and exact["nonzero"] and exact["value"] == 3 / 300 and exact["n"] == 300
    assert pii["k"] == 0 and not pii["nonzero"]
    audit = {a["run"]: a for a in sec.audit}
    assert audit["par-inf-audit"]["verdict"] == "positive lower bound"
    assert audit["par-eps2-audit"]["verdict"] == "below the ledger's epsilon"
    said = audit_sentences(sec)
    assert ("n = 256 audit canaries, new users' messages by Min-K%, 61 of 64 guesses right, 95% one-sided; "
            "ceiling 2.5): positive lower bound") in said[0]
    assert "random secrets by log-likelihood, 95% one-sided" in said[1]  # a report without the kind
    learns = {g.run: g for g in sec.dp_learns}
    # the oracle: the same ratio of mean holdout losses, from the units directly
    def hold(r):
        u = r["units"]["mia_auc"]
        return np.mean([-v for v, m in zip(u["values"], u["member"], strict=True) if not m])
    base, pinf, p8, finf, f8 = (hold(runs[i]) for i in range(5))
    assert learns["par-eps8"].closed.value == pytest.approx((base - p8) / (base - pinf))
    assert learns["fed-eps8"].closed.value == pytest.approx((base - f8) / (base - finf))
    assert learns["par-eps8"].verdict == "at least half closed"  # about 0.6, tight interval
    assert learns["fed-eps8"].verdict == "less than half closed"  # about 0.25
    assert learns["par-eps8"].closed.n == 50


def test_section_renders_and_validates(runs, tmp_path):
    rs = [dict(r) for r in runs]
    rep = {"schema": SCHEMA, "memaudit_version": "t", "runs": rs, "comparisons": comparisons(rs)}
    rep["findings"] = findings.generate(rep)
    rep["literature"] = literature_section(rs)
    for r in rs:
        r.pop("units")
    paths = write_report(rep, tmp_path)
    validate_report(rep)
    html, md = paths["html"].read_text(), paths["md"].read_text()
    for text in (html, md):
        assert "The effects the literature reports" in text and "exposure rises with repetitions" in text
        assert "closes" in text and "one-run audit lower bound" in text


def test_no_gap_to_close_is_said_not_divided(runs):
    """A non-DP fine-tune no better than the public base leaves no gap: no ratio, one sentence."""
    base = _run("base", "centralized", 0.0, slope=0.0, loss=5.0, seed=0, role="public-base")
    sec = literature_section([base, _run("par-inf", "centralized", math.inf, slope=1.5, loss=5.5, seed=1),
                              _run("par-eps8", "centralized", 8.0, slope=0.0, loss=7.0, seed=2, unit="example")])
    (g,) = sec.dp_learns
    assert g.closed is None and g.verdict.startswith("no gap")
    assert any("no gap" in s for s in sec.sentences)


def _every_test(rep: dict) -> list:
    """Every test of a report: comparison cells' `Test`s, then the literature section's."""
    comp = rep["comparisons"]
    blocks = comp.matched + comp.effects + comp.matched_utility.pairs
    cells = [c.test for b in blocks for c in b.metrics.values() if c.test]
    lit = [e.trend for e in rep["literature"].exposure if e.trend] + [
        b.test for e in rep["literature"].exposure for b in e.buckets if b.test]
    return cells + lit


def test_one_holm_family_over_every_test_of_the_report(runs):
    """The comparisons and the literature section are corrected together, as the report and the
    README say ("over every test of the report"); they used to be two families at 0.05 each."""
    rep = {"schema": SCHEMA, "runs": runs, "comparisons": comparisons(runs), "literature": literature_section(runs)}
    section_alone = [b.test.p_adjusted for b in rep["literature"].exposure[0].buckets if b.test]
    adjusted = findings.adjust_report(rep)
    tests = _every_test(adjusted)
    n_comp = len(tests) - rep["literature"].family
    assert n_comp > 0 and rep["literature"].family > 0
    assert {t.family for t in tests} == {len(tests)} and adjusted["literature"].family == len(tests)
    assert [t.p_adjusted for t in tests] == pytest.approx(_holm_oracle([t.p_value for t in tests]))
    assert [t.verdict for t in tests[n_comp:]] == ["shown" if t.p_adjusted <= 0.05 else "not shown"
                                                   for t in tests[n_comp:]]
    # the report's correction returns new records: the section it was given is left as it was
    assert section_alone == [b.test.p_adjusted for b in rep["literature"].exposure[0].buckets if b.test]
    assert findings.generate(rep)["tests"] == len(tests)
    assert findings.adjust_report(adjusted) == adjusted  # adjusting again changes nothing


def _probe_with_bucket_tests() -> dict:
    """probes.json whose exposure buckets carry their Mann-Whitney test and the probe's own Holm
    over its buckets (p_holm), as `memaudit.probes.exposure` writes them."""
    cellx = {"value": 1.0, "ci_low": None, "ci_high": None, "n": 10, "unit": "canaries", "note": "n too small"}
    by_rep = {str(r): {"all": cellx, "user": cellx, "excess": cellx,
                       "test": {"test": "mann-whitney-u one-sided (inserted > references)", "p_value": p,
                                "p_holm": min(1.0, 3 * p), "n": 10, "n_references": 60}}
              for r, p in ((1, 0.4), (4, 0.01), (16, 0.00286))}
    return {"schema": 1, "probes": {"exposure": {"summary": {"method": "enumeration", "max_exposure": 13.3,
                                                             "by_repetitions": by_rep}, "scores": []}}}


def test_probe_tables_show_the_reports_family_never_a_second_one():
    """Issue 68, item 3: the per-run probe table said "Holm over buckets p = 0.00859", a second
    family, where the report's one family gave the same test 0.36. The row shows the raw p,
    labelled unadjusted; in a report, the adjusted p of the report's family where the family holds
    the same test (the literature section's bucket of the same run, repetitions and canaries)."""
    from memaudit.reports.probes_adapter import settle_rows, summarize_probes

    rows = [r for r in summarize_probes(_probe_with_bucket_tests())["rows"] if "excess over" in r["metric"]]
    assert len(rows) == 3
    assert not any("Holm over" in r["metric"] or "0.00858" in r["metric"] for r in rows)
    assert all("unadjusted" in r["metric"] for r in rows)
    lit = {"exposure": [{"run": "par-inf", "buckets": [
        {"repetitions": 16, "owner_kind": "user", "test": {"p_value": 0.00286, "p_adjusted": 0.36, "family": 66}},
        {"repetitions": 4, "owner_kind": "user", "test": {"p_value": 0.02, "p_adjusted": 0.9, "family": 66}},
        {"repetitions": 4, "owner_kind": "spread", "test": {"p_value": 0.03, "p_adjusted": 0.9, "family": 66}}]}]}
    before = [dict(r) for r in rows]
    settled = settle_rows(rows, "par-inf", lit)
    text = {r["metric"].split(" repetitions")[0].split(", ")[-1]: r["metric"] for r in settled}
    assert "p = 0.00286, Holm-adjusted p = 0.36 over the report's 66 tests" in text["16"]
    # 4 repetitions: two owner kinds, two tests of the family, neither the probe's: unadjusted
    assert "unadjusted" in text["4"] and "Holm-adjusted" not in text["4"]
    assert not any("family_test" in r for r in settled)
    assert rows == before  # new rows; the ones given are left as they were
    # another run's rows: the family holds none of their tests
    assert all("unadjusted" in r["metric"] for r in settle_rows(rows, "fed-inf", lit))
