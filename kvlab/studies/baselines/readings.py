""""How to read this" texts of the baselines study (notebooks 01 and 08): the Teacher / OverFill / Student
(/ Standalone) table and the regimes table, each against what the blog found for the same rows. Computed from
the table, so a reading stays true when the numbers change.
"""
from __future__ import annotations

import math

import pandas as pd

from kvlab.harness.prose import BLOG, BLOG_SETTING, HOW, cap, join, n_of, paired_verdict, row_of, spread_sentence
from kvlab.harness.tableview import fmt, single_prompt

# --- what the blog reports (quoted from the source) -------------------------------------------------------------
BLOG_BASELINES = {"teacher": {"teacher_ppl": 1.64, "repeat3": 0.032}, "overfill": {"teacher_ppl": 1.88, "repeat3": 0.072},
                  "student": {"teacher_ppl": 2.35, "repeat3": 0.028}}

LOOPS = ("Why teacher-PPL and on-path KL can favour a looping decoder: both score each decoder on the text it wrote "
         "itself. Once a phrase has appeared, the teacher predicts its repetition with high confidence (copying from "
         "context is what attention does best), so a decoder stuck in a loop writes text the teacher finds *easy*: "
         "teacher-PPL drops and, on those confident steps, KL(p_T‖q) is small too. `kl_forced` / `nll_forced` score "
         "every decoder on the same reference text (the teacher's own sampled continuation), teacher-forced, so a "
         "decoder cannot choose easy text; repeat@3 and distinct-2 show the loops directly.")


def read_baselines(table: pd.DataFrame) -> str:
    """Teacher / OverFill / Student (/ Standalone) rows (``policy``, ``teacher_ppl``, ``kl``, ``repeat3``,
    ``*_std``, ``n_prompts``; with ``kl_forced`` and the paired ``d_*`` columns when the table has them)."""
    r = {p: row_of(table, p) for p in ("teacher", "overfill", "student")}
    if any(v is None for v in r.values()):
        raise ValueError("read_baselines needs rows 'teacher', 'overfill' and 'student' in column 'policy'")
    alone = row_of(table, "standalone")
    T, O, S = (float(r[p].teacher_ppl) for p in ("teacher", "overfill", "student"))
    one = single_prompt(table)
    n = n_of(table)
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
                v = paired_verdict(row, "kl_forced", one, n, lower_is_better=False)     # Δ > 0: the baseline is further off
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
    return join(text)


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
        vs = [paired_verdict(row, m, n == 1, n, lower_is_better=False).replace(": better (", ": OverFill better (")
              .replace(": worse (", ": OverFill worse (") for m in ("kl_forced", "teacher_ppl")]
        parts.append(f"{r.regime}, {r.baseline}: Δkl_forced {vs[0]}; Δteacher-PPL {vs[1]}.")
    return join(parts)


__all__ = ["read_baselines", "read_regimes"]
