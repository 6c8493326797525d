"""Eviction figures, functions of the stored tables (registered in :mod:`kvlab.harness.figures`, rendered by
:mod:`kvlab.viz.figures`)."""
from __future__ import annotations

import numpy as np

from kvlab.harness.figures import figure, new_figure

EVICT_COLORS = {"full": "#222222", "sliding": "#1b9e77", "h2o": "#d95f02", "random": "#999999", "block": "#7570b3",
                "confkv": "#e7298a", "confkv_recency": "#66a61e", "confkv_attention": "#e6ab02",
                "random_rate": "#a6761d", "confkv_int8": "#1f78b4", "confkv_pyramidal": "#fb9a99",
                "confkv+overfill+refresh": "#6a3d9a", "confkv_fixed": "#000080", "snapkv": "#b15928"}


def _color(name: str, i: int) -> str:
    return EVICT_COLORS.get(name, f"C{i % 10}")


@figure("evict_sawtooth", needs=("evict_sawtooth",))
def evict_sawtooth_figure(tables, policies=None):
    """Cache length and bytes per step for every policy on the same prompt; eviction events are
    dots on each curve, refresh events (OverFill + refresh runs) crosses; the lower panel is
    Conf-KV's confidence with γ and the budget it chose (the sawtooth's cause)."""
    df = tables["evict_sawtooth"]
    names = list(dict.fromkeys(df.policy)) if policies is None else list(policies)
    conf = df[(df.policy == "confkv") & df.confidence.notna()] if "confkv" in names else df.iloc[:0]
    rows = 3 if len(conf) else 2
    fig = new_figure(figsize=(12, 2.9 * rows + 0.6))
    axes = fig.subplots(rows, 1, sharex=True)
    for i, name in enumerate(names):
        g = df[df.policy == name]
        c = _color(name, i)
        lw = 1.8 if name.startswith("confkv") and name in ("confkv", "confkv+overfill+refresh") else 1.0
        for ax, col in zip(axes[:2], ("cache_len", "cache_mb")):
            if col == "cache_mb" and name == "full" and len(names) > 1:
                continue                     # the bytes panel zooms on the evicting policies
            z = 5 if name == "confkv" else 2
            ax.plot(g.step, g[col], color=c, lw=lw, label=name, drawstyle="steps-post", zorder=z)
            ev = g[g.evicted > 0]
            ax.scatter(ev.step, ev[col], color=c, s=7, zorder=z + 1)
            rf = g[g.refreshed > 0]
            if len(rf):
                ax.scatter(rf.step, rf[col], color=c, marker="x", s=40, zorder=4)
    axes[0].set_ylabel("cache entries")
    axes[1].set_ylabel("KV cache MiB")
    axes[1].set_title("KV bytes per step of the evicting policies (INT8 entries counted as 1 byte)", fontsize=9)
    axes[0].set_title("cache length per step (after the evict phase); dots = eviction events, × = refresh")
    axes[0].legend(fontsize=7, ncol=4, loc="upper left")
    for ax in axes:
        ax.grid(linestyle=":", linewidth=0.6)
    if len(conf):
        ax = axes[2]
        ax.plot(conf.step, conf.confidence, color=_color("confkv", 0), lw=1.0, label="Conf-KV confidence")
        gamma = conf.gamma.dropna()
        if len(gamma):
            ax.axhline(float(gamma.iloc[0]), color="k", ls="--", lw=0.9, label=f"γ = {float(gamma.iloc[0]):g}")
        ax.set_ylabel("confidence")
        ax.set_ylim(-0.02, 1.02)
        if conf.budget.notna().any():
            ax2 = ax.twinx()
            ax2.plot(conf.step, conf.budget, color="#555555", lw=0.9, drawstyle="steps-post", alpha=0.7,
                     label="budget chosen")
            ax2.set_ylabel("budget (entries)")
            ax2.legend(fontsize=7, loc="lower right")
        ax.legend(fontsize=7, loc="lower left")
    axes[-1].set_xlabel("decode step t")
    fig.suptitle("KV-cache eviction on one prompt: the Conf-KV sawtooth vs fixed budgets")
    fig.tight_layout()
    return fig


