"""Run a grid: key every task, skip what the run store holds, run the rest on an engine in chunks
of ``batch`` tasks of one pair and mode (each chunk one batched decode), store each outcome as it
arrives (this process alone writes the store). The batch size is not part of a run's key.

A pair that fails to load (a probe raises) fails only its own tasks: each becomes an ``error`` row
under :func:`load_error_key` (the run's real key needs the fingerprints of the models that did not
load) and every other task runs. Once that pair loads, its load-error rows are removed."""
from __future__ import annotations

import time
from dataclasses import dataclass, field, replace

from kvlab.store.results import CodeVersionMismatch, Store
from kvlab.sweep.engines import make_engine
from kvlab.sweep.spec import GridSpec, Task
from kvlab.sweep.task import execute, execute_chunk


@dataclass
class SweepReport:
    name: str
    engine: str
    total: int                 # tasks in the grid
    skipped: int               # already stored (finished runs, from any sweep, table or the playground)
    done: int = 0              # stored in this call
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


def _store(store) -> Store:
    return store if isinstance(store, Store) else Store(store)


def group(task: Task) -> tuple:
    """The model group of a task: the pair its worker loads (``engine.probe(*group)``)."""
    return task.models, task.config.student


def load_error_key(task: Task) -> str:
    """The run-store key of a task whose models failed to load (its run key needs their fingerprints)."""
    from kvlab.store.results import run_key

    return run_key({"kind": "load_error", "task_id": task.task_id})


def key_tasks(spec: GridSpec, engine) -> tuple[list[Task], dict]:
    """Every task of ``spec`` with its ``run_key``, from fingerprints the engine's workers report
    (:meth:`probe`, one per model group). Raises :class:`CodeVersionMismatch` if a worker runs
    another code version than this driver (before any task runs). A group whose probe raises gets
    ``{"error": ...}`` as its probe and its tasks :func:`load_error_key`. Returns (tasks, probes)."""
    import traceback

    from kvlab.harness.experiment import stored_config
    from kvlab.store.provenance import CODE_VERSION
    from kvlab.store.results import run_key

    probes = {}
    out = []
    for t in spec.tasks():
        g = group(t)
        if g not in probes:
            try:
                probes[g] = engine.probe(*g)
            except CodeVersionMismatch:
                raise
            except Exception as e:  # noqa: BLE001 - a pair that does not load fails its tasks, not the sweep
                probes[g] = {"error": f"loading the models failed: {type(e).__name__}: {e}",
                             "traceback": traceback.format_exc(limit=6)[-4000:]}
                out.append(replace(t, run_key=load_error_key(t)))
                continue
            if probes[g]["code_version"] != CODE_VERSION:
                raise CodeVersionMismatch(
                    f"the {getattr(engine, 'name', 'sweep')} workers run kvlab code version "
                    f"{probes[g]['code_version']!r}, this driver {CODE_VERSION!r}: their rows would be refused; "
                    "run the same kvlab on both (the Ray engine ships the driver's code with a runtime_env)")
        p = probes[g]
        if "error" in p:
            out.append(replace(t, run_key=load_error_key(t)))
            continue
        out.append(replace(t, run_key=run_key(stored_config(p["teacher"], p["student"], t.prompt, t.decode))))
    return out, probes


def chunks(tasks: list[Task], batch: int) -> list[list[Task]]:
    """``tasks`` in chunks of at most ``batch`` that share a model group and mode (what one batched
    decode can run), in the order of each group's first task."""
    by: dict = {}
    for t in tasks:
        by.setdefault((group(t), t.decode.mode), []).append(t)
    return [ts[k:k + batch] for ts in by.values() for k in range(0, len(ts), batch)]


def pending(tasks: list[Task], store: Store, retry_errors: bool = True) -> tuple[list[Task], list[Task]]:
    """(tasks still to run, tasks whose run is stored): a finished run counts wherever it was
    computed; an error row counts only with ``retry_errors=False``."""
    have = store.ok_keys()
    if not retry_errors:
        rows = store.load(compact=False)
        if len(rows):
            have |= set(rows.loc[rows["status"] == "error", "run_key"])
    todo = [t for t in tasks if t.run_key not in have]
    return todo, [t for t in tasks if t.run_key in have]


