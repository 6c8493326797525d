"""The Explore tab's plot (plotly ``FigureWidget``): entropy per step, cache length, and the live cache's
provenance strip, for the shown run, its baseline and the pinned runs; streamed points while a run decodes.
Widgets only: no model, cache or file is touched here.

The figure is the page's one ``FigureWidget`` (its trace indices: ``T_*``), updated in place, always on the
kernel's loop (:func:`on_kernel_loop`).
"""
from __future__ import annotations

import time

import plotly.graph_objects as go
from plotly.subplots import make_subplots

from kvlab.playground.compare import MAX_PINS
from kvlab.playground.render import BASE, PIN_COLORS, REFRESH, STUDENT, TEACHER
from kvlab.playground.shown import LivePoint, Shown

_WRITER_SCALE = [[0.0, STUDENT], [0.5, STUDENT], [0.5, TEACHER], [1.0, TEACHER]]
# trace indices of the Explore figure
T_BASE, T_RUN, T_REF, T_TAU, T_BASE_LEN, T_LEN, T_MAP, T_LEG_T, T_LEG_S, T_PIN0 = range(10)
PLOT_THROTTLE_S = 0.15


def _kernel_loop():
    """The running kernel's IO loop (None outside a kernel, e.g. in tests)."""
    try:
        from IPython import get_ipython
    except ImportError:
        return None
    ip = get_ipython()
    return getattr(getattr(ip, "kernel", None), "io_loop", None)


def on_kernel_loop(fn, *args) -> None:
    """Run ``fn(*args)`` on the kernel's loop, after the message being handled.

    plotly's FigureWidget sends each update as a trait set to a value and at once back to None. In a
    minimal Voilà page (chromium), updates made inside a button callback, or from a thread while that
    callback ran, never reached the plot; the same updates deferred to the kernel loop always did.
    So every figure update goes through here. Without a kernel (tests, scripts) ``fn`` runs at once.
    """
    loop = _kernel_loop()
    if loop is None:
        fn(*args)
    else:
        loop.add_callback(fn, *args)


