"""The refresh study's figures (registered in :mod:`kvlab.harness.figures`): the quality × overhead Pareto, cache
provenance over time, and the entropy trace of one run; :func:`place_labels` keeps point labels apart."""
from __future__ import annotations

import numpy as np

from kvlab.harness.figures import figure, new_figure
from kvlab.harness.tableview import plural


REFRESH_COLORS = {"none": "#7570b3", "periodic": "#1b9e77", "entropy": "#d95f02", "probe_kl": "#e7298a",
                  "speculative": "#66a61e"}


NEXT_MARKERS = {"teacher": "s", "student": "^"}


PROVENANCE_COLORS = {"teacher": "#1b9e77", "student": "#d95f02"}


def place_labels(ax, xy_px, labels, fontsize: float, dpi: float, pad: float = 1.5,
                 marker_px: float = 5.0) -> list[tuple[float, float]]:
    """Offsets (points) for ``labels`` at pixel positions ``xy_px`` so that no two label boxes
    overlap and no box covers a marker: greedy, in order, over candidates on rings of growing
    radius around each point (text sizes measured with Agg); where no candidate is free, the one
    with the least overlap. Returns one ``(dx, dy)`` in points per label (``ha`` from the sign of
    dx, ``va="bottom"``)."""
    from matplotlib.backends.backend_agg import RendererAgg
    from matplotlib.font_manager import FontProperties

    renderer = RendererAgg(10, 10, dpi)
    font = FontProperties(size=fontsize)
    scale = dpi / 72.0
    cands = [(dx * r, dy * r + (-fontsize if dy < 0 else (-fontsize / 2 if dy == 0 else 0)))
             for r in (3, 7, 12, 18, 26, 36)
             for dx, dy in ((1, 1), (-1, 1), (1, -1), (-1, -1), (1, 0), (-1, 0), (0, 1), (0, -1))]
    pts = np.asarray(xy_px, dtype=float)
    boxes, out = [], []

    def box(x, y, lab, dx, dy):
        w, h, d = renderer.get_text_width_height_descent(lab, font, ismath=False)
        x0 = x + dx * scale - (w if dx < 0 else (w / 2 if dx == 0 else 0))
        y0 = y + dy * scale
        return (x0 - pad, y0 - pad, x0 + w + pad, y0 + h + d + pad)

    def overlap(b, own):
        area = 0.0
        for o in boxes:
            area += max(0.0, min(b[2], o[2]) - max(b[0], o[0])) * max(0.0, min(b[3], o[3]) - max(b[1], o[1]))
        for j, (px, py) in enumerate(pts):
            if j != own:   # every other marker, as a box of ± marker radius
                area += max(0.0, min(b[2], px + marker_px) - max(b[0], px - marker_px)) * \
                    max(0.0, min(b[3], py + marker_px) - max(b[1], py - marker_px))
        return area

    for i, ((x, y), lab) in enumerate(zip(pts, labels)):
        scored = [(overlap(box(x, y, lab, *c), i), k, c) for k, c in enumerate(cands)]
        free = [c for a, _, c in scored if a == 0]
        choice = free[0] if free else min(scored)[2]
        boxes.append(box(x, y, lab, *choice))
        out.append(choice)
    return out


