"""The playground in a real browser: Voilà serves notebooks/06_playground.py (smoke settings, the real
pair, a fresh run store in a tmp dir), Playwright drives Debian's chromium: move the τ slider, wait for
the teacher-PPL readout to change, check readouts (a refresh run, its baseline, an eviction run) against
the stored runs, step through one token. The screenshot goes to the test's tmp dir; ``figures/playground.png``
is refreshed only by ``make playground-screenshot`` (``python -m kvlab.playground.screenshot``).

Needs the packages ``voila`` and ``playwright`` and ``/usr/bin/chromium`` (``make test`` installs
all three; Playwright's own browser download is not used). Not skipped when they are missing: it fails
and says what to install.
"""
from __future__ import annotations

import time
from pathlib import Path

import pytest

from kvlab.playground.controller import fmt

PAGE_TIMEOUT_MS = 600_000      # Voilà shows the page once the notebook ran: model load + first runs (slow on a loaded machine)
# the i-th plotly graph of the app, in page order (0 = Explore's traces, the page's one FigureWidget)
PLOT_JS = "const _plot = i => document.querySelectorAll('.kvlab-playground .js-plotly-plot')[i];"


@pytest.mark.integration
def test_playground_tau_slider_in_a_real_browser(tmp_path):
    try:
        import jupytext  # noqa: F401
        from playwright.sync_api import sync_playwright
    except ImportError as e:  # fail, don't skip: `make test` installs them
        pytest.fail(f"{e.name} is missing: `pip install -e .[dev,notebooks]` (make test does)")
    from kvlab.playground.browser import chromium, open_page, serve, type_slider, wait_key_change

    try:
        exe = chromium()
    except FileNotFoundError as e:
        pytest.fail(str(e))
    runs = tmp_path / "runs"
    shot = tmp_path / "playground.png"
    with serve(tmp_path / "page", runs) as (url, proc):
        with sync_playwright() as pw:
            browser = pw.chromium.launch(executable_path=exe, args=["--no-sandbox"])
            try:
                page, errors = open_page(browser, url, PAGE_TIMEOUT_MS)
                ppl = page.locator(".kvlab-ro-teacher_ppl")
                ppl0 = ppl.inner_text()
                key0 = page.locator(".kvlab-run-key").inner_text()
                readout = page.locator(".kvlab-tau_bits .widget-readout")
                tau0 = float(readout.inner_text())
                assert key0 == _key_for(runs, tau0)      # the page shows the stored run of the slider's τ
                # the baseline column is the stored baseline run (no refresh, full cache)
                base_key = page.locator(".kvlab-base-key").inner_text()
                base = _stored(runs, base_key)
                assert base["config"]["decode"]["refresh"] is None and base["config"]["decode"].get("evict") is None
                assert page.locator(".kvlab-base-teacher_ppl").inner_text() == fmt(base["result"]["teacher_ppl"], "g3")
                assert page.locator(".kvlab-base-kl").inner_text() == fmt(base["result"]["kl"], "g3")
                assert "one sample, no spread" in page.locator(".kvlab-readouts").inner_text()

                # refresh_next = teacher: after a refresh the teacher picks the next token (a live run)
                page.locator(".kvlab-refresh_next select").select_option("teacher")
                key0 = wait_key_change(page, key0)
                ppl0 = ppl.inner_text()
                # move τ to 0 bits: a refresh after every step, so the teacher picks every token: a new
                # config, decoded live while the page streams it, then stored; its PPL must differ
                tau1 = 0.0
                type_slider(page, readout, f"{tau1:.2f}")
                page.wait_for_function(
                    "([k, p]) => { const e = document.querySelector('.kvlab-run-key');"
                    " const q = document.querySelector('.kvlab-ro-teacher_ppl');"
                    " return e && q && e.innerText !== k && q.innerText !== p; }",
                    arg=[key0, ppl0], timeout=180_000)
                key1, ppl1 = page.locator(".kvlab-run-key").inner_text(), ppl.inner_text()
                stored = _stored(runs, key1)
                assert stored["config"]["decode"]["refresh"] == {"policy": "EntropyGate", "tau_bits": tau1, "min_gap": 1, "W": None}
                assert stored["config"]["decode"]["refresh_next"] == "teacher"
                assert ppl1 == fmt(stored["result"]["teacher_ppl"], "g3") != ppl0
                assert page.locator(".kvlab-ro-refreshes").inner_text() == str(stored["result"]["refreshes"])
                assert "why refreshes fired" in page.locator(".kvlab-why").inner_text()
                _wait_plotted(page, stored["result"]["steps"]["entropy_bits"], errors=errors)    # the plot redrew in place

                # back to the first τ: stored, so answered from disk (time it end to end in the browser)
                t0 = type_slider(page, readout, f"{tau0:.2f}")
                page.wait_for_function("k => document.querySelector('.kvlab-run-key').innerText === k",
                                       arg=key0, timeout=30_000)
                dt = time.perf_counter() - t0
                assert ppl.inner_text() == ppl0
                _wait_plotted(page, _stored(runs, key0)["result"]["steps"]["entropy_bits"], errors=errors)
                assert "run store" in page.locator(".kvlab-status").inner_text()
                assert not page.locator(".kvlab-progress").is_visible()      # a store hit shows no progress bar
                print(f"\nbrowser: stored τ position redrawn {1000 * dt:.0f} ms after the edit "
                      f"(Enter -> new run key on the page); page status: {page.locator('.kvlab-status').inner_text()}")

                # eviction: a sliding window of 32 entries; the readouts are the stored eviction run's
                page.locator(".kvlab-evict select").select_option("sliding")
                key2 = wait_key_change(page, key0)
                type_slider(page, page.locator(".kvlab-budget .widget-readout"), "32")
                key2 = wait_key_change(page, key2)
                ev = _stored(runs, key2)
                assert ev["config"]["decode"]["evict"] == {"policy": "SlidingWindow", "window": 32, "sinks": 4}
                assert sum(ev["result"]["steps"]["evicted"]) > 0
                page.wait_for_function("v => document.querySelector('.kvlab-ro-kl').innerText === v",
                                       arg=fmt(ev["result"]["kl"], "g3"), timeout=30_000)
                steps = ev["result"]["steps"]["cache_bytes"]
                assert page.locator(".kvlab-ro-cache_kib").inner_text() == fmt(sum(steps) / len(steps) / 1024, "g3")
                assert page.locator(".kvlab-ro-teacher_ppl").inner_text() == fmt(ev["result"]["teacher_ppl"], "g3")
                page.wait_for_timeout(500)
                page.screenshot(path=str(shot), full_page=True)
                assert shot.stat().st_size > 10_000

                # cache-inspector tab: the shown (stored) eviction run is decoded again with the inspector
                # attached; the page then shows which tokens each layer holds and the survival map, per step
                page.locator(".lm-TabBar-tab", has_text="Cache inspector").click()
                button = page.locator(".kvlab-inspect")
                if button.is_visible():
                    button.click()
                page.locator(".kvlab-inspect-map").wait_for(timeout=180_000)
                assert page.locator(".kvlab-inspect-tokens span").count() > 0
                assert page.locator(".kvlab-inspect-step").is_visible()
                last = page.locator(".kvlab-inspect-step .widget-readout").inner_text()
                assert f"after step {last}" in page.locator(".kvlab-inspect-text").inner_text()

                # step-through tab: Reset builds one decoding of these settings, Step decodes a token
                page.locator(".lm-TabBar-tab", has_text="Step through").click()
                page.locator(".kvlab-step-reset").click()
                page.locator(".kvlab-step-step").click()
                info = page.locator(".kvlab-step-info")
                info.filter(has_text="top-5 candidates").wait_for(timeout=60_000)
                assert "step 1/" in info.inner_text().replace("\n", " ")
                assert page.locator(".kvlab-step-map .kvlab-slot").count() > 0      # the live map, one cell per slot
            finally:
                browser.close()
    assert proc.poll() is not None


