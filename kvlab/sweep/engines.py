"""Where tasks run: in this process, in worker processes, or on Ray actors.

Every engine takes the same tasks and hands each finished ``(row, trace)`` back to the driver
(``on_result``), which alone writes the results table. Models are loaded once per process
(in-process: once per Python session; processes: once per worker; Ray: once per actor).
"""
from __future__ import annotations

import os
import socket
import time
from typing import Callable, Iterable

from .spec import Task
from .task import PairCache, execute, open_store

PROCESS_PAIRS = PairCache()          # the driver process's pairs (local engine), reused across sweeps

OnResult = Callable[[dict, object], None]


def error_row(task: Task, engine: str, msg: str) -> dict:
    """The row recorded for a task whose worker died more often than it may be retried."""
    from .task import _provenance

    now = time.time()
    return {**task.columns(), **_provenance(), "engine": engine, "worker": "", "status": "error",
            "error": msg, "wall_s": float("nan"), "started_at": now, "finished_at": now}


class LocalEngine:
    """Tasks one after another in this process."""

    name = "local"

    def __init__(self, store_root=None, execute_fn=execute, pairs: PairCache | None = None):
        self.store_root, self.execute_fn = store_root, execute_fn
        self.pairs = pairs if pairs is not None else PROCESS_PAIRS

    def run(self, tasks: Iterable[Task], on_result: OnResult) -> None:
        store = open_store(self.store_root)
        for t in tasks:
            try:
                row, trace = self.execute_fn(t, self.pairs, store, self.name, f"pid{os.getpid()}")
            except Exception as e:  # noqa: BLE001 - execute() records its own errors; this guards wrappers
                row, trace = error_row(t, self.name, f"{type(e).__name__}: {e}"), None
            on_result(row, trace)

    def close(self) -> None:
        pass


# --------------------------------------------------------------------------- processes

_WORKER: dict = {}


def _init_worker(store_root, threads: int, execute_fn) -> None:
    import torch

    torch.set_num_threads(threads)
    _WORKER.update(pairs=PairCache(), store=open_store(store_root), fn=execute_fn)


def _run_in_worker(task: Task):
    return _WORKER["fn"](task, _WORKER["pairs"], _WORKER["store"], "processes", f"pid{os.getpid()}")


