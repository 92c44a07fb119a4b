"""The report in a real headless browser: plots drawn, no console errors, no network, no dialog."""

from memaudit.reports.write import write_report
from tests.reports.browser import check_report, chromium_path
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
