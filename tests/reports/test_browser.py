"""The report in a real headless browser: plots drawn, no console errors, no network, no dialog;
and the first screen (1280 x 800) holds the answer: the frontier and the matched-utility line."""

from memaudit.reports.build import build_report
from memaudit.reports.write import write_report
from tests.reports._fixtures import write_run_dir
from tests.reports.browser import FIRST_SCREEN, check_report, chromium_path
from tests.reports.test_render import XSS, make_report


def test_report_in_headless_chromium(tmp_path):
    assert chromium_path(), "Chromium is missing: scripts/install_browser.sh installs it"
    paths = write_report(make_report(), tmp_path)
    seen = check_report(paths["html"], tmp_path / "report.png")
    assert seen["plots"] >= 1, seen
    assert "membership_roc" in seen["plot_ids"]
    assert seen["console_errors"] == [] and seen["page_errors"] == []
    assert seen["external_requests"] == []
    assert seen["dialogs"] == []
    assert seen["img_elements"] == 0  # the onerror payload stayed text
    assert set(XSS) <= set(seen["sample_texts"])
    assert (tmp_path / "report.png").stat().st_size > 1000


def test_first_screen_answers_the_question(tmp_path, request):
    """A sweep-shaped report (public base, both backends with and without DP): the first screen
    shows the matched-utility line and the frontier plot; its screenshot is kept for review in
    .pytest_cache/d/memaudit/report_first_screen.png (pytest's cache folder, not committed)."""
    sweep = tmp_path / "sweep"
    write_run_dir(sweep / "base", "centralized", ppl=400, role="public-base")
    write_run_dir(sweep / "par-inf", "centralized", ppl=50, exposure_shift=0.5, mia_shift=1.0)
    write_run_dir(sweep / "par-eps2", "centralized", ppl=90, dp=(1.0, 400, 16, 50))
    write_run_dir(sweep / "fed-inf", "federated", ppl=95, exposure_shift=0.3, mia_shift=0.3)
    write_run_dir(sweep / "fed-eps6", "federated", ppl=150, dp=(1.0, 51, 8, 30))
    paths = write_report(build_report([sweep]), tmp_path / "report")
    cache = getattr(request.config, "cache", None)  # absent under -p no:cacheprovider
    shot = (cache.mkdir("memaudit") if cache else tmp_path) / "report_first_screen.png"
    seen = check_report(paths["html"], tmp_path / "full.png", first_screen=shot)
    assert seen["console_errors"] == [] and seen["page_errors"] == [] and seen["external_requests"] == []
    assert "frontier" in seen["plot_ids"]
    assert seen["answer_top"] is not None and seen["answer_top"] < FIRST_SCREEN["height"]
    assert "At matched utility" in seen["first_screen_text"]
    assert "Findings that pass the statistical rules" in seen["first_screen_text"]
    assert shot.stat().st_size > 1000


def test_readme_picture_is_the_quickstart_first_screen(tmp_path):
    """docs/report-first-screen.png, shown in the README, is what Chromium draws of the first
    screen (1280 x 800) of the quickstart snapshot's report, from today's snapshot and templates.
    `MEMAUDIT_WRITE_GOLDEN=1` re-renders it (after a new snapshot or a template change)."""
    import json
    import os

    import numpy as np
    from PIL import Image

    from memaudit.io import atomic_write_bytes, atomic_write_text
    from memaudit.reports.snapshots import (
        SCREENSHOT,
        SCREENSHOT_META,
        first_screen_html,
        html_digest,
        screenshot_stale,
    )

    html = first_screen_html()
    page = tmp_path / "report.html"
    page.write_text(html, encoding="utf-8")
    shot = tmp_path / "first-screen.png"
    seen = check_report(page, None, first_screen=shot)
    assert seen["console_errors"] == [] and seen["page_errors"] == [] and seen["external_requests"] == []
    assert "At matched utility" in seen["first_screen_text"]
    if os.environ.get("MEMAUDIT_WRITE_GOLDEN") == "1":
        atomic_write_bytes(SCREENSHOT, shot.read_bytes())
        atomic_write_text(SCREENSHOT_META, json.dumps(
            {"snapshot": "docs/snapshots/quickstart.report.json", "viewport": FIRST_SCREEN,
             "html_sha256": html_digest(html)}, indent=1, sort_keys=True) + "\n")
    fix = "re-render it: MEMAUDIT_WRITE_GOLDEN=1 python -m pytest tests/reports/test_browser.py -k picture"
    assert not screenshot_stale(html), f"docs/report-first-screen.png shows another report; {fix}"
    now = np.asarray(Image.open(shot).convert("RGB"), dtype=np.int16)
    committed = np.asarray(Image.open(SCREENSHOT).convert("RGB"), dtype=np.int16)
    assert now.shape == committed.shape == (FIRST_SCREEN["height"], FIRST_SCREEN["width"], 3)
    # the same HTML in the same browser: equal but for font anti-aliasing
    assert float(np.mean(np.any(now != committed, axis=-1))) < 0.01, fix
