"""Open a report in Debian's headless Chromium (driven by Playwright) with the network cut off."""
from __future__ import annotations

import shutil
from pathlib import Path

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync"]


def inspect_report(path: Path) -> dict:
    from playwright.sync_api import sync_playwright

    console_errors, page_errors, requests, dialogs = [], [], [], []
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=FLAGS, headless=True)
        context = browser.new_context(offline=True)
        page = context.new_page()
        page.on("console", lambda m: console_errors.append(m.text) if m.type == "error" else None)
        page.on("pageerror", lambda e: page_errors.append(str(e)))

        def on_dialog(d):  # an alert() from planted markup would land here: record it and close it
            dialogs.append(d.message)
            d.dismiss()
        page.on("dialog", on_dialog)

        def route(r):
            if not r.request.url.startswith(("file://", "data:", "about:")):
                requests.append(r.request.url)
                r.abort()
            else:
                r.continue_()
        page.route("**/*", route)
        page.goto(Path(path).resolve().as_uri(), wait_until="load", timeout=120_000)
        page.wait_for_timeout(1500)
        figures = page.evaluate("""() => Array.from(document.querySelectorAll('.plotly-graph-div')).map(
            d => d.querySelectorAll('svg.main-svg').length)""")
        statuses = page.evaluate("""() => Array.from(document.querySelectorAll('#ds-header .ds-status')).map(
            s => s.textContent)""")
        text = page.inner_text("body")
        # planted payloads set this global if any of them ran
        pwned = page.evaluate("() => window.__ds_pwned === undefined ? null : String(window.__ds_pwned)")
        browser.close()
    return {"figures": figures, "console_errors": console_errors, "page_errors": page_errors,
            "network_requests": requests, "statuses": statuses, "text": text, "dialogs": dialogs,
            "pwned": pwned}
