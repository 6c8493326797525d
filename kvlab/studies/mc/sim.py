"""Monte-Carlo-dropout refresh-trigger simulation (blog "Future Work" section).
Pure numpy; :func:`write_outputs` alone writes its CSVs under the folder it is given.

Reproduces, bit-for-bit, the blog's reference simulation: a 400-step decode
with confident / epistemic-drift / post-refresh / aleatoric phases, in which
N stochastic forward passes are simulated per step.  Two refresh triggers
are compared: predictive entropy (nats, of the pass-averaged distribution)
and MC variance (mean over the vocabulary of the across-pass logit variance).

Pure numpy/pandas; matplotlib is imported lazily by the plot functions only.
"""
from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import numpy as np
import pandas as pd

PHASES = ("conf", "drift", "post", "alea")
PHASE_COLORS = {"conf": "#c7e9c0", "drift": "#fdd0a2", "post": "#c7e9c0", "alea": "#c6dbef"}
PHASE_LABELS = {"conf": "confident", "drift": "epistemic drift", "post": "post-refresh", "alea": "aleatoric"}


def phase_legend_labels() -> dict[str, str]:
    """Legend text per shading colour: phases that share a colour share an entry."""
    by_color: dict[str, list[str]] = {}
    for ph in PHASES:
        by_color.setdefault(PHASE_COLORS[ph], []).append(PHASE_LABELS[ph])
    return {c: "phase: " + " / ".join(names) for c, names in by_color.items()}
TIME_SERIES_COLUMNS = ("t", "phase", "entropy", "mc_var", "entropy_fire", "mcvar_fire")
SUMMARY_COLUMNS = ("steps", "mean_entropy", "mean_mcvar", "frac_entropy_fire", "frac_mcvar_fire")

PhaseMap = tuple[tuple[str, float], ...]


def _phase_map(name: str, value, positive: bool) -> PhaseMap:
    """Normalise a per-phase mapping into a hashable, validated tuple of pairs."""
    items = dict(value.items() if isinstance(value, Mapping) else value)
    if set(items) != set(PHASES):
        raise ValueError(f"{name} must have exactly the phases {PHASES}, got {sorted(items)}")
    out = tuple((ph, float(items[ph])) for ph in PHASES)
    for ph, v in out:
        if not math.isfinite(v) or v < 0 or (positive and v == 0):
            raise ValueError(f"{name}[{ph!r}] must be {'> 0' if positive else '>= 0'}, got {v}")
    return out


@dataclass(frozen=True)
class SimConfig:
    """All parameters of the simulation; defaults are the blog's values.

    Per-phase parameters accept any mapping and are stored as tuples of
    (phase, value) pairs so the config stays hashable; read them with
    ``cfg.phase_params(ph)``.
    """
    seed: int = 0
    D: int = 5000             # vocab size
    N: int = 16               # MC passes per step
    T: int = 400              # decode steps
    probe_M: int = 16         # probe interval of the gate (steps)
    refractory: int = 32      # min distance between fires (steps)
    entropy_pct: float = 90.0  # percentile threshold for entropy
    mcvar_pct: float = 70.0    # percentile threshold for MC variance
    m_high: float = 8.0       # logit margin of the confident mode
    m_mid: float = 3.0        # logit margin during drift
    # per phase: logit spread across passes (epistemic), per-pass white noise, temperature (<1 => flatter)
    sig_between: PhaseMap = (("conf", 0.05), ("drift", 1.5), ("post", 0.05), ("alea", 0.10))
    sig_within: PhaseMap = (("conf", 0.01), ("drift", 0.05), ("post", 0.01), ("alea", 0.01))
    alpha: PhaseMap = (("conf", 1.0), ("drift", 1.0), ("post", 1.0), ("alea", 1 / 2.5))

    def __post_init__(self) -> None:
        for name, lo in (("D", 2), ("N", 2), ("T", 1), ("probe_M", 1), ("refractory", 0)):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < lo:
                raise ValueError(f"{name} must be an integer >= {lo}, got {v!r}")
        for name, ok, what in (("entropy_pct", lambda v: 0 < v < 100, "lie in (0, 100)"),
                               ("mcvar_pct", lambda v: 0 < v < 100, "lie in (0, 100)"),
                               ("m_high", math.isfinite, "be finite"), ("m_mid", math.isfinite, "be finite")):
            if not ok(float(getattr(self, name))):
                raise ValueError(f"{name} must {what}, got {getattr(self, name)!r}")
        for name, positive in (("sig_between", False), ("sig_within", False), ("alpha", True)):
            object.__setattr__(self, name, _phase_map(name, getattr(self, name), positive))

    def phase_params(self, ph: str) -> tuple[float, float, float]:
        """(alpha, sig_between, sig_within) of phase ph."""
        return dict(self.alpha)[ph], dict(self.sig_between)[ph], dict(self.sig_within)[ph]


