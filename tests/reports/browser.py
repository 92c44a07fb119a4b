"""Open a report in Debian's headless Chromium through Playwright and record what happened."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

CHROMIUM_ARGS = [
    "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
    "--disable-background-networking", "--disable-component-update", "--disable-sync",
]


def chromium_path() -> str | None:
    for p in ("/usr/bin/chromium", "/usr/bin/chromium-browser"):
        if Path(p).exists():
            return p
    return shutil.which("chromium")


def check_report(html_path: Path, screenshot: Path) -> dict[str, Any]:
    from playwright.sync_api import sync_playwright

    url = html_path.resolve().as_uri()
    seen: dict[str, Any] = {"requests": [], "console_errors": [], "dialogs": [], "page_errors": []}
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=chromium_path(), args=CHROMIUM_ARGS, headless=True)
        try:
            page = browser.new_page()
            page.on("request", lambda r: seen["requests"].append(r.url))
            page.on("console", lambda m: seen["console_errors"].append(m.text) if m.type == "error" else None)
            page.on("pageerror", lambda e: seen["page_errors"].append(str(e)))

            def on_dialog(d):
                seen["dialogs"].append(d.message)
                d.dismiss()

            page.on("dialog", on_dialog)
            page.goto(url, wait_until="load")
            page.wait_for_timeout(300)
            seen["plots"] = page.eval_on_selector_all("div.plot svg", "els => els.length")
            seen["plot_ids"] = page.eval_on_selector_all("div.plot", "els => els.map(e => e.dataset.plot)")
            seen["sample_texts"] = page.eval_on_selector_all("div.sample", "els => els.map(e => e.textContent)")
            seen["img_elements"] = page.eval_on_selector_all("img", "els => els.length")
            page.screenshot(path=str(screenshot), full_page=True)
        finally:
            browser.close()
    seen["external_requests"] = [u for u in seen["requests"] if u != url]
    return seen
