"""The playground's HTML panels as plain strings (no widgets): the readouts table, the spread, the
back-to-back timing, why refreshes fired, the generated text, the live map, the step-through readout and
the cache inspector.
:mod:`kvlab.playground.view` puts them into ``ipywidgets.HTML``; they are testable without a browser.
"""
from __future__ import annotations

import html

from kvlab.harness.experiment import MIN_PAIRS
from kvlab.playground.shown import READOUTS, Shown, fmt
from kvlab.playground.spread import Spread
from kvlab.playground.why import PPL_NOTE

TEACHER, STUDENT, BASE, REFRESH = "#1b9e77", "#d95f02", "#9e9e9e", "#e7298a"
PIN_COLORS = ("#1f77b4", "#9467bd", "#8c564b", "#17becf")


def esc(s: str) -> str:
    """HTML-escaped text, newlines shown as ↵."""
    return html.escape(s).replace("\n", "↵<br>")


def status_html(text: str) -> str:
    """The status line."""
    return f"<div style='font-family:monospace;font-size:12px;color:#333'>{esc(text)}</div>"


def table_html(sh: Shown, pinned=()) -> str:
    """The readouts table of ``sh``: this run, its baseline, the difference, and every pinned run but ``sh``."""
    pins = [p for p in pinned if p.key != sh.key]
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



def spread_html(sp: Spread | None) -> str:
    """Means over prompts × seeds with paired 95 % CIs vs the baseline ("" without a spread)."""
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



def timing_html(t: dict) -> str:
    """The back-to-back timing vs the baseline (a "timing" event's payload)."""
    return (f"<div style='font-size:12px'>time vs baseline, <b>timed back to back</b> ({t['pairs']} pairs, same prompt "
            f"and seed, order alternating): <b><span class='kvlab-overhead'>{fmt(t['overhead_pct'], '+.1f')}</span> %</b> "
            f"(median; quartiles {fmt(t['q25'], '+.1f')} … {fmt(t['q75'], '+.1f')} %; baseline vs itself "
            f"{fmt(t['noise_pct'], '+.1f')} %, the noise floor) · {esc(t['settings'].prompt[:40])}…</div>")



def why_html(sh: Shown) -> str:
    """Why refreshes fired (the policy's own words), the same-tokens note and the PPL note."""
    parts = []
    if sh.reasons:
        shown = "; ".join(f"step {t}: {esc(w)}" for t, w in sh.reasons[:8])
        more = f"; … {len(sh.reasons) - 8} more (hover the ▲ markers)" if len(sh.reasons) > 8 else ""
        parts.append(f"<b>why refreshes fired</b> ({len(sh.reasons)}): {shown}{more}")
    elif sh.settings.policy != "none":
        parts.append("<b>no refresh fired</b> in this run")
    if sh.note:
        parts.append(f"<span class='kvlab-same-tokens'>{esc(sh.note)}</span>")
    parts.append(f"<span style='color:#666'>{esc(PPL_NOTE)}</span>")
    return "<div style='font-size:12px;line-height:1.4;margin:4px 0'>" + "<br>".join(parts) + "</div>"



def text_html(sh: Shown) -> str:
    """The generated text: teacher-written entries shaded, teacher-drawn tokens underlined, evicted struck."""
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
        t = esc(tok)
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



def step_info_html(v, total: int) -> str:
    """The step-through readout of one :class:`~kvlab.playground.stepper.StepView` ``v`` (of ``total``
    steps): token, source, entropy, cache length, whether a refresh fired and why, the top-5 candidates."""
    rec = v.record
    bars = "".join(
        f"<tr><td style='font-family:monospace'>{esc(repr(t))}</td><td><div style='background:{TEACHER if i == rec.token_id else '#7570b3'};"
        f"width:{max(1, int(200 * p))}px;height:10px'></div></td><td>{p:.3f}</td></tr>"
        for t, p, i in v.top5)
    fired = (f"<b style='color:{REFRESH}'>refresh fired: {v.spliced} entries spliced</b>" if v.refreshed else "no refresh")
    if v.why:
        fired += f"<br><span class='kvlab-step-why'>why: {esc(v.why)}</span>"
    fired += f"<br><small style='color:#666'>{esc(PPL_NOTE)}</small>"
    return (
        f"<div style='display:flex;gap:24px'><div style='font-size:13px'>step <b>{rec.step}</b>/{total} · "
        f"token <b style='font-family:monospace'>{esc(repr(v.token))}</b> from the {v.source}<br>"
        f"entropy <b>{v.entropy_bits:.3f}</b> bits · p(top1) {rec.top1_prob:.3f}<br>cache length <b>{v.cache_len}</b> "
        f"(prompt {v.prompt_len}) · {fired}</div><table style='font-size:12px'><tr><th colspan=3>top-5 candidates</th></tr>{bars}</table></div>")


def step_text_html(v, history) -> str:
    """The text stepped so far (``history``: the StepViews), shaded where ``v``'s cache holds teacher entries."""
    teacher_pos = {sl.position for sl in v.live if sl.writer == "teacher"}
    parts = []
    for i, h in enumerate(history):
        pos = v.prompt_len + i
        bg = f"background:{TEACHER}33" if pos in teacher_pos else ""
        parts.append(f"<span style='{bg}'>{esc(h.token)}</span>" + (f"<b style='color:{REFRESH}'>⟳</b>" if h.refreshed else ""))
    return f"<div style='font-size:13px;line-height:1.5'>{''.join(parts)}</div>"

# ------------------------------------------------------------------ cache inspector


def inspect_html(v) -> str:
    """The cache inspector's message and shaded text of one
    :class:`~kvlab.playground.inspection.InspectView` ``v`` (the survival map is :func:`png_html`)."""
    msg = f"<div class='kvlab-inspect-msg kvlab-inspect-{v.state}' style='font-size:12px;margin:4px 0'>{esc(v.message)}</div>"
    if v.step is None:
        return msg
    legend = ("<small style='color:#666'>each token of the prompt and the generated text, shaded by the share of the "
              f"{v.num_layers} layers that still hold it after step {v.step} (dark: all, pale: none); hover a token: "
              "position, writer, layers, score and the step it was evicted</small>")
    return (msg + legend + "<div class='kvlab-inspect-tokens' style='font-size:13px;border:1px solid #eee;padding:6px;"
            f"max-height:260px;overflow:auto'>{v.tokens_html}</div>")


def png_html(png: bytes | None, alt: str = "") -> str:
    """An inline ``<img>`` of PNG bytes ("" for None)."""
    if png is None:
        return ""
    import base64

    return (f"<img class='kvlab-inspect-map' alt='{html.escape(alt, quote=True)}' style='max-width:100%' "
            f"src='data:image/png;base64,{base64.b64encode(png).decode()}'>")
