"""The playground's control column (ipywidgets): one widget per setting with its error line
(:class:`ControlPanel`), and the "precompute a slider's whole range" row (:class:`PrecomputeRow`).
Widgets only: no model, cache or file is touched here.

Every control calls :meth:`Playground.set <kvlab.playground.Playground.set>`; rows of settings the current
policy, mode, sampling or eviction does not use are hidden. DOM classes ``kvlab-<control>`` and
``kvlab-err-<control>`` let a browser test find them.
"""
from __future__ import annotations

import math

import ipywidgets as W

from kvlab.playground.render import esc
from kvlab.playground.settings import EVICT_PARAMS, MC_SIGNALS, NO_EVICTION, POLICIES, POLICY_LABELS, POLICY_PARAMS, SAMPLINGS

_LABELS = {"T": "T (period)", "W": "W (window, 0=∞)", "tau_bits": "τ (bits)", "M": "M (probe every)",
           "kappa": "κ (nats)", "k": "k (burst)", "mc_threshold": "MC threshold", "mc_every": "MC every",
           "mc_passes": "MC passes", "mc_p": "MC dropout p", "temperature": "temperature", "top_p": "top-p",
           "budget": "budget", "gamma": "Conf-KV γ", "recent": "recent window", "n_prompts": "prompts ×",
           "n_seeds": "× seeds"}
_STYLE = {"description_width": "120px"}
_ROW = W.Layout(width="400px")
_SLIDER_PARAMS = ("T", "W", "tau_bits", "M", "kappa", "k", "mc_threshold", "mc_every", "mc_passes", "mc_p", "temperature",
                  "top_p", "budget", "gamma", "recent")


class PrecomputeRow:
    """A slider picker, "whole range" (:meth:`Playground.precompute`), "stop", a progress bar and a message."""

    def __init__(self, pg):
        self.pg = pg
        self.param = W.Dropdown(options=[], description="precompute", style=_STYLE, layout=W.Layout(width="220px"))
        self.button = W.Button(description="whole range", layout=W.Layout(width="110px"))
        self.button.add_class("kvlab-precompute")
        self.button.on_click(self._precompute)
        self.stop = W.Button(description="stop", layout=W.Layout(width="60px"), tooltip="stop precomputing / the live run")
        self.stop.on_click(lambda _: self.pg.cancel())
        self.bar = W.IntProgress(value=0, min=0, max=1, layout=W.Layout(width="400px"))
        self.msg = W.HTML("")
        self.rows = [W.HBox([self.param, self.button, self.stop]), self.bar, self.msg]

    def set_options(self, opts: list) -> None:
        """Offer the sliders ``opts`` (keeping the pick when it is still offered)."""
        if list(self.param.options) != opts:
            keep = self.param.value
            self.param.options = opts
            self.param.value = keep if keep in opts else (opts[0] if opts else None)

    def progress(self, p) -> None:
        """Show a "precompute" :class:`~kvlab.playground.shown.Progress`."""
        self.bar.max, self.bar.value = max(1, p.total), p.done
        self.msg.value = esc(p.message)

    def _precompute(self, _button):
        param = self.param.value
        if not param:
            self.msg.value = "pick a slider"
            return
        try:
            grid = self.pg.grid(param)
            self.bar.max, self.bar.value = max(1, len(grid)), 0
            self.pg.precompute(param, grid)
            self.msg.value = f"precomputing {param}: {len(grid)} positions…"
        except Exception as e:
            self.msg.value = f"<span style='color:#c00'>{esc(str(e))}</span>"


