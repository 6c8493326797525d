"""The blog's refresh regime (seed 000, "Periodic Refresh on OverFill", "Entropy Gating", "Speculative Refresh";
issue 37 item 2): long generations (N ≥ 512; the blog's N = 1,200) of long-form ELI5 answers, the OverFill student
decoding, a few cheap refreshes: periodic T = 64 / 128 / 256, an entropy gate whose τ is calibrated to
~2.5 refreshes per 1,000 tokens, speculative k = 8 and probe-KL at the same budget — each against no refresh on
the same prompts and seeds.

Prompts: the first ``--prompts`` of ``data/prompts.jsonl`` (long-form "ELI5 / explain like I'm five … step by
step" questions written for kvlab; ``tests/test_train.py`` checks they are disjoint from, and no near-duplicate
of, ``data/train_prompts.jsonl``). Thresholds are calibrated on no-refresh OverFill runs of the first
``--calib-prompts`` of ``data/calibration.jsonl`` (disjoint from both), at the same N.

Two tables: ``refresh_long`` (one row per policy, paired bootstrap intervals against ``no_refresh`` over
prompts) and ``refresh_equal_cost`` (policies whose knobs were set to hit about 2 and about 8 refreshes per
1,000 tokens, beside their achieved rates). Free-running columns (teacher-PPL, tail log-prob, repeat@3,
distinct-2, refreshes) come from the free runs; ``kl_forced`` / ``nll_forced`` from the teacher-forced path
on the teacher's reference continuation (:func:`kvlab.harness.forced.forced_columns`); ``latency_overhead``
from runs timed side by side in this process (:func:`kvlab.studies.refresh.tables.paired_timing`).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Sequence

import numpy as np
import pandas as pd

BASE = "no_refresh"
LONG_T = (64, 128, 256)          # the blog's periodic strides
MAIN_BUDGET = 2.5                # refreshes per 1,000 tokens: the blog's entropy gate (2.5 refreshes at N = 1,200)
COST_TIERS = (2.0, 8.0)          # the equal-cost table's "about 2" and "about 8" per 1,000 tokens
SPEC_K = 8
PROBE_M = 8
TAIL = 50                        # tail log-prob: the last 50 generated tokens under the teacher
MIN_TOKENS = 512
PAIRED = ("teacher_ppl", "kl_forced", "nll_forced", "tail_logprob", "repeat3", "distinct2")
LONG_COLS = ["policy", "family", "knob", "tokens", "refreshes_per_1k", "refreshes", "teacher_tokens",
             "teacher_tokens_per_token", "teacher_tokens_forced", "teacher_ppl", "d_teacher_ppl", "d_teacher_ppl_lo",
             "d_teacher_ppl_hi", "d_teacher_ppl_mde", "kl_forced", "d_kl_forced", "d_kl_forced_lo", "d_kl_forced_hi",
             "d_kl_forced_mde", "nll_forced", "d_nll_forced", "d_nll_forced_lo", "d_nll_forced_hi", "tail_logprob",
             "d_tail_logprob", "d_tail_logprob_lo", "d_tail_logprob_hi", "d_tail_logprob_mde", "repeat3", "d_repeat3",
             "d_repeat3_lo", "d_repeat3_hi", "distinct2", "d_distinct2", "d_distinct2_lo", "d_distinct2_hi",
             "latency_overhead", "n_prompts"]
EQUAL_COLS = ["tier_per_1k", "policy", "family", "knob", "refreshes_per_1k", "teacher_tokens_per_token",
              "d_teacher_ppl", "d_teacher_ppl_lo", "d_teacher_ppl_hi", "d_kl_forced", "d_kl_forced_lo",
              "d_kl_forced_hi", "d_tail_logprob", "d_tail_logprob_lo", "d_tail_logprob_hi", "d_repeat3",
              "d_repeat3_lo", "d_repeat3_hi", "n_prompts"]


# --------------------------------------------------------------------------- per-sequence metrics


def repeat3(tokens: Sequence[int]) -> float:
    """repeat@3: share of the sequence's 3-grams that repeat an earlier 3-gram (0 = none repeats)."""
    from kvlab.core.metrics import repeat_at_n

    return repeat_at_n(list(tokens), 3)


