"""The playground's widgets: a thin ipywidgets + plotly ``FigureWidget`` view over
:class:`~kvlab.playground.Playground` (all logic lives there and in :class:`~kvlab.playground.Stepper`).
Widgets only: no model, cache or file is touched here.

``PlaygroundView(pg).widget`` is the whole app (an "Explore" tab, a "Step through" tab and a "Cache
inspector" tab); display it
in a notebook or serve the notebook with Voilà (``make playground``). Plots are updated in place.
DOM classes (``kvlab-ro-<readout>``, ``kvlab-run-key``, ``kvlab-<control>``, ``kvlab-err-<control>``)
let a browser test find what it needs.

:class:`PlaygroundView` composes one part per panel and routes the controller's events to them:
:class:`~kvlab.playground.view_controls.ControlPanel` (the controls column, with the precompute row),
:class:`~kvlab.playground.view_results.ResultsPanel` (status, readouts, spread, buttons, text) around
:class:`~kvlab.playground.view_plot.ExplorePlot` (the figure),
:class:`~kvlab.playground.view_step.StepPanel` (the step-through tab) and
:class:`~kvlab.playground.view_inspect.InspectPanel` (the cache inspector of the shown run); their HTML is
:mod:`kvlab.playground.render` (plain strings).
"""
from __future__ import annotations

import threading

import ipywidgets as W

from kvlab.playground.compare import MAX_PINS
from kvlab.playground.controller import Playground
from kvlab.playground.render import PIN_COLORS, live_map_html
from kvlab.playground.view_controls import ControlPanel, PrecomputeRow
from kvlab.playground.view_inspect import InspectPanel
from kvlab.playground.view_plot import PLOT_THROTTLE_S, T_PIN0, ExplorePlot, on_kernel_loop
from kvlab.playground.view_results import ResultsPanel
from kvlab.playground.view_step import StepPanel


class PlaygroundView:
    """Widgets bound to a :class:`Playground`; ``.widget`` is the app."""

    def __init__(self, pg: Playground):
        self.pg = pg
        self._lock = threading.RLock()
        self.panel = ControlPanel(pg, on_errors=self._render_errors)
        self.plot = ExplorePlot(pg, self._lock)
        self.results = ResultsPanel(pg, self.plot)
        self.steps = StepPanel(pg)
        self.inspector = InspectPanel(pg)
        # the widgets tests and scripts reach for, by their old names
        self.controls, self.errs, self.policy_rows = self.panel.controls, self.panel.errs, self.panel.policy_rows
        self.fig = self.plot.fig
        r = self.results
        self.status, self.progress, self.progress_msg, self.table, self.why = (r.status, r.progress, r.progress_msg,
                                                                               r.table, r.why)
        self.step_info, self.step_map = self.steps.info, self.steps.map
        self.widget = W.VBox([
            W.HTML("<h3 style='margin:4px 0'>kvlab playground — refresh and eviction, live</h3>"),
            W.Tab(children=[W.HBox([self.panel.widget, self.results.widget]), self.steps.widget, self.inspector.widget],
                  titles=("Explore", "Step through", "Cache inspector")),
        ])
        self.widget.add_class("kvlab-playground")
        pg.subscribe(self._on_event)
        self.panel.sync_visibility()
        if pg.shown is not None:
            self.results.render(pg.shown)
        if pg.inspection is not None:
            self.inspector.show(pg.inspection)
        self._render_errors(pg.errors)
        self._on_event("percentiles", pg.percentiles())
        self.results.set_status(pg.status)

    @property
    def stepper(self):
        """The step-through tab's :class:`~kvlab.playground.stepper.Stepper` (None before its first Reset)."""
        return self.steps.stepper

    def _render_errors(self, errors: dict) -> None:
        self.panel.render_errors(errors)
        self.results.errors(errors)

    def _on_event(self, event: str, payload) -> None:
        with self._lock:
            if event == "errors":
                self._render_errors(payload)
            elif event == "status":
                self.results.set_status(payload)
            elif event == "percentiles":
                self.panel.percentiles(payload)
            elif event == "settings":
                self.panel.sync_controls(payload)
            elif event == "shown":
                self.results.render(payload)
            elif event == "inspect":
                self.inspector.show(payload)
            elif event == "spread":
                self.results.spread(payload)
            elif event == "pins":
                if self.pg.shown is not None:
                    self.results.render(self.pg.shown)
            elif event == "timing":
                self.results.timing(payload)
            elif event == "live_start":
                self.results.live_start(payload)
            elif event == "point":
                self.results.point(payload)
            elif event == "progress":
                if payload.stage == "precompute":
                    self.panel.pre.progress(payload)
                else:
                    self.results.progress_event(payload)


def show(pg: Playground) -> W.Widget:
    """Build the view of ``pg`` and return its widget (display it)."""
    return PlaygroundView(pg).widget


__all__ = ["MAX_PINS", "PIN_COLORS", "PLOT_THROTTLE_S", "T_PIN0", "ControlPanel", "ExplorePlot", "PlaygroundView",
           "InspectPanel", "PrecomputeRow", "ResultsPanel", "StepPanel", "live_map_html", "on_kernel_loop", "show"]
