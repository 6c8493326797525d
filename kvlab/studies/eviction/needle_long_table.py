"""The tables of :mod:`kvlab.studies.eviction.needle_long`: Wilson intervals, the full cache's cells, the pooled and
per-task accuracy tables, their Markdown, the writer."""
from __future__ import annotations

import math

import pandas as pd

from kvlab.studies.eviction.needle_long import POLICIES, SETTINGS, LongGrid

TABLE_COLS = ["setting", "policy", "length", "accuracy", "n", "ci_lo", "ci_hi", "task", "partial", "mean_cache_len",
              "max_cache_len", "budget", "full_accuracy"]
TASK_COLS = ["task"] + [c for c in TABLE_COLS if c != "task"]


def wilson(k: float, n: int, z: float = 1.959964) -> tuple[float, float]:
    """Wilson score interval of ``k`` successes in ``n`` trials (95 % at the default ``z``)."""
    if n <= 0:
        return float("nan"), float("nan")
    p = k / n
    den = 1 + z * z / n
    mid = (p + z * z / (2 * n)) / den
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / den
    return max(0.0, mid - half), min(1.0, mid + half)


def _acc(g: pd.DataFrame) -> pd.Series:
    n, k = len(g), float(g.correct.sum())
    lo, hi = wilson(k, n)
    return pd.Series({"accuracy": k / n, "n": n, "ci_lo": lo, "ci_hi": hi, "partial": g.partial.mean(),
                      "mean_cache_len": g.mean_cache_len.mean(), "max_cache_len": g.max_cache_len.max()})


def full_cells(runs: pd.DataFrame, threshold: float) -> pd.DataFrame:
    """Full-cache accuracy of every (task, length) cell (prefill setting when run, else streamed) and
    ``kept``: at least ``threshold``."""
    full = runs[runs.policy == "full"]
    if full.empty:
        raise ValueError("the grid has no full-cache runs: add 'full' to the policies (cells are kept by it)")
    setting = "prefill" if (full.setting == "prefill").any() else "streamed"
    full = full[full.setting == setting]
    out = full.groupby(["task", "length"], sort=False).apply(_acc, include_groups=False).reset_index()
    out["n"] = out.n.astype(int)
    out["kept"] = out.accuracy >= threshold
    return out[["task", "length", "accuracy", "n", "ci_lo", "ci_hi", "partial", "kept"]]


def _grouped(keep: pd.DataFrame, by: list[str]) -> pd.DataFrame:
    out = keep.groupby(by, sort=False).apply(_acc, include_groups=False).reset_index()
    out["n"] = out.n.astype(int)
    rank = {**{p: i for i, p in enumerate(POLICIES)}, **{x: i for i, x in enumerate(SETTINGS)}}
    return out.sort_values(by[:-2] + ["length", "policy"] if "task" in by else ["setting", "length", "policy"],
                           key=lambda c: c.map(rank) if c.name in ("policy", "setting") else c, kind="stable")


def long_table(runs: pd.DataFrame, threshold: float = 0.8) -> tuple[pd.DataFrame, pd.DataFrame, pd.DataFrame]:
    """(pooled, per_task, cells) over the (task, length) cells the full cache passes (:func:`full_cells`):
    accuracy with Wilson 95 % intervals per (setting, policy, length) pooled over those cells' tasks (``task``
    names them), the same per task, and the full-cache accuracy of every cell."""
    cells = full_cells(runs, threshold)
    kept = cells[cells.kept][["task", "length", "accuracy"]].rename(columns={"accuracy": "full_accuracy"})
    keep = runs.merge(kept, on=["task", "length"])
    if keep.empty:
        return pd.DataFrame(columns=TABLE_COLS), pd.DataFrame(columns=TASK_COLS), cells
    per = _grouped(keep, ["task", "setting", "policy", "length"]).merge(
        keep.groupby(["task", "length"]).agg(budget=("budget", "first"), full_accuracy=("full_accuracy", "first"))
        .reset_index(), on=["task", "length"])
    ref = "prefill" if (keep.setting == "prefill").any() else "streamed"
    full = keep[(keep.policy == "full") & (keep.setting == ref)].groupby("length").correct.mean()
    info = keep.groupby("length").agg(task=("task", lambda t: "+".join(dict.fromkeys(t))), budget=("budget", "first"))
    pooled = _grouped(keep, ["setting", "policy", "length"]).merge(
        info.assign(full_accuracy=full).reset_index(), on="length")
    return pooled[TABLE_COLS].reset_index(drop=True), per[TASK_COLS].reset_index(drop=True), cells


