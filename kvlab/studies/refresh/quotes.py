"""What README.md and docs/*.md quote from the refresh study (``kvlab.viz.docs`` renders it): the periodic,
entropy, methods, teacher-forced and calibration tables, and the key results (each refresh − no refresh, and
the student reading its own prompt cache − the teacher's).
"""
from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pandas as pd

from kvlab.harness.quotes import View, as_number, cell, mde_note, pick, quote, read
from kvlab.harness.tableview import fmt


VIEWS = {
    "refresh_periodic": View("refresh_periodic", [
        ("policy", "policy"), ("refreshes", "refreshes"), ("teacher tokens", "teacher_tokens"),
        ("teacher-forced KL ↓", "kl_forced"), ("Δ forced KL vs none (95 % CI)", ("d_kl_forced", "d_kl_forced_lo",
                                                                                 "d_kl_forced_hi")),
        ("MDE", "d_kl_forced_mde"), ("teacher-PPL ↓", ("teacher_ppl", "teacher_ppl_std")), ("KL ↓", ("kl", "kl_std")),
        ("ΔKL vs none (95 % CI)", ("d_kl", "d_kl_lo", "d_kl_hi")), ("repeat@3 ↓", "repeat3")]),
    "refresh_entropy": View("refresh_entropy", [
        ("policy", "policy"), ("τ (bits)", "tau_bits"), ("refreshes / 1k", "refreshes_per_1k"),
        ("teacher-forced KL ↓", "kl_forced"), ("Δ forced KL vs none (95 % CI)", ("d_kl_forced", "d_kl_forced_lo",
                                                                                 "d_kl_forced_hi")),
        ("teacher-PPL ↓", ("teacher_ppl", "teacher_ppl_std")), ("KL ↓", ("kl", "kl_std")),
        ("ΔKL vs none (95 % CI)", ("d_kl", "d_kl_lo", "d_kl_hi")), ("repeat@3 ↓", "repeat3")]),
    "refresh_methods": View("refresh_methods", [
        ("policy", "policy"), ("refresh_next", ("text", "refresh_next")), ("refreshes", "refreshes"),
        ("teacher tokens", "teacher_tokens"), ("probe tokens", "probe_tokens"),
        ("teacher-forced KL ↓", "kl_forced"), ("Δ forced KL vs none (95 % CI)", ("d_kl_forced", "d_kl_forced_lo",
                                                                                 "d_kl_forced_hi")),
        ("teacher-PPL ↓", ("teacher_ppl", "teacher_ppl_std")), ("KL ↓", ("kl", "kl_std")),
        ("ΔKL vs none (95 % CI)", ("d_kl", "d_kl_lo", "d_kl_hi"))]),
    "refresh_forced": View("refresh_forced", [
        ("cache written by", "condition"), ("KL(p_T‖q_S) ↓", ("kl", "kl_std")),
        ("Δ vs OverFill's cache (95 % CI)", ("d_kl_vs_overfill", "d_lo", "d_hi")), ("prompts", "n_prompts")]),
    "refresh_calibration": View("refresh_calibration", [
        ("student steps", "n_steps"), ("entropy p90 (bits)", "entropy_p90"), ("p95", "entropy_p95"),
        ("p99", "entropy_p99"), ("KL p90 (nats)", "kl_p90")]),
    # kvlab.studies.refresh.long: the blog's regime (long generations, a few refreshes per 1,000 tokens)
    "refresh_long": View("refresh_long", [
        ("policy", "policy"), ("knob", ("text", "knob")), ("refreshes / 1k", "refreshes_per_1k"),
        ("teacher tokens / token", "teacher_tokens_per_token"),
        ("Δ teacher-PPL vs none (95 % CI)", ("d_teacher_ppl", "d_teacher_ppl_lo", "d_teacher_ppl_hi")),
        ("MDE", "d_teacher_ppl_mde"),
        ("Δ tail log-prob (95 % CI)", ("d_tail_logprob", "d_tail_logprob_lo", "d_tail_logprob_hi")),
        ("Δ repeat@3 (95 % CI)", ("d_repeat3", "d_repeat3_lo", "d_repeat3_hi")),
        ("Δ forced KL (95 % CI)", ("d_kl_forced", "d_kl_forced_lo", "d_kl_forced_hi")),
        ("overhead %", "latency_overhead"), ("prompts", "n_prompts")]),
    "refresh_equal_cost": View("refresh_equal_cost", [
        ("tier / 1k", "tier_per_1k"), ("policy", "policy"), ("knob", ("text", "knob")),
        ("achieved / 1k", "refreshes_per_1k"), ("teacher tokens / token", "teacher_tokens_per_token"),
        ("Δ teacher-PPL (95 % CI)", ("d_teacher_ppl", "d_teacher_ppl_lo", "d_teacher_ppl_hi")),
        ("Δ tail log-prob (95 % CI)", ("d_tail_logprob", "d_tail_logprob_lo", "d_tail_logprob_hi")),
        ("Δ forced KL (95 % CI)", ("d_kl_forced", "d_kl_forced_lo", "d_kl_forced_hi"))]),
}

