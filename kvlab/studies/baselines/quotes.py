"""What README.md and docs/*.md quote from the baselines study (``kvlab.viz.docs`` renders it): the baselines
table and the key results of ``baselines_regimes`` (each baseline − OverFill, teacher-forced KL, per regime).
"""
from __future__ import annotations

from pathlib import Path

from kvlab.harness.quotes import View, as_number, cell, mde_note, read


VIEWS = {
    "baselines": View("baselines", [
        ("policy", "policy"), ("teacher-PPL ↓", ("teacher_ppl", "teacher_ppl_std")),
        ("KL(p_T‖q) ↓", ("kl", "kl_std")), ("teacher-forced KL, steps 2..N ↓", ("kl_forced", "kl_forced_std")),
        ("step 1", "kl_forced_step1"),
        ("Δ forced KL vs OverFill (95 % CI)", ("d_kl_forced", "d_kl_forced_lo", "d_kl_forced_hi")),
        ("MDE", "d_kl_forced_mde"), ("repeat@3 ↓", ("repeat3", "repeat3_std")), ("distinct-2 ↑", "distinct2"),
        ("prompts", "n_prompts")]),
}


def key_results(figures: Path) -> list[tuple[str, str, str]]:
    """README's key results: per regime, each baseline − OverFill on ``kl_forced`` with its paired
    interval and MDE."""
    rows = []
    reg = read(figures, "baselines_regimes")
    names = {"student": "the student alone (the blog's baseline)",
             "standalone": "a separately trained student (the paper's baseline)"}
    for _, r in reg.iterrows():
        regime = str(r["regime"]).split(",")[0]
        free = ""
        if {"d_kl", "d_teacher_ppl"} <= set(reg.columns):       # the free-running metrics, same sign: + = OverFill better
            free = ("; free-running: on-path KL Δ " + cell(r, ("d_kl", "d_kl_lo", "d_kl_hi"))
                    + ", teacher-PPL Δ " + cell(r, ("d_teacher_ppl", "d_teacher_ppl_lo", "d_teacher_ppl_hi"), 2))
        rows.append((f"{regime} ({int(as_number(r['tokens']))} tokens): {names.get(str(r['baseline']), r['baseline'])} "
                     "− OverFill, teacher-forced KL (steps 2..N)",
                     f"{cell(r, 'kl_forced_base')} vs {cell(r, 'kl_forced_OF')}; Δ "
                     + cell(r, ("d_kl_forced", "d_kl_forced_lo", "d_kl_forced_hi")) + mde_note(r)
                     + f", n = {int(as_number(r['n_prompts']))}" + free, "baselines_regimes"))
    return rows


__all__ = ["VIEWS", "key_results"]
