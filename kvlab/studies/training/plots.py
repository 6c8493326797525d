"""The training-curves and training-Pareto figures (registered in :mod:`kvlab.harness.figures`, rendered by :mod:`kvlab.viz.figures`).
Draws from a table; writes only through the figure registry's renderer.
"""
from __future__ import annotations

from kvlab.harness.figures import figure, new_figure

COLORS = {"standalone": "#1f77b4", "overfill": "#d62728", "refresh-aware": "#2ca02c"}


@figure("train_curves", needs=("train_curves",))
def train_curves_figure(tables):
    """Loss per step (left) and held-out KL to the teacher (right), one line per trained variant."""
    df = tables["train_curves"]
    fig = new_figure(figsize=(10, 3.6))
    ax1, ax2 = fig.subplots(1, 2)
    for i, (v, g) in enumerate(df.groupby("variant", sort=False)):
        c = COLORS.get(v, f"C{i}")
        ax1.plot(g["step"], g["loss"], color=c, alpha=0.35, lw=0.8)
        ax1.plot(g["step"], g["loss"].rolling(5, min_periods=1).mean(), color=c, label=v)
        h = g.dropna(subset=["heldout_kl"]) if "heldout_kl" in g else g.iloc[:0]
        ax2.plot(h["step"], h["heldout_kl"], "o-", color=c, label=v)
    ax1.set(xlabel="optimiser step", ylabel="training loss (CE/KL mix)", title="loss (line: 5-step mean)")
    ax2.set(xlabel="optimiser step", ylabel="KL(p_T ‖ q), nats / token", title="held-out KL to the teacher")
    ax1.legend(), ax2.legend()
    fig.tight_layout()
    return fig


@figure("train_pareto", needs=("train_pareto",))
def train_pareto_figure(tables):
    """Held-out KL (short prompts left, long held-out histories right) against the decode speed-up over the teacher,
    one labelled dot per trained point; the Pareto front (lower KL, faster) joined by a line."""
    df = tables["train_pareto"]
    panels = [("heldout_kl", "front", "short held-out prompts")]
    if "heldout_kl_long" in df and df["heldout_kl_long"].notna().any():
        panels.append(("heldout_kl_long", "front_long", "long held-out examples (300-800 tokens)"))
    num = {pt: i + 1 for i, pt in enumerate(df["point"])}       # points are numbered; the key is below the axes
    fig = new_figure(figsize=(5.2 * len(panels), 4.0 + 0.16 * len(df)))
    for ax, (kl, front, title) in zip(fig.subplots(1, len(panels), squeeze=False)[0], panels):
        d = df.dropna(subset=[kl, "speedup"]).sort_values(["speedup", kl])
        on = d[d[front].astype(bool)]
        ax.plot(on["speedup"], on[kl], "-", color="#d62728", lw=1, label="Pareto front")
        ax.scatter(d["speedup"], d[kl], c=["#d62728" if f else "#7f7f7f" for f in d[front].astype(bool)], zorder=3)
        span = max(float(d["speedup"].max() - d["speedup"].min()), 1e-9) if len(d) else 1.0
        prev, k = None, 0
        for _, r in d.iterrows():       # points at (nearly) one speed-up, e.g. recipes of one shape: labels stacked
            k = k + 1 if prev is not None and abs(r["speedup"] - prev) < 0.03 * span else 0
            prev = r["speedup"]
            ax.annotate(str(num[r["point"]]), (r["speedup"], r[kl]), fontsize=8, xytext=(5, -4 + 9 * k),
                        textcoords="offset points")
        ax.set(xlabel="decode speed-up over the teacher (x)", ylabel="KL(p_T ‖ q), nats / token", title=title)
        ax.legend(fontsize=8)
    key = "   ".join(f"{i} = {pt}" + ("" if df["speedup"].notna().iloc[i - 1] else " (missing)")
                     for pt, i in num.items())
    fig.text(0.01, 0.01, key, fontsize=7, wrap=True)
    fig.tight_layout(rect=(0, 0.04 + 0.02 * (len(df) // 4), 1, 1))
    return fig
