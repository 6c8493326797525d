"""The playground's widgets: a thin ipywidgets + plotly ``FigureWidget`` view over
:class:`~kvlab.playground.Playground` (all logic lives there and in :class:`~kvlab.playground.Stepper`).

``PlaygroundView(pg).widget`` is the whole app (an "Explore" tab and a "Step through" tab); display it
in a notebook or serve the notebook with Voilà (``make playground``). Plots are updated in place.
DOM classes (``kvlab-ro-<readout>``, ``kvlab-run-key``, ``kvlab-<control>``, ``kvlab-err-<control>``)
let a browser test find what it needs.
"""
from __future__ import annotations

import html
import math
import threading
import time

import ipywidgets as W
import plotly.graph_objects as go
from plotly.subplots import make_subplots

from .controller import MAX_PINS, READOUTS, LivePoint, Playground, Progress, Shown, fmt
from .settings import EVICT_PARAMS, MC_SIGNALS, NO_EVICTION, POLICIES, POLICY_LABELS, POLICY_PARAMS, SAMPLINGS
from ..experiment import MIN_PAIRS
from .spread import Spread
from .stepper import SettingsError, Stepper
from .why import PPL_NOTE

TEACHER, STUDENT, BASE, REFRESH = "#1b9e77", "#d95f02", "#9e9e9e", "#e7298a"
_WRITER_SCALE = [[0.0, STUDENT], [0.5, STUDENT], [0.5, TEACHER], [1.0, TEACHER]]
_LABELS = {"T": "T (period)", "W": "W (window, 0=∞)", "tau_bits": "τ (bits)", "M": "M (probe every)",
           "kappa": "κ (nats)", "k": "k (burst)", "mc_threshold": "MC threshold", "mc_every": "MC every",
           "mc_passes": "MC passes", "mc_p": "MC dropout p", "temperature": "temperature", "top_p": "top-p",
           "budget": "budget", "gamma": "Conf-KV γ", "recent": "recent window", "n_prompts": "prompts ×",
           "n_seeds": "× seeds"}
PIN_COLORS = ("#1f77b4", "#9467bd", "#8c564b", "#17becf")
# trace indices of the Explore figure
T_BASE, T_RUN, T_REF, T_TAU, T_BASE_LEN, T_LEN, T_MAP, T_LEG_T, T_LEG_S, T_PIN0 = range(10)
_STYLE = {"description_width": "120px"}
_ROW = W.Layout(width="400px")
_SLIDER_PARAMS = ("T", "W", "tau_bits", "M", "kappa", "k", "mc_threshold", "mc_every", "mc_passes", "mc_p", "temperature",
                  "top_p", "budget", "gamma", "recent")
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


def _esc(s: str) -> str:
    return html.escape(s).replace("\n", "↵<br>")


