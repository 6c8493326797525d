""""How to read this" texts, computed from the tables and figures they sit under.

Every function takes the numbers a notebook shows and returns Markdown: which direction is better, what
the spread or interval means at this sample size, what the paper or blog found for the same quantity,
and whether this table agrees. Nothing is hard-coded about *this* run's outcome, so a reading stays
true when the numbers change (a retrained student, another prompt set, smoke settings).
"""
from __future__ import annotations

import math

import pandas as pd

from kvlab.harness.tableview import fmt, plural, single_prompt

# --- the sources, named (links where the source has one) --------------------------------------------------------
OVERFILL = "[OverFill (Kim et al. 2025)](https://arxiv.org/abs/2508.08446)"
BLOG = ("the blog *KV-Cache Refresh Methods for Long Generation* (Emara, Kim & Abdelfattah 2025; code: "
        "[friendshipkim/overfill](https://github.com/friendshipkim/overfill))")
BLOG_SETTING = "50 ELI5 prompts × 1200 tokens, a larger teacher/student pair"
CONFKV = ("the Conf-KV paper (*Conf-KV: Confidence-Aware KV Cache Eviction with Mixed-Precision Storage for "
          "Long-Horizon LLM*, Li & Miao 2026)")
OPENVINO = ("[OpenVINO GenAI's KV-cache eviction](https://github.com/openvinotoolkit/openvino.genai/blob/master/"
            "site/docs/concepts/optimization-techniques/kvcache-eviction-algorithm.md)")

# --- what they report (quoted from the sources) -----------------------------------------------------------------
BLOG_BASELINES = {"teacher": {"teacher_ppl": 1.64, "repeat3": 0.032}, "overfill": {"teacher_ppl": 1.88, "repeat3": 0.072},
                  "student": {"teacher_ppl": 2.35, "repeat3": 0.028}}
BLOG_PERIODIC = {0: (1.88, 0.0), 256: (1.86, 0.7), 128: (1.81, 2.0), 64: (1.71, 3.9)}   # T: (PPL, overhead %)
BLOG_ENTROPY = {5.5: (2.5, 1.70), 6.0: (2.0, 2.27), 6.5: (1.5, 2.19)}                  # τ bits: (refreshes, PPL)
BLOG_SPECULATIVE = (8, 1.77, 1.9)                                                     # k, PPL, overhead %
CONFKV_GAP_CLOSED = 0.74          # Conf-KV-L closes 74 % of the sliding-window → full-cache PPL gap (GPT-2)
CONFKV_ABLATION = {"random_rate": 36.54, "confkv_recency": 32.08, "confkv_attention": 31.47, "confkv": 30.92}

HOW = "**How to read this.** "


def cap(s: str) -> str:
    """``s`` with its first letter upper-case (a source's name at the start of a sentence)."""
    return s[:1].upper() + s[1:]


def _row(table: pd.DataFrame, policy: str, col: str = "policy"):
    hit = table[table[col] == policy]
    return None if hit.empty else hit.iloc[0]


def _n(table: pd.DataFrame) -> int:
    for c in ("n_prompts", "n", "n_runs"):
        if c in table.columns:
            return int(pd.to_numeric(table[c], errors="coerce").max())
    return 0


def _join(parts) -> str:
    return " ".join(p.strip() for p in parts if p.strip())


def interval_verdict(d: float, lo: float, hi: float, one: bool, lower_is_better: bool = True,
                     mde: float | None = None, n: int | None = None) -> str:
    """What a paired difference and its bootstrap 95 % interval say, in words; with ``mde`` and ``n`` an
    interval that spans 0 reads "no detectable difference at n = N (MDE x)": how large an effect these
    prompts could have seen (kvlab.core.metrics.mde: 2.8 × SD / √n, 80 % power at α = 0.05)."""
    if one:
        return f"{fmt(d, 3, signed=True)} (one prompt: no interval, not evidence either way)"
    if lo is None or (isinstance(lo, float) and math.isnan(lo)):
        return f"{fmt(d, 3, signed=True)} (too few prompts for an interval: not evidence either way)"
    span = f"{fmt(d, 3, signed=True)} [{fmt(lo, 3, signed=True)}, {fmt(hi, 3, signed=True)}]"
    if lo > 0 or hi < 0:
        good = (hi < 0) == lower_is_better
        return f"{span}: {'better' if good else 'worse'} (the interval excludes 0)"
    if mde is not None and n is not None and not (isinstance(mde, float) and math.isnan(mde)):
        return f"{span}: no detectable difference at n = {n} (MDE {fmt(mde, 3)})"
    return f"{span}: no measurable change (the interval spans 0)"


