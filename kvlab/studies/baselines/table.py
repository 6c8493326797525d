"""The blog's Baselines table (no refresh), with both definitions of the student baseline.

Rows, on the same prompts with the same per-prompt seeds:

* ``teacher``    — the teacher prefills and decodes;
* ``overfill``   — the teacher prefills, the OverFill decoder decodes;
* ``student``    — the *same* OverFill decoder alone, on its own prefill: the blog's Student row (the
  blog's student, ``overfill-Llama-3.2-3B-Instruct-pruned-h0.45-i0.45``, is OverFill's trained decoder);
* ``standalone`` — a separately trained student of the same shape, alone: the OverFill paper's
  equal-budget baseline (absent when no such student is given, e.g. for the untrained ``pruned`` pair).

Columns: the blog's teacher-PPL, on-path KL and repeat@3; the loop-proof teacher-forced ``kl_forced`` /
``nll_forced`` on a fixed reference continuation (:mod:`kvlab.harness.forced`) and ``distinct2``; and
paired differences to ``overfill`` with bootstrap 95 % intervals and the minimum detectable difference.
"""
from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pandas as pd

from kvlab.decode import DecodeConfig
from kvlab.harness.experiment import RunSpec, paired_bootstrap, run_policies, summarize, write_table
from kvlab.store import RunStore

POLICIES = {
    "teacher": DecodeConfig(mode="teacher"),
    "overfill": DecodeConfig(mode="overfill"),
    "student": DecodeConfig(mode="student"),
    "standalone": DecodeConfig(mode="student"),
}
FORCED = ["kl_forced", "nll_forced", "kl_forced_step1", "nll_forced_step1", "distinct2"]
PAIRED = ("kl_forced", "kl", "teacher_ppl")
# Quality columns: deterministic for fixed seeds on one machine (tracked in figures/).
COLUMNS = ["policy", "tokens", "teacher_ppl", "kl", "kl_all", "repeat3", "distinct2", "kl_forced", "nll_forced",
           "kl_forced_step1", "nll_forced_step1", "d_kl_forced", "d_kl_forced_lo", "d_kl_forced_hi", "d_kl_forced_mde", "d_kl", "d_kl_lo", "d_kl_hi",
           "d_kl_mde", "d_teacher_ppl", "d_teacher_ppl_lo", "d_teacher_ppl_hi", "tail_logprob", "chars",
           "teacher_ppl_std", "kl_std", "repeat3_std", "kl_forced_std", "n_prompts"]
# Timing columns: machine- and load-dependent, written to baselines_timing (not tracked).
TIMING_COLUMNS = ["policy", "ttft_s", "tps", "tokens", "total_s", "e2e_tps", "total_s_std", "n_prompts"]
TIME_RUN_COLUMNS = ["ttft_s", "tps", "total_s", "e2e_tps"]
TIMING_NOTE = ("Times of the stored runs, each timed when it was run (mean over prompts, std over prompts); runs of "
               "different policies were not timed side by side, so read ratios between rows with care. "
               "Machine-dependent.\n\n")
ROWS_NOTE = ("Rows: `student` = the OverFill decoder alone on its own prefill (the blog's Student row); "
             "`standalone` = a separately trained student of the same shape, alone (the OverFill paper's "
             "equal-budget baseline). `d_*`: paired mean difference row − `overfill` over the same prompts "
             "and seeds, bootstrap 95 % interval (`_lo`, `_hi`); positive = worse than OverFill for KL/PPL.")


def baselines(teacher, student, spec: RunSpec, store: RunStore, progress: bool = True,
              rebuild_student_cache: bool = False, alone=None, forced: bool = True) -> tuple[pd.DataFrame, pd.DataFrame]:
    """(table, per-run rows). ``student`` decodes the ``overfill`` and ``student`` rows; ``alone`` (a
    separately trained student, e.g. ``standalone``) the ``standalone`` row, left out when ``alone``
    is None or ``student`` itself. ``rebuild_student_cache``: OverFill with a KV-incompatible
    student (it prefills its own cache from the text). ``forced=False`` skips the teacher-forced
    columns (only stored free-running runs are read)."""
    policies = {k: v for k, v in POLICIES.items() if k != "standalone"}
    if rebuild_student_cache:
        policies["overfill"] = replace(policies["overfill"], rebuild_student_cache=True)
    frames = [run_policies(teacher, student, spec, policies, store, progress)]
    extra = [_forced(teacher, student, spec, policies, store, progress)] if forced else []
    if alone is not None and alone is not student:
        solo = {"standalone": POLICIES["standalone"]}
        frames.append(run_policies(teacher, alone, spec, solo, store, progress))
        extra += [_forced(teacher, alone, spec, solo, store, progress)] if forced else []
    per_run = pd.concat(frames, ignore_index=True)
    if extra:
        per_run = per_run.merge(pd.concat(extra, ignore_index=True), on=["policy", "prompt_idx"], how="left")
    per_run = per_run.sort_values(["prompt_idx"], kind="stable").reset_index(drop=True)
    return baselines_table(per_run), per_run


