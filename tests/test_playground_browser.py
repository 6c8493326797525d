"""The playground in a real browser: Voilà serves notebooks/06_playground.py (smoke settings, the real
pair, a fresh run store in a tmp dir), Playwright drives Debian's chromium: move the τ slider, wait for
the teacher-PPL readout to change, check it against the stored run, screenshot figures/playground.png.

Needs the packages ``voila`` and ``playwright`` and ``/usr/bin/chromium`` (``make test`` installs
all three; Playwright's own browser download is not used). Not skipped when they are missing: it fails
and says what to install.
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kvlab.playground.controller import fmt

REPO = Path(__file__).resolve().parent.parent
NOTEBOOK = REPO / "notebooks" / "06_playground.py"
SCREENSHOT = REPO / "figures" / "playground.png"
PAGE_TIMEOUT_MS = 240_000
# the i-th plotly graph of the app, in page order (0 = Explore's traces, the page's one FigureWidget)
PLOT_JS = "const _plot = i => document.querySelectorAll('.kvlab-playground .js-plotly-plot')[i];"      # Voilà shows the page once the notebook ran: model load + first runs


def _chromium() -> str:
    for path in (os.environ.get("KVLAB_CHROMIUM"), "/usr/bin/chromium", shutil.which("chromium"),
                 shutil.which("chromium-browser")):
        if path and Path(path).is_file():
            return path
    pytest.fail("no chromium: run `make test` (it installs Debian's chromium) or `apt-get install -y chromium`")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_listening(port: int, proc: subprocess.Popen, timeout: float) -> None:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if proc.poll() is not None:
            raise AssertionError(f"voila exited with {proc.returncode} before listening")
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.25)
    raise AssertionError(f"voila did not listen on 127.0.0.1:{port} within {timeout:.0f} s")


def _stop(proc: subprocess.Popen) -> None:
    """Stop the server (and its kernel) through its own pid / process group."""
    if proc.poll() is not None:
        return
    try:
        os.killpg(proc.pid, signal.SIGTERM)      # the server was started as its own session: pgid == pid
    except ProcessLookupError:
        return
    try:
        proc.wait(20)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(10)


@pytest.mark.integration
def test_playground_tau_slider_in_a_real_browser(tmp_path):
    try:
        import jupytext
        from playwright.sync_api import sync_playwright
    except ImportError as e:  # fail, don't skip: `make test` installs them
        pytest.fail(f"{e.name} is missing: `pip install -e .[dev,notebooks]` (make test does)")
    chromium = _chromium()
    nb_path = tmp_path / "06_playground.ipynb"
    jupytext.write(jupytext.read(NOTEBOOK), nb_path)
    runs = tmp_path / "runs"
    env = {**os.environ, "KVLAB_SMOKE": "1", "KVLAB_RUNS": str(runs), "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([str(REPO)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p])}
    port = _free_port()
    log = open(tmp_path / "voila.log", "w")
    proc = subprocess.Popen([sys.executable, "-m", "voila", str(nb_path), "--no-browser", f"--port={port}",
                             "--Voila.ip=127.0.0.1", "--VoilaExecutor.timeout=600"],
                            cwd=tmp_path, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        _wait_listening(port, proc, 120)
        with sync_playwright() as pw:
            browser = pw.chromium.launch(executable_path=chromium, args=["--no-sandbox"])
            try:
                page = browser.new_page(viewport={"width": 1280, "height": 1500})
                page.goto(f"http://127.0.0.1:{port}/", timeout=PAGE_TIMEOUT_MS)
                ppl = page.locator(".kvlab-ro-teacher_ppl")
                ppl.wait_for(timeout=PAGE_TIMEOUT_MS)
                ppl0 = ppl.inner_text()
                key0 = page.locator(".kvlab-run-key").inner_text()
                readout = page.locator(".kvlab-tau_bits .widget-readout")
                tau0 = float(readout.inner_text())
                assert key0 == _key_for(runs, tau0)      # the page shows the stored run of the slider's τ

                # refresh_next = teacher: after a refresh the teacher picks the next token (a live run)
                page.locator(".kvlab-refresh_next select").select_option("teacher")
                page.wait_for_function("k => document.querySelector('.kvlab-run-key').innerText !== k",
                                       arg=key0, timeout=180_000)
                key0, ppl0 = page.locator(".kvlab-run-key").inner_text(), ppl.inner_text()
                # move τ to 0 bits: a refresh after every step, so the teacher picks every token: a new
                # config, decoded live while the page streams it, then stored; its PPL must differ
                tau1 = 0.0
                _type_slider(page, readout, f"{tau1:.2f}")
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
                _wait_plotted(page, stored["result"]["steps"]["entropy_bits"])    # the plot redrew in place

                # back to the first τ: stored, so answered from disk (time it end to end in the browser)
                t0 = _type_slider(page, readout, f"{tau0:.2f}")
                page.wait_for_function("k => document.querySelector('.kvlab-run-key').innerText === k",
                                       arg=key0, timeout=30_000)
                dt = time.perf_counter() - t0
                assert ppl.inner_text() == ppl0
                _wait_plotted(page, _stored(runs, key0)["result"]["steps"]["entropy_bits"])
                assert "run store" in page.locator(".kvlab-status").inner_text()
                print(f"\nbrowser: stored τ position redrawn {1000 * dt:.0f} ms after the edit "
                      f"(Enter -> new run key on the page); page status: {page.locator('.kvlab-status').inner_text()}")
                page.wait_for_timeout(500)                 # the picture: τ at its calibrated p90
                SCREENSHOT.parent.mkdir(parents=True, exist_ok=True)
                page.screenshot(path=str(SCREENSHOT), full_page=True)

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
    finally:
        _stop(proc)
        log.close()
    assert proc.poll() is not None


def _wait_plotted(page, entropy, timeout: float = 30.0) -> None:
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
    raise AssertionError(f"the entropy plot did not redraw: {got} != {entropy}")


def _type_slider(page, readout, value: str) -> float:
    """Edit an ipywidgets slider through its readout (what a user types), then Enter; returns the
    ``perf_counter`` time just before Enter (the change)."""
    readout.click()
    page.keyboard.press("Control+A")
    page.keyboard.type(value)
    t = time.perf_counter()
    page.keyboard.press("Enter")
    return t


def _stored(runs: Path, key: str) -> dict:
    """The stored run whose config key is ``key`` (``runs/<key>.<code+machine key>.json``)."""
    files = list(runs.glob(f"{key}.*.json"))
    assert len(files) == 1, f"expected one stored run for key {key}, found {files}"
    return json.loads(files[0].read_text())


def _key_for(runs: Path, tau: float) -> str:
    """The stored run (in this test's fresh store) whose entropy gate has ``tau``."""
    keys = [p.name.split(".")[0] for p in runs.glob("*.json")     # <config key>.<code+machine key>.json
            if (json.loads(p.read_text())["config"]["decode"].get("refresh") or {}).get("tau_bits") == tau]
    assert len(keys) == 1, f"expected one stored run with tau_bits={tau}, found {keys}"
    return keys[0]