@figure("evict_needle", needs=("evict_needle",))
def evict_needle_figure(tables):
    """Passkey retrieval heat-maps in KVCache-Factory's style: one panel per policy (columns) and
    setting (rows: ``streamed`` question through the loop, ``prefill`` question prefilled), needle
    depth (rows of a panel) × prompt length (columns), at matched mean memory per setting."""
    df = tables["evict_needle"]
    if "setting" not in df:
        df = df.assign(setting="prefill")
    settings = list(dict.fromkeys(df.setting))
    names = list(dict.fromkeys(df.policy))
    fig = new_figure(figsize=(2.3 * len(names) + 1.2, 2.6 * len(settings) + 0.6))
    axes = np.atleast_2d(fig.subplots(len(settings), len(names), sharey=True, squeeze=False))
    im = None
    for r, setting in enumerate(settings):
        for c, name in enumerate(names):
            ax = axes[r, c]
            g = df[(df.setting == setting) & (df.policy == name)]
            if not len(g):
                ax.set_axis_off()
                continue
            pv = g.pivot_table(index="depth", columns="length", values="accuracy", aggfunc="mean")
            im = ax.imshow(pv.to_numpy(), vmin=0, vmax=1, cmap="RdYlGn", aspect="auto")
            ax.set_xticks(range(pv.shape[1]), [str(x) for x in pv.columns], fontsize=7)
            ax.set_yticks(range(pv.shape[0]), [f"{d:g}" for d in pv.index], fontsize=7)
            for (i, j), v in np.ndenumerate(pv.to_numpy()):
                ax.text(j, i, f"{v:.2f}", ha="center", va="center", fontsize=6.5)
            mem = f", {g.mean_cache_len.mean():.0f} entries" if "mean_cache_len" in g else ""
            ax.set_title(f"{setting} · {name}\n{g.accuracy.mean():.2f}{mem}", fontsize=7.5)
            if r == len(settings) - 1:
                ax.set_xlabel("prompt tokens")
        axes[r, 0].set_ylabel("needle depth\n(0 = oldest, 1 = by the question)", fontsize=8)
    if im is not None:
        fig.colorbar(im, ax=list(axes.ravel()), shrink=0.8, label="exact retrieval")
    fig.suptitle("Passkey retrieval under eviction at matched mean memory (greedy; title: setting · policy: mean "
                 "exact retrieval, mean cache entries)", y=1.02, fontsize=10)
    return fig


@figure("evict_gamma", needs=("evict_gamma",))
def evict_gamma_figure(tables):
    """The γ sweep: Conf-KV's KL to the full cache against its mean cache length, one point per γ
    (labelled, with ±1 per-prompt std), and the fixed-budget control and H2O as reference points."""
    df = tables["evict_gamma"]
    fig = new_figure(figsize=(7.5, 4.6))
    ax = fig.subplots(1, 1)
    sw = df[df.gamma.notna()].sort_values("gamma")
    ax.errorbar(sw.mean_len, sw.kl, yerr=sw.kl_std, color=_color("confkv", 0), marker="o", lw=1.2, capsize=3,
                label="Conf-KV, γ sweep")
    for _, r in sw.iterrows():
        ax.annotate(f"γ={r.gamma:g}\n{r.frac_loose:.0%} loose", (r.mean_len, r.kl), fontsize=7,
                    textcoords="offset points", xytext=(5, 4))
    for i, (_, r) in enumerate(df[df.gamma.isna()].iterrows()):
        ax.errorbar([r.mean_len], [r.kl], yerr=[r.kl_std], marker="s", color=_color(r.policy, i + 3), capsize=3,
                    ls="none", label=r.policy)
    ax.set_xlabel("mean cache entries per layer (memory)")
    ax.set_ylabel("KL(p_full ‖ p_evicted), nats / token")
    ax.grid(linestyle=":", linewidth=0.6)
    ax.legend(fontsize=8)
    ax.set_title("Conf-KV's quality–memory knob: γ (higher γ → more steps on the loose budget)", fontsize=10)
    fig.tight_layout()
    return fig


def plot_confidence_trace(records, gamma: float, title: str = ""):
    """A live run's Conf-KV confidence per step with γ, the budget it chose and the cache length
    (records of a :class:`kvlab.decode.Decoding` with ``evict=ConfKV(...)``; not a registered figure).
    Eviction steps are marked on the cache-length curve."""
    fig = new_figure(figsize=(11, 4.6))
    ax, ax2 = fig.subplots(2, 1, sharex=True, height_ratios=[1, 1.2])
    steps = [r.step for r in records]
    conf = [r.signals.get("confidence", float("nan")) for r in records]
    budget = [r.signals.get("budget", float("nan")) for r in records]
    ax.plot(steps, conf, color=_color("confkv", 0), lw=1.0, label="confidence")
    ax.axhline(gamma, color="k", ls="--", lw=0.9, label=f"γ = {gamma:g}")
    tight = [s for s, c in zip(steps, conf) if c >= gamma]
    ax.scatter(tight, [1.01] * len(tight), marker="|", color="#444", s=30, label="confident → tight budget")
    ax.set_ylim(-0.02, 1.05)
    ax.set_ylabel("confidence")
    ax.legend(fontsize=7, loc="lower left", ncol=3)
    ax2.plot(steps, [r.cache_len for r in records], color=_color("confkv", 0), lw=1.3, drawstyle="steps-post",
             label="cache entries")
    ax2.plot(steps, budget, color="#555", lw=0.9, ls=":", drawstyle="steps-post", label="budget chosen")
    ev = [r for r in records if r.evicted]
    ax2.scatter([r.step for r in ev], [r.cache_len for r in ev], color=_color("confkv", 0), s=10, zorder=3,
                label=f"eviction ({sum(r.evicted for r in ev)} entries in {len(ev)} events)")
    ax2.set_ylabel("entries")
    ax2.set_xlabel("decode step t")
    ax2.legend(fontsize=7, loc="upper left")
    for a in (ax, ax2):
        a.grid(linestyle=":", linewidth=0.6)
    fig.suptitle(title or "Conf-KV: confidence, γ and the budget")
    fig.tight_layout()
    return fig
