"""Run a grid: skip finished rows, run the rest on an engine, write each row as it finishes."""
from __future__ import annotations

import time
from dataclasses import dataclass, field

from ..results import Results
from .engines import make_engine
from .spec import GridSpec, Task
from .task import execute


@dataclass
class SweepReport:
    name: str
    engine: str
    total: int                 # tasks in the grid
    skipped: int               # already stored (status ok)
    done: int = 0              # written in this call
    errors: int = 0            # of which error rows
    wall_s: float = 0.0
    results_root: str = ""
    error_messages: list = field(default_factory=list)

    @property
    def tasks_per_s(self) -> float:
        return self.done / self.wall_s if self.wall_s > 0 else float("nan")

    def __str__(self) -> str:
        return (f"sweep {self.name!r} [{self.engine}]: {self.total} tasks, {self.skipped} already stored, "
                f"{self.done} run ({self.errors} errors) in {self.wall_s:.1f} s -> {self.results_root}")


def pending(spec: GridSpec, results: Results, retry_errors: bool = True) -> tuple[list[Task], int]:
    """(tasks still to run, how many are already stored)."""
    tasks = spec.tasks()
    have = results.row_ids(status="ok" if retry_errors else None)
    todo = [t for t in tasks if t.row_id not in have]
    return todo, len(tasks) - len(todo)


def run_sweep(spec: GridSpec, *, engine: str = "local", workers: int | None = None, address: str | None = None,
              results=None, runs=None, progress: bool = True, retry_errors: bool = True,
              execute_fn=execute, engine_obj=None, **engine_kw) -> SweepReport:
    """Run every (config, prompt, repeat) of ``spec`` that ``results`` lacks.

    ``runs`` is the per-run JSON store the runs go through (default: ``$KVLAB_RUNS`` or ``runs/``;
    ``False`` = none). Rows are written by this process as tasks finish, so a killed sweep loses
    only the tasks in flight and a rerun skips what is stored. Error rows (a task that raised) are
    rerun next time unless ``retry_errors=False``."""
    from tqdm.auto import tqdm

    from ..store import default_root as runs_root

    res = results if isinstance(results, Results) else Results(results)
    store_root = None if runs is False else (runs if runs is not None else runs_root())
    todo, skipped = pending(spec, res, retry_errors)
    eng = engine_obj if engine_obj is not None else (
        make_engine(engine, workers, address, store_root, execute_fn, **engine_kw) if todo else None)
    report = SweepReport(spec.name, getattr(eng, "name", engine), skipped + len(todo), skipped,
                         results_root=str(res.root))
    if not todo:
        return report
    bar = tqdm(total=len(todo), desc=f"sweep {spec.name}", unit="run", disable=not progress, dynamic_ncols=True)

    def on_result(row, trace):
        res.write(row, trace)
        report.done += 1
        if row.get("status") != "ok":
            report.errors += 1
            report.error_messages.append(f"{row.get('policy')} prompt {row.get('prompt_idx')}: {row.get('error')}")
        bar.update(1)
        bar.set_postfix(errors=report.errors, refresh=False)

    t0 = time.perf_counter()
    try:
        eng.run(todo, on_result)
    finally:
        report.wall_s = time.perf_counter() - t0
        bar.close()
        if engine_obj is None:
            eng.close()
    return report
