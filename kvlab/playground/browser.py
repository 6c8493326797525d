"""Serve the playground page with Voilà and drive it in Debian's chromium (Playwright): shared by the
browser test and :mod:`kvlab.playground.screenshot`.
It starts and stops (by process group) the Voilà server it launched, and writes only into the folders it is given.

Needs ``voila``, ``playwright`` (its Python package only: the browser is the system's chromium,
``apt-get install -y chromium``) and ``jupytext``.
"""
from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
NOTEBOOK = REPO / "notebooks" / "06_playground.py"


def chromium() -> str:
    """Path of a chromium executable (``$KVLAB_CHROMIUM``, /usr/bin/chromium, or on PATH)."""
    for path in (os.environ.get("KVLAB_CHROMIUM"), "/usr/bin/chromium", shutil.which("chromium"),
                 shutil.which("chromium-browser")):
        if path and Path(path).is_file():
            return path
    raise FileNotFoundError("no chromium: `apt-get install -y chromium` (or set KVLAB_CHROMIUM to its path)")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_listening(port: int, proc: subprocess.Popen, timeout: float, what: str = "voila",
                   log: Path | None = None) -> None:
    """Wait until ``proc`` (``what``) accepts connections on 127.0.0.1:``port``; raise if it exits first or
    the time runs out (with the tail of its ``log`` file, when given)."""
    def fail(msg: str):
        tail = f":\n{log.read_text()[-3000:]}" if log is not None and log.is_file() else ""
        raise RuntimeError(msg + tail)

    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if proc.poll() is not None:
            fail(f"{what} exited with {proc.returncode} before listening")
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.25)
    fail(f"{what} did not listen on 127.0.0.1:{port} within {timeout:.0f} s")


def stop(proc: subprocess.Popen) -> None:
    """Stop the server (and its kernels) through its process group (started as its own session): the whole
    group, even when the group leader (e.g. ``make``) has already exited, since its children would be left."""
    try:
        os.killpg(proc.pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    try:
        proc.wait(20)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(10)


@contextmanager
def serve(workdir: Path, runs: Path, smoke: bool = True, extra_env: dict | None = None):
    """Voilà serving notebook 06 on a free loopback port; yields ``(url, proc)``; stops it on exit.
    ``runs``: the run store the page uses (``$KVLAB_RUNS``)."""
    import jupytext

    workdir = Path(workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    nb_path = workdir / "06_playground.ipynb"
    jupytext.write(jupytext.read(NOTEBOOK), nb_path)
    env = {**os.environ, "KVLAB_RUNS": str(runs), "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([str(REPO)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]),
           **(extra_env or {})}
    if smoke:
        env["KVLAB_SMOKE"] = "1"
    port = free_port()
    log = open(workdir / "voila.log", "w")
    proc = subprocess.Popen([sys.executable, "-m", "voila", str(nb_path), "--no-browser", f"--port={port}",
                             "--Voila.ip=127.0.0.1", "--VoilaExecutor.timeout=600"],
                            cwd=workdir, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        wait_listening(port, proc, 120)
        yield f"http://127.0.0.1:{port}/", proc
    finally:
        stop(proc)
        log.close()


def type_slider(page, readout, value: str) -> float:
    """Edit an ipywidgets slider through its readout (what a user types), then Enter; returns the
    ``perf_counter`` time just before Enter (the change)."""
    readout.click()
    page.keyboard.press("Control+A")
    page.keyboard.type(value)
    t = time.perf_counter()
    page.keyboard.press("Enter")
    return t


def wait_key_change(page, old_key: str, timeout_ms: int = 180_000) -> str:
    """Wait until the page shows another run key than ``old_key``; returns it."""
    page.wait_for_function("k => { const e = document.querySelector('.kvlab-run-key'); return e && e.innerText !== k; }",
                           arg=old_key, timeout=timeout_ms)
    return page.locator(".kvlab-run-key").inner_text()


ANYWIDGET_TIMEOUT = "[anywidget] Failed to initialize model"


def open_page(browser, url: str, timeout_ms: int, tries: int = 3):
    """A page of the playground with live plots; returns ``(page, errors)`` (``errors``: page errors and
    console errors seen since).

    plotly's FigureWidget is an anywidget, and anywidget gives a model 2 s to initialize
    (``AbortSignal.timeout(2000)``); on an overloaded machine loading plotly's bundle takes longer, the
    plot renders but never receives updates, and the page logs ANYWIDGET_TIMEOUT. Then the page is
    loaded again (the bundle is cached by then), up to ``tries`` times."""
    for i in range(tries):
        page = browser.new_page(viewport={"width": 1280, "height": 1500})
        errors: list[str] = []
        page.on("pageerror", lambda e, errors=errors: errors.append(f"pageerror: {e}"))
        page.on("console", lambda m, errors=errors: errors.append(f"console.{m.type}: {m.text}") if m.type == "error" else None)
        page.goto(url, timeout=timeout_ms)
        page.locator(".kvlab-ro-teacher_ppl").wait_for(timeout=timeout_ms)
        page.wait_for_timeout(2500)                      # past anywidget's 2 s initialization window
        if not any(ANYWIDGET_TIMEOUT in e for e in errors):
            return page, errors
        print(f"page load {i + 1}: {ANYWIDGET_TIMEOUT} (machine too slow for anywidget's 2 s); loading again", flush=True)
        page.close()
    raise RuntimeError(f"{ANYWIDGET_TIMEOUT} on {tries} page loads: the plots would not update (machine overloaded?)")