NOTES = ["evict_needle_long.csv pools the tasks of every kept cell per (setting, policy, length) (column task names "
         "them); evict_needle_long_tasks.csv has one row per (task, setting, policy, length)",
         "accuracy: exact retrieval (niah_single / niah_multikey: the first number of the answer is the asked "
         "one; niah_multivalue: all values; vt: every variable of the chain); partial: the mean fraction found",
         "ci_lo / ci_hi: Wilson 95 % interval of accuracy over the n cases (one case = one generated prompt)",
         "a (task, length) cell enters only when the full cache retrieves in it (full_accuracy >= the threshold); "
         "every cell's full-cache accuracy is in evict_needle_long_full.csv",
         "one prefill per case (chunked, full cache) shared by every policy and both settings; greedy answer up to a "
         "newline after answer text; mean_cache_len / max_cache_len: cache entries while answering"]


def _cell(r) -> str:
    return f"{r.accuracy:.2f} [{r.ci_lo:.2f}, {r.ci_hi:.2f}]"


def _pivot(t: pd.DataFrame, col) -> pd.DataFrame:
    t = t.assign(col=[col(r) for r in t.itertuples()], val=[_cell(r) for r in t.itertuples()])
    pv = t.pivot(index="policy", columns="col", values="val")
    pv = pv.loc[[p for p in POLICIES if p in pv.index], list(dict.fromkeys(t.col))]
    pv["mean cache"] = t.groupby("policy").mean_cache_len.mean().round(0).astype(int).loc[pv.index]
    return pv.reset_index()


def long_markdown(pooled: pd.DataFrame, per_task: pd.DataFrame, cells: pd.DataFrame, threshold: float) -> str:
    """The full cache per cell; per setting the pooled pivot (policy × length) and the per-task pivot
    (policy × task and length), accuracy [Wilson 95 %]."""
    from kvlab.harness.experiment import to_markdown

    c = cells.assign(**{"full accuracy [95 %]": [_cell(r) for r in cells.itertuples()],
                        "in table": cells.kept.map({True: "yes", False: "no"})})
    parts = [f"Full cache per (task, length) cell (a cell enters the tables at accuracy >= {threshold:g}):\n\n"
             + to_markdown(c[["task", "length", "n", "full accuracy [95 %]", "partial", "in table"]], floatfmt=".2f")]
    for setting in dict.fromkeys(pooled.setting):
        t, pt = pooled[pooled.setting == setting], per_task[per_task.setting == setting]
        tasks = "; ".join(f"{L}: {x}" for L, x in dict(zip(t.length, t.task)).items())
        parts.append(f"Setting `{setting}`, pooled over the tasks the full cache passes ({tasks}): accuracy "
                     f"[Wilson 95 %], budget {int(t.budget.iloc[0])} entries, n = "
                     f"{', '.join(str(v) for v in dict.fromkeys(t.n))} cases per length:\n\n"
                     + to_markdown(_pivot(t, lambda r: f"{r.length} tokens (n={r.n})")))
        parts.append(f"Setting `{setting}` per task:\n\n"
                     + to_markdown(_pivot(pt, lambda r: f"{r.task} {r.length} (n={r.n})")))
    return "\n\n".join(parts) + "\n"


def write_long(runs: pd.DataFrame, grid: LongGrid, out) -> list:
    """``evict_needle_long.csv`` (pooled; its ``.md`` has every pivot and the notes), ``evict_needle_long_tasks.csv``
    (per task), ``evict_needle_long_full.csv`` (every cell's full-cache accuracy) and ``evict_needle_long_runs.csv``
    (one row per run) under ``out``."""
    from pathlib import Path

    from kvlab.harness.experiment import provenance_note

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    pooled, per_task, cells = long_table(runs, grid.threshold)
    paths = []
    for name, df in (("evict_needle_long", pooled), ("evict_needle_long_tasks", per_task),
                     ("evict_needle_long_full", cells), ("evict_needle_long_runs", runs)):
        df.round(5).to_csv(out / f"{name}.csv", index=False)
        paths.append(out / f"{name}.csv")
    md = out / "evict_needle_long.md"
    md.write_text(long_markdown(pooled, per_task, cells, grid.threshold) + "\n"
                  + "\n".join(f"- {n}" for n in NOTES + [provenance_note()]) + "\n")
    return paths + [md]


__all__ = ["TABLE_COLS", "TASK_COLS", "NOTES", "wilson", "full_cells", "long_table", "long_markdown", "write_long"]