def distinct2(tokens: Sequence[int]) -> float:
    """Distinct bigrams / bigrams (1 = no bigram repeats)."""
    from kvlab.harness.forced import distinct_n

    return distinct_n(list(tokens), 2)


def tail_logprob(teacher_logprobs: Sequence[float], tail: int = TAIL) -> float:
    """Mean of the last ``tail`` per-token log-probs under the teacher (the blog's "tail log-prob")."""
    v = np.asarray(teacher_logprobs, dtype=float)
    if v.size == 0:
        raise ValueError("teacher_logprobs is empty: nothing to score")
    return float(v[-tail:].mean())


# --------------------------------------------------------------------------- calibration and the policies


def count_for_rate(tokens: int, per_1k: float) -> int:
    """Refreshes in an ``tokens``-long run at ``per_1k`` per 1,000 tokens (at least one)."""
    return max(1, round(per_1k * tokens / 1000.0))


def period_for_rate(tokens: int, per_1k: float) -> int:
    """The smallest period T with exactly :func:`count_for_rate` refreshes in ``tokens`` steps (a refresh fires
    after steps T, 2T, … but never after the last step, so a run refreshes ``(tokens - 1) // T`` times): the
    refreshes are spread over the run instead of bunched at its start."""
    c = count_for_rate(tokens, per_1k)
    T = max(1, math.ceil(tokens / (c + 1)))
    while (tokens - 1) // T > c:
        T += 1
    return T


def achieved_rate(signal: Sequence[float], tau: float, probe_every: int = 1) -> float:
    """Refreshes per 1,000 tokens a threshold gate would fire on a recorded trace (open loop: every value above
    ``tau`` fires; with ``probe_every = M`` only every M-th value is seen)."""
    v = np.asarray(signal, dtype=float)[probe_every - 1::probe_every]
    if v.size == 0:
        raise ValueError("signal is empty")
    return 1000.0 * float((v > tau).sum()) / (v.size * probe_every)


@dataclass(frozen=True)
class LongCalibration:
    """Student entropy (bits) and teacher–student KL (nats) per student step of no-refresh OverFill runs on the
    calibration prompts, and the thresholds read from them."""

    entropy: tuple[float, ...]
    kl: tuple[float, ...]

    def tau(self, per_1k: float) -> float:
        from kvlab.refresh.base import tau_for_budget

        return tau_for_budget(self.entropy, per_1k)

    def kappa(self, per_1k: float, M: int = PROBE_M) -> float:
        from kvlab.refresh.base import tau_for_budget

        return tau_for_budget(self.kl[M - 1::M] if len(self.kl) >= M else self.kl, per_1k, probe_every=M)


