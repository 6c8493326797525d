"""The blog's Baselines table (no refresh): Teacher / OverFill / Student on the same prompts."""
from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pandas as pd

from kvlab.decode import DecodeConfig
from .experiment import RunSpec, run_policies, summarize, write_table
from kvlab.store import RunStore

POLICIES = {
    "teacher": DecodeConfig(mode="teacher"),
    "overfill": DecodeConfig(mode="overfill"),
    "student": DecodeConfig(mode="student"),
}
# Quality columns: deterministic for fixed seeds on one machine (tracked in figures/).
COLUMNS = ["policy", "tokens", "teacher_ppl", "kl", "kl_all", "repeat3", "tail_logprob", "chars", "teacher_ppl_std",
           "kl_std", "repeat3_std", "n_prompts"]
# Timing columns: machine- and load-dependent, written to baselines_timing (not tracked).
TIMING_COLUMNS = ["policy", "ttft_s", "tps", "tokens", "total_s", "e2e_tps", "total_s_std", "n_prompts"]
TIME_RUN_COLUMNS = ["ttft_s", "tps", "total_s", "e2e_tps"]
TIMING_NOTE = ("Times of the stored runs, each timed when it was run (mean over prompts, std over prompts); runs of "
               "different policies were not timed side by side, so read ratios between rows with care. "
               "Machine-dependent.\n\n")


def baselines(teacher, student, spec: RunSpec, store: RunStore, progress: bool = True,
              rebuild_student_cache: bool = False, alone=None) -> tuple[pd.DataFrame, pd.DataFrame]:
    """(table, per-run rows); the table has quality and timing columns (:func:`write_baselines`
    splits them). ``student`` decodes the OverFill row; ``alone`` (default: ``student``) the Student
    row — e.g. the ``overfill``- and ``standalone``-trained students. ``rebuild_student_cache``:
    OverFill with a KV-incompatible student (it prefills its own cache from the text)."""
    policies = dict(POLICIES)
    if rebuild_student_cache:
        policies["overfill"] = replace(policies["overfill"], rebuild_student_cache=True)
    if alone is None or alone is student:
        per_run = run_policies(teacher, student, spec, policies, store, progress)
    else:
        with_of = run_policies(teacher, student, spec, {k: policies[k] for k in ("teacher", "overfill")}, store,
                               progress)
        solo = run_policies(teacher, alone, spec, {"student": policies["student"]}, store, progress)
        per_run = pd.concat([with_of, solo], ignore_index=True).sort_values(["prompt_idx"], kind="stable")
        per_run = per_run.reset_index(drop=True)
    return baselines_table(per_run), per_run


def baselines_table(per_run: pd.DataFrame) -> pd.DataFrame:
    """The table from per-run rows (``policy`` in teacher/overfill/student, one row per run): quality
    and timing columns (:func:`write_baselines` writes them to separate files)."""
    return summarize(per_run, order=list(POLICIES)).reindex(columns=list(dict.fromkeys(COLUMNS + TIMING_COLUMNS)))


def write_baselines(table: pd.DataFrame, per_run: pd.DataFrame, out: Path) -> list[Path]:
    """``baselines`` and ``baselines_runs`` hold quality only (they do not change when the same
    runs are timed again); ``baselines_timing`` holds the machine-dependent times."""
    paths = write_table(table[COLUMNS], out, "baselines")
    paths += write_table(per_run.drop(columns=[c for c in TIME_RUN_COLUMNS if c in per_run]), out, "baselines_runs")
    paths += write_table(table[TIMING_COLUMNS], out, "baselines_timing")
    md = Path(out) / "baselines_timing.md"
    md.write_text(TIMING_NOTE + md.read_text())
    return paths
