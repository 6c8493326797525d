"""The "Step through" tab (ipywidgets): Step / Run / Stop / Reset over one
:class:`~kvlab.playground.stepper.Stepper` of the Explore tab's settings, with the step's readout, the
live map of the cache and the text so far (HTML from :mod:`kvlab.playground.render`).
"""
from __future__ import annotations

import threading
import time

import ipywidgets as W

from kvlab.playground.render import esc, live_map_html, step_info_html, step_text_html
from kvlab.playground.settings import POLICY_LABELS
from kvlab.playground.stepper import SettingsError, Stepper

_OVER = "<small>the run is over: Reset to start again</small>"


def _error(e: BaseException) -> str:
    return f"<span style='color:#c00'>⚠ {esc(type(e).__name__ + ': ' + str(e))}</span>"


class StepPanel:
    """The step-through tab of a :class:`~kvlab.playground.Playground`; ``widget`` is the tab."""

    def __init__(self, pg):
        self.pg = pg
        self.stepper: Stepper | None = None
        self._thread: threading.Thread | None = None
        b = {n: W.Button(description=n, layout=W.Layout(width="90px")) for n in ("Step", "Run", "Stop", "Reset")}
        b["Step"].on_click(lambda _: self.step_once())
        b["Run"].on_click(lambda _: self.run())
        b["Stop"].on_click(lambda _: self.stepper and self.stepper.stop())
        b["Reset"].on_click(lambda _: self.reset())
        for n, w in b.items():
            w.add_class(f"kvlab-step-{n.lower()}")
        self.buttons = b
        self.msg = W.HTML("<i>Reset builds one decoding from the Explore tab's controls; Step decodes one token.</i>")
        self.info = W.HTML("")
        self.info.add_class("kvlab-step-info")
        # The live map is HTML, not a second FigureWidget: plotly's widget bundle keeps one figure
        # model per page module (its factory shares a variable), and in chromium a second FigureWidget's
        # updates did not show (measured); the Explore traces stay the page's one FigureWidget.
        self.map = W.HTML("")
        self.map.add_class("kvlab-step-map")
        self.text = W.HTML("")
        self.widget = W.VBox([W.HBox(list(b.values())), self.msg, self.info, self.map, self.text])

    def _busy(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def reset(self) -> bool:
        """Build one decoding of the current settings (False, with the reason shown, when they are bad)."""
        if self.stepper is not None:
            self.stepper.stop()
        if self._thread is not None:
            self._thread.join()
        try:
            if self.stepper is None:
                self.stepper = Stepper(self.pg)
            else:
                self.stepper.reset()
        except SettingsError as e:
            self.msg.value = f"<span style='color:#c00'>⚠ fix the Explore controls first: {esc(str(e))}</span>"
            return False
        except Exception as e:
            self.msg.value = _error(e)
            return False
        s = self.stepper.settings
        self.msg.value = (f"<small>{esc(s.mode)} · refresh {esc(POLICY_LABELS[s.policy])} · N={s.N} · "
                          f"{esc(s.prompt[:80])}</small>")
        self.info.value = ""
        self.text.value = ""
        self.map.value = ""
        return True

    def step_once(self) -> None:
        """Decode one token (building the decoding first if there is none)."""
        if self._busy() or (self.stepper is None and not self.reset()):
            return
        try:
            v = self.stepper.step()
        except Exception as e:
            self.msg.value = _error(e)
            return
        if v is None:
            self.msg.value = _OVER
        else:
            self.draw(v)

    def run(self) -> None:
        """Decode to the end on a thread, redrawing at most every 0.1 s (Stop stops it)."""
        if self._busy() or (self.stepper is None and not self.reset()):
            return
        last = {"t": 0.0}

        def on_step(v):
            if time.perf_counter() - last["t"] > 0.1 or v.done:
                self.draw(v)
                last["t"] = time.perf_counter()

        def work():
            try:
                self.stepper.run(on_step=on_step)
            except Exception as e:
                self.msg.value = _error(e)

        self._thread = threading.Thread(target=work, daemon=True, name="kvlab-step-run")
        self._thread.start()

    def draw(self, v) -> None:
        """Show step view ``v``: its readout, the live map and the text so far."""
        self.info.value = step_info_html(v, self.stepper.total)
        self.map.value = live_map_html(v.live, v.prompt_len)
        self.text.value = step_text_html(v, self.stepper.history)
        if v.done:
            self.msg.value = _OVER