@dataclass(frozen=True)
class SimResult:
    config: SimConfig
    time_series: pd.DataFrame    # columns TIME_SERIES_COLUMNS
    phase_summary: pd.DataFrame  # index 'phase', columns SUMMARY_COLUMNS
    tau_entropy: float
    tau_mcvar: float
    fires_entropy: list[int]
    fires_mcvar: list[int]


def phase(t: int) -> str:
    """Phase label of step t, with exactly the reference's boundaries.

    NB: t == 200 matches none of the explicit ranges (drift is [100, 200),
    post is (200, 250]) and so falls through to the else-branch -> 'conf';
    likewise every t > 350 (and t < 0).  Kept as-is for bit-exact reproduction.
    """
    if 0 <= t < 100:
        return "conf"     # confident start
    elif 100 <= t < 200:
        return "drift"    # epistemic drift
    elif 200 < t <= 250:
        return "post"     # post-refresh confident
    elif 250 < t <= 350:
        return "alea"     # aleatoric ambiguity
    else:
        return "conf"


def _base_logits(ph: str, cfg: SimConfig, rng: np.random.Generator) -> np.ndarray:
    """One big mode (conf/post/drift) or two near-tied modes (alea); draws like the reference."""
    confident = ph in ("conf", "post")
    mu = np.full(cfg.D, -cfg.m_high if confident else -cfg.m_mid)
    if ph == "alea":
        mu[:] = 0.0
        top = rng.choice(cfg.D, 2, replace=False)
        mu[top] = [0.2, 0.18]
    else:
        mu[rng.integers(cfg.D)] = cfg.m_high if confident else cfg.m_mid
    return mu


def _softmax_rows(Z: np.ndarray) -> np.ndarray:
    """Row-wise softmax with row-max subtraction (same arithmetic as the per-row reference)."""
    ex = np.exp(Z - Z.max(axis=1, keepdims=True))
    return ex / ex.sum(axis=1, keepdims=True)


def count_triggers(series: Sequence[float], tau: float, M: int = 16, refractory: int = 16) -> list[int]:
    """Probe every M steps; fire when series[t] > tau and >= refractory steps since the last fire.

    Defaults are the reference's; the simulation calls it with cfg.refractory (32).
    """
    fires: list[int] = []
    last = -10**9
    for t in range(0, len(series), M):
        if series[t] > tau and (t - last) >= refractory:
            fires.append(t)
            last = t
    return fires


def contiguous_spans(labels: Sequence) -> list[tuple]:
    """[(label, start, end_inclusive)] runs of equal labels (for phase shading)."""
    if len(labels) == 0:
        return []
    spans, cur, start = [], labels[0], 0
    for i in range(1, len(labels)):
        if labels[i] != cur:
            spans.append((cur, start, i - 1))
            cur, start = labels[i], i
    spans.append((cur, start, len(labels) - 1))
    return spans


def simulate(cfg: SimConfig | None = None) -> SimResult:
    """Run the simulation.  RNG order matches the reference: U matrix, then per
    step the base-logit draw(s) followed by the N per-pass normal vectors
    (drawn as one (N, D) block, which is the same stream as N draws of size D)."""
    cfg = SimConfig() if cfg is None else cfg
    rng = np.random.default_rng(cfg.seed)
    U = rng.normal(size=(cfg.N, cfg.D))          # pass-specific epistemic directions
    U /= np.linalg.norm(U, axis=1, keepdims=True)

    H, Uvar, phases = np.zeros(cfg.T), np.zeros(cfg.T), []  # entropy (nats), MC variance
    for t in range(cfg.T):
        ph = phase(t)
        phases.append(ph)
        alpha, sig_between, sig_within = cfg.phase_params(ph)
        mu = _base_logits(ph, cfg, rng) * alpha
        Z = mu + sig_between * U + sig_within * rng.normal(size=(cfg.N, cfg.D))  # [N, D] logits
        pbar = _softmax_rows(Z).mean(0)
        H[t] = -(pbar * np.log(pbar + 1e-9)).sum()   # nats
        Uvar[t] = Z.var(axis=0).mean()

    tau_entropy = float(np.percentile(H, cfg.entropy_pct))
    tau_mcvar = float(np.percentile(Uvar, cfg.mcvar_pct))
    fires_entropy = count_triggers(H, tau_entropy, M=cfg.probe_M, refractory=cfg.refractory)
    fires_mcvar = count_triggers(Uvar, tau_mcvar, M=cfg.probe_M, refractory=cfg.refractory)

    steps = np.arange(cfg.T)
    ts = pd.DataFrame({
        "t": steps, "phase": phases, "entropy": H, "mc_var": Uvar,
        "entropy_fire": np.isin(steps, fires_entropy).astype(int),
        "mcvar_fire": np.isin(steps, fires_mcvar).astype(int),
    })
    summary = ts.groupby("phase").agg(
        steps=("t", "count"), mean_entropy=("entropy", "mean"), mean_mcvar=("mc_var", "mean"),
        frac_entropy_fire=("entropy_fire", "mean"), frac_mcvar_fire=("mcvar_fire", "mean"),
    )
    return SimResult(cfg, ts, summary, tau_entropy, tau_mcvar, fires_entropy, fires_mcvar)