def _fv(r, m: str, one: bool, n: int, lower_is_better: bool = True) -> str:
    """:func:`interval_verdict` of row ``r``'s paired columns ``d_<m>``, ``_lo``, ``_hi``, ``_mde``."""
    g = (lambda c: float(r[c]) if c in r.index and pd.notna(r[c]) else float("nan"))
    return interval_verdict(g(f"d_{m}"), g(f"d_{m}_lo"), g(f"d_{m}_hi"), one, lower_is_better,
                            mde=g(f"d_{m}_mde"), n=n)


LOOPS = ("Why teacher-PPL and on-path KL can favour a looping decoder: both score each decoder on the text it wrote "
         "itself. Once a phrase has appeared, the teacher predicts its repetition with high confidence (copying from "
         "context is what attention does best), so a decoder stuck in a loop writes text the teacher finds *easy*: "
         "teacher-PPL drops and, on those confident steps, KL(p_T‖q) is small too. `kl_forced` / `nll_forced` score "
         "every decoder on the same reference text (the teacher's own sampled continuation), teacher-forced, so a "
         "decoder cannot choose easy text; repeat@3 and distinct-2 show the loops directly.")


def spread_sentence(table: pd.DataFrame) -> str:
    n = _n(table)
    if single_prompt(table):
        return "One prompt: there is no spread, and a single prompt can rank these rows either way. "
    rough = f" With only {plural(n, 'prompt')}, intervals are rough or not given." if n < 5 else ""
    return (f"`±` is the standard deviation across the {plural(n, 'prompt')} (how much one prompt differs from "
            f"another, not the uncertainty of the mean); paired differences carry a bootstrap 95 % interval.{rough} ")


def smoke_banner(smoke: bool) -> str:
    """The banner a notebook prints at its top in smoke mode (empty otherwise)."""
    if not smoke:
        return ""
    return ("> ⚠️ **Smoke mode** (`KVLAB_SMOKE=1`): tiny settings that check the code runs end to end. "
            "**The numbers check the code, not findings** — the readings below still describe them, but read "
            "findings from a full run (unset `KVLAB_SMOKE`).")


