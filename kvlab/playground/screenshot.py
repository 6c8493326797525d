"""Refresh ``figures/playground.png``: serve the playground page (Voilà), open it in chromium, pin the
first run, move τ once (so the picture shows a run, its baseline and a pinned run overlaid), and
screenshot the page.
Writes the PNG it is asked for and runs into the run store; it starts and stops its own Voilà server.

    python -m kvlab.playground.screenshot [--out figures/playground.png] [--smoke] [--runs DIR]

``make playground-screenshot`` runs it. The run store defaults to the project's (``$KVLAB_RUNS`` or
``runs/``), so stored runs make it quick; ``--smoke`` uses the notebook's smoke settings (N=20).
"""
from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

from kvlab.playground.browser import REPO, chromium, open_page, serve, type_slider, wait_key_change

PAGE_TIMEOUT_MS = 900_000


def main(argv=None) -> Path:
    ap = argparse.ArgumentParser(prog="python -m kvlab.playground.screenshot", description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=str(REPO / "figures" / "playground.png"), help="PNG to write")
    ap.add_argument("--smoke", action="store_true", help="the notebook's smoke settings (N=20, one student)")
    ap.add_argument("--runs", default=None, help="run store folder (default: $KVLAB_RUNS or the project's runs/)")
    ap.add_argument("--tau-shift", type=float, default=-0.5, help="bits τ moves by before the picture")
    args = ap.parse_args(argv)
    from playwright.sync_api import sync_playwright

    from kvlab.store import default_root

    runs = Path(args.runs).expanduser() if args.runs else default_root()
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="kvlab-screenshot-") as tmp, serve(Path(tmp), runs, smoke=args.smoke) as (url, _):
        with sync_playwright() as pw:
            browser = pw.chromium.launch(executable_path=chromium(), args=["--no-sandbox"])
            try:
                page, _ = open_page(browser, url, PAGE_TIMEOUT_MS)
                key0 = page.locator(".kvlab-run-key").inner_text()
                page.locator(".kvlab-pin").click()
                readout = page.locator(".kvlab-tau_bits .widget-readout")
                tau = max(0.0, float(readout.inner_text()) + args.tau_shift)
                type_slider(page, readout, f"{tau:.2f}")
                wait_key_change(page, key0, PAGE_TIMEOUT_MS)
                page.locator(".kvlab-pin-teacher_ppl").first.wait_for(timeout=60_000)
                page.wait_for_timeout(1500)          # plot redraw
                page.screenshot(path=str(out), full_page=True)
            finally:
                browser.close()
    print(f"wrote {out} ({time.perf_counter() - t0:.0f} s; run store {runs})")
    return out


if __name__ == "__main__":
    main()
