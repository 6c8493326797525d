"""Where tasks run: in this process, in worker processes, or on Ray actors.
Engines start and stop their own workers (processes or Ray actors); only the driver writes the run store.

Every engine has the same three calls: :meth:`probe` (load a pair in a worker, report its
fingerprints, code version and size — what the driver keys runs with), :meth:`run` (run chunks of
tasks — one pair and mode per chunk, decoded as one batch by :func:`kvlab.sweep.task.run_chunk` —,
hand each ``(task, outcome)`` back to the driver, which alone writes the run store) and :meth:`close`.
Models are loaded once per process (in-process: once per Python session; processes: once per
worker; Ray: once per actor). A worker that dies is charged to the tasks it was running, and only to
them: each is retried alone (a chunk of one) on a fresh worker up to ``max_retries`` times, then
recorded as failed, while every other task goes on.
"""
from __future__ import annotations

import os
import socket
import time
from typing import Callable, Iterable

from kvlab.sweep.spec import Task
from kvlab.sweep.task import PairCache, execute, execute_chunk, failed, probe, run_chunk

PROCESS_PAIRS = PairCache()          # the driver process's pairs (local engine), reused across sweeps

OnOutcome = Callable[[Task, dict], None]
Chunk = list            # of Task: one pair and mode (kvlab.sweep.runner.chunks), decoded as one batch


def charge(chunk: list[Task], tries: dict, max_retries: int, queue: list, on_outcome: OnOutcome, engine: str,
           why: Callable[[int], str]) -> None:
    """A chunk that failed as a whole: each task is charged one try; past ``max_retries`` it fails with
    ``why(tries)``, else it goes back on ``queue`` alone (a chunk of one)."""
    for t in chunk:
        tries[t.task_id] += 1
        if tries[t.task_id] > max_retries:
            on_outcome(t, failed(t, engine, why(tries[t.task_id])))
        else:
            queue.append([t])


class LocalEngine:
    """Chunks of tasks one after another in this process."""

    name = "local"

    def __init__(self, execute_fn=execute, pairs: PairCache | None = None, chunk_fn=execute_chunk):
        self.execute_fn, self.chunk_fn = execute_fn, chunk_fn
        self.pairs = pairs if pairs is not None else PROCESS_PAIRS

    def probe(self, models, student) -> dict:
        return probe(models, student, self.pairs)

    def run(self, chunks: Iterable[Chunk], on_outcome: OnOutcome) -> None:
        for chunk in chunks:
            try:
                outs = run_chunk(chunk, self.pairs, self.name, f"pid{os.getpid()}", self.execute_fn, self.chunk_fn)
            except Exception as e:  # noqa: BLE001 - execute() records its own errors; this guards wrappers
                outs = [failed(t, self.name, f"{type(e).__name__}: {e}") for t in chunk]
            for t, out in zip(chunk, outs):
                on_outcome(t, out)

    def close(self) -> None:
        pass


# --------------------------------------------------------------------------- processes


def _worker_main(conn, threads: int, execute_fn, chunk_fn=execute_chunk) -> None:
    """A worker process: answer ("probe", (models, student)) with a dict and ("run", chunk) with one
    outcome per task, until None."""
    import torch

    torch.set_num_threads(threads)
    pairs = PairCache()
    while True:
        try:
            msg = conn.recv()
        except EOFError:
            return
        if msg is None:
            return
        kind, payload = msg
        try:
            if kind == "probe":
                reply = probe(*payload, pairs)
            else:
                reply = run_chunk(payload, pairs, "processes", f"pid{os.getpid()}", execute_fn, chunk_fn)
        except Exception as e:  # noqa: BLE001 - reported to the driver, the worker lives on
            msg = f"{type(e).__name__}: {e}"
            reply = {"status": "error", "error": msg} if kind == "probe" else [failed(t, "processes", msg)
                                                                             for t in payload]
        conn.send(reply)