# --- notebook 01: baselines ------------------------------------------------------------------------------------
def read_baselines(table: pd.DataFrame) -> str:
    """Teacher / OverFill / Student (/ Standalone) rows (``policy``, ``teacher_ppl``, ``kl``, ``repeat3``,
    ``*_std``, ``n_prompts``; with ``kl_forced`` and the paired ``d_*`` columns when the table has them)."""
    r = {p: _row(table, p) for p in ("teacher", "overfill", "student")}
    if any(v is None for v in r.values()):
        raise ValueError("read_baselines needs rows 'teacher', 'overfill' and 'student' in column 'policy'")
    alone = _row(table, "standalone")
    T, O, S = (float(r[p].teacher_ppl) for p in ("teacher", "overfill", "student"))
    one = single_prompt(table)
    n = _n(table)
    order = " < ".join(f"{p} {fmt(float(r[p].teacher_ppl), 2)}" for p in sorted(r, key=lambda p: r[p].teacher_ppl))
    text = [HOW + "Lower is better in every column but distinct-2: teacher-PPL (how likely the teacher finds the "
            "text), KL(p_T‖q) (how far the decoder's next-token distribution is from the teacher's, in nats; 0 for "
            "the teacher by construction), repeat@3 (the share of repeated 3-grams) and the teacher-forced "
            "`kl_forced` / `nll_forced` (on one fixed reference text per prompt). " + spread_sentence(table)]
    text.append("Two baselines: `student` is the OverFill decoder itself run alone on its own prefill — the blog's "
                "Student row (its student is OverFill's trained decoder); `standalone` is a separately trained "
                "student of the same shape — the OverFill paper's equal-budget baseline"
                + (" (no such student in this table: the pair is untrained)." if alone is None else "."))
    rel = "better" if O < S else "worse"
    gap = abs(O - S)
    sd = max(float(r["overfill"].get("teacher_ppl_std", float("nan"))), float(r["student"].get("teacher_ppl_std", float("nan"))))
    caveat = ""
    if not one and not math.isnan(sd) and gap < sd:
        caveat = f" — a gap smaller than the per-prompt spread (up to ±{fmt(sd, 2)}), so these prompts do not settle it"
    text.append(f"Here, by teacher-PPL: {order}. **OverFill scores {rel} teacher-PPL than the student alone "
                f"({fmt(O, 2)} vs {fmt(S, 2)}){caveat}.**")
    b = BLOG_BASELINES
    blog_order = T < O < S
    if blog_order:
        agree = "This table agrees: OverFill sits between the two."
    elif O >= S:
        agree = ("This table **contradicts** it: OverFill is not better than the student here, so the teacher's "
                 "prefill did not buy quality on this pair and prompt set.")
    else:
        agree = "This table differs: OverFill scores better than the teacher here."
    text.append(f"{cap(BLOG)} ({BLOG_SETTING}) found Teacher {b['teacher']['teacher_ppl']} < OverFill "
                f"{b['overfill']['teacher_ppl']} < Student {b['student']['teacher_ppl']}. {agree}")
    if "d_kl_forced" in table.columns and pd.notna(r["student"].get("d_kl_forced", float("nan"))):
        parts = []
        for name, row in (("student (the blog's baseline)", r["student"]), ("standalone (the paper's)", alone)):
            if row is not None and pd.notna(row.get("d_kl_forced", float("nan"))):
                v = _fv(row, "kl_forced", one, n, lower_is_better=False)     # Δ > 0: the baseline is further off
                v = v.replace(": better (", ": OverFill better (").replace(": worse (", ": OverFill worse (")
                parts.append(f"{name} − OverFill: {v}")
        text.append("**Teacher-forced KL on the teacher's reference text** (`kl_forced`, the score loops can't fool; "
                    "Δ = baseline − OverFill, so above 0 means OverFill is closer to the teacher): "
                    + "; ".join(parts) + ".")
    rep = {p: float(r[p].repeat3) for p in r}
    worst = max(rep, key=rep.get)
    here = (f"the most repetitive text here is {worst}'s ({fmt(rep[worst], 3)})" if rep[worst] > 0
            else "no decoder repeats a 3-gram here")
    text.append(f"PPL rewards repetition loops, so read it with repeat@3: {here} (the blog: OverFill "
                f"{b['overfill']['repeat3']}, teacher {b['teacher']['repeat3']}, student {b['student']['repeat3']}).")
    text.append(LOOPS)
    return _join(text)


def read_regimes(table: pd.DataFrame) -> str:
    """``baselines_regimes``: per (``regime``, ``baseline``) the paired ``d_kl_forced`` (+ ``_lo``/``_hi``/``_mde``),
    ``d_kl``, ``d_teacher_ppl`` of baseline − OverFill."""
    if table.empty:
        raise ValueError("read_regimes needs at least one (regime, baseline) row")
    parts = [HOW + "Each row compares OverFill with one baseline in one prompt regime, paired over the same prompts; "
             "Δ = baseline − OverFill, so above 0 favours OverFill. " + cap(BLOG) + " says OverFill pays off for "
             "long prompts and short answers, where most of the context the decoder reads was written by the teacher."]
    for r in table.itertuples():
        row = pd.Series(r._asdict())
        n = int(r.n_prompts)
        vs = [_fv(row, m, n == 1, n, lower_is_better=False).replace(": better (", ": OverFill better (")
              .replace(": worse (", ": OverFill worse (") for m in ("kl_forced", "teacher_ppl")]
        parts.append(f"{r.regime}, {r.baseline}: Δkl_forced {vs[0]}; Δteacher-PPL {vs[1]}.")
    return _join(parts)


