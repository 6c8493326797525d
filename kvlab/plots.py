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


REFRESH_COLORS = {"none": "#7570b3", "periodic": "#1b9e77", "entropy": "#d95f02", "probe_kl": "#e7298a",
                  "speculative": "#66a61e"}


@figure("refresh_pareto", needs=("refresh_all",))
def refresh_pareto_figure(tables):
    """Quality (KL, teacher-PPL) vs latency overhead % for every refresh policy and setting.

    Points are means over prompts; error bars are per-prompt std of the paired overhead and the
    bootstrap 95 % interval of ΔKL / Δteacher-PPL against no refresh (shifted onto the mean).
    """
    df = tables["refresh_all"]
    Figure = _mpl()
    fig = Figure(figsize=(12, 4.4))
    axes = fig.subplots(1, 2)
    for ax, m, label in zip(axes, ["kl", "teacher_ppl"], ["KL(p_T‖q) nats ↓", "teacher-PPL ↓"]):
        for r in df.itertuples():
            lo, hi = getattr(r, f"d_{m}_lo"), getattr(r, f"d_{m}_hi")
            d = getattr(r, f"d_{m}")
            y = getattr(r, m)
            yerr = [[max(d - lo, 0)], [max(hi - d, 0)]]
            nxt = r.refresh_next if isinstance(r.refresh_next, str) else ""   # CSV reads "" back as NaN
            marker = {"teacher": "s", "student": "^"}.get(nxt, "o")
            ax.errorbar(r.overhead_pct, y, xerr=r.overhead_pct_std, yerr=yerr, fmt=marker,
                        color=REFRESH_COLORS.get(r.family, "gray"), capsize=2, ms=6, alpha=0.9,
                        label=r.family if nxt in ("", "rerun") else f"{r.family} (next={nxt})")
            ax.annotate(r.policy, (r.overhead_pct, y), fontsize=6.5, xytext=(3, 3), textcoords="offset points")
        ax.set_xlabel("latency overhead % vs no refresh (paired)")
        ax.set_title(label)
        ax.grid(linestyle=":", linewidth=0.6)
    handles, labels = axes[0].get_legend_handles_labels()
    uniq = dict(zip(labels, handles))
    axes[1].legend(uniq.values(), uniq.keys(), fontsize=7, loc="best")
    n = int(df["n_prompts"].iloc[0])
    fig.suptitle(f"Refresh policies on OverFill: quality vs overhead ({n} prompts × {int(df['tokens'].iloc[0])} tokens; "
                 "bars: per-prompt std of overhead, 95% bootstrap CI of the paired Δ)")
    fig.tight_layout()
    return fig


def plot_entropy_trace(records, tau_bits: float, title: str = ""):
    """Student entropy per step with the gate's τ line and the steps after which a refresh fired
    (a live trace's records; not a registered figure)."""
    Figure = _mpl()
    fig = Figure(figsize=(11, 3.2))
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
    (green teacher, orange student, white empty); from :func:`kvlab.refresh.provenance`."""
    from matplotlib.colors import ListedColormap

    Figure = _mpl()
    fig = Figure(figsize=(11, 3.6))
    ax = fig.subplots()
    cmap = ListedColormap(["white", "#d95f02", "#1b9e77"])
    ax.imshow(np.asarray(matrix) + 1, aspect="auto", cmap=cmap, vmin=0, vmax=2, interpolation="nearest",
              extent=(-0.5, matrix.shape[1] - 0.5, matrix.shape[0] * every + 0.5, 0.5))
    ax.axvline(prompt_len - 0.5, color="k", lw=0.8, ls=":")
    ax.set_xlabel("cache slot (prompt | generated)")
    ax.set_ylabel("after step t")
    ax.set_title(title or "Cache provenance: teacher (green) vs student (orange)")
    fig.tight_layout()
    return fig