class PlaygroundView:
    """Widgets bound to a :class:`Playground`; ``.widget`` is the app."""

    def __init__(self, pg: Playground):
        self.pg = pg
        self.controls: dict[str, W.Widget] = {}
        self.errs: dict[str, W.HTML] = {}
        self._syncing = False
        self._live = {"steps": [], "ent": [], "len": [], "ref": []}
        self._last_draw = 0.0
        self._lock = threading.RLock()
        self._build_controls()
        self._build_outputs()
        self._build_stepper()
        self.widget = W.VBox([
            W.HTML("<h3 style='margin:4px 0'>kvlab playground — refresh and eviction, live</h3>"),
            W.Tab(children=[W.HBox([self.left, self.right]), self.step_box], titles=("Explore", "Step through")),
        ])
        self.widget.add_class("kvlab-playground")
        pg.subscribe(self._on_event)
        self._sync_visibility()
        if pg.shown is not None:
            self._render(pg.shown)
        self._render_errors(pg.errors)
        self._on_event("percentiles", pg.percentiles())
        self.status.value = self._status_html(pg.status)

    # ------------------------------------------------------------------ controls

    def _control(self, name: str, widget: W.Widget, extra: W.Widget | None = None) -> W.Widget:
        widget.add_class(f"kvlab-{name}")
        err = W.HTML("", layout=W.Layout(margin="0 0 0 8px"))
        err.add_class(f"kvlab-err-{name}")
        self.controls[name], self.errs[name] = widget, err
        widget.observe(lambda ch, n=name: self._changed(n, ch["new"]), "value")
        parts = [widget] + ([extra] if extra is not None else [])
        return W.VBox([W.HBox(parts), err], layout=W.Layout(margin="0"))

    def _slider(self, name: str, width: str = "400px") -> W.Widget:
        r = self.pg.ranges[name]
        cls = W.IntSlider if r.integer else W.FloatSlider
        kw = {} if r.integer else {"readout_format": f".{max(0, len(repr(r.step).split('.')[-1]))}f"}
        return cls(value=getattr(self.pg.settings, name), min=r.lo, max=r.hi, step=r.step, description=_LABELS[name],
                   continuous_update=False, style=_STYLE, layout=W.Layout(width=width), **kw)

    def _build_controls(self):
        s = self.pg.settings
        prompts = self.pg.prompts
        self.prompt_pick = W.Dropdown(options=[(p[:60] + ("…" if len(p) > 60 else ""), p) for p in prompts] + [("(typed)", None)],
                                      value=s.prompt if s.prompt in prompts else None, description="prompt",
                                      style=_STYLE, layout=_ROW)
        self.prompt_pick.observe(self._picked, "value")
        text = W.Textarea(value=s.prompt, placeholder="type a prompt", continuous_update=False,
                          layout=W.Layout(width="400px", height="64px"))
        self.pct = {"tau_bits": W.HTML(""), "kappa": W.HTML(""), "mc_threshold": W.HTML("")}
        rows = [self.prompt_pick, self._control("prompt", text),
                self._control("mode", W.ToggleButtons(options=["teacher", "student", "overfill"], value=s.mode,
                                                      description="mode", tooltips=["teacher alone", "student alone",
                                                      "OverFill: teacher prefill, student decodes"],
                                                      style={"button_width": "86px", **_STYLE})),
                self._control("policy", W.Dropdown(options=[(POLICY_LABELS[p], p) for p in POLICIES], value=s.policy,
                                                   description="refresh", style=_STYLE, layout=_ROW))]
        self.policy_rows = {}
        for name in ("T", "W", "tau_bits", "M", "kappa", "k"):
            self.policy_rows[name] = self._control(name, self._slider(name, "320px" if name in self.pct else "400px"),
                                                   self.pct.get(name))
        self.policy_rows["mc_signal"] = self._control("mc_signal", W.Dropdown(options=MC_SIGNALS, value=s.mc_signal,
                                                                              description="MC signal", style=_STYLE, layout=_ROW))
        self.policy_rows["mc_threshold"] = self._control("mc_threshold", self._slider("mc_threshold", "320px"),
                                                         self.pct["mc_threshold"])
        for name in ("mc_every", "mc_passes", "mc_p"):
            self.policy_rows[name] = self._control(name, self._slider(name))
        rows += list(self.policy_rows.values())
        self.next_row = self._control("refresh_next", W.Dropdown(options=["rerun", "student", "teacher"], value=s.refresh_next,
                                                                 description="refresh_next", style=_STYLE, layout=_ROW))
        rows.append(self.next_row)
        self.student_row = self._control("student", W.Dropdown(options=list(self.pg.student_variants), value=s.student,
                                                               description="student", style=_STYLE, layout=_ROW,
                                                               disabled=len(self.pg.student_variants) == 1))
        rows.append(self.student_row)
        self.prune_row = self._control("prune_ratio", W.Dropdown(options=list(self.pg.prune_ratios), value=s.prune_ratio,
                                                                 description="student prune", style=_STYLE, layout=_ROW))
        rows.append(self.prune_row)
        rows.append(self._control("N", W.IntText(value=s.N, description="N tokens", style=_STYLE, layout=_ROW)))
        rows.append(self._control("sampling", W.ToggleButtons(options=list(SAMPLINGS), value=s.sampling,
                                                              description="sampling",
                                                              style={"button_width": "86px", **_STYLE})))
        self.sample_rows = [self._control("temperature", self._slider("temperature")), self._control("top_p", self._slider("top_p"))]
        rows += self.sample_rows
        rows.append(self._control("seed", W.IntText(value=s.seed, description="seed", style=_STYLE, layout=_ROW)))
        ev_opts = [NO_EVICTION] + list(self.pg.eviction_names)
        rows.append(self._control("evict", W.Dropdown(options=ev_opts, value=s.evict, description="eviction",
                                                      disabled=len(ev_opts) == 1, style=_STYLE, layout=_ROW)))
        self.budget_row = self._control("budget", self._slider("budget"))
        rows.append(self.budget_row)
        self.evict_rows = {name: self._control(name, self._slider(name)) for name in ("gamma", "recent")}
        rows += list(self.evict_rows.values())
        # spread: N prompts × seeds
        rows.append(W.HTML("<small>spread: average over prompts × seeds (mean ± paired 95 % CI vs the baseline)</small>"))
        rows.append(W.HBox([self._control("n_prompts", W.IntSlider(value=s.n_prompts, min=1, max=min(int(self.pg.ranges["n_prompts"].hi), len(self.pg.prompts)),
                                                                    description=_LABELS["n_prompts"], continuous_update=False,
                                                                    style={"description_width": "60px"}, layout=W.Layout(width="200px"))),
                            self._control("n_seeds", W.IntSlider(value=s.n_seeds, min=1, max=int(self.pg.ranges["n_seeds"].hi),
                                                                  description=_LABELS["n_seeds"], continuous_update=False,
                                                                  style={"description_width": "50px"}, layout=W.Layout(width="190px")))]))
        # precompute a slider's whole range
        self.pre_param = W.Dropdown(options=[], description="precompute", style=_STYLE, layout=W.Layout(width="220px"))
        self.pre_button = W.Button(description="whole range", layout=W.Layout(width="110px"))
        self.pre_button.add_class("kvlab-precompute")
        self.pre_button.on_click(self._precompute)
        self.pre_stop = W.Button(description="stop", layout=W.Layout(width="60px"), tooltip="stop precomputing / the live run")
        self.pre_stop.on_click(lambda _: self.pg.cancel())
        self.pre_bar = W.IntProgress(value=0, min=0, max=1, layout=W.Layout(width="400px"))
        self.pre_msg = W.HTML("")
        rows += [W.HTML("<hr style='margin:6px 0'>"), W.HBox([self.pre_param, self.pre_button, self.pre_stop]),
                 self.pre_bar, self.pre_msg]
        self.left = W.VBox(rows, layout=W.Layout(width="430px", min_width="430px"))
        self.controls["prompt"].add_class("kvlab-prompt-text")

    def _picked(self, ch):
        if ch["new"] is not None and not self._syncing:
            self.controls["prompt"].value = ch["new"]

    def _changed(self, name: str, value) -> None:
        if self._syncing:
            return
        if name == "N" or name == "seed":
            value = int(value) if value is not None else value
        try:
            self.pg.set(**{name: value})
        except Exception as e:   # never let a callback error escape into the kernel
            self._render_errors({**self.pg.errors, name: f"{type(e).__name__}: {e}"})
        self._sync_visibility()

    def _sync_visibility(self):
        s = self.pg.settings
        used = set(POLICY_PARAMS.get(s.policy, ()))
        for name, row in self.policy_rows.items():
            row.layout.display = "" if name in used else "none"
        self.next_row.layout.display = "" if s.policy != "none" else "none"
        self.student_row.layout.display = "" if s.mode != "teacher" else "none"
        self.prune_row.layout.display = "" if s.mode != "teacher" and s.student == "pruned" else "none"
        for row in self.sample_rows:
            row.layout.display = "" if s.sampling == "sample" else "none"
        self.budget_row.layout.display = "" if s.evict != NO_EVICTION else "none"
        ev_used = set(EVICT_PARAMS.get(s.evict, ())) if s.evict != NO_EVICTION else set()
        for name, row in self.evict_rows.items():
            row.layout.display = "" if name in ev_used else "none"
        if s.policy == "mc":
            self._mc_slider_range()
        opts = [p for p in POLICY_PARAMS.get(s.policy, ()) if p in _SLIDER_PARAMS and p != "W"]   # the policy's own first
        opts += [p for p in _SLIDER_PARAMS if p not in opts and (p in used or (p in ("temperature", "top_p") and s.sampling == "sample")
                 or (p == "budget" and s.evict != NO_EVICTION) or p in ev_used)]
        if list(self.pre_param.options) != opts:
            keep = self.pre_param.value
            self.pre_param.options = opts
            self.pre_param.value = keep if keep in opts else (opts[0] if opts else None)
        if s.prompt in self.pg.prompts and self.prompt_pick.value != s.prompt:
            self._syncing = True
            try:
                self.prompt_pick.value = s.prompt
            finally:
                self._syncing = False
        elif s.prompt not in self.pg.prompts and self.prompt_pick.value is not None:
            self._syncing = True
            try:
                self.prompt_pick.value = None
            finally:
                self._syncing = False

    def _mc_slider_range(self) -> None:
        """The MC threshold slider spans the calibrated range of the chosen signal."""
        r = self.pg.mc_range()
        w = self.controls["mc_threshold"]
        if (w.min, w.max, w.step) != (r.lo, r.hi, r.step):
            self._syncing = True
            try:
                val = self.pg.settings.mc_threshold
                w.max = max(r.hi, w.min)
                w.min, w.step = r.lo, r.step
                w.readout_format = f".{max(0, -math.floor(math.log10(r.step)))}f" if r.step < 1 else ".0f"
                w.value = min(max(val, r.lo), r.hi)
            finally:
                self._syncing = False

    def _sync_controls(self, s) -> None:
        """Put every control at ``s``'s value (after the controller changed a setting itself)."""
        self._syncing = True
        try:
            for name, w in self.controls.items():
                v = getattr(s, name, None)
                if v is not None and w.value != v:
                    if name == "mc_threshold":
                        self._syncing = False
                        self._mc_slider_range()
                        self._syncing = True
                    w.value = v
        finally:
            self._syncing = False

    def _precompute(self, _button):
        param = self.pre_param.value
        if not param:
            self.pre_msg.value = "pick a slider"
            return
        try:
            grid = self.pg.grid(param)
            self.pre_bar.max, self.pre_bar.value = max(1, len(grid)), 0
            self.pg.precompute(param, grid)
            self.pre_msg.value = f"precomputing {param}: {len(grid)} positions…"
        except Exception as e:
            self.pre_msg.value = f"<span style='color:#c00'>{_esc(str(e))}</span>"

    # ------------------------------------------------------------------ outputs

    def _build_outputs(self):
        self.status = W.HTML("")
        self.status.add_class("kvlab-status")
        # the progress bar shows only while something decodes (a store hit never fills it)
        self.progress = W.IntProgress(value=0, min=0, max=1, description="", layout=W.Layout(width="520px", visibility="hidden"))
        self.progress.add_class("kvlab-progress")
        self.progress_msg = W.HTML("")
        self.table = W.HTML("<i>no result yet</i>")
        self.table.add_class("kvlab-readouts")
        self.spread_box = W.HTML("")
        self.spread_box.add_class("kvlab-spread")
        self.why = W.HTML("")
        self.why.add_class("kvlab-why")
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
        self.text = W.HTML("")
        self.text.add_class("kvlab-text")
        legend = (f"<small><span style='background:{TEACHER}33'>teacher-written entry (refreshed)</span> · "
                  f"<u>token drawn from the teacher</u> · <b style='color:{REFRESH}'>⟳</b> refresh after this token · "
                  f"<s style='color:#999'>evicted</s></small>")
        # pin / overlay, back-to-back timing, export
        b = {n: W.Button(description=d, layout=W.Layout(width=w), tooltip=t) for n, d, w, t in (
            ("pin", "pin this run", "110px", "keep this run overlaid on the plots and beside the readouts"),
            ("unpin", "unpin all", "90px", "remove every pinned run"),
            ("timing", "time vs baseline", "140px", "time this configuration and its baseline back to back (3 pairs)"),
            ("export", "export PNG + CSV", "140px", "save the current view: plots as PNG, series and readouts as CSV"))}
        for n, w in b.items():
            w.add_class(f"kvlab-{n}")
        b["pin"].on_click(lambda _: self._guard(self.pg.pin))
        b["unpin"].on_click(lambda _: self._guard(self.pg.unpin))
        b["timing"].on_click(lambda _: self._guard(self.pg.time_vs_baseline))
        b["export"].on_click(lambda _: self._export())
        self.buttons = b
        self.timing_box = W.HTML("")
        self.timing_box.add_class("kvlab-timing")
        self.export_box = W.HTML("")
        self.export_box.add_class("kvlab-export")
        self.right = W.VBox([self.status, W.HBox([self.progress, self.progress_msg]), self.table, self.spread_box,
                             W.HBox(list(b.values())), self.timing_box, self.export_box, self.fig, self.why,
                             W.HTML(legend), self.text], layout=W.Layout(width="780px"))

    def _guard(self, fn) -> None:
        """Run a button's action; a ValueError (nothing to pin, bad controls) goes to the status line."""
        try:
            fn()
        except ValueError as e:
            self.status.value = self._status_html(f"⚠ {e}")

    def _export(self) -> None:
        from .export import export_view

        try:
            paths = export_view(self.pg)
        except ValueError as e:
            self.export_box.value = f"<span style='color:#c00'>⚠ {_esc(str(e))}</span>"
            return
        links = []
        import base64
        for p in paths:
            mime = "image/png" if p.suffix == ".png" else "text/csv"
            data = base64.b64encode(p.read_bytes()).decode()
            links.append(f"<a download='{html.escape(p.name, quote=True)}' href='data:{mime};base64,{data}'>{_esc(p.name)}</a>")
        self.export_box.value = (f"<small>saved in <code>{_esc(str(paths[0].parent))}</code>: " + " · ".join(links)
                                 + "</small>")

    def _status_html(self, text: str) -> str:
        return f"<div style='font-family:monospace;font-size:12px;color:#333'>{_esc(text)}</div>"

    def _on_event(self, event: str, payload) -> None:
        with self._lock:
            if event == "errors":
                self._render_errors(payload)
            elif event == "status":
                self.status.value = self._status_html(payload)
            elif event == "percentiles":
                for name, w in self.pct.items():
                    p = payload.get(name)
                    w.value = (f"<span style='font-size:12px;white-space:nowrap' title='calibrated percentile'>"
                               f"&nbsp;≈ p{p:.0f} calib.</span>" if p is not None else "<small>&nbsp;(calibrating)</small>")
            elif event == "settings":
                self._sync_controls(payload)
            elif event == "shown":
                self._render(payload)
            elif event == "spread":
                self.spread_box.value = self._spread_html(payload)
            elif event == "pins":
                if self.pg.shown is not None:
                    self._render(self.pg.shown)
            elif event == "timing":
                self.timing_box.value = self._timing_html(payload)
            elif event == "live_start":
                self._live = {"steps": [], "ent": [], "len": [], "ref": []}
                self._bar(payload.N, 0, "decoding…")
                on_kernel_loop(self._draw_live, True, (), (), payload)
            elif event == "point":
                self._point(payload)
            elif event == "progress":
                self._progress(payload)

    def _bar(self, total: int, done: int, msg: str) -> None:
        """Show the progress bar at ``done``/``total`` (hidden again by :meth:`_bar_off`)."""
        self.progress.max, self.progress.value = max(1, total), done
        self.progress.layout.visibility = "visible"
        self.progress_msg.value = _esc(msg)

    def _bar_off(self) -> None:
        self.progress.value = 0
        self.progress.layout.visibility = "hidden"
        self.progress_msg.value = ""

    def _render_errors(self, errors: dict) -> None:
        for name, w in self.errs.items():
            msg = errors.get(name)
            w.value = f"<span style='color:#c00;font-size:12px'>⚠ {_esc(msg)}</span>" if msg else ""
        if "run" in errors:
            self.status.value = self._status_html(f"run failed: {errors['run']}")

    def _progress(self, p: Progress) -> None:
        if p.stage == "precompute":
            self.pre_bar.max, self.pre_bar.value = max(1, p.total), p.done
            self.pre_msg.value = _esc(p.message)
        elif p.done >= p.total and not p.message:
            self._bar_off()
        else:
            self._bar(p.total, p.done, p.message)

    def _point(self, p: LivePoint) -> None:
        L = self._live
        L["steps"].append(p.step)
        L["ent"].append(p.entropy_bits)
        L["len"].append(p.cache_len)
        if p.refreshed:
            L["ref"].append((p.step, p.entropy_bits))
        self._bar(p.total, p.step, f"{p.step}/{p.total} tokens · {fmt(p.tps, '.1f')} tok/s")
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

    def _render(self, sh: Shown) -> None:
        on_kernel_loop(self._plot_now, sh)
        self.table.value = self._table_html(sh)
        self.why.value = self._why_html(sh)
        self.text.value = self._text_html(sh)
        self._bar_off()

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

    def _table_html(self, sh: Shown) -> str:
        pins = [p for p in self.pg.pinned if p.key != sh.key]
        head = ("<tr style='border-bottom:1px solid #ccc'><th></th><th>this run</th>"
                "<th>baseline<br><small>(no refresh, full cache)</small></th><th>Δ</th>"
                + "".join(f"<th style='color:{PIN_COLORS[i % len(PIN_COLORS)]}' title='{html.escape(p.label, quote=True)}'>"
                          f"pin {i + 1}</th>" for i, p in enumerate(pins)) + "</tr>")
        rows = []
        for name, label, spec in READOUTS:
            v, bv = sh.readouts[name], sh.base_readouts[name]
            try:
                delta = fmt(v - bv, "+" + spec)
            except TypeError:
                delta = ""
            pin_cells = "".join(f"<td style='text-align:right'><span class='kvlab-pin-{name}'>{fmt(p.readouts[name], spec)}</span></td>"
                                for p in pins)
            rows.append(f"<tr><td>{label}</td><td style='text-align:right'><b><span class='kvlab-ro-{name}'>{fmt(v, spec)}</span></b></td>"
                        f"<td style='text-align:right;color:#777'><span class='kvlab-base-{name}'>{fmt(bv, spec)}</span></td>"
                        f"<td style='text-align:right;color:#555'>{delta}</td>{pin_cells}</tr>")
        s = sh.settings
        scope = ("<div style='font-size:12px;color:#444;margin-bottom:2px'><b>one run</b>: 1 prompt × 1 seed "
                 f"(seed {s.seed}) — one sample, no spread; 3 significant digits. "
                 "Set prompts × seeds above 1 for means with paired 95 % CIs.</div>")
        return (scope + "<table style='border-collapse:collapse;font-size:13px' cellpadding='3'>" + head
                + "".join(rows) + "</table>"
                f"<div style='font-size:11px;color:#666'>run <span class='kvlab-run-key'>{sh.key}</span> · baseline "
                f"<span class='kvlab-base-key'>{sh.base_key}</span> · this run decoded at {fmt(sh.readouts['tps'], 'g3')} tok/s "
                "(one timing on this machine, not compared: use “time vs baseline”)</div>")

    def _spread_html(self, sp: Spread | None) -> str:
        if sp is None:
            return ""
        s = sp.settings
        head = (f"<div style='font-size:12px;margin-top:6px'><b>{s.n_prompts} prompt(s) × {s.n_seeds} seed(s)</b>: "
                f"<span class='kvlab-spread-done'>{sp.done}/{sp.total}</span> pairs finished"
                + ("" if sp.complete else " (filling in as runs finish)") + "</div>")
        rows = []
        for name, label, spec in READOUTS:
            st = sp.stats.get(name)
            if st is None:
                continue
            ci = (f"[{fmt(st['lo'], '+' + spec)}, {fmt(st['hi'], '+' + spec)}]" if st["n"] >= MIN_PAIRS
                  else f"(CI from {MIN_PAIRS} pairs; n={st['n']})")
            rows.append(f"<tr><td>{label}</td><td style='text-align:right'><span class='kvlab-mean-{name}'>{fmt(st['mean'], spec)}</span></td>"
                        f"<td style='text-align:right;color:#777'>{fmt(st['base'], spec)}</td>"
                        f"<td style='text-align:right'><span class='kvlab-d-{name}'>{fmt(st['d'], '+' + spec)}</span> {ci}</td></tr>")
        return (head + "<table style='border-collapse:collapse;font-size:13px' cellpadding='3'>"
                "<tr style='border-bottom:1px solid #ccc'><th></th><th>mean</th><th>baseline mean</th>"
                "<th>Δ mean [paired 95 % CI]</th></tr>" + "".join(rows) + "</table>")

    def _timing_html(self, t: dict) -> str:
        return (f"<div style='font-size:12px'>time vs baseline, <b>timed back to back</b> ({t['pairs']} pairs, same prompt "
                f"and seed, order alternating): <b><span class='kvlab-overhead'>{fmt(t['overhead_pct'], '+.1f')}</span> %</b> "
                f"(median; quartiles {fmt(t['q25'], '+.1f')} … {fmt(t['q75'], '+.1f')} %; baseline vs itself "
                f"{fmt(t['noise_pct'], '+.1f')} %, the noise floor) · {_esc(t['settings'].prompt[:40])}…</div>")

    def _why_html(self, sh: Shown) -> str:
        parts = []
        if sh.reasons:
            shown = "; ".join(f"step {t}: {_esc(w)}" for t, w in sh.reasons[:8])
            more = f"; … {len(sh.reasons) - 8} more (hover the ▲ markers)" if len(sh.reasons) > 8 else ""
            parts.append(f"<b>why refreshes fired</b> ({len(sh.reasons)}): {shown}{more}")
        elif sh.settings.policy != "none":
            parts.append("<b>no refresh fired</b> in this run")
        if sh.note:
            parts.append(f"<span class='kvlab-same-tokens'>{_esc(sh.note)}</span>")
        parts.append(f"<span style='color:#666'>{_esc(PPL_NOTE)}</span>")
        return "<div style='font-size:12px;line-height:1.4;margin:4px 0'>" + "<br>".join(parts) + "</div>"

    def _text_html(self, sh: Shown) -> str:
        r = sh.result
        live = r.get("live") or {"positions": [], "writers": []}
        writer = dict(zip(live["positions"], live["writers"]))
        steps = r["steps"]
        out = []
        for i, tok in enumerate(sh.tokens):
            pos = sh.prompt_len + i
            w = writer.get(pos)
            style = []
            if w == "teacher":
                style.append(f"background:{TEACHER}33")
            t = _esc(tok)
            if steps["source"][i] == "teacher":
                t = f"<u>{t}</u>"
            if w is None and i < len(sh.tokens) - 1 and live["positions"]:
                t = f"<s style='color:#999'>{t}</s>"
            span = f"<span style='{';'.join(style)}'>{t}</span>"
            if steps["refreshed"][i]:
                span += f"<b style='color:{REFRESH}'>⟳</b>"
            out.append(span)
        return ("<div style='font-size:13px;line-height:1.5;border:1px solid #eee;padding:6px;max-height:220px;overflow:auto'>"
                + "".join(out) + "</div>")

    # ------------------------------------------------------------------ step-through

    def _build_stepper(self):
        self.stepper: Stepper | None = None
        self._step_thread: threading.Thread | None = None
        b = {n: W.Button(description=n, layout=W.Layout(width="90px")) for n in ("Step", "Run", "Stop", "Reset")}
        b["Step"].on_click(lambda _: self._step_once())
        b["Run"].on_click(lambda _: self._step_run())
        b["Stop"].on_click(lambda _: self.stepper and self.stepper.stop())
        b["Reset"].on_click(lambda _: self._step_reset())
        for n, w in b.items():
            w.add_class(f"kvlab-step-{n.lower()}")
        self.step_buttons = b
        self.step_msg = W.HTML("<i>Reset builds one decoding from the Explore tab's controls; Step decodes one token.</i>")
        self.step_info = W.HTML("")
        self.step_info.add_class("kvlab-step-info")
        # The live map is HTML, not a second FigureWidget: plotly's widget bundle keeps one figure
        # model per page module (its factory shares a variable), and in chromium a second FigureWidget's
        # updates did not show (measured); the Explore traces stay the page's one FigureWidget.
        self.step_map = W.HTML("")
        self.step_map.add_class("kvlab-step-map")
        self.step_text = W.HTML("")
        self.step_box = W.VBox([W.HBox(list(b.values())), self.step_msg, self.step_info, self.step_map, self.step_text])

    def _step_reset(self) -> bool:
        if self.stepper is not None:
            self.stepper.stop()
        if self._step_thread is not None:
            self._step_thread.join()
        try:
            if self.stepper is None:
                self.stepper = Stepper(self.pg)
            else:
                self.stepper.reset()
        except SettingsError as e:
            self.step_msg.value = f"<span style='color:#c00'>⚠ fix the Explore controls first: {_esc(str(e))}</span>"
            return False
        except Exception as e:
            self.step_msg.value = f"<span style='color:#c00'>⚠ {_esc(type(e).__name__ + ': ' + str(e))}</span>"
            return False
        s = self.stepper.settings
        self.step_msg.value = (f"<small>{_esc(s.mode)} · refresh {_esc(POLICY_LABELS[s.policy])} · N={s.N} · "
                               f"{_esc(s.prompt[:80])}</small>")
        self.step_info.value = ""
        self.step_text.value = ""
        self.step_map.value = ""
        return True

    def _step_once(self):
        if self._step_thread is not None and self._step_thread.is_alive():
            return
        if self.stepper is None and not self._step_reset():
            return
        try:
            v = self.stepper.step()
        except Exception as e:
            self.step_msg.value = f"<span style='color:#c00'>⚠ {_esc(type(e).__name__ + ': ' + str(e))}</span>"
            return
        if v is None:
            self.step_msg.value = "<small>the run is over: Reset to start again</small>"
        else:
            self._draw_step(v)

    def _step_run(self):
        if self._step_thread is not None and self._step_thread.is_alive():
            return
        if self.stepper is None and not self._step_reset():
            return
        last = {"t": 0.0}

        def on_step(v):
            if time.perf_counter() - last["t"] > 0.1 or v.done:
                self._draw_step(v)
                last["t"] = time.perf_counter()

        def work():
            try:
                self.stepper.run(on_step=on_step)
            except Exception as e:
                self.step_msg.value = f"<span style='color:#c00'>⚠ {_esc(type(e).__name__ + ': ' + str(e))}</span>"

        self._step_thread = threading.Thread(target=work, daemon=True, name="kvlab-step-run")
        self._step_thread.start()

    def _draw_step(self, v) -> None:
        rec = v.record
        bars = "".join(
            f"<tr><td style='font-family:monospace'>{_esc(repr(t))}</td><td><div style='background:{TEACHER if i == rec.token_id else '#7570b3'};"
            f"width:{max(1, int(200 * p))}px;height:10px'></div></td><td>{p:.3f}</td></tr>"
            for t, p, i in v.top5)
        fired = (f"<b style='color:{REFRESH}'>refresh fired: {v.spliced} entries spliced</b>" if v.refreshed else "no refresh")
        if v.why:
            fired += f"<br><span class='kvlab-step-why'>why: {_esc(v.why)}</span>"
        fired += f"<br><small style='color:#666'>{_esc(PPL_NOTE)}</small>"
        self.step_info.value = (
            f"<div style='display:flex;gap:24px'><div style='font-size:13px'>step <b>{rec.step}</b>/{self.stepper.total} · "
            f"token <b style='font-family:monospace'>{_esc(repr(v.token))}</b> from the {v.source}<br>"
            f"entropy <b>{v.entropy_bits:.3f}</b> bits · p(top1) {rec.top1_prob:.3f}<br>cache length <b>{v.cache_len}</b> "
            f"(prompt {v.prompt_len}) · {fired}</div><table style='font-size:12px'><tr><th colspan=3>top-5 candidates</th></tr>{bars}</table></div>")
        self.step_map.value = live_map_html(v.live, v.prompt_len)
        teacher_pos = {sl.position for sl in v.live if sl.writer == "teacher"}
        toks = [h.token for h in self.stepper.history]
        parts = []
        for i, (t, h) in enumerate(zip(toks, self.stepper.history)):
            pos = v.prompt_len + i
            bg = f"background:{TEACHER}33" if pos in teacher_pos else ""
            parts.append(f"<span style='{bg}'>{_esc(t)}</span>" + (f"<b style='color:{REFRESH}'>⟳</b>" if h.refreshed else ""))
        self.step_text.value = f"<div style='font-size:13px;line-height:1.5'>{''.join(parts)}</div>"
        if v.done:
            self.step_msg.value = "<small>the run is over: Reset to start again</small>"