# --- notebook 02: refresh ----------------------------------------------------------------------------------------
def read_periodic(table: pd.DataFrame) -> str:
    """``refresh_periodic``: ``none`` + ``periodic_T*`` rows with ``T``, ``teacher_ppl``, ``kl``, ``d_kl`` (+ interval)."""
    one = single_prompt(table)
    per = table[table.policy.str.startswith("periodic")].sort_values("T", ascending=False)
    base = _row(table, "none")
    if per.empty or base is None:
        raise ValueError("read_periodic needs a 'none' row and at least one 'periodic_T*' row")
    parts = [HOW + "Each row refreshes every T tokens; smaller T = more teacher work. Lower KL and teacher-PPL are "
             "better; ΔKL is the paired difference to no refresh on the same prompts and seeds (below 0 = the "
             "refresh brought the student closer to the teacher). " + spread_sentence(table)]
    n = _n(table)
    parts.append("ΔKL by T: " + "; ".join(f"T={int(r.T)}: {interval_verdict(r.d_kl, r.d_kl_lo, r.d_kl_hi, one)}"
                                         for r in per.itertuples()) + ".")
    if "d_kl_forced" in table.columns:
        parts.append("Δkl_forced (teacher-forced on the teacher's reference, loops can't fool it) by T: "
                     + "; ".join(f"T={int(r['T'])}: {_fv(r, 'kl_forced', one, n)}" for _, r in per.iterrows()) + ".")
    ppl = [float(base.teacher_ppl)] + [float(v) for v in per.teacher_ppl]
    falls = all(b < a for a, b in zip(ppl, ppl[1:]))
    seq = " → ".join(fmt(v, 2) for v in ppl)
    blog = " → ".join(f"{v[0]}" for v in BLOG_PERIODIC.values())
    parts.append(f"Teacher-PPL from no refresh to the smallest T: {seq} — it "
                 f"{'falls steadily, as in' if falls else 'does not fall steadily, unlike'} {BLOG}, where PPL fell "
                 f"{blog} (no refresh, T = 256, 128, 64; +0.7 / +2.0 / +3.9 % latency).")
    return _join(parts)


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
        parts.append("Δkl_forced by τ: " + "; ".join(f"τ = {fmt(r.tau_bits, 2)}: {_fv(r, 'kl_forced', one, _n(table))}"
                                                   for _, r in ent.iterrows()) + ".")
    best = ent.loc[ent.d_kl.idxmin()]
    parts.append(f"The lowest ΔKL here is {best.policy}'s ({fmt(best.d_kl, 3, signed=True)}). {cap(BLOG)} "
                 f"found τ = 5.5 bits fired {BLOG_ENTROPY[5.5][0]} times per generation and reached PPL "
                 f"{BLOG_ENTROPY[5.5][1]:.2f} — as low as refreshing every 64 tokens ({BLOG_PERIODIC[64][0]:.2f}) for less "
                 "teacher work; higher τ (6.0, 6.5) fired less and lost most of the gain.")
    return _join(parts)


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
        parts.append("Δkl_forced vs no refresh: " + "; ".join(f"{r.policy}: {_fv(r, 'kl_forced', one, _n(table))}"
                                                           for _, r in meth.iterrows()) + ".")
    k, ppl, over = BLOG_SPECULATIVE
    parts.append(f"{cap(BLOG)} found speculative refresh (k = {k}) at PPL {ppl} with ~{over} % latency "
                 f"overhead against periodic T = 64 at {BLOG_PERIODIC[64][0]} with {BLOG_PERIODIC[64][1]} %: a little "
                 "quality for half the overhead.")
    return _join(parts)


def read_timing(table: pd.DataFrame) -> str:
    """``refresh_timing``: ``overhead_pct`` and its quartiles per policy; the ``none`` row is the noise floor."""
    base = _row(table, "none")
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
    return _join(parts)


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
        r = _row(table, cond, "condition")
        if r is not None:
            m = float(r["d_mde"]) if "d_mde" in r.index else None
            parts.append(f"{what}: ΔKL {interval_verdict(r.d_kl_vs_overfill, r.d_lo, r.d_hi, one, mde=m, n=_n(table))}.")
    parts.append(f"{cap(BLOG)} argues that a refresh re-anchors the student's state and lowers "
                 "KL(p_T‖q) for the tokens after it; a `refreshed` interval below 0 is that effect, measured with the "
                 "sampling noise removed.")
    return _join(parts)


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


