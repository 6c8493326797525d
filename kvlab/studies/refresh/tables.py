"""The blog's refresh tables (seed 000, "Periodic Refresh" … "Speculative Refresh") from stored runs.

Every policy runs over the same prompts with the same per-prompt seeds (:class:`RunSpec`), so each
table reports paired comparisons against the no-refresh OverFill run: per-prompt std beside each
mean and a paired bootstrap 95 % interval for ΔKL. These quality columns come from stored runs.

Latency overhead is a ratio, so it never comes from stored runs (they may have been timed on
another day, on a busier machine): :func:`paired_timing` times each policy and the no-refresh
reference back to back in this process (same prompt, same seed, fixed N, order alternating,
repeated), and :func:`overhead_table` reports the median of the per-pair ratios with their
spread. Timing tables are machine-dependent and written to separate ``*_timing`` files.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import pandas as pd

from kvlab.decode import DecodeConfig, run
from kvlab.harness.experiment import RunSpec, paired_bootstrap, run_policies, scored_run, scored_runs, write_table
from kvlab.refresh.policies import EntropyGate, Periodic, ProbeKL, Speculative
from kvlab.refresh.base import tau_for_budget, tau_from_percentile
from kvlab.harness.costs import run_costs
from kvlab.store import RunStore

BLOG_N = 1200
BLOG_T = (256, 128, 64)
ENTROPY_PCTS = (90.0, 95.0, 99.0)
KL_PCT = 90.0
PROBE_M = 8
SPEC_K = 8
BUDGET_PER_1K = 2.5
TIMING_PROMPTS = 2      # prompts of the spec timed for the overhead (the first ones)
TIMING_REPEATS = 2      # paired (reference, policy) timings per prompt and policy


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
    jobs = [(p, DecodeConfig(mode="overfill", max_new_tokens=spec.tokens, sampling=spec.sampling_for(i)))
            for i, p in enumerate(spec.prompts)]
    for res in scored_runs(teacher, student, jobs, store, batch=spec.batch, progress=progress):
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
    """Per-policy paired quality statistics against ``base`` on the same prompts: ΔKL, Δteacher-PPL and
    (when the runs have it) Δkl_forced with a bootstrap 95 % interval over prompts and the minimum
    detectable difference ``d_<m>_mde`` (kvlab.core.metrics.mde). (No timing: see :func:`paired_timing`.)"""
    from kvlab.core.metrics import add_mde

    metrics = tuple(m for m in ("kl_forced", "kl", "teacher_ppl") if m in per_run)
    return add_mde(paired_bootstrap(per_run, base, metrics, n_boot=n_boot, seed=seed), per_run, base, metrics)


def summary(per_run: pd.DataFrame, info: pd.DataFrame) -> pd.DataFrame:
    """One row per policy: quality means, per-prompt std, paired quality statistics, cost in tokens
    (deterministic for fixed seeds; no timing columns)."""
    cols = ["teacher_ppl", "kl", "kl_all", "repeat3", "refreshes", "teacher_tokens", "probe_tokens", "tokens"]
    cols += [c for c in FORCED_COLS if c in per_run]
    g = per_run.groupby("policy", sort=False)
    s = g[cols].mean()
    for m in ("teacher_ppl", "kl", "repeat3", "refreshes"):
        s[f"{m}_std"] = g[m].std(ddof=1).fillna(0.0)
    s["n_prompts"] = g.size()
    s["refreshes_per_1k"] = 1000.0 * s["refreshes"] / s["tokens"]
    s = s.reset_index().merge(paired(per_run), on="policy")
    return info.merge(s, on="policy")


FORCED_COLS = ["kl_forced", "nll_forced", "kl_forced_step1", "refreshes_forced", "teacher_tokens_forced", "distinct2"]
_FORCED_D = ["kl_forced", "d_kl_forced", "d_kl_forced_lo", "d_kl_forced_hi", "d_kl_forced_mde", "refreshes_forced",
             "teacher_tokens_forced", "nll_forced", "distinct2"]
PERIODIC_COLS = ["policy", "T", *_FORCED_D, "teacher_ppl", "teacher_ppl_std", "kl", "kl_std", "d_kl", "d_kl_lo",
                 "d_kl_hi", "d_kl_mde", "repeat3", "repeat3_std", "refreshes", "teacher_tokens", "n_prompts"]
ENTROPY_COLS = ["policy", "tau_bits", "percentile", "refreshes", "refreshes_std", "refreshes_per_1k", *_FORCED_D,
                "teacher_ppl", "teacher_ppl_std", "kl", "kl_std", "d_kl", "d_kl_lo", "d_kl_hi", "d_kl_mde", "repeat3",
                "repeat3_std", "teacher_tokens", "n_prompts"]
METHODS_COLS = ["policy", "family", "refresh_next", "refreshes", "teacher_tokens", "probe_tokens", "max_delta",
                *_FORCED_D, "teacher_ppl", "teacher_ppl_std", "kl", "kl_std", "kl_all", "d_kl", "d_kl_lo", "d_kl_hi",
                "d_kl_mde", "repeat3", "repeat3_std", "n_prompts"]
TIMING_COLS = ["policy", "overhead_pct", "overhead_pct_q25", "overhead_pct_q75", "overhead_pct_min", "overhead_pct_max",
               "pairs", "total_s", "ref_total_s", "tps", "teacher_pct", "refreshes", "tokens", "timing_prompts", "repeats"]
# Per-run columns that are machine-dependent times (kept out of the tracked quality tables).
TIME_COLUMNS = ("ttft_s", "tps", "total_s", "e2e_tps", "teacher_s", "teacher_pct")


def paired_timing(teacher, student, spec: RunSpec, cfgs: dict[str, DecodeConfig], *, base: str = "none",
                  prompts: int = TIMING_PROMPTS, repeats: int = TIMING_REPEATS, progress: bool = False) -> pd.DataFrame:
    """Time every policy in ``cfgs`` against ``base`` side by side in this process.

    For each of the first ``prompts`` prompts of ``spec``, each repeat and each policy, the
    reference and the policy run back to back (same prompt, same per-prompt seed, fixed
    N = ``spec.tokens``, no distributions kept; which one runs first alternates), after one
    warm-up run. ``base`` itself is timed against another ``base`` run: its "overhead" is the
    A/A noise floor. One row per pair: ``ratio = total_s / ref_total_s``.
    """
    if base not in cfgs:
        raise ValueError(f"base={base!r} must be one of the configurations {list(cfgs)}")
    for name, v in (("prompts", prompts), ("repeats", repeats)):
        if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
            raise ValueError(f"timing {name}={v!r} must be a positive int")
    n = min(prompts, len(spec.prompts))

    def cfg_for(name, i):
        return replace(cfgs[name], max_new_tokens=spec.tokens, sampling=spec.sampling_for(i), keep_dists=False)

    from tqdm.auto import tqdm

    run(teacher, student, spec.prompts[0], cfg_for(base, 0))   # warm-up (first-call costs)
    rows = []
    jobs = [(r, i, j, name) for r in range(repeats) for i in range(n) for j, name in enumerate(cfgs)]
    for r, i, j, name in tqdm(jobs, disable=not progress, desc=f"timing {base} vs policy", unit="pair"):
        order = [("ref", base), ("pol", name)]
        if (r + i + j) % 2:
            order.reverse()
        traces = {role: run(teacher, student, spec.prompts[i], cfg_for(nm, i)) for role, nm in order}
        pol, ref = traces["pol"], traces["ref"]
        costs = run_costs(pol.records)
        rows.append({"policy": name, "prompt_idx": i, "repeat": r, "first": order[0][0],
                     "total_s": pol.total_s, "ref_total_s": ref.total_s, "ratio": pol.total_s / ref.total_s,
                     "tokens": len(pol.records), "refreshes": costs["refreshes"],
                     "teacher_s": costs["teacher_s"], "teacher_pct": costs["teacher_pct"]})
    return pd.DataFrame(rows)


def overhead_table(timing: pd.DataFrame) -> pd.DataFrame:
    """One row per policy: median overhead % over its (reference, policy) pairs, with the
    quartiles and range of the per-pair overheads; median times of the timed runs."""
    out = []
    for name, g in timing.groupby("policy", sort=False):
        over = 100.0 * (g["ratio"].to_numpy() - 1.0)
        q25, med, q75 = np.percentile(over, [25, 50, 75])
        out.append({"policy": name, "overhead_pct": med, "overhead_pct_q25": q25, "overhead_pct_q75": q75,
                    "overhead_pct_min": over.min(), "overhead_pct_max": over.max(), "pairs": len(g),
                    "total_s": g["total_s"].median(), "ref_total_s": g["ref_total_s"].median(),
                    "tps": float(np.median(g["tokens"] / g["total_s"])), "teacher_pct": g["teacher_pct"].median(),
                    "refreshes": g["refreshes"].mean(), "tokens": int(g["tokens"].iloc[0]),
                    "timing_prompts": int(g["prompt_idx"].nunique()), "repeats": int(g["repeat"].nunique())})
    return pd.DataFrame(out).reindex(columns=TIMING_COLS)


def timing_note(table: pd.DataFrame, base: str = "none") -> str:
    """How the overhead in a timing table was measured (the Markdown file's first lines)."""
    from kvlab.harness.tableview import plural

    r = table.iloc[0]
    return (f"Overhead % = median over (reference, policy) pairs of 100·(t_policy / t_{base} − 1), each pair timed "
            f"back to back in one process (same prompt and seed, N = {int(r.tokens)} tokens, order alternating), "
            f"{plural(r.timing_prompts, 'prompt')} × {plural(r.repeats, 'repeat')} = {plural(r.pairs, 'pair')} per policy after "
            f"one warm-up; q25/q75/min/max: spread of the per-pair overheads. The `{base}` row times {base} against "
            f"itself (noise floor). Machine-dependent: not reused from the run store.\n\n")


def refresh_tables(teacher, student, spec: RunSpec, store: RunStore, calib: RunSpec, progress: bool = True,
                   timing_prompts: int = TIMING_PROMPTS, timing_repeats: int = TIMING_REPEATS) -> dict[str, pd.DataFrame]:
    """Calibrate, run every policy on ``spec`` (stored, paired seeds), build the three quality tables,
    and time every policy against no refresh side by side (``refresh_timing``; ``timing_repeats=0``
    skips the timing)."""
    cal = calibrate(teacher, student, calib, store, progress=progress)
    cfgs, info = refresh_policies(spec.tokens, cal)
    if progress:
        print(f"runs: {len(cfgs)} configurations × {len(spec.prompts)} prompt{'' if len(spec.prompts) == 1 else 's'} (stored runs are reused)", flush=True)
    per_run = run_policies(teacher, student, spec, cfgs, store, progress)
    per_run["max_delta"] = [_max_delta(teacher, student, spec, cfgs[r.policy], r.prompt_idx, store)
                            for r in per_run.itertuples()]
    per_run = with_forced(teacher, student, spec, cfgs, store, per_run, progress)
    tables = tables_from_runs(per_run, info, ["none", f"periodic_T{min(periods_for(spec.tokens))}", f"speculative_k{SPEC_K}",
                                              f"probe_kl_M{PROBE_M}", f"entropy_p{ENTROPY_PCTS[1]:g}"])
    tables["refresh_calibration"] = pd.DataFrame([{"n_steps": len(cal.entropy),
                                                   **{f"entropy_p{p:g}": cal.tau(p) for p in ENTROPY_PCTS},
                                                   "entropy_budget": cal.tau_budget(), f"kl_p{KL_PCT:g}": cal.kappa(KL_PCT)}])
    if timing_repeats:
        if progress:
            print(f"timing: every policy vs no refresh, back to back, {min(timing_prompts, len(spec.prompts))} "
                  f"prompt(s) × {timing_repeats} repeat(s)", flush=True)
        timing = paired_timing(teacher, student, spec, cfgs, prompts=timing_prompts, repeats=timing_repeats,
                               progress=progress)
        tables["refresh_timing"] = overhead_table(timing)
        tables["refresh_timing_runs"] = timing
    return tables


def with_forced(teacher, student, spec: RunSpec, cfgs: dict, store: RunStore, per_run: pd.DataFrame,
                progress: bool = False) -> pd.DataFrame:
    """``per_run`` with ``kl_forced`` / ``nll_forced`` / ``distinct2`` per run (kvlab.harness.forced: every
    policy scored on the teacher's stored reference continuation, refreshing at its own steps on it) and what
    that forced path's own schedule cost (``refreshes_forced`` / ``teacher_tokens_forced``)."""
    from kvlab.harness.forced import forced_columns

    if progress:
        print(f"forced scores: {len(cfgs)} configurations × {len(spec.prompts)} prompts on the teacher's reference "
              "(stored)", flush=True)
    return per_run.merge(forced_columns(teacher, student, spec, cfgs, store), on=["policy", "prompt_idx"], how="left")


def tables_from_runs(per_run: pd.DataFrame, info: pd.DataFrame, methods: list[str] | None = None) -> dict[str, pd.DataFrame]:
    """The periodic / entropy / methods tables (and ``refresh_all``) from per-run rows (``policy``,
    ``prompt_idx`` pairing runs across policies, metrics, costs, ``max_delta``) and ``info`` (one row
    per policy: ``family``, ``refresh_next``, parameters). ``methods``: the policies of the methods
    table besides the non-rerun periodic ones (None = every policy)."""
    allp = summary(per_run, info)
    allp["max_delta"] = per_run.groupby("policy", sort=False)["max_delta"].max().loc[allp.policy].to_numpy()
    periodic = allp[allp.family.isin(["none", "periodic"]) & allp.refresh_next.isin(["", "rerun"])]
    entropy = allp[allp.family.isin(["none", "entropy"])]
    picked = allp.policy.isin(methods) if methods is not None else allp.policy.notna()
    methods = allp[picked | (allp.family == "periodic") & (allp.refresh_next != "rerun")]
    return {"refresh_periodic": periodic.reindex(columns=PERIODIC_COLS),
            "refresh_entropy": entropy.reindex(columns=ENTROPY_COLS),
            "refresh_methods": methods.reindex(columns=METHODS_COLS),
            "refresh_all": allp, "refresh_runs": per_run.drop(columns=[c for c in TIME_COLUMNS if c in per_run])}


def _max_delta(teacher, student, spec, cfg, i, store) -> int:
    """Largest teacher prefill at one refresh step of a stored run (constant for speculative)."""
    cfg = replace(cfg, max_new_tokens=spec.tokens, sampling=spec.sampling_for(i))
    steps = scored_run(teacher, student, spec.prompts[i], cfg, store)["steps"]
    return max((t - p for t, p, r in zip(steps["teacher_tokens"], steps["probe_tokens"], steps["refreshed"]) if r),
               default=0)


CSV_ONLY = ("refresh_provenance", "refresh_timing_runs")   # long tables nobody reads as Markdown


def write_refresh(tables: dict[str, pd.DataFrame], out: Path) -> list[Path]:
    """CSV + Markdown per table; timing tables' Markdown starts with how the overhead was measured."""
    from kvlab.core.metrics import KL_ALL_NOTE, KL_NOTE, MDE_NOTE
    from kvlab.harness.forced import DISTINCT_NOTE, FORCED_COST_NOTE, FORCED_SCORE_NOTE
    from kvlab.studies.refresh.forced import FORCED_NOTE

    paths = []
    for name, df in tables.items():
        base = name.removesuffix("_long")
        if base in CSV_ONLY:
            Path(out).mkdir(parents=True, exist_ok=True)
            df.to_csv(Path(out) / f"{name}.csv", index=False)
            paths.append(Path(out) / f"{name}.csv")
            continue
        if base == "refresh_forced":
            notes = [FORCED_NOTE]
        elif "kl_forced" in df:
            notes = [KL_NOTE, FORCED_SCORE_NOTE] + ([FORCED_COST_NOTE] if "refreshes_forced" in df else []) + [
                     DISTINCT_NOTE, MDE_NOTE,
                     "`d_*`: paired mean difference policy − `none` (no refresh) over the same prompts and seeds, "
                     "bootstrap 95 % interval (`_lo`, `_hi`); negative = refresh lowers it."]
            if "kl_all" in df:
                notes.insert(1, KL_ALL_NOTE)
        else:
            notes = None                                             # None: the KL captions
        paths += write_table(df.round(4), out, name, notes=notes)
        if base.endswith("_timing") and len(df):
            md = Path(out) / f"{name}.md"
            md.write_text(timing_note(df) + md.read_text())
    return paths


def provenance_table(teacher, student, spec: RunSpec, T: int | None = None, progress: bool = False) -> pd.DataFrame:
    """Who wrote each cache slot after every step of prompt 0 (``spec``'s tokens and seed), for
    OverFill's single teacher prefill and for teacher re-prefills every ``T`` steps (full window,
    and the last ``T // 2`` entries; ``refresh_next="teacher"``, so a refresh leaves the student
    cache equal to the teacher's over its window): one row per (condition, step) with the writers
    as a string (``T`` teacher, ``S`` student) — the table behind the ``refresh_provenance`` figure."""
    from kvlab.decode import Decoding
    from kvlab.harness.costs import provenance

    T = T or min(periods_for(spec.tokens))
    W = max(1, T // 2)
    conds = {"prefill only (OverFill, no refresh)": None,
             f"re-prefill every T={T} (Periodic, W=T)": Periodic(T),
             f"re-prefill last W={W} every T={T} (Periodic, W<T)": Periodic(T, W)}
    rows = []
    for name, pol in conds.items():
        if progress:
            print(f"provenance: {name}", flush=True)
        d = Decoding(teacher, student, spec.prompts[0],
                     DecodeConfig(mode="overfill", max_new_tokens=spec.tokens, sampling=spec.sampling_for(0), refresh=pol,
                                  refresh_next="teacher" if pol is not None else "rerun"))
        records, mat = provenance(d)
        n_ref = sum(1 for r in records if r.refreshed)
        for rec, row in zip(records, mat):
            rows.append({"condition": name, "step": rec.step, "prompt_len": len(d.prompt_ids), "refreshes": n_ref,
                         "writers": "".join("T" if v == 1 else "S" for v in row if v >= 0)})
    return pd.DataFrame(rows)
