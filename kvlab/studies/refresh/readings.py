""""How to read this" texts of the refresh study (notebooks 02 and 07): the periodic, entropy, methods, timing
and teacher-forced tables against what the blog found, one run's costs, entropy trace and provenance.
Computed from the tables, so a reading stays true when the numbers change.
"""
from __future__ import annotations

import pandas as pd

from kvlab.harness.prose import BLOG, HOW, cap, interval_verdict, join, n_of, paired_verdict, row_of, spread_sentence
from kvlab.harness.tableview import fmt, plural, single_prompt

# --- what the blog reports (quoted from the source) -------------------------------------------------------------
BLOG_PERIODIC = {0: (1.88, 0.0), 256: (1.86, 0.7), 128: (1.81, 2.0), 64: (1.71, 3.9)}   # T: (PPL, overhead %)
BLOG_ENTROPY = {5.5: (2.5, 1.70), 6.0: (2.0, 2.27), 6.5: (1.5, 2.19)}                  # τ bits: (refreshes, PPL)
BLOG_SPECULATIVE = (8, 1.77, 1.9)                                                     # k, PPL, overhead %


def read_periodic(table: pd.DataFrame) -> str:
    """``refresh_periodic``: ``none`` + ``periodic_T*`` rows with ``T``, ``teacher_ppl``, ``kl``, ``d_kl`` (+ interval)."""
    one = single_prompt(table)
    per = table[table.policy.str.startswith("periodic")].sort_values("T", ascending=False)
    base = row_of(table, "none")
    if per.empty or base is None:
        raise ValueError("read_periodic needs a 'none' row and at least one 'periodic_T*' row")
    parts = [HOW + "Each row refreshes every T tokens; smaller T = more teacher work. Lower KL and teacher-PPL are "
             "better; ΔKL is the paired difference to no refresh on the same prompts and seeds (below 0 = the "
             "refresh brought the student closer to the teacher). " + spread_sentence(table)]
    n = n_of(table)
    parts.append("ΔKL by T: " + "; ".join(f"T={int(r.T)}: {interval_verdict(r.d_kl, r.d_kl_lo, r.d_kl_hi, one)}"
                                         for r in per.itertuples()) + ".")
    if "d_kl_forced" in table.columns:
        parts.append("Δkl_forced (teacher-forced on the teacher's reference, loops can't fool it) by T: "
                     + "; ".join(f"T={int(r['T'])}: {paired_verdict(r, 'kl_forced', one, n)}" for _, r in per.iterrows()) + ".")
    ppl = [float(base.teacher_ppl)] + [float(v) for v in per.teacher_ppl]
    falls = all(b < a for a, b in zip(ppl, ppl[1:]))
    seq = " → ".join(fmt(v, 2) for v in ppl)
    blog = " → ".join(f"{v[0]}" for v in BLOG_PERIODIC.values())
    parts.append(f"Teacher-PPL from no refresh to the smallest T: {seq} — it "
                 f"{'falls steadily, as in' if falls else 'does not fall steadily, unlike'} {BLOG}, where PPL fell "
                 f"{blog} (no refresh, T = 256, 128, 64; +0.7 / +2.0 / +3.9 % latency).")
    return join(parts)


