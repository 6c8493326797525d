"""The "Cache inspector" tab (ipywidgets): for the shown run, which tokens each layer still holds after
the step the slider picks — the shaded text and the layers × positions survival map, from
:class:`~kvlab.playground.inspection.Inspection` (logic) and :mod:`kvlab.playground.render` (HTML).
A run answered from the run store has no per-layer history: the "inspect the cache" button decodes it
again with the inspector attached. Widgets only: no model, cache or file is touched here.
"""
from __future__ import annotations

import ipywidgets as W

from kvlab.playground.render import esc, inspect_html, png_html


class InspectPanel:
    """The cache-inspector tab of a :class:`~kvlab.playground.Playground`; ``widget`` is the tab."""

    def __init__(self, pg):
        self.pg = pg
        self.inspection = None
        self.button = W.Button(description="inspect the cache", layout=W.Layout(width="160px"),
                               tooltip="decode the shown run again with the cache inspector attached")
        self.button.add_class("kvlab-inspect")
        self.button.on_click(lambda _: self._inspect())
        self.slider = W.IntSlider(value=1, min=1, max=1, description="after step", continuous_update=False,
                                  layout=W.Layout(width="520px", display="none"))
        self.slider.add_class("kvlab-inspect-step")
        self._quiet = False                            # True while show() moves the slider itself
        self.slider.observe(lambda ch: None if self._quiet else self.draw(ch["new"]), names="value")
        self.text = W.HTML("<i>no run shown yet</i>")
        self.text.add_class("kvlab-inspect-text")
        self.map = W.HTML("")
        self.map.add_class("kvlab-inspect-survival")
        self.widget = W.VBox([W.HBox([self.button, self.slider]), self.text, self.map])

    def _inspect(self) -> None:
        try:
            self.pg.inspect()
        except ValueError as e:
            self.text.value = f"<span style='color:#c00'>⚠ {esc(str(e))}</span>"

    def show(self, inspection) -> None:
        """Show ``inspection`` (an "inspect" event): the slider spans its steps and starts at the last one."""
        self.inspection = inspection
        steps = inspection.steps
        self.button.layout.display = "" if inspection.state == "stored" else "none"
        self.slider.layout.display = "" if steps else "none"
        if steps:
            self._quiet = True
            try:   # widen first so min and max never cross (a slider refuses min > max)
                self.slider.min, self.slider.max = min(self.slider.min, steps[0]), max(self.slider.max, steps[-1])
                self.slider.value = steps[-1]
                self.slider.min, self.slider.max = steps[0], steps[-1]
            finally:
                self._quiet = False
        self.draw(steps[-1] if steps else None)

    def draw(self, at: int | None) -> None:
        """Show the state after step ``at`` of the current inspection."""
        ins = self.inspection
        if ins is None:
            return
        try:
            v = ins.view(at if ins.steps else None)
        except ValueError as e:                         # a step the inspector did not observe
            self.text.value = f"<span style='color:#c00'>⚠ {esc(str(e))}</span>"
            return
        self.text.value = inspect_html(v)
        self.map.value = png_html(ins.survival_png(v.step), alt=f"survival map after step {v.step}") if v.step else ""