def long_policies(tokens: int, cal: LongCalibration | None) -> tuple[dict, pd.DataFrame]:
    """Every configuration the two tables need, by name, and a frame describing each (``family``, ``knob``,
    ``target_per_1k``); ``cal=None``: only the rows without a calibrated threshold. Speculative k at about 2 and 8 refreshes per 1,000 tokens is not run: with
    ``refresh_next="rerun"`` it leaves the same cache as periodic T = k (kvlab.refresh.policies.speculative;
    the blog: "same post-refresh KV") at the same teacher tokens, so the periodic rows stand for it."""
    from kvlab.decode import DecodeConfig
    from kvlab.refresh.policies import EntropyGate, Periodic, ProbeKL, Speculative

    base = DecodeConfig(mode="overfill")
    cfgs, rows = {}, []

    def add(name, policy, family, knob, target=float("nan")):
        if name in cfgs:
            return
        cfgs[name] = replace(base, refresh=policy, refresh_next="rerun")
        rows.append({"policy": name, "family": family, "knob": knob, "target_per_1k": target})

    add(BASE, None, "none", "")
    for T in LONG_T:
        add(f"periodic_T{T}", Periodic(T), "periodic", f"T={T}", 1000.0 * ((tokens - 1) // T) / tokens)
    for r in COST_TIERS:
        T = period_for_rate(tokens, r)
        add(f"periodic_T{T}", Periodic(T), "periodic", f"T={T}", r)
    for r in (MAIN_BUDGET, COST_TIERS[1]) if cal is not None else ():
        tau = round(cal.tau(r), 3)
        add(f"entropy_b{r:g}", EntropyGate(tau), "entropy", f"tau={tau:g} bits", r)
    add(f"speculative_k{SPEC_K}", Speculative(SPEC_K), "speculative", f"k={SPEC_K}", 1000.0 / SPEC_K)
    if cal is not None:
        kappa = round(cal.kappa(MAIN_BUDGET), 4)
        add(f"probe_kl_M{PROBE_M}", ProbeKL(PROBE_M, kappa), "probe_kl", f"M={PROBE_M}, kappa={kappa:g}", MAIN_BUDGET)
    return cfgs, pd.DataFrame(rows)


# --------------------------------------------------------------------------- tables from per-run rows


def per_run_rows(runs: Sequence[dict], keys: Sequence[tuple[int, str]]) -> pd.DataFrame:
    """One row per stored free run (``keys[j] = (prompt_idx, policy)``): the blog's columns recomputed from the
    run's tokens and per-token teacher log-probs, plus its refresh cost."""
    rows = []
    for (i, name), res in zip(keys, runs):
        toks = res["steps"]["token_id"]
        rows.append({"policy": name, "prompt_idx": i, "tokens": len(toks), "teacher_ppl": res["teacher_ppl"],
                     "tail_logprob": tail_logprob(res["teacher_logprobs"]), "repeat3": repeat3(toks),
                     "distinct2": distinct2(toks), "refreshes": res["refreshes"],
                     "teacher_tokens": res["teacher_tokens"]})
    return pd.DataFrame(rows)


def long_table(per_run: pd.DataFrame, info: pd.DataFrame, overhead: pd.DataFrame | None = None,
               n_boot: int = 2000, seed: int = 0) -> pd.DataFrame:
    """One row per policy: means, and per paired metric the mean difference to ``no_refresh`` on the same
    prompts with its bootstrap 95 % interval over prompts (``d_<m>``, ``_lo``, ``_hi``) and MDE."""
    from kvlab.core.metrics import add_mde
    from kvlab.harness.experiment import paired_bootstrap

    if BASE not in set(per_run.policy):
        raise ValueError(f"per_run has no {BASE!r} rows: the paired intervals need the reference policy")
    if "teacher_tokens_forced" not in per_run:
        per_run = per_run.assign(teacher_tokens_forced=float("nan"))
    metrics = [m for m in PAIRED if m in per_run]
    g = per_run.groupby("policy", sort=False)
    means = g[["tokens", "refreshes", "teacher_tokens", "teacher_tokens_forced", *metrics]].mean()
    means["n_prompts"] = g.size()
    means["refreshes_per_1k"] = 1000.0 * means["refreshes"] / means["tokens"]
    means["teacher_tokens_per_token"] = means["teacher_tokens"] / means["tokens"]
    pairs = add_mde(paired_bootstrap(per_run, BASE, metrics, n_boot=n_boot, seed=seed), per_run, BASE, metrics)
    out = info.merge(means.reset_index(), on="policy").merge(pairs, on="policy")
    if overhead is not None and len(overhead):
        out = out.merge(overhead.rename(columns={"overhead_pct": "latency_overhead"})[["policy", "latency_overhead"]],
                        on="policy", how="left")
    out["tokens"] = out["tokens"].round().astype(int)
    out["n_prompts"] = out["n_prompts"].astype(int)
    return out.reindex(columns=LONG_COLS)


def equal_cost_table(table: pd.DataFrame, info: pd.DataFrame, tiers: Sequence[float] = COST_TIERS) -> pd.DataFrame:
    """Per cost tier: the row of each family whose achieved refresh rate is nearest the tier (periodic, entropy,
    speculative, probe-KL; a family joins a tier only within a factor 2 of it)."""
    t = table.merge(info[["policy", "target_per_1k"]], on="policy", how="left")
    rows = []
    for tier in tiers:
        for fam in ("periodic", "entropy", "speculative", "probe_kl"):
            f = t[(t.family == fam) & (t.refreshes_per_1k > 0)]
            if f.empty:
                continue
            j = (np.log(f.refreshes_per_1k / tier)).abs().idxmin()
            if abs(math.log(f.loc[j, "refreshes_per_1k"] / tier)) <= math.log(2):
                rows.append({"tier_per_1k": tier, **f.loc[j].to_dict()})
    return pd.DataFrame(rows).reindex(columns=EQUAL_COLS)


# --------------------------------------------------------------------------- the study


def _log(msg: str, progress: bool) -> None:
    if progress:
        import time

        print(f"[{time.strftime('%H:%M:%S')}] refresh-long: {msg}", flush=True)


CALIBRATED = ("entropy", "probe_kl")      # row-name prefixes whose threshold needs the calibration runs


def refresh_long(teacher, student, spec, calib, store, *, timing_prompts: int = 1, timing_repeats: int = 1,
                 policies: Sequence[str] | None = None, progress: bool = True) -> dict[str, pd.DataFrame]:
    """Calibrate on ``calib`` (no-refresh OverFill runs), run every policy of :func:`long_policies` on ``spec``
    (stored, paired seeds), score each on the teacher-forced reference, time each against no refresh side by side
    (``timing_repeats=0``: no timing, ``latency_overhead`` NaN) and build the tables. ``policies``: only these
    rows (and ``no_refresh``); without entropy / probe-KL rows nothing is calibrated."""
    from kvlab.harness.experiment import scored_runs
    from kvlab.harness.forced import forced_columns
    from kvlab.studies.refresh.tables import calibrate, overhead_table, paired_timing

    if spec.tokens < MIN_TOKENS:
        raise ValueError(f"--tokens={spec.tokens} is below {MIN_TOKENS}: the blog's regime is long generations "
                         f"(N = 1,200; this study needs N >= {MIN_TOKENS})")
    wanted = None if policies is None else [BASE, *[p for p in policies if p != BASE]]
    cal = None
    if wanted is None or any(p.startswith(CALIBRATED) for p in wanted):
        _log(f"calibration: {len(calib.prompts)} no-refresh runs × {calib.tokens} tokens", progress)
        c = calibrate(teacher, student, calib, store, progress=progress)
        cal = LongCalibration(c.entropy, c.kl)
    cfgs, info = long_policies(spec.tokens, cal)
    if wanted is not None:
        unknown = [p for p in wanted if p not in cfgs]
        if unknown:
            raise ValueError(f"--policies: {unknown} not among this run's rows {list(cfgs)}")
        cfgs = {p: cfgs[p] for p in wanted}
        info = info.set_index("policy").loc[wanted].reset_index()
    _log(f"free runs: {len(cfgs)} policies × {len(spec.prompts)} prompts × {spec.tokens} tokens (stored runs reused)",
         progress)
    keys = [(i, name) for name in cfgs for i in range(len(spec.prompts))]
    jobs = [(spec.prompts[i], replace(cfgs[name], max_new_tokens=spec.tokens, sampling=spec.sampling_for(i)))
            for i, name in keys]
    runs = scored_runs(teacher, student, jobs, store, batch=spec.batch, progress=progress)
    per_run = per_run_rows(runs, keys)
    _log("teacher-forced scores on the teacher's reference continuation", progress)
    forced = forced_columns(teacher, student, spec, cfgs, store, progress=progress).drop(columns=["distinct2"])
    per_run = per_run.merge(forced, on=["policy", "prompt_idx"], how="left")
    overhead = None
    if timing_repeats:
        _log(f"latency: every policy vs {BASE}, back to back, {timing_prompts} prompt(s) × {timing_repeats} "
             "repeat(s)", progress)
        overhead = overhead_table(paired_timing(teacher, student, spec, cfgs, base=BASE, prompts=timing_prompts,
                                                repeats=timing_repeats, progress=progress))
    table = long_table(per_run, info, overhead)
    tables = {"refresh_long": table, "refresh_equal_cost": equal_cost_table(table, info), "refresh_long_runs": per_run}
    if overhead is not None:
        tables["refresh_long_timing"] = overhead
    if cal is None:
        return tables
    tables["refresh_long_calibration"] = pd.DataFrame([{"calib_prompts": len(calib.prompts), "tokens": calib.tokens,
                               "n_steps": len(cal.entropy), **{f"tau_b{r:g}": cal.tau(r) for r in (MAIN_BUDGET,
                                                                                               COST_TIERS[1])},
                               f"kappa_b{MAIN_BUDGET:g}_M{PROBE_M}": cal.kappa(MAIN_BUDGET),
                               **{f"open_loop_per_1k_b{r:g}": achieved_rate(cal.entropy, cal.tau(r))
                                  for r in (MAIN_BUDGET, COST_TIERS[1])}}])
    return tables


def long_notes(spec, calib, table: pd.DataFrame) -> list[str]:
    """What the refresh_long table's columns mean and what it was run on."""
    from kvlab.core.metrics import MDE_NOTE
    from kvlab.harness.forced import FORCED_SCORE_NOTE

    return [f"OverFill student decoding, N = {spec.tokens} new tokens (EOS ignored), {len(spec.prompts)} long-form ELI5 "
            f"prompts (data/prompts.jsonl, first {len(spec.prompts)}), sampling T = {spec.sampling.temperature}, "
            f"top-p {spec.sampling.top_p}, seed {spec.sampling.seed} + prompt index for every policy. Thresholds "
            f"calibrated on {len(calib.prompts)} no-refresh runs of data/calibration.jsonl (disjoint prompts); "
            "`knob` holds them.",
            "`d_*`: paired mean difference policy − `no_refresh` over the same prompts and seeds, bootstrap 95 % "
            "interval over prompts (`_lo`, `_hi`); `_mde`: the smallest difference detectable at this n.",
            "Free-running columns (`teacher_ppl`, `tail_logprob`: mean teacher log-prob of the last 50 generated "
            "tokens, `repeat3`: share of 3-grams repeating an earlier one, `distinct2`, `refreshes_per_1k`, "
            "`teacher_tokens`: refresh prefills + probes) come from the free runs.",
            FORCED_SCORE_NOTE + " On this path a refresh makes the student's cache the teacher's cache of the same "
            "reference text, so a refresh lowers `kl_forced` by construction (docs/refresh.md).",
            "`teacher_tokens_forced`: teacher tokens the policy spends on the forced path (NaN where "
            "kvlab.harness.forced does not report them).",
            "`latency_overhead`: % wall time over `no_refresh`, median of runs timed back to back in one process "
            "(refresh_long_timing.csv, machine-dependent); NaN when the run skipped the timing.",
            MDE_NOTE]


def write_long(tables: dict[str, pd.DataFrame], out, spec, calib) -> list:
    """CSV + Markdown of the two tables (the per-run rows and calibration as CSV + Markdown; timing CSV only)."""
    from pathlib import Path

    from kvlab.harness.experiment import write_table

    out = Path(out)
    paths = write_table(tables["refresh_long"].round(4), out, "refresh_long", notes=long_notes(spec, calib,
                                                                                                 tables["refresh_long"]))
    paths += write_table(tables["refresh_equal_cost"].round(4), out, "refresh_equal_cost", notes=[
        "Policies whose knobs were set to hit about 2 and about 8 refreshes per 1,000 tokens (`tier_per_1k`), "
        "each family's row nearest the tier (within a factor 2); `refreshes_per_1k`: the rate achieved on the "
        "free runs. Speculative k at these rates is periodic T = k (same post-refresh cache, same teacher "
        "tokens with refresh_next = rerun), so the periodic row stands for it.",
        "`d_*`: paired difference against `no_refresh`, bootstrap 95 % interval over prompts (refresh_long.md)."])
    if "refresh_long_calibration" in tables:
        paths += write_table(tables["refresh_long_calibration"].round(4), out, "refresh_long_calibration", notes=[
            "Thresholds from no-refresh OverFill runs on data/calibration.jsonl: τ (bits) for the entropy gate at b "
            "refreshes per 1,000 tokens, κ (nats) for probe-KL every M steps; `open_loop_per_1k_*`: the rate τ "
            "fires at on the calibration trace itself."])
    paths += write_table(tables["refresh_long_runs"].round(5), out, "refresh_long_runs", notes=["Per run."])
    if "refresh_long_timing" in tables:
        tables["refresh_long_timing"].to_csv(out / "refresh_long_timing.csv", index=False)
        paths.append(out / "refresh_long_timing.csv")
    return paths