@figure("refresh_pareto", needs=("refresh_all", "refresh_timing"))
def refresh_pareto_figure(tables):
    """Quality (KL, teacher-PPL) vs latency overhead % for every refresh policy and setting.

    Points are numbered (labels placed so they do not overlap); the table on the right names each
    number. x: median overhead over (no refresh, policy) pairs timed side by side (bars: quartiles);
    y: mean over prompts (bars: bootstrap 95 % interval of the paired Δ vs no refresh, shifted onto
    the mean). Legend below the axes, never over the points.
    """
    q = tables["refresh_all"]
    t = tables["refresh_timing"]
    df = q.merge(t[["policy", "overhead_pct", "overhead_pct_q25", "overhead_pct_q75", "pairs"]], on="policy",
                 how="inner", suffixes=("_stored", ""))
    fig = new_figure(figsize=(15, max(5.2, 1.8 + 0.3 * len(df))))
    gs = fig.add_gridspec(1, 3, width_ratios=[1, 1, 0.95])
    axes = [fig.add_subplot(gs[0, 0]), fig.add_subplot(gs[0, 1])]
    tab_ax = fig.add_subplot(gs[0, 2])
    handles = {}
    for ax, m, label in zip(axes, ["kl", "teacher_ppl"], ["KL(p_T‖q) nats ↓", "teacher-PPL ↓"]):
        for n, r in enumerate(df.itertuples(), 1):
            lo, hi, d, y = getattr(r, f"d_{m}_lo"), getattr(r, f"d_{m}_hi"), getattr(r, f"d_{m}"), getattr(r, m)
            x = r.overhead_pct
            nxt = r.refresh_next if isinstance(r.refresh_next, str) else ""   # CSV reads "" back as NaN
            key = r.family if nxt in ("", "rerun") else f"{r.family} (next={nxt})"
            h = ax.errorbar(x, y, xerr=[[max(x - r.overhead_pct_q25, 0)], [max(r.overhead_pct_q75 - x, 0)]],
                            yerr=[[max(d - lo, 0)], [max(hi - d, 0)]], fmt=NEXT_MARKERS.get(nxt, "o"),
                            color=REFRESH_COLORS.get(r.family, "gray"), capsize=2, ms=6, alpha=0.9)
            handles.setdefault(key, h)
        ax.set_xlabel("latency overhead % vs no refresh (median of paired timings)")
        ax.set_title(label)
        ax.grid(linestyle=":", linewidth=0.6)
        ax.margins(0.12)
    fig.legend(list(handles.values()), list(handles.keys()), fontsize=9, loc="lower center", ncol=len(handles),
               frameon=False)
    fig.tight_layout(rect=(0, 0.07, 1, 0.93))
    for ax, m in zip(axes, ["kl", "teacher_ppl"]):
        labels = [str(n) for n in range(1, len(df) + 1)]
        px = ax.transData.transform(np.column_stack([df["overhead_pct"], df[m]]))
        for (x, y), lab, off in zip(zip(df["overhead_pct"], df[m]), labels,
                                    place_labels(ax, px, labels, 8, fig.dpi)):
            far = abs(off[0]) > 8 or abs(off[1]) > 15
            ax.annotate(lab, (x, y), xytext=off, textcoords="offset points", fontsize=8,
                        ha="right" if off[0] < 0 else ("center" if off[0] == 0 else "left"), va="bottom",
                        arrowprops={"arrowstyle": "-", "lw": 0.4, "color": "0.5"} if far else None)
    tab_ax.axis("off")
    cells = [[str(n), r.policy, f"{r.overhead_pct:+.1f}", f"{r.d_kl:+.3f}"] for n, r in enumerate(df.itertuples(), 1)]
    table = tab_ax.table(cellText=cells, colLabels=["#", "policy", "overhead %", "ΔKL"], loc="center",
                         colLoc="left", cellLoc="left", colWidths=[0.08, 0.5, 0.24, 0.18])
    table.auto_set_font_size(False)
    table.set_fontsize(10)          # the side table must read like the axes' labels, not ~7 px text
    table.scale(1, 1.6)
    n = int(df["n_prompts"].iloc[0])
    fig.suptitle(f"Refresh policies on OverFill: quality ({plural(n, 'prompt')} × {int(df['tokens'].iloc[0])} tokens, stored runs) "
                 f"vs overhead ({int(df['pairs'].iloc[0])} side-by-side timed pairs per policy)")
    return fig


def _provenance_matrix(rows):
    """Writer strings ('T' teacher, 'S' student) per step -> int matrix (1 T, 0 S, -1 empty)."""
    width = max(len(w) for w in rows)
    mat = np.full((len(rows), width), -1, dtype=np.int8)
    for i, w in enumerate(rows):
        mat[i, :len(w)] = [1 if c == "T" else 0 for c in w]
    return mat


@figure("refresh_provenance", needs=("refresh_provenance",))
def refresh_provenance_figure(tables):
    """The blog's two diagrams as measured: who wrote each cache slot over time, OverFill's one
    teacher prefill vs periodic teacher re-prefills (full and windowed), one panel per condition."""
    df = tables["refresh_provenance"]
    conds = list(dict.fromkeys(df["condition"]))
    fig = new_figure(figsize=(11, 2.6 * len(conds) + 0.6))
    axes = fig.subplots(len(conds), 1, squeeze=False)[:, 0]
    for ax, c in zip(axes, conds):
        g = df[df["condition"] == c].sort_values("step")
        _draw_provenance(ax, _provenance_matrix(list(g["writers"])), int(g["prompt_len"].iloc[0]))
        ax.set_title(f"{c}: {int(g['refreshes'].iloc[0])} refreshes", fontsize=9)
    _provenance_legend(axes[0])
    fig.suptitle(f"Cache provenance over time (prompt 0, {int(df['step'].max())} tokens): "
                 "teacher prefill only vs teacher re-prefills")
    fig.tight_layout()
    return fig