def format_summary(result: SimResult) -> str:
    """The reference's printed report."""
    return "\n".join([
        "=== Phase summary ===", str(result.phase_summary.round(4)), "",
        f"Thresholds: tau_entropy={result.tau_entropy:.4f} nats, tau_mcvar={result.tau_mcvar:.6f}",
        f"Entropy fires at: {result.fires_entropy}",
        f"MC-variance fires at: {result.fires_mcvar}",
    ])


# ----------------------------------------------------------------------------- plots

# signal -> (column, threshold attr, fires attr, y label, title of its own figure)
_SIGNALS = {
    "entropy": ("entropy", "tau_entropy", "fires_entropy", "entropy (nats)",
                "Student Entropy over Time (simulated)"),
    "mc_var": ("mc_var", "tau_mcvar", "fires_mcvar", "mean logit variance", "MC-Variance over Time (simulated)"),
}


def _draw_series(ax, result: SimResult, signal: str) -> None:
    col, tau_attr, fires_attr, ylabel, _ = _SIGNALS[signal]
    ts, tau = result.time_series, getattr(result, tau_attr)
    y = ts[col].to_numpy()
    legend = phase_legend_labels()
    for lab, s, e in contiguous_spans(list(ts["phase"])):
        color = PHASE_COLORS.get(lab, "#eeeeee")
        ax.axvspan(s, e, alpha=0.2, color=color, label=legend.pop(color, None))   # one legend entry per colour
    ax.plot(ts["t"].to_numpy(), y, label=col)
    ax.axhline(tau, linestyle="--", color="k", linewidth=1, label=f"tau = {tau:.4g}")
    idx = np.asarray(getattr(result, fires_attr), dtype=int)
    ax.scatter(idx, y[idx], marker="x", color="crimson", zorder=3, label="fires")
    ax.set_ylabel(ylabel)
    ax.grid(True, linestyle=":", linewidth=0.6)


def _figure(nrows: int, figsize: tuple[float, float]):
    from kvlab.harness.figures import new_figure  # lazy: no pyplot state, works headless, displays in Jupyter
    fig = new_figure(figsize=figsize)
    return fig, fig.subplots(nrows, 1, sharex=True, squeeze=False)[:, 0]


def _plot_single(result: SimResult, signal: str):
    fig, (ax,) = _figure(1, (10, 4))
    _draw_series(ax, result, signal)
    ax.legend(loc="upper left", fontsize=8)
    ax.set_title(_SIGNALS[signal][4])
    ax.set_xlabel("step t")
    return fig


def plot_entropy(result: SimResult):
    """Entropy over time with phase shading, tau_entropy line and entropy fires."""
    return _plot_single(result, "entropy")


def plot_mcvar(result: SimResult):
    """MC variance over time with phase shading, tau_mcvar line and MC-variance fires."""
    return _plot_single(result, "mc_var")


def plot_triggers(result: SimResult):
    """Both signals on stacked axes sharing x, with phase shading, tau lines and fires."""
    fig, (ax_h, ax_u) = _figure(2, (10, 6))
    for ax, signal in ((ax_h, "entropy"), (ax_u, "mc_var")):
        _draw_series(ax, result, signal)
        ax.legend(loc="upper left", fontsize=8)
    ax_u.set_xlabel("step t")
    fig.suptitle("Refresh triggers: entropy vs MC variance (simulated)")
    return fig


# ----------------------------------------------------------------------------- outputs

def write_outputs(result: SimResult, out_dir) -> dict:
    """Write mc_phase_summary.csv / mc_time_series.csv / mc_thresholds.csv; return JSON-able thresholds and fires."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    result.phase_summary.to_csv(out / "mc_phase_summary.csv")
    result.time_series.to_csv(out / "mc_time_series.csv", index=False)
    pd.DataFrame([{"tau_entropy": result.tau_entropy, "tau_mcvar": result.tau_mcvar}]).to_csv(
        out / "mc_thresholds.csv", index=False)
    return {"tau_entropy": float(result.tau_entropy), "tau_mcvar": float(result.tau_mcvar),
            "fires_entropy": [int(t) for t in result.fires_entropy],
            "fires_mcvar": [int(t) for t in result.fires_mcvar]}