# --- notebook 05: eviction -------------------------------------------------------------------------------------
def read_evict_matched(table: pd.DataFrame) -> str:
    """``evict_matched``: ``full``, ``confkv``, ablations and fixed-budget rows at matched memory."""
    one = single_prompt(table)
    full, ck = _row(table, "full"), _row(table, "confkv")
    if full is None or ck is None:
        raise ValueError("read_evict_matched needs rows 'full' and 'confkv'")
    parts = [HOW + "Every row decodes the same prompts with the same seeds. Lower teacher-PPL and lower KL to the "
             "full cache are better; Δ PPL vs full is the paired difference (0 = as good as keeping everything). "
             "Memory is matched: each fixed-budget family's budget was solved so its mean KV memory equals "
             "Conf-KV's (`memory vs target` ≈ 1). " + spread_sentence(table)]
    parts.append(f"Conf-KV keeps {fmt(float(ck.mean_mb) / float(full.mean_mb) * 100, 0)} % of the full cache's mean "
                 f"memory; its Δ PPL vs full: {interval_verdict(ck.d_teacher_ppl_vs_full, ck.d_teacher_ppl_vs_full_lo, ck.d_teacher_ppl_vs_full_hi, one)}.")
    fixed = table[table.matched_by == "solved budget"]
    if len(fixed):
        order = ", ".join(f"{r.policy} {fmt(r.teacher_ppl, 2)}" for r in fixed.sort_values("teacher_ppl").itertuples())
        beats = [r.policy for r in fixed.itertuples() if r.teacher_ppl > ck.teacher_ppl]
        parts.append(f"At the same memory, fixed budgets score (PPL, best first): {order}; Conf-KV "
                     f"({fmt(ck.teacher_ppl, 2)}) beats {len(beats)} of {len(fixed)}"
                     f"{' (' + ', '.join(beats) + ')' if beats else ''}.")
    sl = _row(table, "sliding")
    if sl is not None and sl.teacher_ppl > full.teacher_ppl:
        closed = (sl.teacher_ppl - ck.teacher_ppl) / (sl.teacher_ppl - full.teacher_ppl)
        parts.append(f"Conf-KV closes {fmt(100 * closed, 0)} % of the sliding-window → full-cache PPL gap here; "
                     f"{CONFKV} reports {CONFKV_GAP_CLOSED:.0%} for Conf-KV-L on GPT-2.")
    abl = {p: _row(table, p) for p in CONFKV_ABLATION}
    have = {p: float(r.teacher_ppl) for p, r in abl.items() if r is not None}
    if len(have) > 1:
        here = " > ".join(f"{p} {fmt(v, 2)}" for p, v in sorted(have.items(), key=lambda kv: -kv[1]))
        paper = " > ".join(f"{p} {CONFKV_ABLATION[p]}" for p in sorted(have, key=lambda p: -CONFKV_ABLATION[p]))
        same = sorted(have, key=have.get) == sorted(have, key=CONFKV_ABLATION.get)
        parts.append(f"Same schedule, other ranking (the paper's matched-rate ablation): here {here}; the paper: {paper}"
                     f" — {'the same order' if same else 'a different order'}.")
    off = table[(table.mem_vs_target - 1).abs() > 0.1]
    off = off[~off.policy.isin(["full"])]
    if len(off):
        parts.append("Not matched within 10 %: " + ", ".join(f"{r.policy} (×{fmt(r.mem_vs_target, 2)})"
                                                             for r in off.itertuples()) + " — compare those with care.")
    return _join(parts)


