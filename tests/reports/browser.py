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


FIRST_SCREEN = {"width": 1280, "height": 800}


def check_report(html_path: Path, screenshot: Path | None, first_screen: Path | None = None) -> dict[str, Any]:
    """Open the report; save a full-page screenshot (unless `screenshot` is None) and the first
    screen's, 1280 x 800, when `first_screen` is given; return what the page did and where its
    answer sits."""
    from playwright.sync_api import sync_playwright

    url = html_path.resolve().as_uri()
    seen: dict[str, Any] = {"requests": [], "console_errors": [], "dialogs": [], "page_errors": []}
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=chromium_path(), args=CHROMIUM_ARGS, headless=True)
        try:
            page = browser.new_page(viewport=FIRST_SCREEN)
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
            seen["answer_top"] = page.evaluate(
                "() => { const e = document.querySelector('#plot-frontier');"
                " return e ? e.getBoundingClientRect().top : null; }")
            seen["first_screen_text"] = page.evaluate("() => document.querySelector('#answer')?.innerText || ''")
            if first_screen is not None:
                page.screenshot(path=str(first_screen), full_page=False)
            if screenshot is not None:
                page.screenshot(path=str(screenshot), full_page=True)
        finally:
            browser.close()
    seen["external_requests"] = [u for u in seen["requests"] if u != url]
    return seen


# every element's right edge and width (outside <svg> internals), the page's scroll width, and
# where each selector's first element sits, as Chromium lays the page out at 1280 x 800
_LAYOUT_JS = """(sels) => {
  const W = window.innerWidth;
  const wide = [];
  for (const e of document.body.querySelectorAll('*')) {
    if (e.closest('svg') && e.tagName.toLowerCase() !== 'svg') continue;
    const r = e.getBoundingClientRect();
    if (r.width > W || r.right > W + 0.5) wide.push({tag: e.tagName.toLowerCase(), id: e.id,
        cls: e.className && e.className.baseVal === undefined ? e.className : '', width: r.width, right: r.right});
  }
  const at = {};
  for (const s of sels) {
    const e = document.querySelector(s);
    if (!e) { at[s] = null; continue; }
    const r = e.getBoundingClientRect();
    at[s] = {top: r.top, bottom: r.bottom, left: r.left, right: r.right, width: r.width,
             text: e.innerText || ''};
  }
  return {window: {width: W, height: window.innerHeight},
          scroll_width: document.documentElement.scrollWidth,
          page_height: document.documentElement.scrollHeight, too_wide: wide, at: at};
}"""


def page_layout(html_path: Path, selectors: list[str], first_screen: Path | None = None) -> dict[str, Any]:
    """Open the page at 1280 x 800 and measure it: `too_wide` lists every element wider than the
    window or reaching past its right edge, `at[selector]` the first match's box and text (None
    when absent); the first screen's screenshot is saved to `first_screen` when given."""
    from playwright.sync_api import sync_playwright

    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=chromium_path(), args=CHROMIUM_ARGS, headless=True)
        try:
            page = browser.new_page(viewport=FIRST_SCREEN)
            errors: list[str] = []
            page.on("pageerror", lambda e: errors.append(str(e)))
            page.goto(html_path.resolve().as_uri(), wait_until="load")
            out = page.evaluate(_LAYOUT_JS, selectors)
            out["page_errors"] = errors
            if first_screen is not None:
                page.screenshot(path=str(first_screen), full_page=False)
        finally:
            browser.close()
    return out
