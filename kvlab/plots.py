"""Plot functions of stored tables (registered in :mod:`kvlab.figures`)."""
from __future__ import annotations

import numpy as np

from .figures import _mpl, figure

POLICY_COLORS = {"teacher": "#1b9e77", "overfill": "#7570b3", "student": "#d95f02"}


@figure("baselines", needs=("baselines",))
def baselines_figure(tables):
    """Teacher / OverFill / Student: quality (teacher-PPL, KL, repeat@3) and speed, with per-prompt std."""
    df = tables["baselines"]
    Figure = _mpl()
    fig = Figure(figsize=(12, 3.2))
    axes = fig.subplots(1, 4)
    x = np.arange(len(df))
    colors = [POLICY_COLORS.get(p, "gray") for p in df["policy"]]
    for ax, col, label in zip(axes, ["teacher_ppl", "kl", "repeat3", "tps"],
                              ["teacher-PPL ↓", "KL(p_T‖q) nats ↓", "repeat@3 ↓", "decode tok/s ↑"]):
        err = df[f"{col}_std"] if f"{col}_std" in df else None
        ax.bar(x, df[col], yerr=err, color=colors, capsize=3)
        ax.set_xticks(x, df["policy"])
        ax.set_title(label)
        ax.grid(axis="y", linestyle=":", linewidth=0.6)
    n = int(df["n_prompts"].iloc[0]) if "n_prompts" in df else 0
    fig.suptitle(f"Baselines (no refresh): {n} prompts × {int(df['tokens'].iloc[0])} tokens, mean ± per-prompt std")
    fig.tight_layout()
    return fig


def _mc_result(tables):
    """Rebuild the simulation result the blog plots from its stored time series."""
    from types import SimpleNamespace

    ts = tables["mc_time_series"]
    fires_e = ts.loc[ts["entropy_fire"] == 1, "t"].astype(int).tolist()
    fires_m = ts.loc[ts["mcvar_fire"] == 1, "t"].astype(int).tolist()
    th = tables["mc_thresholds"].iloc[0]
    return SimpleNamespace(time_series=ts, tau_entropy=float(th["tau_entropy"]), tau_mcvar=float(th["tau_mcvar"]),
                           fires_entropy=fires_e, fires_mcvar=fires_m)


@figure("mc_entropy", needs=("mc_time_series", "mc_thresholds"))
def mc_entropy_figure(tables):
    from .mcsim import plot_entropy

    return plot_entropy(_mc_result(tables))


@figure("mc_variance", needs=("mc_time_series", "mc_thresholds"))
def mc_variance_figure(tables):
    from .mcsim import plot_mcvar

    return plot_mcvar(_mc_result(tables))


@figure("mc_triggers", needs=("mc_time_series", "mc_thresholds"))
def mc_triggers_figure(tables):
    from .mcsim import plot_triggers

    return plot_triggers(_mc_result(tables))