def read_needle(table: pd.DataFrame) -> str:
    """The long needle table (``policy``, ``length``, ``depth``, ``accuracy``)."""
    acc = table.groupby("policy", sort=False)["accuracy"].mean()
    full = acc.get("full", float("nan"))
    n = int(table.groupby("policy")["n"].sum().max()) if "n" in table else len(table)
    parts = [HOW + "1.00 = every hidden passkey retrieved exactly; higher is better. Depth 0 hides the key at the "
             f"start of the haystack (oldest entries), 1 at the end. {plural(n, 'case')} per policy"
             f"{' — a handful: one miss moves a cell a lot' if n < 10 else ''}."]
    if full < 1:
        parts.append(f"The full cache itself retrieves only {fmt(full, 2)}: misses here are partly the model's, not "
                     "the eviction policy's.")
    else:
        parts.append("The full cache retrieves every key, so each miss below is the eviction policy's.")
    rest = acc.drop("full", errors="ignore").sort_values(ascending=False)
    parts.append("Mean accuracy: " + ", ".join(f"{p} {fmt(v, 2)}" for p, v in rest.items()) + ".")
    d0 = table[table.depth == table.depth.min()]
    deep = d0.groupby("policy", sort=False)["accuracy"].mean()
    lost = [p for p, v in deep.drop("full", errors="ignore").items() if v == 0]
    if lost and deep.get("full", 0) == 1:
        parts.append(f"At depth {fmt(float(table.depth.min()), 2)} (the oldest entries), where the full cache always "
                     f"retrieves the key, {', '.join(lost)} never do: they evicted it.")
    parts.append(f"{cap(CONFKV)} reports that Conf-KV preserves needle-in-a-haystack retrieval at matched memory; "
                 f"{OPENVINO} keeps a never-evicted start area and evicts whole blocks by accumulated attention.")
    return _join(parts)


def read_survivors(frame: pd.DataFrame, live: list[int], prompt_len: int) -> str:
    """After eviction: how many of the prompt's ledger rows are still in the cache, and which."""
    alive = sorted(i for i in live if i < prompt_len)
    total = len(live)
    if not alive:
        what = "none of the prompt's entries survive: the cache holds only generated tokens"
    else:
        first = [i for i in alive if i < 8]
        what = (f"{len(alive)} of the prompt's {prompt_len} entries survive ({fmt(100 * len(alive) / prompt_len, 0)} %)"
                f"{f', {len(first)} of them among the first 8 (the attention sinks)' if first else ''}")
    return (HOW + f"Each column is a cache snapshot; a line joins a slot to the ledger row it holds. At the end the "
            f"cache holds {plural(total, 'entry', 'entries')}; {what}. Survivors keep their RoPE positions (lower panel).")


def read_pareto(summary: pd.DataFrame, x: str, y: str, mask) -> str:
    """Which configs are Pareto-optimal in (x cost, y quality), both lower-is-better."""
    front = summary[list(mask)].sort_values(x)
    return (HOW + f"Left panel: down and left is better (lower `{y}` for less `{x}`); the right panel reads the same "
            f"way for teacher-PPL against in-run teacher time. Circled in the left panel: the Pareto front, configs no other "
            f"config beats on both: {', '.join(front.policy)}. Every other point is dominated. "
            + spread_sentence(summary.assign(n_prompts=summary.get("n_runs", 1))))


__all__ = ["read_baselines", "read_periodic", "read_entropy", "read_methods", "read_timing", "read_forced",
           "costs_frame", "read_trace", "read_provenance", "read_evict_matched", "read_needle", "read_survivors",
           "read_pareto", "smoke_banner", "interval_verdict", "spread_sentence"]


def read_ledger(ledger: pd.DataFrame, prompt_len: int, mode: str = "overfill") -> str:
    """The cache ledger of one decode (``KVCache.to_frame`` + a ``text`` column): prompt rows, y₁'s writer."""
    prompt = ledger[ledger.step == -1]
    gen = ledger[ledger.step >= 0]
    writers = ", ".join(f"{w} ×{n}" for w, n in prompt.writer.value_counts().items())
    parts = [HOW + f"One row per cache entry: token, RoPE position, the model that computed its K/V (`writer`) and "
             f"the decode step that wrote it. The first {prompt_len} rows are the prompt, written in one prefill "
             f"before any token is generated, hence `step = -1` ({writers})."]
    special = [t for t in prompt.get("text", pd.Series(dtype=str)) if t.startswith("<|") and t.endswith("|>")]
    if special:
        head = "".join(prompt.text.head(3)).replace("\n", "⏎")
        tail = "".join(prompt.text.tail(3)).replace("\n", "⏎")
        system = " (with a default system message first)" if "system" in "".join(prompt.text.head(4)) else ""
        parts.append(f"The prompt starts with `{head}` and ends with `{tail}`: the tokenizer's chat template wraps your "
                     f"text in role markers{system} — {plural(len(special), 'special token')} such as `{special[0]}` — so "
                     "the model answers as the assistant. They are real tokens in the cache, written like any other.")
    if len(gen):
        y1 = gen.iloc[0]
        if mode == "overfill":
            parts.append(f"The first generated entry (y₁, step {int(y1.step)}) shows writer **{y1.writer}**: the teacher's "
                         "prefill logits *chose* y₁, but y₁'s K/V is computed when the decoder reads it back at the next "
                         "step — the cache lags the emitted token by one entry — and in OverFill that decoder is the "
                         "student.")
        n_s = int((gen.writer == "student").sum())
        parts.append(f"Of the {len(gen)} generated entries, {n_s} are student-written.")
    return _join(parts)


