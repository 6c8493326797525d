"""`make lab` in a real browser: JupyterLab (started through the Makefile, without its install step) opens
notebooks/01's ``.py`` as a notebook, not as text, saving it leaves the committed file byte-identical
(so ``git status`` stays clean), and no "official Jupyter news" prompt shows (test_lab_settings.py checks
the overrides against the installed schemas).

Needs what ``make test`` installs: JupyterLab + jupytext, ``playwright``, Debian's ``/usr/bin/chromium``, and
the settings override ``make install`` copies into the venv (``jupyter/overrides.json``). Not skipped when
they are missing: it fails and says what to install.
"""
from __future__ import annotations

import os
import secrets
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kvlab.playground.browser import chromium, free_port, stop, wait_listening

REPO = Path(__file__).resolve().parent.parent
NOTEBOOK = "notebooks/01_overfill_step_by_step.py"
TIMEOUT_MS = 180_000


def _wait_kernel_idle(port: int, token: str, name: str, timeout: float) -> None:
    """Wait until the server has a session for notebook ``name`` whose kernel is idle (REST API)."""
    import json
    import urllib.request

    end, sessions = time.monotonic() + timeout, []
    while time.monotonic() < end:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/api/sessions?token={token}", timeout=10) as r:
            sessions = json.load(r)
        if any(s["path"].endswith(name) and s["kernel"]["execution_state"] == "idle" for s in sessions):
            return
        time.sleep(0.5)
    raise AssertionError(f"no idle kernel for {name} within {timeout:.0f} s: {sessions}")


def _git_status(path: str) -> str:
    return subprocess.run(["git", "status", "--porcelain", "--", path], cwd=REPO, capture_output=True, text=True,
                          check=True).stdout