def read_entropy(table: pd.DataFrame) -> str:
    """``refresh_entropy``: ``entropy_*`` rows with ``tau_bits``, ``refreshes_per_1k``, ``d_kl`` (+ interval)."""
    one = single_prompt(table)
    ent = table[table.policy.str.startswith("entropy")].sort_values("tau_bits")
    if ent.empty:
        raise ValueError("read_entropy needs 'entropy_*' rows")
    parts = [HOW + "A lower threshold τ fires more often (more refreshes per 1k tokens, more teacher work). ΔKL vs no "
             "refresh below 0 is better. " + spread_sentence(table)]
    parts.append("By τ: " + "; ".join(f"τ = {fmt(r.tau_bits, 2)} bits ({fmt(r.refreshes_per_1k, 1)} refreshes / 1k "
                                      f"tokens): ΔKL {interval_verdict(r.d_kl, r.d_kl_lo, r.d_kl_hi, one)}"
                                      for r in ent.itertuples()) + ".")
    if "d_kl_forced" in table.columns:
        parts.append("Δkl_forced by τ: " + "; ".join(f"τ = {fmt(r.tau_bits, 2)}: {paired_verdict(r, 'kl_forced', one, n_of(table))}"
                                                   for _, r in ent.iterrows()) + ".")
    best = ent.loc[ent.d_kl.idxmin()]
    parts.append(f"The lowest ΔKL here is {best.policy}'s ({fmt(best.d_kl, 3, signed=True)}). {cap(BLOG)} "
                 f"found τ = 5.5 bits fired {BLOG_ENTROPY[5.5][0]} times per generation and reached PPL "
                 f"{BLOG_ENTROPY[5.5][1]:.2f} — as low as refreshing every 64 tokens ({BLOG_PERIODIC[64][0]:.2f}) for less "
                 "teacher work; higher τ (6.0, 6.5) fired less and lost most of the gain.")
    return join(parts)


def read_methods(table: pd.DataFrame) -> str:
    """``refresh_methods``: one row per method with ``kl``, ``d_kl`` (+ interval), ``teacher_tokens``."""
    one = single_prompt(table)
    meth = table[table.policy != "none"]
    if meth.empty:
        raise ValueError("read_methods needs rows besides 'none'")
    best = meth.loc[meth.kl.idxmin()]
    cheap = meth.loc[meth.teacher_tokens.idxmin()]
    parts = [HOW + "One row per refresh method at its default setting; lower KL is better, `teacher tokens` is the "
             "teacher's work per run (refresh prefills + probes). " + spread_sentence(table)]
    parts.append(f"Lowest KL: {best.policy} ({fmt(best.kl, 3)}, ΔKL {interval_verdict(best.d_kl, best.d_kl_lo, best.d_kl_hi, one)}); "
                 f"least teacher work: {cheap.policy} ({fmt(cheap.teacher_tokens, 1)} tokens).")
    if "d_kl_forced" in table.columns:
        parts.append("Δkl_forced vs no refresh: " + "; ".join(f"{r.policy}: {paired_verdict(r, 'kl_forced', one, n_of(table))}"
                                                           for _, r in meth.iterrows()) + ".")
    k, ppl, over = BLOG_SPECULATIVE
    parts.append(f"{cap(BLOG)} found speculative refresh (k = {k}) at PPL {ppl} with ~{over} % latency "
                 f"overhead against periodic T = 64 at {BLOG_PERIODIC[64][0]} with {BLOG_PERIODIC[64][1]} %: a little "
                 "quality for half the overhead.")
    return join(parts)


def read_timing(table: pd.DataFrame) -> str:
    """``refresh_timing``: ``overhead_pct`` and its quartiles per policy; the ``none`` row is the noise floor."""
    base = row_of(table, "none")
    rest = table[table.policy != "none"]
    parts = [HOW + "Overhead % = extra wall time of a policy over no refresh, timed back to back; lower is better. "
             "The bars/quartiles are the spread over the timed pairs."]
    if base is not None:
        noise = max(abs(float(base.overhead_pct_q25)), abs(float(base.overhead_pct_q75)))
        above = rest[rest.overhead_pct_q25 > noise]
        parts.append(f"The `none` row times no refresh against itself: its quartiles (±{fmt(noise, 1)} %) are the noise "
                     f"floor. {plural(len(above), 'policy', 'policies')} of {len(rest)} cost more than that noise "
                     f"(lower quartile above it){': ' + ', '.join(above.policy) if len(above) else ''}.")
    if int(table["pairs"].max()) <= 1:
        parts.append("One timed pair per policy: a single timing, not a measurement of the overhead.")
    parts.append(f"{cap(BLOG)} reports +0.7 % to +3.9 % for periodic refresh on a GPU with a larger "
                 "pair; on a 2-core CPU the teacher's share of the time is much larger.")
    return join(parts)