def run_sweep(spec: GridSpec, *, engine: str = "local", workers: int | None = None, address: str | None = None,
              store=None, results=None, progress: bool = True, retry_errors: bool = True,
              execute_fn=execute, engine_obj=None, batch: int | None = None, chunk_fn=execute_chunk,
              **engine_kw) -> SweepReport:
    """Run every (config, prompt, repeat) of ``spec`` whose run the store lacks.

    ``store`` (or its older name ``results``): the run store or its root (default ``$KVLAB_RUNS`` or
    ``runs/``). Runs already stored — by this sweep, another sweep, a table or the playground — are
    not rerun, only tagged with this sweep's name. Outcomes are stored by this process as tasks
    finish, so a killed sweep loses only the tasks in flight and a rerun skips what is stored.
    Error rows are rerun next time unless ``retry_errors=False``. A trained student missing from the
    model cache raises (naming ``python -m kvlab train-student``) before any engine starts: a sweep
    never trains. A pair that fails to load fails its own tasks only (error rows).

    ``batch`` (default :data:`kvlab.harness.experiment.DEFAULT_BATCH`): tasks of one pair and mode
    decoded together by a worker (``chunk_fn``, :func:`kvlab.sweep.task.execute_chunk`); a row that
    fails is an error row, the others of its batch are stored. ``batch=1``: one task at a time
    (``execute_fn``, the unbatched loop). A killed sweep loses the chunks in flight."""
    from tqdm.auto import tqdm

    from kvlab.harness.experiment import stored_config
    from kvlab.store.rows import config_columns
    from kvlab.sweep.students import check_trained
    from kvlab.sweep.task import student_columns

    from kvlab.harness.experiment import check_batch

    batch = check_batch(batch)
    if batch > 1 and execute_fn is not execute and chunk_fn is execute_chunk:
        raise ValueError(f"execute_fn= runs one task at a time, but batch={batch} runs chunks with chunk_fn=: "
                         "pass batch=1, or a chunk_fn= too")
    check_trained(spec)                   # before any engine (Ray, processes) starts
    st = _store(store if store is not None else results)
    eng = engine_obj if engine_obj is not None else make_engine(engine, workers, address, execute_fn, chunk_fn,
                                                                  **engine_kw)
    try:
        tasks, probes = key_tasks(spec, eng)
        st.forget([load_error_key(t) for t in tasks if "error" not in probes[group(t)]])   # that pair loads now
        todo, stored = pending(tasks, st, retry_errors)
        for t in stored:
            st.tag(t.run_key, spec.name)
        report = SweepReport(spec.name, getattr(eng, "name", engine), len(tasks), len(stored),
                             results_root=str(st.root))
        unloaded = [t for t in todo if "error" in probes[group(t)]]
        todo = [t for t in todo if "error" not in probes[group(t)]]
        for t in unloaded:                 # their models did not load: recorded, never sent to a worker
            p = probes[group(t)]
            st.put_error(t.run_key, {**t.columns(), **student_columns(t), "engine": report.engine,
                                     "traceback": p["traceback"]}, p["error"], tags=[spec.name])
            report.done += 1
            report.errors += 1
            report.error_messages.append(f"{t.config.policy} prompt {t.prompt_idx}: {p['error']}")
        if not todo:
            return report
        bar = tqdm(total=len(todo), desc=f"sweep {spec.name}", unit="run", disable=not progress, dynamic_ncols=True)

        def on_outcome(task: Task, out: dict) -> None:
            msg = None
            if out.get("status") == "ok":
                try:
                    st.put(out["config"], out["result"], meta=out["meta"], tags=[spec.name], extra=out.get("extra"))
                except CodeVersionMismatch as e:
                    msg = str(e)
            else:
                msg = out.get("error") or "failed"
            if msg is not None:
                p = probes[group(task)]
                cols = {**task.columns(), **config_columns(stored_config(p["teacher"], p["student"], task.prompt,
                                                                          task.decode)),
                        **(out.get("extra") or {}), "traceback": out.get("traceback", "")}
                st.put_error(task.run_key, cols, msg, meta=out.get("meta"), tags=[spec.name])
                report.errors += 1
                report.error_messages.append(f"{task.config.policy} prompt {task.prompt_idx}: {msg}")
            report.done += 1
            bar.update(1)
            bar.set_postfix(errors=report.errors, refresh=False)

        t0 = time.perf_counter()
        try:
            eng.run(chunks(todo, batch), on_outcome)
        finally:
            report.wall_s = time.perf_counter() - t0
            bar.close()
        return report
    finally:
        if engine_obj is None:
            eng.close()
