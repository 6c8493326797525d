"""The blog's Baselines table (no refresh): Teacher / OverFill / Student on the same prompts."""
from __future__ import annotations

from pathlib import Path

import pandas as pd

from .decode import DecodeConfig
from .experiment import RunSpec, run_policies, summarize, write_table
from .store import RunStore

POLICIES = {
    "teacher": DecodeConfig(mode="teacher"),
    "overfill": DecodeConfig(mode="overfill"),
    "student": DecodeConfig(mode="student"),
}
COLUMNS = ["policy", "ttft_s", "tps", "tokens", "total_s", "e2e_tps", "teacher_ppl", "kl", "kl_all", "repeat3",
           "tail_logprob", "chars", "teacher_ppl_std", "kl_std", "repeat3_std", "total_s_std", "n_prompts"]


def baselines(teacher, student, spec: RunSpec, store: RunStore, progress: bool = True) -> tuple[pd.DataFrame, pd.DataFrame]:
    """(table, per-run rows)."""
    per_run = run_policies(teacher, student, spec, POLICIES, store, progress)
    table = summarize(per_run, order=list(POLICIES))[COLUMNS]
    return table, per_run


def write_baselines(table: pd.DataFrame, per_run: pd.DataFrame, out: Path) -> list[Path]:
    return write_table(table, out, "baselines") + write_table(per_run, out, "baselines_runs")