def read_steps(records) -> str:
    """One decode's step records: how unsure the decoder was, step by step."""
    recs = list(records)
    if not recs:
        return HOW + "No steps were decoded."
    import statistics

    h = [r.entropy_bits for r in recs]
    p1 = [r.top1_prob for r in recs]
    unsure = [r.step for r in recs if r.top1_prob < 0.5]
    by = ", ".join(f"{w} ×{n}" for w, n in pd.Series([r.source for r in recs]).value_counts().items())
    return (HOW + "`H` is the entropy of the next-token distribution in bits (0 = certain; high = many plausible "
            "tokens), `p1` the probability of the most likely token, `cache` the entries after the step, `by` the "
            f"model whose logits chose the token. Over {plural(len(recs), 'step')}: median H = "
            f"{fmt(statistics.median(h), 2)} bits, median p1 = {fmt(statistics.median(p1), 2)}; "
            f"{plural(len(unsure), 'step')} had p1 < 0.5 (the decoder was unsure there). Tokens chosen by: {by}.")


def read_confidence(records, gamma: float) -> str:
    """A Conf-KV run's records: how often it was confident (tight budget) and what the cache did."""
    recs = [r for r in records if r.signals.get("confidence") is not None]   # signals: a read-only mapping
    if not recs:
        return HOW + "No step carried a Conf-KV confidence (no eviction policy ran)."
    conf = [r for r in recs if r.signals.get("confidence") >= gamma]
    cut = [r for r in recs if r.evicted]
    lens = [r.cache_len for r in records]
    return (HOW + f"The upper line is Conf-KV's confidence per step (higher = surer), γ = {fmt(gamma, 2)} the dashed "
            "line: at or above it the tight budget applies, below it the loose one; the lower panel is the cache "
            f"length. {len(conf)} of {len(recs)} steps were confident; the cache was cut at "
            f"{plural(len(cut), 'step')}, and its length ranged {min(lens)}–{max(lens)} entries. "
            "Conf-KV's premise (from the paper): a confident step needs less context, so the cache can shrink "
            "there and grow back while the model is unsure — a sawtooth.")


def read_sawtooth(saw: pd.DataFrame) -> str:
    """``evict_sawtooth``: per-policy cache length per step on one prompt."""
    g = saw.groupby("policy", sort=False)["cache_len"]
    stats = ", ".join(f"{p} {int(lo)}–{int(hi)}" for p, (lo, hi) in g.agg(["min", "max"]).iterrows())
    ck = saw[saw.policy == "confkv"]
    ups = int((ck.cache_len.diff() > 0).sum()) if len(ck) else 0
    downs = int((ck.cache_len.diff() < 0).sum()) if len(ck) else 0
    return (HOW + f"Cache length per step on one prompt (lower = less memory; quality is in the table below). "
            f"Range per policy: {stats}. Conf-KV's cache grew at {plural(ups, 'step')} and was cut at "
            f"{plural(downs, 'step')}: {'a sawtooth' if ups and downs else 'no sawtooth on this run'}.")