def read_forced(table: pd.DataFrame) -> str:
    """``refresh_forced``: conditions ``student`` / ``overfill`` / ``window`` / ``refreshed`` with ``kl`` and
    ``d_kl_vs_overfill`` (``d_lo``, ``d_hi``)."""
    one = single_prompt(table)
    parts = [HOW + "The tokens are fixed (the teacher's greedy text); only who wrote the cache differs. Lower KL = the "
             "student predicts the teacher's next-token distribution better. Δ is against OverFill's cache (teacher "
             "prompt, student text). " + spread_sentence(table)]
    for cond, what in (("refreshed", "a teacher re-prefill of the generated text"),
                       ("window", "a teacher rewrite of the last W entries only"),
                       ("student", "the student's own prefill (no teacher at all)")):
        r = row_of(table, cond, "condition")
        if r is not None:
            m = float(r["d_mde"]) if "d_mde" in r.index else None
            parts.append(f"{what}: ΔKL {interval_verdict(r.d_kl_vs_overfill, r.d_lo, r.d_hi, one, mde=m, n=n_of(table))}.")
    parts.append(f"{cap(BLOG)} argues that a refresh re-anchors the student's state and lowers "
                 "KL(p_T‖q) for the tokens after it; a `refreshed` interval below 0 is that effect, measured with the "
                 "sampling noise removed.")
    return join(parts)


def costs_frame(costs: dict) -> pd.DataFrame:
    """``kvlab.harness.costs.run_costs``' dict as a two-column table with plain names."""
    names = {"refreshes": "refreshes", "teacher_tokens": "teacher tokens (prefills + probes)",
             "probe_tokens": "probe tokens", "delta_tokens": "teacher prefill tokens (Σ|Δ|)",
             "spliced": "cache entries overwritten", "teacher_s": "teacher compute (s)", "probes": "probe steps",
             "teacher_pct": "teacher time, % of the rest of the run"}
    rows = [{"cost": names.get(k, k.replace("_", " ")), "value": fmt(v, 2) if isinstance(v, float) else str(v)}
            for k, v in costs.items()]
    return pd.DataFrame(rows)


def read_trace(records, tau: float) -> str:
    """The entropy trace of one entropy-gated run: how many steps crossed τ and where it refreshed."""
    recs = list(records)
    over = [r.step for r in recs if r.entropy_bits >= tau]
    fired = [r.step for r in recs if r.refreshed]
    return (HOW + f"Each point is one generated token's student entropy (bits; high = unsure). Of {plural(len(recs), 'step')}, "
            f"{len(over)} reached τ = {fmt(tau, 2)} bits and the run refreshed {plural(len(fired), 'time')}"
            f"{' (' + plural(len(fired), 'step').split(' ')[1] + ' ' + ', '.join(map(str, fired[:12])) + ('…' if len(fired) > 12 else '') + ')' if fired else ''}. "
            "Teacher-PPL depends only on the emitted tokens: a τ that changes the refreshes but not the tokens leaves it "
            "unchanged.")


def read_provenance(matrix, prompt_len: int, label: str) -> str:
    """A provenance matrix (steps × slots; 1 teacher, 0 student, −1 empty): the final row's writers."""
    import numpy as np

    last = np.asarray(matrix)[-1]
    gen = last[prompt_len:]
    gen = gen[gen >= 0]
    t = int((gen == 1).sum())
    return (HOW + f"Rows are steps (time runs down), columns cache slots; green = teacher-written, orange = "
            f"student-written. The first {prompt_len} slots are the prompt (the teacher's prefill). At the end of "
            f"{label}, {t} of the {len(gen)} generated entries are teacher-written ({fmt(100 * t / max(1, len(gen)), 0)} %).")


__all__ = ["read_periodic", "read_entropy", "read_methods", "read_timing", "read_forced", "costs_frame", "read_trace",
           "read_provenance"]
