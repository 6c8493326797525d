"""Eviction experiments on stored runs: the sawtooth trace and the matched-memory table.

**Matched memory.** Conf-KV's memory is not a knob: it is what its confidence schedule does on the
prompts. So Conf-KV runs first and its achieved mean KV bytes (mean over steps of
``StepRecord.cache_bytes``, then over prompts) is the *target*. Every fixed-budget family
(sliding window, H2O, random, block) has one integer budget knob; :func:`solve_budget` finds the
knob whose achieved mean memory is closest to the target:

1. a first guess from the full-cache runs: a hard cap ``b`` turns the full cache's length
   trajectory ``n_t`` into ``min(n_t, b)`` (:func:`capped_mean`), which is inverted exactly;
2. the family runs at that budget (stored runs) and its *measured* mean memory is compared with
   the target; while it is off by more than ``tol`` the solver brackets and bisects on measured
   values (each probe is a stored run set, so a rerun of the table recomputes nothing).

The table reports the target, the achieved mean and its per-prompt spread for every row, so
"matched" can be checked, not assumed. Conf-KV's ranker ablations (recency-only, attention-only,
random victims) keep its confidence schedule, so their memory follows the same schedule; their
achieved memory is reported beside the target too.

**KL to the full cache.** Runs are on the teacher alone (``mode="teacher"``). :func:`kvlab.core.metrics.score`
compares each step's distribution with the teacher's uncached forward over prompt + continuation,
i.e. ``KL(p_full(· | x, y_<t) ‖ p_evicted(· | x, y_<t))`` along the run's own tokens: exactly the KL
of the pruned cache to the full one. Paired statistics (bootstrap over prompts, same seeds) are
computed against the full-cache run and against Conf-KV.

The study is split by idea: :mod:`~kvlab.studies.eviction.solver` (memory of a run, the budget solver),
:mod:`~kvlab.studies.eviction.design` (:class:`EvictStudy`, the needle grid), :mod:`~kvlab.studies.eviction.matched`
(the matched-memory and γ tables), :mod:`~kvlab.studies.eviction.sawtooth`, :mod:`~kvlab.studies.eviction.int8`,
:mod:`~kvlab.studies.eviction.notes` (the tables' notes); this module is the job (:func:`evict_tables`,
:func:`write_evict`) and re-exports them.
"""
from __future__ import annotations

from pathlib import Path

import pandas as pd

from kvlab.harness.experiment import RunSpec, write_table
from kvlab.store import RunStore
from kvlab.studies.eviction.design import (ABLATIONS, FAMILIES, FAMILY_SETUP, FORCED_POLICIES, INT8_GROUP,  # noqa: F401
                                           KVCRUSH_BLOCKS, PROTECT, EvictStudy, NeedleGrid, known_families,
                                           policy_names)
from kvlab.studies.eviction.int8 import int8_error_table
from kvlab.studies.eviction.matched import (GAMMA_COLS, MATCHED_COLS, _cfg, _mean_mb, _params, _sinks,  # noqa: F401
                                            entry_bytes_16bit, eviction_rate, gamma_table, matched_runs, matched_table,
                                            paired_ci, runs_of)
from kvlab.studies.eviction.notes import TABLE_NOTES
from kvlab.studies.eviction.sawtooth import SAWTOOTH_COLS, SAWTOOTH_POLICIES, sawtooth_frame, sawtooth_runs  # noqa: F401
from kvlab.studies.eviction.solver import (MIB, Solved, budget_fractions, capped_mean, invert_capped,  # noqa: F401
                                           run_memory, solve_budget)


def evict_tables(teacher, student, spec: RunSpec, store: RunStore, study: EvictStudy = EvictStudy(),
                 grid: NeedleGrid | None = NeedleGrid(), refresh=None,
                 progress: bool = True) -> dict[str, pd.DataFrame]:
    """Every table of ``python -m kvlab evict`` from stored runs (computed where missing)."""
    from kvlab.studies.eviction import needle

    per_run, info, pols = matched_runs(teacher, spec, store, study, progress)
    matched = matched_table(per_run, info)
    tables = {"evict_matched": matched, "evict_matched_runs": per_run, "evict_gamma": gamma_table(matched)}
    saw = sawtooth_runs(teacher, student, spec, store, pols, study, refresh=refresh)
    tables["evict_sawtooth"] = sawtooth_frame(saw, gamma=study.gamma)
    tables["evict_int8"] = int8_error_table(teacher, spec.prompts[:2], study.protect)
    if grid is not None:
        cases = needle.make_cases(teacher.tokenizer, grid.lengths, grid.depths, grid.reps, grid.seed)
        nruns, used = needle.matched_needle_runs(teacher, cases, grid.budget, store, gamma=study.gamma,
                                                 progress=progress, batch=spec.batch, kvpress=study.kvpress)
        order = list(dict.fromkeys(n for u in used.values() for n in u))
        tables["evict_needle"] = needle.needle_table(nruns, order=order)
        tables["evict_needle_runs"] = nruns
    return tables


def write_evict(tables: dict[str, pd.DataFrame], out: Path) -> list[Path]:
    """CSV + Markdown of every table; ``evict_needle.md`` holds the two accuracy pivots."""
    from kvlab.studies.eviction.needle import needle_markdown

    out = Path(out)
    paths = []
    for name, df in tables.items():
        paths += write_table(df.round(5), out, name, notes=TABLE_NOTES.get(name.replace("_runs", ""), []))
    if "evict_needle" in tables:   # the two accuracy pivots instead of the long table
        from kvlab.harness.experiment import provenance_note

        notes = TABLE_NOTES["evict_needle"] + [provenance_note()]
        (out / "evict_needle.md").write_text(needle_markdown(tables["evict_needle"]) + "\n"
                                             + "\n".join(f"- {n}" for n in notes) + "\n")
    return paths


__all__ = ["EvictStudy", "Solved", "solve_budget", "capped_mean", "invert_capped", "run_memory", "matched_runs",
           "budget_fractions", "gamma_table", "int8_error_table",
           "matched_table", "paired_ci", "eviction_rate", "sawtooth_frame", "sawtooth_runs", "write_evict",
           "NeedleGrid", "evict_tables"]
