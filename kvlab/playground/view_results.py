"""The Explore tab's result column (ipywidgets): status line, progress bar, readouts table, spread,
pin / timing / export buttons, the plot (:class:`~kvlab.playground.view_plot.ExplorePlot`), why refreshes
fired and the generated text. The HTML comes from :mod:`kvlab.playground.render`.
"""
from __future__ import annotations

import html

import ipywidgets as W

from kvlab.playground.render import REFRESH, TEACHER, esc, spread_html, status_html, table_html, text_html, timing_html, why_html
from kvlab.playground.shown import Progress, Shown, fmt

_LEGEND = (f"<small><span style='background:{TEACHER}33'>teacher-written entry (refreshed)</span> · "
           f"<u>token drawn from the teacher</u> · <b style='color:{REFRESH}'>⟳</b> refresh after this token · "
           f"<s style='color:#999'>evicted</s></small>")
_BUTTONS = (("pin", "pin this run", "110px", "keep this run overlaid on the plots and beside the readouts"),
            ("unpin", "unpin all", "90px", "remove every pinned run"),
            ("timing", "time vs baseline", "140px", "time this configuration and its baseline back to back (3 pairs)"),
            ("export", "export PNG + CSV", "140px", "save the current view: plots as PNG, series and readouts as CSV"))


def _html(cls: str, value: str = "") -> W.HTML:
    w = W.HTML(value)
    w.add_class(cls)
    return w


class ResultsPanel:
    """The result column of a :class:`~kvlab.playground.Playground` around ``plot``; ``widget`` is the column."""

    def __init__(self, pg, plot):
        self.pg = pg
        self.plot = plot
        self.status = _html("kvlab-status")
        # the progress bar shows only while something decodes (a store hit never fills it)
        self.progress = W.IntProgress(value=0, min=0, max=1, description="", layout=W.Layout(width="520px", visibility="hidden"))
        self.progress.add_class("kvlab-progress")
        self.progress_msg = W.HTML("")
        self.table = _html("kvlab-readouts", "<i>no result yet</i>")
        self.spread_box = _html("kvlab-spread")
        self.why = _html("kvlab-why")
        self.text = _html("kvlab-text")
        # pin / overlay, back-to-back timing, export
        b = {n: W.Button(description=d, layout=W.Layout(width=w), tooltip=t) for n, d, w, t in _BUTTONS}
        for n, w in b.items():
            w.add_class(f"kvlab-{n}")
        b["pin"].on_click(lambda _: self._guard(self.pg.pin))
        b["unpin"].on_click(lambda _: self._guard(self.pg.unpin))
        b["timing"].on_click(lambda _: self._guard(self.pg.time_vs_baseline))
        b["export"].on_click(lambda _: self._export())
        self.buttons = b
        self.timing_box = _html("kvlab-timing")
        self.export_box = _html("kvlab-export")
        self.widget = W.VBox([self.status, W.HBox([self.progress, self.progress_msg]), self.table, self.spread_box,
                              W.HBox(list(b.values())), self.timing_box, self.export_box, plot.fig, self.why,
                              W.HTML(_LEGEND), self.text], layout=W.Layout(width="780px"))

    def _guard(self, fn) -> None:
        """Run a button's action; a ValueError (nothing to pin, bad controls) goes to the status line."""
        try:
            fn()
        except ValueError as e:
            self.set_status(f"⚠ {e}")

    def _export(self) -> None:
        from kvlab.playground.export import export_view

        try:
            paths = export_view(self.pg)
        except ValueError as e:
            self.export_box.value = f"<span style='color:#c00'>⚠ {esc(str(e))}</span>"
            return
        links = []
        import base64
        for p in paths:
            mime = "image/png" if p.suffix == ".png" else "text/csv"
            data = base64.b64encode(p.read_bytes()).decode()
            links.append(f"<a download='{html.escape(p.name, quote=True)}' href='data:{mime};base64,{data}'>{esc(p.name)}</a>")
        self.export_box.value = (f"<small>saved in <code>{esc(str(paths[0].parent))}</code>: " + " · ".join(links)
                                 + "</small>")

    def set_status(self, text: str) -> None:
        self.status.value = status_html(text)

    def bar(self, total: int, done: int, msg: str) -> None:
        """Show the progress bar at ``done``/``total`` (hidden again by :meth:`bar_off`)."""
        self.progress.max, self.progress.value = max(1, total), done
        self.progress.layout.visibility = "visible"
        self.progress_msg.value = esc(msg)

    def bar_off(self) -> None:
        self.progress.value = 0
        self.progress.layout.visibility = "hidden"
        self.progress_msg.value = ""

    def progress_event(self, p: Progress) -> None:
        """A "progress" event (other than precompute's): the bar, hidden once a stage finished silently."""
        if p.done >= p.total and not p.message:
            self.bar_off()
        else:
            self.bar(p.total, p.done, p.message)

    def point(self, p) -> None:
        """A streamed :class:`~kvlab.playground.shown.LivePoint`: the bar and the plot."""
        self.bar(p.total, p.step, f"{p.step}/{p.total} tokens · {fmt(p.tps, '.1f')} tok/s")
        self.plot.point(p)

    def live_start(self, s) -> None:
        self.bar(s.N, 0, "decoding…")
        self.plot.start_live(s)

    def errors(self, errors: dict) -> None:
        """A failed run shows on the status line."""
        if "run" in errors:
            self.set_status(f"run failed: {errors['run']}")

    def render(self, sh: Shown) -> None:
        """Show the stored run ``sh``: plot, readouts (beside the pinned runs), why, text."""
        self.plot.render(sh)
        self.table.value = table_html(sh, self.pg.pinned)
        self.why.value = why_html(sh)
        self.text.value = text_html(sh)
        self.bar_off()

    def spread(self, sp) -> None:
        self.spread_box.value = spread_html(sp)

    def timing(self, t: dict) -> None:
        self.timing_box.value = timing_html(t)
