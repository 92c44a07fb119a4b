"""The figures of docs/results.md and the README come from the committed report snapshots
(docs/snapshots/*.report.json): every marked block agrees with what `python -m
memaudit.reports.snapshots` renders from them."""

import shutil

import pytest

from memaudit.reports.snapshots import (
    BLOCK,
    README,
    RESULTS,
    SNAPSHOTS,
    load_snapshot,
    main,
    stale_blocks,
    update_doc,
)


def _names():
    return sorted(p.name.removesuffix(".report.json") for p in SNAPSHOTS.glob("*.report.json"))


def test_docs_agree_with_their_snapshots():
    for doc in (README, RESULTS):
        assert stale_blocks(doc) == [], f"run `python -m memaudit.reports.snapshots` to re-render {doc.name}"


def test_every_snapshot_has_its_block_and_validates():
    assert "quickstart" in _names()
    blocks = {m["name"] for m in BLOCK.finditer(RESULTS.read_text(encoding="utf-8")) if m["kind"] == "snapshot"}
    assert set(_names()) == blocks
    summaries = [m["name"] for m in BLOCK.finditer(README.read_text(encoding="utf-8"))]
    assert summaries == ["quickstart"]  # the README shows the quickstart, in short
    for name in _names():
        report, meta = load_snapshot(name)  # schema-checked
        assert meta and meta["wall_s"] > 0 and meta["command"].startswith("memaudit sweep")
        for r in report["runs"]:  # committed: no extracted member text, no local paths
            assert r["samples"] == [] and r["path"] == r["id"]


def _copy(tmp_path):
    readme, snaps = tmp_path / "results.md", tmp_path / "snapshots"
    shutil.copy(RESULTS, readme)
    shutil.copytree(SNAPSHOTS, snaps)
    return readme, snaps


def test_a_number_changed_by_hand_is_caught_and_rewritten(tmp_path):
    readme, snaps = _copy(tmp_path)
    text = readme.read_text(encoding="utf-8")
    m = next(BLOCK.finditer(text))
    body = m["body"]
    edited = body.replace("| ", "| 9", 1) if "| " in body else body + "x"
    readme.write_text(text.replace(body, edited), encoding="utf-8")
    assert stale_blocks(readme, snaps) == [f"snapshot:{m['name']}"]
    assert main(["--check", "--doc", str(readme), "--snapshots", str(snaps)]) == 1
    assert update_doc(readme, snaps) == [f"snapshot:{m['name']}"]
    assert readme.read_text(encoding="utf-8") == text
    assert main(["--check", "--doc", str(readme), "--snapshots", str(snaps)]) == 0


def test_a_block_without_its_snapshot_is_one_line(tmp_path, capsys):
    readme, snaps = _copy(tmp_path)
    readme.write_text("x\n<!-- snapshot:paper -->\n<!-- /snapshot -->\n", encoding="utf-8")
    with pytest.raises(ValueError, match="snapshot 'paper'"):
        stale_blocks(readme, snaps)
    assert main(["--check", "--doc", str(readme), "--snapshots", str(snaps)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("memaudit: error:") and err.count("\n") == 1


def test_readme_is_short_and_its_links_resolve():
    """The README a newcomer reads: under 150 lines, every relative link and image on disk."""
    import re

    text = README.read_text(encoding="utf-8")
    assert len(text.splitlines()) < 150
    targets = re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", text)
    assert "docs/report-first-screen.png" in targets and "docs/results.md" in targets
    for t in targets:
        if "://" not in t:
            assert (README.parent / t).exists(), t


def test_the_pictures_digest_ignores_clip_ids_that_differ_across_cpus():
    """matplotlib's clip-path ids hash a float rectangle whose last bits depend on numpy's SIMD
    kernels (AVX-512 or not): the same picture must keep its digest, a moved point must not."""
    from memaudit.reports.snapshots import html_digest

    svg = ('<svg><clipPath id="{a}"><rect x="1.5"/></clipPath><path clip-path="url(#{a})" d="M 0 {y}"/>'
           '<path clip-path="url(#{b})" d="M 1 2"/><clipPath id="{b}"/></svg>')
    here = svg.format(a="pacdbfd78a0", b="pdc26d46ae6", y="3.25")
    other_cpu = svg.format(a="p68ab54779b", b="pf02529ba88", y="3.25")
    assert html_digest(here) == html_digest(other_cpu)
    assert html_digest(here) != html_digest(svg.format(a="pacdbfd78a0", b="pdc26d46ae6", y="3.26"))
    assert html_digest(here) != html_digest(svg.format(a="pacdbfd78a0", b="pacdbfd78a0", y="3.25"))  # ids merged