def read_phase_summary(ps: pd.DataFrame) -> str:
    """``mcsim``'s phase summary (index = phase; ``mean_entropy``, ``mean_mcvar``, ``frac_*_fire``)."""
    hi_var = ps.mean_mcvar.idxmax()
    hi_ent = ps.mean_entropy.nlargest(2).index.tolist()
    ratio = float(ps.mean_mcvar.max() / max(ps.mean_mcvar.drop(hi_var).max(), 1e-12))
    return (HOW + "One row per phase of the simulation: mean entropy (bits) and mean MC variance U(t) over its "
            "steps, and the share of its steps where each gate fired. A good refresh signal is high in the "
            f"epistemic drift only. Entropy is highest in {hi_ent[0]} and {hi_ent[1]} "
            f"({fmt(ps.mean_entropy[hi_ent[0]], 2)} vs {fmt(ps.mean_entropy[hi_ent[1]], 2)} bits): it cannot tell them "
            f"apart. MC variance is highest in {hi_var}, {fmt(ratio, 0)}× any other phase — in the blog's "
            "simulation it separates drift from ambiguity by construction; the real student below is the test.")


def read_firings(firings: pd.DataFrame) -> str:
    """Replayed MC-gate fires per prompt and signal, with the extra student passes they cost."""
    g = firings.groupby("signal", sort=False)
    fires = g["fires"].apply(lambda s: sum(len(f) for f in s))
    extra = g["extra_student_passes"].sum()
    decode = g["decode_passes"].sum()
    per = "; ".join(f"{sig}: {plural(int(fires[sig]), 'fire')}, {int(extra[sig])} extra student passes "
                    f"({fmt(100 * extra[sig] / max(1, decode[sig]), 0)} % on top of {int(decode[sig])} decode passes)"
                    for sig in fires.index)
    return (HOW + f"Where each gate would refresh on the stored traces ({plural(firings.prompt.nunique(), 'prompt')}), "
            f"and what its probes cost: {per}. Fewer fires at the same cost is not better by itself — a fire is "
            "useful only where refreshing lowers the KL to the teacher afterwards (notebook 02 measures that).")


def read_mc_trace(trace: pd.DataFrame, fires: dict) -> str:
    """One prompt's MC trace (``step``, ``entropy``) and each gate's fire steps: do fires sit where the
    student is unsure (entropy above its median on this prompt)?"""
    med = float(trace.entropy.median())
    ent = dict(zip(trace.step, trace.entropy))
    parts = []
    for sig, steps in fires.items():
        hi = sum(1 for t in steps if ent.get(t, -1) > med)
        parts.append(f"{sig}: {plural(len(steps), 'fire')}" + (f", {hi} at above-median entropy" if steps else ""))
    return (HOW + f"Each panel is one signal over the decode steps of this prompt (higher = more uncertain); dashed "
            f"lines mark where its gate would fire. The median entropy here is {fmt(med, 2)} nats. "
            + "; ".join(parts) + ". A signal that fires only where entropy is high adds nothing over the entropy gate; "
            "one that fires elsewhere is either seeing epistemic drift or noise — the correlation table above says which.")


def read_tick(frame: pd.DataFrame, before: list[int], after: list[int], positions_after: list[int]) -> str:
    """One surgery tick: the ledger (``KVCache.ledger_frame``), the live maps before and after it, and the
    cache's per-slot positions after it (``KVCache.positions``), checked against the ledger rows'."""
    gone = sorted(set(before) - set(after))
    new = sorted(set(after) - set(before))
    pos = dict(zip(frame.row, frame.position))
    kept = [r for r in after if r in set(before)]
    moved = sum(1 for r, p in zip(after, positions_after) if r in set(before) and p != pos[r])
    shifted = sum(1 for i, r in enumerate(kept) if before.index(r) != after.index(r))
    origins = frame[frame.row.isin(new)].origin.value_counts()
    what = ", ".join(f"{n} by `{o}`" for o, n in origins.items())
    return (HOW + f"Each column of the picture is the cache before / after the tick; a line joins a slot to the ledger "
            f"row it holds. The tick retired {plural(len(gone), 'row')} and wrote {plural(len(new), 'row')} ({what}); "
            f"the cache went from {len(before)} to {len(after)} entries. {plural(shifted, 'surviving entry', 'surviving entries')} "
            f"changed slot, {moved} changed position"
            + (": positions belong to the ledger row (no re-rotation), so the model still sees each survivor at its "
               "original distance" if moved == 0 else " (re-rotated)") + f" — from position {pos[after[0]] if after else 0} "
            f"to {max(pos[r] for r in after) if after else 0} now{', with gaps where rows were deleted' if gone else ''}.")