class ControlPanel:
    """Every control of a :class:`~kvlab.playground.Playground` (``controls``, ``errs`` per setting name);
    ``widget`` is the column. ``on_errors(errors)`` shows errors a control's callback raised."""

    def __init__(self, pg, on_errors):
        self.pg = pg
        self.on_errors = on_errors
        self.controls: dict[str, W.Widget] = {}
        self.errs: dict[str, W.HTML] = {}
        self._syncing = False
        self.pre = PrecomputeRow(pg)
        self.widget = W.VBox(self._rows() + [W.HTML("<hr style='margin:6px 0'>")] + self.pre.rows,
                             layout=W.Layout(width="430px", min_width="430px"))
        self.controls["prompt"].add_class("kvlab-prompt-text")

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

    def _dropdown(self, name: str, options, description: str, **kw) -> W.Widget:
        return self._control(name, W.Dropdown(options=options, value=getattr(self.pg.settings, name),
                                              description=description, style=_STYLE, layout=_ROW, **kw))

    def _rows(self) -> list:
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
                self._dropdown("policy", [(POLICY_LABELS[p], p) for p in POLICIES], "refresh")]
        self.policy_rows = {}
        for name in ("T", "W", "tau_bits", "M", "kappa", "k"):
            self.policy_rows[name] = self._control(name, self._slider(name, "320px" if name in self.pct else "400px"),
                                                   self.pct.get(name))
        self.policy_rows["mc_signal"] = self._dropdown("mc_signal", MC_SIGNALS, "MC signal")
        self.policy_rows["mc_threshold"] = self._control("mc_threshold", self._slider("mc_threshold", "320px"),
                                                         self.pct["mc_threshold"])
        for name in ("mc_every", "mc_passes", "mc_p"):
            self.policy_rows[name] = self._control(name, self._slider(name))
        rows += list(self.policy_rows.values())
        self.next_row = self._dropdown("refresh_next", ["rerun", "student", "teacher"], "refresh_next")
        self.student_row = self._dropdown("student", list(self.pg.student_variants), "student",
                                          disabled=len(self.pg.student_variants) == 1)
        self.prune_row = self._dropdown("prune_ratio", list(self.pg.prune_ratios), "student prune")
        rows += [self.next_row, self.student_row, self.prune_row,
                 self._control("N", W.IntText(value=s.N, description="N tokens", style=_STYLE, layout=_ROW)),
                 self._control("sampling", W.ToggleButtons(options=list(SAMPLINGS), value=s.sampling, description="sampling",
                                                           style={"button_width": "86px", **_STYLE}))]
        self.sample_rows = [self._control("temperature", self._slider("temperature")), self._control("top_p", self._slider("top_p"))]
        rows += self.sample_rows
        rows.append(self._control("seed", W.IntText(value=s.seed, description="seed", style=_STYLE, layout=_ROW)))
        ev_opts = [NO_EVICTION] + list(self.pg.eviction_names)
        rows.append(self._dropdown("evict", ev_opts, "eviction", disabled=len(ev_opts) == 1))
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
        return rows

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
            self.on_errors({**self.pg.errors, name: f"{type(e).__name__}: {e}"})
        self.sync_visibility()

    def sync_visibility(self):
        """Show the rows the current settings use, offer their sliders to precompute, follow the prompt."""
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
        self.pre.set_options(opts)
        pick = s.prompt if s.prompt in self.pg.prompts else None
        if self.prompt_pick.value != pick:
            self._syncing = True
            try:
                self.prompt_pick.value = pick
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

    def sync_controls(self, s) -> None:
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

    def render_errors(self, errors: dict) -> None:
        """Each control's error line: its message in ``errors``, or empty."""
        for name, w in self.errs.items():
            msg = errors.get(name)
            w.value = f"<span style='color:#c00;font-size:12px'>⚠ {esc(msg)}</span>" if msg else ""

    def percentiles(self, payload: dict) -> None:
        """The calibrated percentile beside τ, κ and the MC threshold (a "percentiles" event)."""
        for name, w in self.pct.items():
            p = payload.get(name)
            w.value = (f"<span style='font-size:12px;white-space:nowrap' title='calibrated percentile'>"
                       f"&nbsp;≈ p{p:.0f} calib.</span>" if p is not None else "<small>&nbsp;(calibrating)</small>")