class _Proc:
    def __init__(self, ctx, threads, execute_fn, chunk_fn=execute_chunk):
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_worker_main, args=(child, threads, execute_fn, chunk_fn), daemon=True)
        self.proc.start()
        child.close()
        self.task: Chunk | None = None          # the chunk in flight

    def stop(self, wait: float = 5.0) -> None:
        try:
            self.conn.send(None)
        except (OSError, ValueError):
            pass
        self.proc.join(wait)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join()
        self.conn.close()


class ProcessEngine:
    """Chunks of tasks over ``workers`` spawned processes, one chunk at a time each (each loads its
    models once and decodes its chunk as one batch). A worker that dies is replaced; only the tasks
    it was running are charged a retry, each retried alone."""

    name = "processes"

    def __init__(self, workers: int, execute_fn=execute, max_retries: int = 2, threads: int | None = None,
                 chunk_fn=execute_chunk):
        if not isinstance(workers, int) or isinstance(workers, bool) or workers < 1:
            raise ValueError(f"workers={workers!r} must be a positive int")
        self.workers, self.execute_fn, self.max_retries = workers, execute_fn, max_retries
        self.chunk_fn = chunk_fn
        self.threads = threads or max(1, (os.cpu_count() or 1) // workers)
        self._procs: list[_Proc] = []

    def _spawn(self) -> _Proc:
        import multiprocessing as mp

        return _Proc(mp.get_context("spawn"), self.threads, self.execute_fn, self.chunk_fn)

    def _pool(self) -> list[_Proc]:
        while len(self._procs) < self.workers:      # kept across run() calls: workers keep their models
            self._procs.append(self._spawn())
        return self._procs

    def probe(self, models, student) -> dict:
        w = self._pool()[0]
        w.conn.send(("probe", (models, student)))
        try:
            reply = w.conn.recv()
        except (EOFError, OSError):
            self._replace(w)
            raise RuntimeError(f"a worker process died while loading the models {models} (student {student})") from None
        if reply.get("status") == "error":
            raise RuntimeError(f"loading the models {models} (student {student}) failed in a worker: {reply['error']}")
        return reply

    def _replace(self, w: _Proc) -> None:
        w.proc.join(1)
        if w.proc.is_alive():
            w.proc.kill()
            w.proc.join()
        w.conn.close()
        self._procs[self._procs.index(w)] = self._spawn()

    def run(self, chunks: Iterable[Chunk], on_outcome: OnOutcome) -> None:
        from multiprocessing.connection import wait

        queue = [list(c) for c in chunks][::-1]
        tries = {t.task_id: 0 for c in queue for t in c}
        while queue or any(w.task is not None for w in self._procs):
            for w in self._pool():
                if w.task is None and queue:
                    w.task = queue.pop()
                    w.conn.send(("run", w.task))
            busy = [w for w in self._procs if w.task is not None]
            ready = set(wait([w.conn for w in busy] + [w.proc.sentinel for w in busy]))
            for w in busy:
                if w.conn not in ready and w.proc.sentinel not in ready:
                    continue
                chunk, w.task = w.task, None
                try:
                    outs = w.conn.recv() if w.conn.poll() else None
                except (EOFError, OSError):
                    outs = None
                if outs is not None:
                    for t, out in zip(chunk, outs):
                        on_outcome(t, out)
                    continue
                w.proc.join(1)
                code = w.proc.exitcode
                self._replace(w)                 # it died running this chunk: charge its tasks alone
                charge(chunk, tries, self.max_retries, queue, on_outcome, self.name,
                       lambda n: f"worker died {n} times running this task (exit code {code})")

    def close(self) -> None:
        for w in self._procs:
            w.stop()
        self._procs = []


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


def runtime_env() -> dict:
    """What Ray ships to every node: this kvlab package (so nodes need not have it installed, and
    run exactly the driver's code). Its dependencies must be on the nodes (docs/sweeps_and_store.md, "Ray on a cluster")."""
    from kvlab.store.provenance import PACKAGE_DIR

    return {"py_modules": [str(PACKAGE_DIR)], "excludes": ["__pycache__", "*.pyc"],
            "env_vars": {"TOKENIZERS_PARALLELISM": "false"}}


def _probe_remote(models, student):
    import kvlab
    import ray

    shipped = (ray.get_runtime_context().runtime_env or {}).get("py_modules") or []
    return {**probe(models, student, PairCache()), "kvlab_path": os.path.dirname(kvlab.__file__),
            "py_modules": list(shipped)}


class _Actor:
    """A Ray actor holding its models: one per worker."""

    def __init__(self, execute_fn, chunk_fn=execute_chunk):
        import ray

        self.pairs, self.fn, self.chunk_fn = PairCache(), execute_fn, chunk_fn
        try:
            self.worker = f"actor{ray.get_runtime_context().get_actor_id()[:8]}"
        except Exception:  # noqa: BLE001
            self.worker = f"pid{os.getpid()}"

    def run(self, chunk: Chunk) -> list:
        return run_chunk(chunk, self.pairs, "ray", self.worker, self.fn, self.chunk_fn)

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


GiB = 1 << 30


def actor_memory(pair_bytes: int) -> int:
    """Memory an actor holding a pair reserves: its weights twice (load + conversion peaks, KV cache,
    activations) plus 1 GiB for the Python/torch process itself."""
    return int(2 * pair_bytes + GiB)


class RayEngine:
    """Chunks of tasks on Ray actors, one chunk in flight per actor (decoded as one batch), models
    loaded once per actor.

    ``address=None`` starts a local Ray instance (``num_cpus``) and shuts it down on :meth:`close`;
    an address joins a running cluster. Either way the kvlab package is shipped to the workers
    (:func:`runtime_env`). Each actor reserves ``cpus_per_worker`` CPUs, a GPU when the cluster
    has GPUs, and ``memory_per_worker`` bytes (default :func:`actor_memory` of the pair the
    :meth:`probe` loaded), so the number of actors (default: as many as the cluster's CPUs, GPUs
    and memory allow) follows what a teacher+student pair needs. Any Ray failure of a chunk (its
    actor died, its node died, out of memory, an object lost …) is charged to its tasks alone: each
    is retried alone on a fresh actor up to ``max_retries`` times, then recorded as failed."""

    name = "ray"

    def __init__(self, workers: int | None = None, address: str | None = None, execute_fn=execute,
                 num_cpus: int | None = None, gpus_per_worker: float | None = None, cpus_per_worker: float = 1,
                 memory_per_worker: int | None = None, max_retries: int = 2, chunk_fn=execute_chunk):
        try:
            import ray
        except ImportError as e:
            raise ModuleNotFoundError("--engine ray needs the 'ray' package: pip install ray") from e
        if workers is not None and (isinstance(workers, bool) or not isinstance(workers, int) or workers < 1):
            raise ValueError(f"workers={workers!r} must be a positive int")
        if address:
            check_address(address)
        self._own = False
        if not ray.is_initialized():
            kw = dict(include_dashboard=False, log_to_driver=False, configure_logging=False,
                      runtime_env=runtime_env())
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
        self.gpus_per_worker = gpus_per_worker if gpus_per_worker is not None else (
            1.0 if float(res.get("GPU", 0)) >= 1 else 0.0)
        self.cpus_per_worker, self.memory_per_worker = cpus_per_worker, memory_per_worker
        self.workers, self.execute_fn, self.max_retries = workers, execute_fn, max_retries
        self.chunk_fn = chunk_fn
        self._pair_bytes = 0
        self._actors = None
        self.probes: list[dict] = []

    def probe(self, models, student) -> dict:
        """Load the pair once in a Ray task with an actor's CPUs/GPUs (so on the kind of node the
        actors get): its fingerprints, the workers' code version, and its size for the reservation."""
        fn = self.ray.remote(_probe_remote).options(num_cpus=self.cpus_per_worker, num_gpus=self.gpus_per_worker,
                                                     max_retries=self.max_retries)
        try:
            out = self.ray.get(fn.remote(models, student))
        except Exception as e:  # noqa: BLE001 - any Ray failure: say which models
            raise RuntimeError(f"loading the models {models} (student {student}) on the Ray cluster failed: "
                               f"{type(e).__name__}: {str(e).splitlines()[0][:300]}") from None
        self._pair_bytes = max(self._pair_bytes, int(out["pair_bytes"]))
        self.probes.append(out)
        return out

    def _actor_options(self) -> dict:
        mem = self.memory_per_worker if self.memory_per_worker is not None else actor_memory(self._pair_bytes)
        return dict(num_cpus=self.cpus_per_worker, num_gpus=self.gpus_per_worker, memory=int(mem),
                    max_restarts=0, max_task_retries=0)

    def _fits(self) -> int:
        """Actors the cluster's resources allow."""
        res, opt = self.ray.cluster_resources(), self._actor_options()
        n = [int(res.get("CPU", 0) // opt["num_cpus"])] if opt["num_cpus"] else []
        if opt["num_gpus"]:
            n.append(int(res.get("GPU", 0) // opt["num_gpus"]))
        if opt["memory"] and "memory" in res:
            n.append(int(res["memory"] // opt["memory"]))
        return min(n) if n else 1

    def _new_actor(self):
        return self.ray.remote(_Actor).options(**self._actor_options()).remote(self.execute_fn, self.chunk_fn)

    def _start(self) -> list:
        if self._actors is None:
            fits = self._fits()
            n = self.workers if self.workers is not None else fits
            if n < 1 or fits < 1:
                raise ValueError(f"the Ray cluster cannot hold one worker: each reserves {self._actor_options()} "
                                 f"and the cluster has {self.ray.cluster_resources()}; pass memory_per_worker / "
                                 "--worker-memory or add nodes")
            self._actors = [self._new_actor() for _ in range(n)]
        return self._actors

    def run(self, chunks: Iterable[Chunk], on_outcome: OnOutcome) -> None:
        ray = self.ray
        from ray.exceptions import RayActorError

        actors = self._start()
        queue = [list(c) for c in chunks][::-1]
        tries = {t.task_id: 0 for c in queue for t in c}
        idle = list(range(len(actors)))
        inflight: dict = {}                       # ObjectRef -> (chunk, actor index)
        while queue or inflight:
            while idle and queue:
                i, chunk = idle.pop(), queue.pop()
                inflight[actors[i].run.remote(chunk)] = (chunk, i)
            done, _ = ray.wait(list(inflight), num_returns=1)
            chunk, i = inflight.pop(done[0])
            try:
                outs = ray.get(done[0])
            except Exception as e:  # noqa: BLE001 - every Ray failure type (RayError and its kin) is per task
                if isinstance(e, RayActorError) or not isinstance(e, ray.exceptions.RayTaskError):
                    try:
                        ray.kill(actors[i])
                    except Exception:  # noqa: BLE001
                        pass
                    actors[i] = self._new_actor()     # the task's actor (or its node) is gone: a fresh one
                charge(chunk, tries, self.max_retries, queue, on_outcome, self.name,
                       lambda n: f"failed {n} times on Ray: {type(e).__name__}: {str(e).splitlines()[0][:300]}")
                idle.append(i)
                continue
            idle.append(i)
            for t, out in zip(chunk, outs):
                on_outcome(t, out)

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


def make_engine(engine: str = "local", workers: int | None = None, address: str | None = None,
                execute_fn=execute, chunk_fn=execute_chunk, **kw):
    """``local`` (``workers == 1``: in-process; more: processes) or ``ray``; ``execute_fn`` runs a chunk
    of one task, ``chunk_fn`` a chunk of more (:func:`kvlab.sweep.task.run_chunk`)."""
    if workers is not None and (isinstance(workers, bool) or not isinstance(workers, int) or workers < 1):
        raise ValueError(f"--workers={workers!r} must be a positive int")
    if engine == "local":
        if workers is None or workers == 1:
            return LocalEngine(execute_fn, chunk_fn=chunk_fn)
        return ProcessEngine(workers, execute_fn, chunk_fn=chunk_fn, **kw)
    if engine == "ray":
        return RayEngine(workers, address, execute_fn, chunk_fn=chunk_fn, **kw)
    raise ValueError(f"--engine={engine!r} must be 'local' or 'ray'")