class ExplorePlot:
    """The Explore figure of a :class:`~kvlab.playground.Playground` (``fig``); ``lock``: the view's lock,
    held while traces change."""

    def __init__(self, pg, lock):
        self.pg = pg
        self._lock = lock
        self._live = {"steps": [], "ent": [], "len": [], "ref": []}
        self._last_draw = 0.0
        fig = make_subplots(rows=3, cols=1, shared_xaxes=False, vertical_spacing=0.11, row_heights=[0.45, 0.3, 0.25],
                            subplot_titles=("entropy of the step's distribution (bits)", "cache length (entries; axis from 0)",
                                            "provenance of the live cache (who wrote each entry)"))
        fig.add_trace(go.Scatter(name="baseline", mode="lines", line=dict(color=BASE, dash="dot", width=1)), 1, 1)
        fig.add_trace(go.Scatter(name="this run", mode="lines", line=dict(color="#444", width=1.4)), 1, 1)
        fig.add_trace(go.Scatter(name="refresh (hover: why)", mode="markers", hovertemplate="%{text}<extra></extra>",
                                 marker=dict(color=REFRESH, size=8, symbol="triangle-up")), 1, 1)
        fig.add_trace(go.Scatter(name="τ", mode="lines", line=dict(color=STUDENT, dash="dash", width=1.2)), 1, 1)
        fig.add_trace(go.Scatter(name="baseline cache", mode="lines", line=dict(color=BASE, dash="dot", width=1),
                                 showlegend=False), 2, 1)
        fig.add_trace(go.Scatter(name="cache", mode="lines", line=dict(color="#7570b3", width=1.4), showlegend=False), 2, 1)
        fig.add_trace(go.Heatmap(z=[[]], zmin=0, zmax=1, colorscale=_WRITER_SCALE, showscale=False, name="writer",
                                 hovertemplate="position %{x}<br>%{text}<extra></extra>"), 3, 1)
        # the strip's colour legend, on the plot (empty traces that only draw a legend entry)
        for name, color in (("teacher-written entry", TEACHER), ("student-written entry", STUDENT)):
            fig.add_trace(go.Scatter(name=name, x=[None], y=[None], mode="markers", hoverinfo="skip",
                                     marker=dict(color=color, size=10, symbol="square")), 3, 1)
        for i in range(MAX_PINS):
            c = PIN_COLORS[i % len(PIN_COLORS)]
            fig.add_trace(go.Scatter(name=f"pin {i + 1}", mode="lines", visible=False, line=dict(color=c, width=1.1)), 1, 1)
            fig.add_trace(go.Scatter(name=f"pin {i + 1} cache", mode="lines", visible=False, showlegend=False,
                                     line=dict(color=c, width=1.1)), 2, 1)
        fig.update_yaxes(showticklabels=False, row=3, col=1)
        fig.update_yaxes(rangemode="tozero", row=2, col=1)
        fig.update_xaxes(title_text="step t", row=1, col=1, title_standoff=2)
        fig.update_xaxes(title_text="step t", row=2, col=1, title_standoff=2)
        fig.update_xaxes(title_text="cache position", row=3, col=1, title_standoff=2)
        fig.update_layout(height=600, width=760, margin=dict(l=50, r=10, t=30, b=40), template="plotly_white",
                          legend=dict(orientation="v", x=1.0, y=1.0, xanchor="right", yanchor="top", font=dict(size=10),
                                      bgcolor="rgba(255,255,255,0.8)", bordercolor="#ddd", borderwidth=1))
        for a in fig.layout.annotations:
            a.font.size = 12
        if self.pg.shown is not None:
            # a FigureWidget's front-end misses updates made before it is displayed: start from the data
            self._plot(fig, self.pg.shown)
        self.fig = go.FigureWidget(fig)
        self.fig.add_class("kvlab-fig")

    def start_live(self, s) -> None:
        """A live run of settings ``s`` starts: clear the streamed traces (a "live_start" event)."""
        self._live = {"steps": [], "ent": [], "len": [], "ref": []}
        on_kernel_loop(self._draw_live, True, (), (), s)

    def point(self, p: LivePoint) -> None:
        """Add a streamed step; redraw at most every :data:`PLOT_THROTTLE_S` seconds (and at the last step)."""
        L = self._live
        L["steps"].append(p.step)
        L["ent"].append(p.entropy_bits)
        L["len"].append(p.cache_len)
        if p.refreshed:
            L["ref"].append((p.step, p.entropy_bits))
        now = time.perf_counter()
        if now - self._last_draw >= PLOT_THROTTLE_S or p.step == p.total:
            self._last_draw = now
            on_kernel_loop(self._draw_live, False, p.positions, p.writers)

    def _draw_live(self, force=False, positions=(), writers=(), settings=None) -> None:
        L = {k: list(v) for k, v in self._live.items()}
        d = self.fig.data
        with self._lock, self.fig.batch_update():
            d[T_RUN].x, d[T_RUN].y = L["steps"], L["ent"]
            d[T_REF].x, d[T_REF].y = [r[0] for r in L["ref"]], [r[1] for r in L["ref"]]
            d[T_REF].text = ["refresh (reason once the run is stored)"] * len(L["ref"])
            d[T_LEN].x, d[T_LEN].y = L["steps"], L["len"]
            if settings is not None:
                self._tau_line(settings)
            if writers or force:
                d[T_MAP].x = list(positions)
                d[T_MAP].z = [[1 if w == "teacher" else 0 for w in writers]]
                d[T_MAP].text = [[w for w in writers]]

    def _tau_line(self, s, fig=None) -> None:
        d = (fig if fig is not None else self.fig).data
        if s.policy == "entropy":
            d[T_TAU].x, d[T_TAU].y, d[T_TAU].visible = [1, s.N], [s.tau_bits, s.tau_bits], True
        else:
            d[T_TAU].x, d[T_TAU].y, d[T_TAU].visible = [], [], False

    def render(self, sh: Shown) -> None:
        """Draw the stored run ``sh``, its baseline and the pinned runs (on the kernel's loop)."""
        on_kernel_loop(self._plot_now, sh)

    def _plot_now(self, sh: Shown) -> None:
        with self._lock, self.fig.batch_update():
            self._plot(self.fig, sh)

    def _plot(self, fig, sh: Shown) -> None:
        r, b = sh.result, sh.base
        steps, bsteps = r["steps"], b["steps"]
        xs = list(range(1, len(steps["entropy_bits"]) + 1))
        bxs = list(range(1, len(bsteps["entropy_bits"]) + 1))
        ref = [i for i, f in enumerate(steps["refreshed"]) if f]
        why = dict(sh.reasons)
        live = r.get("live") or {"positions": [], "writers": []}
        tok_by_pos = {sh.prompt_len + i: t for i, t in enumerate(sh.tokens)}
        d = fig.data
        d[T_BASE].x, d[T_BASE].y = bxs, bsteps["entropy_bits"]
        d[T_RUN].x, d[T_RUN].y = xs, steps["entropy_bits"]
        d[T_REF].x, d[T_REF].y = [xs[i] for i in ref], [steps["entropy_bits"][i] for i in ref]
        d[T_REF].text = [f"step {xs[i]}: {why.get(xs[i], 'refresh')}" for i in ref]
        self._tau_line(sh.settings, fig)
        d[T_BASE_LEN].x, d[T_BASE_LEN].y = bxs, bsteps["cache_len"]
        d[T_LEN].x, d[T_LEN].y = xs, steps["cache_len"]
        d[T_MAP].x = live["positions"]
        d[T_MAP].z = [[1 if w == "teacher" else 0 for w in live["writers"]]]
        d[T_MAP].text = [[f"{w}: {tok_by_pos.get(p, '(prompt)')!r}" for p, w in zip(live["positions"], live["writers"])]]
        pins = [p for p in self.pg.pinned if p.key != sh.key]
        for i in range(MAX_PINS):
            e, c = d[T_PIN0 + 2 * i], d[T_PIN0 + 2 * i + 1]
            if i < len(pins):
                ps = pins[i].result["steps"]
                px = list(range(1, len(ps["entropy_bits"]) + 1))
                e.x, e.y, e.visible, e.name = px, ps["entropy_bits"], True, f"pin {i + 1}: {pins[i].label}"[:60]
                c.x, c.y, c.visible = px, ps["cache_len"], True
            else:
                e.x, e.y, e.visible, c.x, c.y, c.visible = [], [], False, [], [], False
        # where the prompt ends on the provenance strip
        x0 = sh.prompt_len - 0.5
        fig.layout.shapes = [dict(type="line", xref="x3", yref="y3 domain", x0=x0, x1=x0, y0=0, y1=1,
                                  line=dict(color="#000", width=2),
                                  label=dict(text="◂ prompt | generated ▸", textangle=0, textposition="middle",
                                             font=dict(size=10, color="#fff")))]