FORCED_COSTS = [("refreshes (forced path)", "refreshes_forced"), ("teacher tokens (forced path)", "teacher_tokens_forced")]


def _with_forced_costs(view: View):
    """``view`` with the forced path's own costs (``refreshes_forced``, ``teacher_tokens_forced``; tables since
    issue 37) right after its ``kl_forced`` columns when its table has them — the cost of the Δ it shows."""
    def render(figures: Path) -> str:
        if "refreshes_forced" not in read(figures, view.csv).columns:
            return view.render(figures)
        cols = list(view.columns)
        at = next(i for i, (_, spec) in enumerate(cols) if spec == "kl_forced")
        return replace(view, columns=cols[:at] + FORCED_COSTS + cols[at:]).render(figures)

    render.__doc__ = f"The {view.csv} view, with the forced path's costs when the table has them."
    return render


for _name in ("refresh_entropy", "refresh_methods"):        # the gated policies: their forced schedule differs
    VIEWS[_name] = _with_forced_costs(VIEWS[_name])


def _long_rows(figures: Path) -> list[tuple[str, str, str]]:
    """The blog's regime (``refresh_long``, when its job has run): each refresh row − no refresh on the free-running
    teacher-PPL and the tail log-prob, with the row's refresh rate; cheap rates (≤ 3 per 1,000 tokens) first."""
    if not (Path(figures) / "refresh_long.csv").exists():
        return []
    t = read(figures, "refresh_long")
    t = t[t["policy"].astype(str) != "no_refresh"].copy()
    t["_rate"] = pd.to_numeric(t["refreshes_per_1k"], errors="coerce")
    t = t.sort_values("_rate")
    n, tokens = int(as_number(t["n_prompts"].iloc[0])), int(as_number(t["tokens"].iloc[0]))
    parts = [f"{r['policy']} ({fmt(r['_rate'], 1)}/1k): PPL Δ "
             + cell(r, ("d_teacher_ppl", "d_teacher_ppl_lo", "d_teacher_ppl_hi"), 2) + mde_note(r, "d_teacher_ppl_mde")
             + ", tail Δ " + cell(r, ("d_tail_logprob", "d_tail_logprob_lo", "d_tail_logprob_hi"))
             + mde_note(r, "d_tail_logprob_mde") for _, r in t.iterrows()]
    rows = [(f"Long generation ({tokens} tokens, n = {n}): each refresh − no refresh (OverFill), free-running "
             "teacher-PPL and tail log-prob of the last 50 tokens (higher is better)", "; ".join(parts), "refresh_long")]
    return rows


def key_results(figures: Path) -> list[tuple[str, str, str]]:
    """README's key results: periodic refresh per T and the gated methods at 64 tokens (each − no refresh on
    ``kl_forced``, with interval and MDE; one row per table), the teacher-forced cache swap, and the blog's long
    regime (:func:`_long_rows`) when its table exists."""
    per = read(figures, "refresh_periodic")
    per = per[per["policy"].astype(str) != "none"]
    parts = [f"T = {fmt(as_number(r['T']), 0)}: Δ " + cell(r, ("d_kl_forced", "d_kl_forced_lo", "d_kl_forced_hi"))
             + mde_note(r) for _, r in per.sort_values("T").iterrows()]
    rows = [("Periodic refresh every T tokens − no refresh (OverFill, 64 tokens), teacher-forced KL",
             "; ".join(parts), "refresh_periodic")]
    met = read(figures, "refresh_methods")
    parts = [f"{pol}: Δ " + cell(r, ("d_kl_forced", "d_kl_forced_lo", "d_kl_forced_hi")) + mde_note(r)
             for pol in met["policy"].astype(str) if pol.startswith(("speculative", "probe_kl", "entropy"))
             for r in [pick(met, pol, "refresh_methods")]]
    if parts:
        rows.append(("Gated refresh − no refresh (OverFill, 64 tokens), teacher-forced KL", "; ".join(parts),
                     "refresh_methods"))
    rows.append(("Student reading its own prompt cache − reading the teacher's (same tokens, teacher-forced)",
                 "ΔKL " + quote(figures, "refresh_forced", "student", ("d_kl_vs_overfill", "d_lo", "d_hi")),
                 "refresh_forced"))
    return rows + _long_rows(figures)


__all__ = ["VIEWS", "key_results"]
