"""The training-curves figure (registered in :mod:`kvlab.viz.base`, rendered by :mod:`kvlab.viz.figures`).
Draws from a table; writes only through the figure registry's renderer.
"""
from __future__ import annotations

from kvlab.viz.base import figure, new_figure

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