def live_map_html(live, prompt_len: int) -> str:
    """One cell per cache slot, coloured by writer (green teacher, orange student); the tooltip gives the
    slot's position, writer and token; a gap in positions (evicted entries) gets a thin grey bar."""
    cells, prev = [], None
    for i, sl in enumerate(live):
        if prev is not None and sl.position != prev + 1:
            cells.append("<span style='display:inline-block;width:3px;height:22px;background:#bbb;margin:0 1px'></span>")
        color = TEACHER if sl.writer == "teacher" else STUDENT
        border = "border-left:2px solid #000;" if sl.position == prompt_len else ""
        tip = html.escape(f"slot {i} · position {sl.position} · {sl.writer} · {sl.token!r}", quote=True)
        cells.append(f"<span class='kvlab-slot kvlab-slot-{sl.writer}' title='{tip}' style='display:inline-block;"
                     f"width:6px;height:22px;background:{color};{border}'></span>")
        prev = sl.position
    n_t = sum(1 for sl in live if sl.writer == "teacher")
    return (f"<div style='font-size:12px;margin:4px 0'>live map: {len(live)} slots — <span style='color:{TEACHER}'>"
            f"■ teacher {n_t}</span> · <span style='color:{STUDENT}'>■ student {len(live) - n_t}</span> "
            f"(black edge: first generated position; grey bar: evicted positions; hover a cell)</div>"
            f"<div style='line-height:0;max-width:1150px'>{''.join(cells)}</div>")


def show(pg: Playground) -> W.Widget:
    """Build the view of ``pg`` and return its widget (display it)."""
    return PlaygroundView(pg).widget
