"""Running sweep tasks in a worker: load (once per process) the pair, run + score one task with
:func:`kvlab.harness.experiment.scored_run` (:func:`execute`) or a chunk of tasks of one pair and mode
as one batched decode with :func:`kvlab.harness.experiment.scored_runs` (:func:`execute_chunk`; the
same code the tables use), hand one outcome per task back. Loads models and decodes; it writes
nothing (the driver stores the outcomes).

Workers never touch a store (on a cluster a store path would be node-local): the driver keys every
task with the fingerprints a :func:`probe` reported, skips what the run store holds, and stores
what workers return (:meth:`kvlab.store.results.Store.put`, which refuses another code version).
"""
from __future__ import annotations

import os
import platform
import time
import traceback

from kvlab.sweep.spec import ModelSpec, Task
from kvlab.sweep.students import StudentChoice

# --------------------------------------------------------------------------- models


def tiny_pair(ratio: float | None = 0.3, seed: int = 0):
    """A random tiny Llama teacher and a narrower student with the same KV geometry (for tests and
    benchmarks of the sweep machinery; deterministic across processes, no files)."""
    import torch

    from kvlab.core.tiny import make_tiny_lm

    ratio = 0.3 if ratio is None else ratio
    with torch.random.fork_rng(devices=[]):          # leave the caller's generator alone
        teacher = make_tiny_lm(seed=seed, intermediate_size=96)
        student = make_tiny_lm(seed=seed + 1, intermediate_size=max(8, int(round(96 * (1 - ratio)))))
    return teacher, student


def load_models(models: ModelSpec, student: StudentChoice | None):
    """(teacher, student) for a task's model spec and student choice (None: ``models.student`` names it).
    A trained student must be in the model cache: a worker never trains (``load_pair`` raises, naming
    the ``train-student`` command)."""
    if models.kind == "tiny":
        return tiny_pair(None if student is None else student.ratio)
    from kvlab.train.pair import load_pair

    if student is None:
        return load_pair(models.teacher, models.student, device=models.device, dtype=models.dtype)
    return load_pair(models.teacher, None, device=models.device, dtype=models.dtype, variant=student.variant,
                     shape=student.shape, train_if_missing=False)


class PairCache:
    """Pairs loaded once per process (or actor) and reused by every task that needs them."""

    def __init__(self, loader=load_models):
        self.loader = loader
        self._pairs: dict = {}

    def get(self, models: ModelSpec, student: StudentChoice | None):
        key = (models, student)
        if key not in self._pairs:
            self._pairs[key] = self.loader(models, student)
        return self._pairs[key]

    def __len__(self) -> int:
        return len(self._pairs)


class NullStore:
    """A run store that stores nothing (a worker computes; the driver stores what it returns)."""

    def get(self, config, **kw):
        return None

    def reused(self, config, tags=()):
        return None

    def get_or_run(self, config, fn, **kw):
        return fn()


# --------------------------------------------------------------------------- what a worker returns


def provenance_meta() -> dict:
    """This process's provenance (what a stored run records as ``meta``)."""
    from kvlab.store.provenance import stamp

    return {**stamp(), "written": time.strftime("%Y-%m-%dT%H:%M:%S%z")}


def pair_bytes(teacher, student) -> int:
    """Bytes of the pair's parameters and buffers (what an actor holding it needs at least)."""
    n = 0
    for lm in (teacher, student):
        model = getattr(lm, "model", None)
        if model is None:
            continue
        for t in list(model.parameters()) + list(model.buffers()):
            n += t.numel() * t.element_size()
    return n


def probe(models: ModelSpec, student_choice: StudentChoice | None, pairs: PairCache) -> dict:
    """Load (once per process) the pair of ``(models, student_choice)`` and say what the driver needs
    before it submits runs: the fingerprints that key them, this process's code version, the pair's size."""
    from kvlab.store.provenance import CODE_VERSION

    teacher, student = pairs.get(models, student_choice)
    return {"teacher": teacher.fingerprint, "student": student.fingerprint, "code_version": CODE_VERSION,
            "pair_bytes": pair_bytes(teacher, student), "device": str(teacher.device), "host": platform.node()}


