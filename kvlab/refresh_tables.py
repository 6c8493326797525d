"""The blog's refresh tables (seed 000, "Periodic Refresh" … "Speculative Refresh") from stored runs.

Every policy runs over the same prompts with the same per-prompt seeds (:class:`RunSpec`), so each
table reports paired comparisons against the no-refresh OverFill run: per-prompt std beside each
mean, a paired bootstrap 95 % interval for ΔKL, and latency overhead computed per prompt from the
paired runs' total times.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import pandas as pd

from .decode import DecodeConfig
from .experiment import RunSpec, run_policies, scored_run, write_table
from .policies import EntropyGate, Periodic, ProbeKL, Speculative
from .refresh import tau_for_budget, tau_from_percentile
from .store import RunStore

BLOG_N = 1200
BLOG_T = (256, 128, 64)
ENTROPY_PCTS = (90.0, 95.0, 99.0)
KL_PCT = 90.0
PROBE_M = 8
SPEC_K = 8
BUDGET_PER_1K = 2.5


def periods_for(tokens: int) -> list[int]:
    """The blog's T ∈ {256, 128, 64} at N = 1200; for shorter runs scaled by N/1200 so each T fires
    about as often per run as in the blog (≈ 4.7, 9.4, 18.8 refreshes)."""
    if tokens >= BLOG_N:
        return list(BLOG_T)
    return sorted({max(2, round(t * tokens / BLOG_N)) for t in BLOG_T}, reverse=True)


@dataclass(frozen=True)
class Calibration:
    """Thresholds from no-refresh OverFill runs on calibration prompts."""

    entropy: tuple[float, ...]       # student entropy (bits) per step
    kl: tuple[float, ...]            # KL(p_T || q_S) (nats) per step

    def tau(self, percentile: float) -> float:
        return tau_from_percentile(self.entropy, percentile)

    def tau_budget(self, per_1k: float = BUDGET_PER_1K) -> float:
        return tau_for_budget(self.entropy, per_1k)

    def kappa(self, percentile: float) -> float:
        return tau_from_percentile(self.kl, percentile)


def calibrate(teacher, student, spec: RunSpec, store: RunStore, progress: bool = False) -> Calibration:
    """Student entropy and teacher–student KL over stored no-refresh OverFill runs on ``spec``'s prompts
    (step 1 is excluded: its distribution is the teacher's prefill)."""
    ent, kl = [], []
    for i, prompt in enumerate(spec.prompts):
        cfg = DecodeConfig(mode="overfill", max_new_tokens=spec.tokens, sampling=spec.sampling_for(i))
        res = scored_run(teacher, student, prompt, cfg, store)
        src = res["steps"]["source"]
        ent += [e for e, s in zip(res["steps"]["entropy_bits"], src) if s == "student"]
        kl += [k for k, s in zip(res["kl_steps"], src) if s == "student"]
    return Calibration(tuple(ent), tuple(kl))


def refresh_policies(tokens: int, cal: Calibration) -> tuple[dict[str, DecodeConfig], pd.DataFrame]:
    """Every configuration the tables need, by name, plus a frame describing each."""
    base = DecodeConfig(mode="overfill")
    rows, cfgs = [], {}

    def add(name, policy, family, next_="rerun", **info):
        cfgs[name] = replace(base, refresh=policy, refresh_next=next_)
        rows.append({"policy": name, "family": family, "refresh_next": next_ if policy else "", **info})

    add("none", None, "none")
    periods = periods_for(tokens)
    for T in periods:
        add(f"periodic_T{T}", Periodic(T), "periodic", T=T)
    for pct in ENTROPY_PCTS:
        tau = round(cal.tau(pct), 3)
        add(f"entropy_p{pct:g}", EntropyGate(tau), "entropy", tau_bits=tau, percentile=pct)
    tau_b = round(cal.tau_budget(BUDGET_PER_1K), 3)
    add(f"entropy_budget{BUDGET_PER_1K:g}", EntropyGate(tau_b), "entropy", tau_bits=tau_b,
        percentile=100 * (1 - BUDGET_PER_1K / 1000))
    kappa = round(cal.kappa(KL_PCT), 4)
    add(f"probe_kl_M{PROBE_M}", ProbeKL(PROBE_M, kappa), "probe_kl", M=PROBE_M, kappa=kappa, percentile=KL_PCT)
    add(f"speculative_k{SPEC_K}", Speculative(SPEC_K), "speculative", k=SPEC_K)
    t_min = min(periods)
    for nxt in ("student", "teacher"):
        add(f"periodic_T{t_min}_{nxt}", Periodic(t_min), "periodic", next_=nxt, T=t_min)
    return cfgs, pd.DataFrame(rows)


def paired(per_run: pd.DataFrame, base: str = "none", n_boot: int = 2000, seed: int = 0) -> pd.DataFrame:
    """Per-policy paired statistics against ``base`` on the same prompts: overhead % (mean, std),
    ΔKL and Δteacher-PPL with a bootstrap 95 % interval over prompts."""
    rng = np.random.default_rng(seed)
    b = per_run[per_run.policy == base].set_index("prompt_idx")
    out = []
    for name, g in per_run.groupby("policy", sort=False):
        g = g.set_index("prompt_idx").loc[b.index]
        over = 100.0 * (g.total_s - b.total_s) / b.total_s
        row = {"policy": name, "overhead_pct": over.mean(), "overhead_pct_std": over.std(ddof=1) if len(over) > 1 else 0.0}
        for m in ("kl", "teacher_ppl"):
            d = (g[m] - b[m]).to_numpy()
            boots = rng.choice(d, size=(n_boot, len(d)), replace=True).mean(1)
            row[f"d_{m}"] = d.mean()
            row[f"d_{m}_lo"], row[f"d_{m}_hi"] = np.percentile(boots, [2.5, 97.5])
        out.append(row)
    return pd.DataFrame(out)


def summary(per_run: pd.DataFrame, info: pd.DataFrame) -> pd.DataFrame:
    """One row per policy: means, per-prompt std, paired statistics, cost."""
    cols = ["teacher_ppl", "kl", "kl_all", "repeat3", "total_s", "tps", "refreshes", "teacher_tokens", "probe_tokens",
            "teacher_s", "teacher_pct", "tokens"]
    g = per_run.groupby("policy", sort=False)
    s = g[cols].mean()
    for m in ("teacher_ppl", "kl", "repeat3", "total_s", "refreshes"):
        s[f"{m}_std"] = g[m].std(ddof=1).fillna(0.0)
    s["n_prompts"] = g.size()
    s["refreshes_per_1k"] = 1000.0 * s["refreshes"] / s["tokens"]
    s = s.reset_index().merge(paired(per_run), on="policy")
    return info.merge(s, on="policy")


PERIODIC_COLS = ["policy", "T", "teacher_ppl", "teacher_ppl_std", "kl", "kl_std", "d_kl", "d_kl_lo", "d_kl_hi",
                 "repeat3", "repeat3_std", "refreshes", "teacher_tokens", "overhead_pct", "overhead_pct_std",
                 "teacher_pct", "n_prompts"]
ENTROPY_COLS = ["policy", "tau_bits", "percentile", "refreshes", "refreshes_std", "refreshes_per_1k", "teacher_ppl", "teacher_ppl_std",
                "kl", "kl_std", "d_kl", "d_kl_lo", "d_kl_hi", "repeat3", "repeat3_std", "total_s", "total_s_std", "tps",
                "teacher_tokens", "overhead_pct", "overhead_pct_std", "n_prompts"]
METHODS_COLS = ["policy", "family", "refresh_next", "refreshes", "teacher_tokens", "probe_tokens", "max_delta",
                "overhead_pct", "overhead_pct_std", "teacher_pct", "teacher_ppl", "teacher_ppl_std", "kl", "kl_std",
                "kl_all", "d_kl", "d_kl_lo", "d_kl_hi", "repeat3", "repeat3_std", "n_prompts"]


def refresh_tables(teacher, student, spec: RunSpec, store: RunStore, calib: RunSpec,
                   progress: bool = True) -> dict[str, pd.DataFrame]:
    """Calibrate, run every policy on ``spec`` (stored, paired seeds), and build the three tables."""
    cal = calibrate(teacher, student, calib, store)
    cfgs, info = refresh_policies(spec.tokens, cal)
    per_run = run_policies(teacher, student, spec, cfgs, store, progress)
    per_run["max_delta"] = [_max_delta(teacher, student, spec, cfgs[r.policy], r.prompt_idx, store)
                            for r in per_run.itertuples()]
    allp = summary(per_run, info)
    allp["max_delta"] = per_run.groupby("policy", sort=False)["max_delta"].max().loc[allp.policy].to_numpy()
    periodic = allp[allp.family.isin(["none", "periodic"]) & allp.refresh_next.isin(["", "rerun"])]
    entropy = allp[allp.family.isin(["none", "entropy"])]
    methods = allp[allp.policy.isin(["none", f"periodic_T{min(periods_for(spec.tokens))}", f"speculative_k{SPEC_K}",
                                     f"probe_kl_M{PROBE_M}", f"entropy_p{ENTROPY_PCTS[1]:g}"])
                   | (allp.family == "periodic") & (allp.refresh_next != "rerun")]
    return {"refresh_periodic": periodic.reindex(columns=PERIODIC_COLS),
            "refresh_entropy": entropy.reindex(columns=ENTROPY_COLS),
            "refresh_methods": methods.reindex(columns=METHODS_COLS),
            "refresh_all": allp, "refresh_runs": per_run,
            "refresh_calibration": pd.DataFrame([{"n_steps": len(cal.entropy), **{f"entropy_p{p:g}": cal.tau(p) for p in ENTROPY_PCTS},
                                                  "entropy_budget": cal.tau_budget(), f"kl_p{KL_PCT:g}": cal.kappa(KL_PCT)}])}


def _max_delta(teacher, student, spec, cfg, i, store) -> int:
    """Largest teacher prefill at one refresh step of a stored run (constant for speculative)."""
    cfg = replace(cfg, max_new_tokens=spec.tokens, sampling=spec.sampling_for(i))
    steps = scored_run(teacher, student, spec.prompts[i], cfg, store)["steps"]
    return max((t - p for t, p, r in zip(steps["teacher_tokens"], steps["probe_tokens"], steps["refreshed"]) if r),
               default=0)


def write_refresh(tables: dict[str, pd.DataFrame], out: Path) -> list[Path]:
    from .forced import FORCED_NOTE

    paths = []
    for name, df in tables.items():
        notes = [FORCED_NOTE] if name == "refresh_forced" else None   # None: the KL captions
        paths += write_table(df.round(4), out, name, notes=notes)
    return paths