class ProcessEngine:
    """Tasks over ``workers`` spawned processes (each loads its models once). A worker that dies
    takes the pool down; unfinished tasks are resubmitted to a fresh pool up to ``max_retries``
    times, then recorded as error rows."""

    name = "processes"

    def __init__(self, workers: int, store_root=None, execute_fn=execute, max_retries: int = 2,
                 threads: int | None = None):
        if not isinstance(workers, int) or workers < 1:
            raise ValueError(f"workers={workers!r} must be a positive int")
        self.workers, self.store_root, self.execute_fn, self.max_retries = workers, store_root, execute_fn, max_retries
        self.threads = threads or max(1, (os.cpu_count() or 1) // workers)

    _pool = None

    def _get_pool(self):
        import multiprocessing as mp
        from concurrent.futures import ProcessPoolExecutor

        if self._pool is None:      # kept across run() calls: workers keep their models
            self._pool = ProcessPoolExecutor(self.workers, mp_context=mp.get_context("spawn"), initializer=_init_worker,
                                             initargs=(self.store_root, self.threads, self.execute_fn))
        return self._pool

    def run(self, tasks: Iterable[Task], on_result: OnResult) -> None:
        from concurrent.futures import as_completed
        from concurrent.futures.process import BrokenProcessPool

        todo = list(tasks)
        tries = {t.row_id: 0 for t in todo}
        while todo:
            failed = []
            pool = self._get_pool()
            futs = {pool.submit(_run_in_worker, t): t for t in todo}
            for f in as_completed(futs):
                t = futs[f]
                try:
                    row, trace = f.result()
                except BrokenProcessPool as e:
                    tries[t.row_id] += 1
                    if tries[t.row_id] > self.max_retries:
                        on_result(error_row(t, self.name, f"worker died {tries[t.row_id]} times: {e}"), None)
                    else:
                        failed.append(t)
                    continue
                on_result(row, trace)
            if failed:                   # the pool is broken: a fresh one for the retries
                self.close()
            todo = failed

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._pool = None


# --------------------------------------------------------------------------- Ray


class RayAddressError(ConnectionError):
    pass


def check_address(address: str, timeout: float = 5.0) -> None:
    """Fail fast (and clearly) when a Ray address does not answer."""
    if address in ("auto", "local"):
        return
    hostport = address.split("://", 1)[-1].rstrip("/")
    host, sep, port = hostport.rpartition(":")
    if not sep or not port.isdigit():
        raise RayAddressError(f"--address {address!r} must look like HOST:PORT (e.g. 10.0.0.5:6379, "
                              "or ray://HOST:10001), or 'auto'")
    try:
        socket.create_connection((host, int(port)), timeout=timeout).close()
    except OSError as e:
        raise RayAddressError(f"--address {address!r} does not answer ({e}); start a cluster there with "
                              "`ray start --head`, or drop --address to start a local Ray instance") from None


class _Actor:
    """A Ray actor holding its models: one per worker."""

    def __init__(self, store_root, execute_fn):
        import ray

        self.pairs, self.store, self.fn = PairCache(), open_store(store_root), execute_fn
        try:
            self.worker = f"actor{ray.get_runtime_context().get_actor_id()[:8]}"
        except Exception:  # noqa: BLE001
            self.worker = f"pid{os.getpid()}"

    def run(self, task: Task):
        return self.fn(task, self.pairs, self.store, "ray", self.worker)

    def ping(self) -> int:
        return os.getpid()


def _init_local(ray, num_cpus, kw, attempts: int = 3) -> None:
    """Start a local Ray instance. Ray gives its raylet a fixed 30 s to register; on a loaded
    machine that can pass, so a timed-out start is cleaned up and tried again."""
    for i in range(attempts):
        try:
            ray.init(num_cpus=num_cpus, **kw)
            return
        except Exception as e:  # noqa: BLE001 - ray raises a bare Exception for this
            if "timed out during startup" not in str(e) or i == attempts - 1:
                raise
            if ray.is_initialized():
                ray.shutdown()
            time.sleep(2)


class RayEngine:
    """Tasks on Ray actors (models loaded once per actor). ``address=None`` starts a local Ray
    instance (``num_cpus``) and shuts it down on :meth:`close`; an address joins an existing
    cluster. Actors get ``num_gpus`` when the cluster has GPUs; a dying actor is restarted and
    its task retried (``max_retries``); the row id makes a retried task's row the same row."""

    name = "ray"

    def __init__(self, workers: int | None = None, address: str | None = None, store_root=None,
                 execute_fn=execute, num_cpus: int | None = None, gpus_per_worker: float | None = None,
                 max_retries: int = 2, in_flight: int = 2):
        try:
            import ray
        except ImportError as e:
            raise ModuleNotFoundError("--engine ray needs the 'ray' package: pip install ray") from e
        if address:
            check_address(address)
        self._own = False
        if not ray.is_initialized():
            kw = dict(include_dashboard=False, log_to_driver=False, configure_logging=False)
            if address:
                try:
                    ray.init(address=address, **kw)
                except Exception as e:  # noqa: BLE001 - ray raises ConnectionError, RuntimeError, …
                    if ray.is_initialized():
                        ray.shutdown()
                    raise RayAddressError(f"--address {address!r} answers but not as a Ray cluster "
                                          f"({type(e).__name__}: {str(e).splitlines()[0][:200]})") from None
            else:
                _init_local(ray, num_cpus, kw)
                self._own = True
        self.ray = ray
        res = ray.cluster_resources()
        gpus = float(res.get("GPU", 0))
        self.gpus_per_worker = gpus_per_worker if gpus_per_worker is not None else (1.0 if gpus >= 1 else 0.0)
        if workers is None:
            workers = int(gpus // self.gpus_per_worker) if self.gpus_per_worker else int(res.get("CPU", 1))
        if workers < 1:
            raise ValueError(f"workers={workers!r}: the Ray cluster has too few resources ({res})")
        self.workers, self.store_root, self.execute_fn = workers, store_root, execute_fn
        self.max_retries, self.in_flight = max_retries, in_flight
        self._actors = None

    def _start(self):
        if self._actors is None:
            cls = self.ray.remote(_Actor).options(num_cpus=1, num_gpus=self.gpus_per_worker,
                                                  max_restarts=self.max_retries, max_task_retries=self.max_retries)
            self._actors = [cls.remote(str(self.store_root) if self.store_root else None, self.execute_fn)
                            for _ in range(self.workers)]
        return self._actors

    def run(self, tasks: Iterable[Task], on_result: OnResult) -> None:
        ray = self.ray
        from ray.exceptions import RayActorError, RayTaskError

        actors = list(self._start())
        queue = list(tasks)[::-1]
        inflight: dict = {}                       # ObjectRef -> (task, actor)
        load = {id(a): 0 for a in actors}

        def submit():
            for a in sorted(actors, key=lambda a: load[id(a)]):
                while queue and load[id(a)] < self.in_flight:
                    t = queue.pop()
                    inflight[a.run.remote(t)] = (t, a)
                    load[id(a)] += 1

        submit()
        while inflight:
            done, _ = ray.wait(list(inflight), num_returns=1)
            ref = done[0]
            t, a = inflight.pop(ref)
            load[id(a)] -= 1
            try:
                on_result(*ray.get(ref))
            except (RayActorError, RayTaskError) as e:
                # restarts and retries are used up: record it, drop a dead actor, go on
                on_result(error_row(t, self.name, f"worker failed after {self.max_retries} retries: "
                                                  f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"), None)
                if isinstance(e, RayActorError):
                    actors.remove(a)
                    if not actors:
                        for t2 in queue[::-1]:
                            on_result(error_row(t2, self.name, "no Ray worker left"), None)
                        queue.clear()
            submit()

    def close(self) -> None:
        if self._actors:
            for a in self._actors:
                try:
                    self.ray.kill(a)
                except Exception:  # noqa: BLE001
                    pass
            self._actors = None
        if self._own and self.ray.is_initialized():
            self.ray.shutdown()


def make_engine(engine: str = "local", workers: int | None = None, address: str | None = None, store_root=None,
                execute_fn=execute, **kw):
    """``local`` (``workers == 1``: in-process; more: processes) or ``ray``."""
    if workers is not None and (isinstance(workers, bool) or not isinstance(workers, int) or workers < 1):
        raise ValueError(f"--workers={workers!r} must be a positive int")
    if engine == "local":
        if workers is None or workers == 1:
            return LocalEngine(store_root, execute_fn)
        return ProcessEngine(workers, store_root, execute_fn, **kw)
    if engine == "ray":
        return RayEngine(workers, address, store_root, execute_fn, **kw)
    raise ValueError(f"--engine={engine!r} must be 'local' or 'ray'")
