"""The real MC-dropout study (``python -m kvlab mc-real``): how the MC signals of the student track its entropy
(:func:`correlation_study`), a gate replayed over a stored trace (:func:`replay_gate`) and the trace figure. The
dropout itself, the probe and the ``MCGate`` policy are the policy library's (:mod:`kvlab.uncertainty.mc`)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Sequence

from kvlab.uncertainty.mc import (DEFAULT_P, DEFAULT_PASSES, SIGNALS, MCGate, check_n_passes, check_p,  # noqa: F401
                                  mc_traces)


def correlations(df, against: str = "entropy", signals: Sequence[str] = SIGNALS) -> dict[str, float]:
    """Pearson r of each MC signal with the student's entropy over the pooled trace rows."""
    return {s: float(df[s].corr(df[against])) for s in signals}


def correlation_intervals(df, against: str = "entropy", signals: Sequence[str] = SIGNALS, by: str = "prompt",
                          n_boot: int = 2000, seed: int = 0) -> dict[str, float]:
    """Bootstrap 95 % intervals of :func:`correlations` over prompts: resample whole prompts (column ``by``) with
    replacement, pool their steps, recompute each Pearson r. ``{"r_<s>_lo": ..., "r_<s>_hi": ...}``; NaN with
    fewer than ``MIN_PAIRS`` prompts (an interval from 2-4 resampled prompts says nothing)."""
    import numpy as np

    from kvlab.harness.experiment import MIN_PAIRS

    groups = df.groupby(by, sort=True)
    n = len(groups)
    out: dict[str, float] = {}
    rng = np.random.default_rng(seed)
    counts = rng.multinomial(n, [1.0 / n] * n, size=n_boot) if n else np.zeros((n_boot, 0))   # (B, prompts)
    for sig in signals:
        if n < MIN_PAIRS:
            out[f"r_{sig}_lo"] = out[f"r_{sig}_hi"] = float("nan")
            continue
        # per prompt sums of x, y, x², y², xy and the step count: a resample's r from the weighted sums
        st = np.array([[len(g), g[sig].sum(), g[against].sum(), (g[sig] ** 2).sum(), (g[against] ** 2).sum(),
                        (g[sig] * g[against]).sum()] for _, g in groups], dtype=float)
        m, sx, sy, sxx, syy, sxy = (counts @ st).T
        cov = sxy - sx * sy / m
        var = (sxx - sx ** 2 / m) * (syy - sy ** 2 / m)
        with np.errstate(invalid="ignore", divide="ignore"):
            r = cov / np.sqrt(var)
        r = r[np.isfinite(r)]
        out[f"r_{sig}_lo"], out[f"r_{sig}_hi"] = (np.percentile(r, [2.5, 97.5]) if len(r) else (np.nan, np.nan))
        out[f"r_{sig}_lo"], out[f"r_{sig}_hi"] = float(out[f"r_{sig}_lo"]), float(out[f"r_{sig}_hi"])
    return out


@dataclass(frozen=True)
class ReplayRecord:
    """What the refresh loop's record carries for a gate: step, signals, steps since refresh."""

    step: int
    signals: Mapping[str, float]
    since_refresh: int | None


def replay_gate(gate: MCGate, df, *, count_from_prefill: bool = True) -> list[int]:
    """Steps at which ``gate`` fires over a stored trace (rows: step + signal columns), probing
    every ``gate.probe_every`` steps — the counterfactual "the trace does not change after a fire"
    (the loop itself would refresh and continue from the new cache).

    ``count_from_prefill``: before the first fire, ``since_refresh = step`` as in the refresh loop
    (the teacher-built prefix counts as a refresh at step 0); ``False``: ``None`` as in the seed's
    ``count_triggers`` (the first probe above threshold fires whatever the refractory gap).
    """
    fires: list[int] = []
    for row in df.itertuples(index=False):
        if row.step % gate.probe_every:
            continue
        if fires:
            since = row.step - fires[-1]
        else:
            since = row.step if count_from_prefill else None
        rec = ReplayRecord(row.step, {gate.key: float(getattr(row, gate.signal))}, since)
        if gate.should_refresh(rec):
            fires.append(int(row.step))
    return fires


# ----------------------------------------------------------------------------- study + plot


def correlation_study(teacher, student, prompts: Sequence[str], *, ps: Sequence[float] = (DEFAULT_P,),
                      tokens: int = 64, n_passes: int = DEFAULT_PASSES, seed: int = 0, mode: str = "overfill",
                      sampling=None):
    """MC traces for each dropout ``p`` over ``prompts`` (every student step probed; greedy unless
    ``sampling`` is given — the same decode for every ``p``).

    Returns ``(traces, table)``: all trace rows with a ``p`` column, and one row per ``p`` with the
    Pearson r of u / mi / flip against the student's entropy over the pooled steps, its bootstrap 95 %
    interval over prompts (``r_<s>_lo`` / ``r_<s>_hi``, :func:`correlation_intervals`) and the number of
    steps pooled.
    """
    import pandas as pd

    ps = [check_p(p) for p in ps]
    check_n_passes(n_passes)
    frames, rows = [], []
    for p in ps:
        df = mc_traces(teacher, student, prompts, tokens=tokens, n_passes=n_passes, p=p, seed=seed, mode=mode,
                       sampling=sampling)
        df.insert(0, "p", p)
        frames.append(df)
        rows.append(correlation_row(df, p=p, n_passes=n_passes, prompts=len(prompts)))
    return pd.concat(frames, ignore_index=True), pd.DataFrame(rows)


def correlation_row(df, *, p: float, n_passes: int, prompts: int) -> dict:
    """One row of the correlation table from one ``p``'s traces (``prompt``, ``entropy`` and signal columns):
    each signal's r with the entropy, then its interval, then the signals' means."""
    r, ci = correlations(df), correlation_intervals(df)
    return {"p": p, "n_passes": n_passes, "steps": len(df), "prompts": prompts,
            **{c: v for k in SIGNALS for c, v in ((f"r_{k}", r[k]), (f"r_{k}_lo", ci[f"r_{k}_lo"]),
                                                  (f"r_{k}_hi", ci[f"r_{k}_hi"]))},
            **{f"mean_{k}": float(df[k].mean()) for k in SIGNALS}}


def plot_real_trace(df, fires: Mapping[str, Sequence[int]] | None = None, title: str = ""):
    """Student entropy, U(t), MI and flip rate of one MC trace on stacked axes; gate fires marked."""
    from kvlab.harness.figures import new_figure

    panels = [("entropy", "student entropy (nats)"), ("u", "U(t): mean logit var"), ("mi", "MI (nats)"),
              ("flip", "argmax-flip rate")]
    fig = new_figure(figsize=(10, 7))
    axes = fig.subplots(len(panels), 1, sharex=True)
    steps = df["step"].to_numpy()
    for ax, (col, label) in zip(axes, panels):
        ax.plot(steps, df[col].to_numpy(), lw=1)
        ax.set_ylabel(label, fontsize=8)
        ax.grid(True, linestyle=":", linewidth=0.6)
        for sig, fired in (fires or {}).items():
            if sig == col:
                for t in fired:
                    ax.axvline(t, color="crimson", lw=1, ls="--")
    axes[-1].set_xlabel("step t")
    fig.suptitle(title or "MC dropout on the student: entropy vs U(t) vs MI vs flip rate")
    fig.tight_layout()
    return fig