def execute(task: Task, pairs: PairCache, engine: str = "local", worker: str = "") -> dict:
    """Run one task in this process (no store: the driver stores what this returns); never raises
    for the task's own failure (``status == "error"`` instead). Returns the *outcome*: ``task_id``,
    ``status``, ``config`` / ``result`` / ``meta`` (for :meth:`kvlab.store.results.Store.put`), ``extra``
    (how it ran: engine, worker, load_s, wall_s, started_at, device) and ``error``."""
    from kvlab.harness.experiment import scored_run, stored_config

    started = time.time()
    t0 = time.perf_counter()
    out = {"task_id": task.task_id, "status": "error", "error": "", "config": None, "result": None}
    extra = {"engine": engine, "worker": worker or f"pid{os.getpid()}", "started_at": started,
             **student_columns(task)}
    try:
        t_load = time.perf_counter()
        teacher, student = pairs.get(task.models, task.config.student)
        extra["load_s"] = time.perf_counter() - t_load      # > 0 only for a worker's first task of a pair
        extra["device"] = str(teacher.device)
        out["config"] = stored_config(teacher, student, task.prompt, task.decode)
        out["result"] = scored_run(teacher, student, task.prompt, task.decode, NullStore())
        out["status"] = "ok"
    except Exception as e:   # noqa: BLE001 - a failing config is a result; the sweep goes on
        out["error"] = f"{type(e).__name__}: {e}"
        out["traceback"] = traceback.format_exc(limit=6)[-4000:]
    extra["wall_s"] = time.perf_counter() - t0
    out.update(meta=provenance_meta(), extra=extra)
    return out


def execute_chunk(tasks: list[Task], pairs: PairCache, engine: str = "local", worker: str = "") -> list[dict]:
    """Run a chunk of tasks of one pair (and mode) as one batched decode (no store); one outcome per
    task, in order, shaped as :func:`execute`'s. A row that fails is an ``error`` outcome and the
    other rows stay ``ok`` (:class:`kvlab.decode.BatchError`); a chunk whose batch fails as a whole
    (e.g. it cannot start) runs its tasks one at a time with :func:`execute`, so each fails or not on
    its own. ``extra["wall_s"]`` is the chunk's wall time (shared by its rows), ``extra["batch"]`` its size."""
    from kvlab.decode import BatchError
    from kvlab.harness.experiment import scored_runs, stored_config

    started = time.time()
    t0 = time.perf_counter()
    worker = worker or f"pid{os.getpid()}"
    try:
        teacher, student = pairs.get(tasks[0].models, tasks[0].config.student)
    except Exception:  # noqa: BLE001 - the load error is each task's own (execute reports it per task)
        return [execute(t, pairs, engine, worker) for t in tasks]
    load_s = time.perf_counter() - t0
    errors: dict = {}
    try:
        results = scored_runs(teacher, student, [(t.prompt, t.decode) for t in tasks], NullStore(), batch=len(tasks))
    except BatchError as e:
        results, errors = e.traces, e.errors
    except Exception:  # noqa: BLE001 - not a row's failure: one at a time, each task fails or not alone
        return [execute(t, pairs, engine, worker) for t in tasks]
    wall_s = time.perf_counter() - t0
    meta = provenance_meta()
    outs = []
    for j, t in enumerate(tasks):
        out = {"task_id": t.task_id, "status": "error", "error": "", "config": None, "result": None, "meta": meta,
               "extra": {"engine": engine, "worker": worker, "started_at": started, **student_columns(t),
                         "load_s": load_s, "device": str(teacher.device), "wall_s": wall_s, "batch": len(tasks)}}
        if j in errors:
            err = errors[j]
            out["error"] = f"{type(err).__name__}: {err}"
            out["traceback"] = "".join(traceback.format_exception(err, limit=6))[-4000:]
        else:
            out.update(status="ok", config=stored_config(teacher, student, t.prompt, t.decode), result=results[j])
        outs.append(out)
    return outs


def run_chunk(tasks: list[Task], pairs: PairCache, engine: str, worker: str, execute_fn=execute,
              chunk_fn=execute_chunk) -> list[dict]:
    """One outcome per task of a chunk: ``execute_fn`` for a chunk of one task (the unbatched path),
    ``chunk_fn`` for more."""
    if len(tasks) == 1:
        return [execute_fn(tasks[0], pairs, engine, worker)]
    return chunk_fn(tasks, pairs, engine, worker)


def failed(task: Task, engine: str, msg: str) -> dict:
    """The outcome recorded for a task whose worker died (or failed) more often than it may be retried."""
    return {"task_id": task.task_id, "status": "error", "error": msg, "config": None, "result": None,
            "meta": provenance_meta(), "extra": {"engine": engine, "worker": "", "started_at": time.time(),
                                                 **student_columns(task)}}


def student_columns(task: Task) -> dict:
    """The row columns naming the task's student (they fill what the run's config does not say)."""
    c = task.config.student
    return c.columns() if c is not None else {"student_ratio": None}