def _forced(teacher, student, spec, policies, store, progress):
    from kvlab.harness.forced import forced_columns

    fast = {k: v for k, v in policies.items() if not v.rebuild_student_cache}
    return forced_columns(teacher, student, spec, fast, store, progress=False)


def baselines_table(per_run: pd.DataFrame) -> pd.DataFrame:
    """The table from per-run rows (``policy`` in :data:`POLICIES`, one row per run): quality and timing
    columns (:func:`write_baselines` writes them to separate files), paired differences to ``overfill``."""
    from kvlab.core.metrics import add_mde

    table = summarize(per_run, order=list(POLICIES))
    g = per_run.groupby("policy", sort=False)
    for m in FORCED:
        if m in per_run:
            table[m] = table.policy.map(g[m].mean())
    if "kl_forced" in per_run:
        table["kl_forced_std"] = table.policy.map(g["kl_forced"].std(ddof=1).fillna(0.0))
    metrics = tuple(m for m in PAIRED if m in per_run)
    if "overfill" in set(per_run.policy):
        pb = add_mde(paired_bootstrap(per_run, "overfill", metrics), per_run, "overfill", metrics)
        table = table.merge(pb.drop(columns=[c for c in pb if c.endswith("_ci")]), on="policy", how="left")
    return table.reindex(columns=list(dict.fromkeys(COLUMNS + TIMING_COLUMNS)))


def baselines_notes() -> list[str]:
    from kvlab.core.metrics import KL_ALL_NOTE, KL_NOTE, MDE_NOTE
    from kvlab.harness.forced import DISTINCT_NOTE, FORCED_SCORE_NOTE

    return [ROWS_NOTE, KL_NOTE, KL_ALL_NOTE, FORCED_SCORE_NOTE, DISTINCT_NOTE, MDE_NOTE]


def write_baselines(table: pd.DataFrame, per_run: pd.DataFrame, out: Path, name: str = "baselines") -> list[Path]:
    """``<name>`` and ``<name>_runs`` hold quality only (they do not change when the same runs are
    timed again); ``<name>_timing`` holds the machine-dependent times."""
    paths = write_table(table[COLUMNS], out, name, notes=baselines_notes())
    paths += write_table(per_run.drop(columns=[c for c in TIME_RUN_COLUMNS if c in per_run]), out, f"{name}_runs")
    paths += write_table(table[TIMING_COLUMNS], out, f"{name}_timing")
    md = Path(out) / f"{name}_timing.md"
    md.write_text(TIMING_NOTE + md.read_text())
    return paths


def regimes_table(tables: dict[str, pd.DataFrame]) -> pd.DataFrame:
    """OverFill vs each baseline, side by side per prompt set (``tables``: regime name → baselines table):
    one row per (regime, baseline) with the paired ``kl_forced`` / ``kl`` / teacher-PPL differences
    baseline − overfill (positive: OverFill better), and both rows' step-1 KL (``kl_forced_step1_*``; the
    paired scores average steps 2..N) when the tables have it."""
    rows = []
    for regime, t in tables.items():
        t = t.set_index("policy")
        for b in ("student", "standalone"):
            if b not in t.index:
                continue
            r = t.loc[b]
            rows.append({"regime": regime, "baseline": b, "n_prompts": int(r.n_prompts), "tokens": int(r.tokens),
                         "kl_forced_OF": t.loc["overfill", "kl_forced"], "kl_forced_base": r.kl_forced,
                         **{c: r[c] for c in ("d_kl_forced", "d_kl_forced_lo", "d_kl_forced_hi", "d_kl_forced_mde",
                                              "d_kl", "d_kl_lo", "d_kl_hi", "d_teacher_ppl", "d_teacher_ppl_lo",
                                              "d_teacher_ppl_hi")},
                         "repeat3_OF": t.loc["overfill", "repeat3"], "repeat3_base": r.repeat3,
                         **({"kl_forced_step1_OF": t.loc["overfill", "kl_forced_step1"],
                             "kl_forced_step1_base": r.kl_forced_step1} if "kl_forced_step1" in t.columns else {})})
    return pd.DataFrame(rows)