def _draw_provenance(ax, matrix, prompt_len: int, every: int = 1):
    from matplotlib.colors import ListedColormap

    cmap = ListedColormap(["white", PROVENANCE_COLORS["student"], PROVENANCE_COLORS["teacher"]])
    ax.imshow(np.asarray(matrix) + 1, aspect="auto", cmap=cmap, vmin=0, vmax=2, interpolation="nearest",
              extent=(-0.5, matrix.shape[1] - 0.5, matrix.shape[0] * every + 0.5, 0.5))
    ax.axvline(prompt_len - 0.5, color="k", lw=0.8, ls=":")
    shown = max(8, (matrix.shape[1] - prompt_len) // 4)          # the prompt's tail: the generated part stays readable
    if prompt_len > shown:
        ax.set_xlim(prompt_len - shown - 0.5, matrix.shape[1] - 0.5)
        ax.set_xlabel(f"cache slot (… last {shown} of {prompt_len} prompt slots | generated)")
    else:
        ax.set_xlabel("cache slot (prompt | generated)")
    ax.set_ylabel("after step t")


def _provenance_legend(ax):
    from matplotlib.patches import Patch

    ax.legend(handles=[Patch(color=PROVENANCE_COLORS["teacher"], label="written by the teacher"),
                       Patch(color=PROVENANCE_COLORS["student"], label="written by the student"),
                       Patch(facecolor="white", edgecolor="gray", label="not yet written")],
              fontsize=7, loc="lower left")


def plot_entropy_trace(records, tau_bits: float, title: str = ""):
    """Student entropy per step with the gate's τ line and the steps after which a refresh fired
    (a live trace's records; not a registered figure)."""
    fig = new_figure(figsize=(11, 3.2))
    ax = fig.subplots()
    steps = [r.step for r in records]
    ax.plot(steps, [r.entropy_bits for r in records], lw=0.9, color="#444", label="entropy of q (bits)")
    ax.axhline(tau_bits, color="#d95f02", ls="--", lw=1, label=f"τ = {tau_bits:.2f} bits")
    fired = [r for r in records if r.refreshed]
    ax.scatter([r.step for r in fired], [r.entropy_bits for r in fired], color="#d95f02", zorder=3, s=22,
               label=f"refresh ({len(fired)})")
    teacher_steps = [r.step for r in records if r.source == "teacher"]
    if teacher_steps:
        ax.scatter(teacher_steps, [0] * len(teacher_steps), marker="|", color="#1b9e77", label="token from teacher")
    ax.set_xlabel("step t")
    ax.set_ylabel("bits")
    ax.legend(fontsize=7, loc="upper right")
    ax.set_title(title or "Entropy-gated refresh")
    ax.grid(linestyle=":", linewidth=0.6)
    fig.tight_layout()
    return fig


def plot_provenance(matrix, prompt_len: int, every: int = 1, title: str = ""):
    """Which model wrote each cache slot over time: rows = decode steps, columns = slots
    (green teacher, orange student, white empty); from :func:`kvlab.harness.costs.provenance`."""
    fig = new_figure(figsize=(11, 3.6))
    ax = fig.subplots()
    _draw_provenance(ax, np.asarray(matrix), prompt_len, every)
    _provenance_legend(ax)
    ax.set_title(title or "Cache provenance: teacher (green) vs student (orange)")
    fig.tight_layout()
    return fig


@figure("refresh_long", needs=("refresh_long",))
def refresh_long_cost(tables):
    """Long generations (kvlab.studies.refresh.long): teacher tokens per generated token (x) against the paired
    change in quality vs no refresh (y, bootstrap 95 % interval over prompts), free-running teacher-PPL and
    teacher-forced KL in separate panels; each policy family one curve over its knob."""
    t = tables["refresh_long"]
    t = t[t.family != "none"]
    fig = new_figure(figsize=(10.5, 4.2))
    axes = fig.subplots(1, 2)
    n = int(t.n_prompts.iloc[0]) if len(t) else 0
    N = int(t.tokens.iloc[0]) if len(t) else 0
    for ax, m, lab in ((axes[0], "teacher_ppl", "Δ teacher-PPL (free-running)"),
                       (axes[1], "kl_forced", "Δ kl_forced (teacher-forced, nats)")):
        for fam, g in t.groupby("family", sort=False):
            g = g.sort_values("teacher_tokens_per_token")
            x, y = g.teacher_tokens_per_token.to_numpy(), g[f"d_{m}"].to_numpy()
            err = np.vstack([y - g[f"d_{m}_lo"].to_numpy(), g[f"d_{m}_hi"].to_numpy() - y])
            ax.errorbar(x, y, yerr=err, marker="o", capsize=3, lw=1.2, color=REFRESH_COLORS.get(fam, "gray"),
                        label=fam)
            for xi, yi, k in zip(x, y, g.knob):
                ax.annotate(str(k), (xi, yi), textcoords="offset points", xytext=(4, 4), fontsize=7)
        ax.axhline(0.0, color="black", lw=0.8, ls="--")
        ax.set_xscale("symlog", linthresh=0.01)
        ax.set_xlim(left=0.0)
        ax.set_xlabel("teacher tokens per generated token (free runs)")
        ax.set_ylabel(lab + " vs no refresh")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.suptitle(f"Refresh over long generations: N = {N} tokens, {plural(n, 'prompt')}; below 0 = better than no "
                 "refresh", fontsize=10)
    fig.tight_layout()
    return fig