def _wait_plotted(page, entropy, timeout: float = 60.0, errors=()) -> None:
    """Wait until the entropy trace in the browser ("this run", trace 1) holds ``entropy``."""
    js = ("() => { const g = _plot(0);"
          " return g && g.data && g.data[1].y ? Array.from(g.data[1].y) : null; }")
    js = js.replace("() => {", "() => { " + PLOT_JS, 1)
    end = time.monotonic() + timeout
    got = None
    while time.monotonic() < end:
        got = page.evaluate(js)
        if got is not None and got == pytest.approx(entropy):
            return
        page.wait_for_timeout(200)
    raise AssertionError(f"the entropy plot did not redraw: {got} != {entropy}; page shows run "
                         f"{page.locator('.kvlab-run-key').inner_text()}; browser errors: {list(errors)[-5:]}")


def _runs(runs: Path) -> dict:
    """``{run key: {"config", "result"}}`` of this test's fresh run store, through its public API."""
    from kvlab.store import RunStore, run_key

    return {run_key(c): {"config": c, "result": r} for c, r in RunStore(runs)}


def _stored(runs: Path, key: str) -> dict:
    """The stored run whose config key is ``key`` (the key the page shows)."""
    got = _runs(runs)
    assert key in got, f"no stored run with key {key}; stored: {sorted(got)}"
    return got[key]


def _key_for(runs: Path, tau: float) -> str:
    """The stored run (in this test's fresh store) whose entropy gate has ``tau``."""
    keys = [k for k, r in _runs(runs).items() if (r["config"]["decode"].get("refresh") or {}).get("tau_bits") == tau]
    assert len(keys) == 1, f"expected one stored run with tau_bits={tau}, found {keys}"
    return keys[0]