@pytest.mark.integration
def test_make_lab_opens_a_py_as_a_notebook_and_saving_changes_nothing(tmp_path):
    try:
        from playwright.sync_api import sync_playwright
    except ImportError as e:  # fail, don't skip: `make test` installs it
        pytest.fail(f"{e.name} is missing: `pip install -e .[dev,notebooks]` (make test does)")
    if shutil.which("make") is None:
        pytest.fail("no `make` on PATH")
    venv = Path(sys.prefix)
    overrides = venv / "share" / "jupyter" / "lab" / "settings" / "overrides.json"
    assert overrides.is_file() and overrides.read_text() == (REPO / "jupyter" / "overrides.json").read_text(), (
        f"{overrides} is missing or stale: `make install` copies jupyter/overrides.json there")
    chromium_path = chromium()
    path = REPO / NOTEBOOK
    before, status_before = path.read_bytes(), _git_status(NOTEBOOK)
    mtime0 = path.stat().st_mtime_ns

    port, token = free_port(), secrets.token_hex(16)
    env = {**os.environ, "JUPYTER_TOKEN": token, "KVLAB_RUNS": str(tmp_path / "runs"),
           # a fresh user: no personal JupyterLab settings or saved layout may decide the viewer
           "JUPYTERLAB_SETTINGS_DIR": str(tmp_path / "lab-settings"),
           "JUPYTERLAB_WORKSPACES_DIR": str(tmp_path / "lab-workspaces"),
           "JUPYTER_RUNTIME_DIR": str(tmp_path / "runtime"), "OMP_NUM_THREADS": "1"}
    log_path = tmp_path / "lab.log"
    log = open(log_path, "w")
    # -o install: never (re)run the install step here; `make test` has installed already
    proc = subprocess.Popen(["make", "--no-print-directory", "-o", "install", "lab", f"PORT={port}", f"VENV={venv}"],
                            cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        wait_listening(port, proc, 120, what="make lab", log=log_path)
        with sync_playwright() as pw:
            browser = pw.chromium.launch(executable_path=chromium_path, args=["--no-sandbox"])
            try:
                page = browser.new_page(viewport={"width": 1280, "height": 900})
                page.goto(f"http://127.0.0.1:{port}/lab/tree/{NOTEBOOK}?token={token}", timeout=TIMEOUT_MS)
                panel = page.locator(".jp-NotebookPanel").first
                panel.wait_for(timeout=TIMEOUT_MS)
                cells = panel.locator(".jp-Cell")
                cells.first.wait_for(timeout=TIMEOUT_MS)
                # cells render in batches (JupyterLab's deferred windowing): wait for more than a handful
                page.wait_for_function("() => document.querySelectorAll('.jp-NotebookPanel .jp-Cell').length > 5",
                                       timeout=60_000)
                assert page.locator(".jp-NotebookPanel .jp-CodeCell").count() > 2
                assert page.locator(".jp-FileEditor").count() == 0, "the .py also opened in the text editor"
                tab = page.locator("#jp-main-dock-panel .lm-TabBar-tab.lm-mod-current .lm-TabBar-tabLabel").first
                assert tab.inner_text() == Path(NOTEBOOK).name      # the panel is this file's
                # the kernel the header names starts (its kernelspec is what a save writes back)
                _wait_kernel_idle(port, token, Path(NOTEBOOK).name, 120)
                panel.locator(".jp-Cell").first.click()
                page.keyboard.press("Escape")
                page.keyboard.press("Control+s")
                end = time.monotonic() + 60
                while path.stat().st_mtime_ns == mtime0 and time.monotonic() < end:
                    time.sleep(0.25)
                assert path.stat().st_mtime_ns != mtime0, "Ctrl+S did not save the notebook"
                time.sleep(1.0)          # let a second write (if any) land
                after = path.read_bytes()
                assert after == before, "saving rewrote the notebook:\n" + _diff(before, after)
                assert _git_status(NOTEBOOK) == status_before
                # no "get notified about official Jupyter news?" toast: the overrides set fetchNews to "false"
                # (Never); by now the lab has long been restored, which is when the prompt would show
                news = page.get_by_text("official Jupyter news")
                assert news.count() == 0, "JupyterLab asked about Jupyter news: jupyter/overrides.json must set " \
                    "@jupyterlab/apputils-extension:notification fetchNews to \"false\""
            finally:
                browser.close()
    finally:
        stop(proc)
        log.close()
        if path.read_bytes() != before:     # never leave the checkout modified by the test
            path.write_bytes(before)
    assert proc.poll() is not None


def _diff(a: bytes, b: bytes) -> str:
    import difflib

    return "".join(difflib.unified_diff(a.decode().splitlines(True), b.decode().splitlines(True), "committed", "saved"))


WIDGET_NOTEBOOK = '''# ---
# jupyter:
#   kernelspec:
#     display_name: Python 3 (ipykernel)
#     language: python
#     name: python3
# ---

# %%
import ipywidgets as W
W.IntSlider(value=3)

# %%
from tqdm.auto import tqdm
for i in tqdm(range(3)):
    pass

# %%
import plotly.graph_objects as go
go.FigureWidget(data=[go.Scatter(y=[1, 2, 3])])
'''


@pytest.mark.integration
def test_widgets_in_a_second_session_and_after_a_reload(tmp_path):
    """The widgets the notebooks use (a slider, a tqdm bar, a plotly FigureWidget) render in a second browser
    session on the same kernel and after a reload, never as "Error displaying widget: model not found"."""
    from playwright.sync_api import sync_playwright

    root = tmp_path / "root"
    root.mkdir()
    (root / "w.py").write_text(WIDGET_NOTEBOOK)
    port, token = free_port(), secrets.token_hex(16)
    env = {**os.environ, "JUPYTER_TOKEN": token, "JUPYTERLAB_SETTINGS_DIR": str(tmp_path / "s"),
           "JUPYTERLAB_WORKSPACES_DIR": str(tmp_path / "w"), "JUPYTER_RUNTIME_DIR": str(tmp_path / "runtime")}
    log_path = tmp_path / "lab.log"
    log = open(log_path, "w")
    proc = subprocess.Popen([sys.executable, "-m", "jupyterlab", "--no-browser", "--allow-root", "--ServerApp.ip=127.0.0.1",
                             f"--ServerApp.port={port}", f"--ServerApp.root_dir={root}",
                             "--LabApp.expose_app_in_browser=True"],
                            env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}/lab/tree/w.py?token={token}"

    widgets_shown = ("() => document.querySelectorAll('.jp-NotebookPanel .js-plotly-plot').length > 0"
                     " && document.querySelectorAll('.jp-NotebookPanel .widget-slider').length > 0"
                     " && document.querySelectorAll('.jp-NotebookPanel .widget-hprogress, .jp-NotebookPanel"
                     " progress').length > 0")

    def run_all(page, when):
        """Run every cell through JupyterLab's own command (not key presses, which a busy CI machine can drop
        while the restored notebook takes focus), dismissing any dialog in the way; up to 3 tries, then fail
        with what the page and the server showed."""
        page.locator(".jp-NotebookPanel .jp-Cell").first.wait_for(timeout=TIMEOUT_MS)
        _wait_kernel_idle(port, token, "w.py", 120)
        page.wait_for_function("() => window.jupyterapp && window.jupyterapp.shell.currentWidget"
                               " && window.jupyterapp.shell.currentWidget.sessionContext"
                               " && window.jupyterapp.shell.currentWidget.sessionContext.session", timeout=TIMEOUT_MS)
        dialogs = []
        for _ in range(3):
            for d in page.locator(".jp-Dialog").all():
                dialogs.append(d.inner_text()[:200])
                d.locator(".jp-Dialog-button.jp-mod-accept").first.click()
            page.evaluate("() => window.jupyterapp.commands.execute('notebook:run-all-cells')")
            try:
                page.wait_for_function(widgets_shown, timeout=60_000)
                return
            except Exception:  # noqa: BLE001 - retried, then reported below with the page and the server log
                continue
        tail = page.locator(".jp-NotebookPanel").first.inner_text()[-500:]
        pytest.fail(f"{when}: the widgets did not render after 3 runs of every cell; dialogs {dialogs}; "
                    f"page tail {tail!r}; server log tail {log_path.read_text()[-1500:]!r}")

    def check(page, when):
        text = page.locator(".jp-NotebookPanel").first.inner_text()
        assert "model not found" not in text and "Error displaying widget" not in text, f"{when}: {text[-500:]}"

    try:
        wait_listening(port, proc, 120, what="make lab", log=log_path)
        with sync_playwright() as pw:
            browser = pw.chromium.launch(executable_path=chromium(), args=["--no-sandbox"])
            try:
                a = browser.new_context().new_page()          # two sessions: separate cookies and storage
                a.goto(url, timeout=TIMEOUT_MS)
                run_all(a, "session A")
                check(a, "session A")
                b = browser.new_context().new_page()
                b.goto(url, timeout=TIMEOUT_MS)
                run_all(b, "session B")                        # re-run on the same kernel from session B
                check(b, "session B re-run")
                check(a, "session A after B's re-run")
                a.reload()
                run_all(a, "session A after a reload")
                check(a, "session A after a reload")
            finally:
                browser.close()
    finally:
        stop(proc)
        log.close()
