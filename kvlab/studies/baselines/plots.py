"""The baselines study's figures (registered in :mod:`kvlab.harness.figures`): quality and timing per row."""
from __future__ import annotations

import numpy as np

from kvlab.harness.figures import figure, new_figure
from kvlab.harness.tableview import plural


POLICY_COLORS = {"teacher": "#1b9e77", "overfill": "#7570b3", "student": "#d95f02", "standalone": "#e7298a"}


def _bars(ax, df, col, label, colors):
    x = np.arange(len(df))
    err = df[f"{col}_std"] if f"{col}_std" in df else None
    ax.bar(x, df[col], yerr=err, color=colors, capsize=3)
    ax.set_xticks(x, df["policy"])
    ax.set_title(label)
    ax.grid(axis="y", linestyle=":", linewidth=0.6)


@figure("baselines", needs=("baselines",))
def baselines_figure(tables):
    """Teacher / OverFill / Student quality (teacher-PPL, KL, repeat@3), with per-prompt std.
    (Speed is machine-dependent: :func:`baselines_timing_figure`.)"""
    df = tables["baselines"]
    cols = [("teacher_ppl", "teacher-PPL ↓"), ("kl", "KL(p_T‖q) nats ↓")]
    if "kl_forced" in df and df["kl_forced"].notna().any():     # the teacher-forced score, which loops cannot fool
        cols.append(("kl_forced", "KL teacher-forced on the reference ↓"))
    cols.append(("repeat3", "repeat@3 ↓"))
    fig = new_figure(figsize=(3.4 * len(cols), 3.2))
    axes = fig.subplots(1, len(cols))
    colors = [POLICY_COLORS.get(p, "gray") for p in df["policy"]]
    for ax, (col, label) in zip(axes, cols):
        _bars(ax, df, col, label, colors)
    n = int(df["n_prompts"].iloc[0]) if "n_prompts" in df else 0
    spread = "mean ± per-prompt std" if n > 1 else "one prompt: no spread"
    fig.suptitle(f"Baselines (no refresh): {plural(n, 'prompt')} × {int(df['tokens'].iloc[0])} tokens, {spread}")
    fig.tight_layout()
    return fig


@figure("baselines_timing", needs=("baselines_timing",))
def baselines_timing_figure(tables):
    """Decode tok/s and end-to-end time of the baseline runs (machine-dependent)."""
    df = tables["baselines_timing"]
    fig = new_figure(figsize=(7, 3.2))
    axes = fig.subplots(1, 2)
    colors = [POLICY_COLORS.get(p, "gray") for p in df["policy"]]
    _bars(axes[0], df, "tps", "decode tok/s ↑", colors)
    _bars(axes[1], df, "total_s", "total s per run ↓", colors)
    fig.suptitle("Baselines: speed of the stored runs (this machine)")
    fig.tight_layout()
    return fig
