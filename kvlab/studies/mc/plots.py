"""The MC-dropout studies' figures (registered in :mod:`kvlab.harness.figures`): the simulation's panels and the real
MC signals against the student's entropy."""
from __future__ import annotations


from kvlab.harness.figures import figure, new_figure
from kvlab.harness.tableview import plural


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
    from kvlab.studies.mc.sim import plot_entropy

    return plot_entropy(_mc_result(tables))


@figure("mc_variance", needs=("mc_time_series", "mc_thresholds"))
def mc_variance_figure(tables):
    from kvlab.studies.mc.sim import plot_mcvar

    return plot_mcvar(_mc_result(tables))


@figure("mc_triggers", needs=("mc_time_series", "mc_thresholds"))
def mc_triggers_figure(tables):
    from kvlab.studies.mc.sim import plot_triggers

    return plot_triggers(_mc_result(tables))


@figure("mc_real", needs=("mc_real_traces", "mc_real_correlations"))
def mc_real_figure(tables):
    """Real MC dropout on the student: each MC signal against the student's entropy, one row per
    dropout p, Pearson r in each panel's title."""
    tr, corr = tables["mc_real_traces"], tables["mc_real_correlations"]
    ps = list(corr["p"])
    sigs = [("u", "U(t): mean logit var"), ("mi", "MI (nats)"), ("flip", "argmax-flip rate")]
    fig = new_figure(figsize=(11, 2.8 * len(ps) + 0.6))
    axes = fig.subplots(len(ps), 3, squeeze=False)
    for row, p in zip(axes, ps):
        d = tr[tr["p"] == p]
        c = corr[corr["p"] == p].iloc[0]
        for ax, (col, label) in zip(row, sigs):
            ax.scatter(d["entropy"], d[col], s=6, alpha=0.5, color="#7570b3")
            ax.set_title(f"p={p:g}: r = {c[f'r_{col}']:+.2f}", fontsize=9)
            ax.set_xlabel("student entropy (nats)", fontsize=8)
            ax.set_ylabel(label, fontsize=8)
            ax.grid(linestyle=":", linewidth=0.6)
    c0 = corr.iloc[0]
    fig.suptitle(f"MC dropout on the student: {plural(c0['prompts'], 'prompt')}, {int(c0['steps'])} probed steps per p, "
                 f"N = {int(c0['n_passes'])} passes")
    fig.tight_layout()
    return fig
