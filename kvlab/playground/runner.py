"""Background work for the playground: one job at a time, a newer job cancels the older one.
Owns one background thread; it touches no files.

A job is a function ``fn(job)`` run on a worker thread; it calls ``job.check()`` between decode
steps (raising :class:`Cancelled` once the job was superseded). :class:`ModelGate` lets the
step-through view use the models between two steps of a background run.
"""
from __future__ import annotations

import threading
import time
import traceback
from contextlib import contextmanager


class Cancelled(Exception):
    """Raised inside a job that was superseded by a newer one (or cancelled)."""


class Job:
    def __init__(self, gen: int, name: str = ""):
        self.gen = gen
        self.name = name
        self.thread: threading.Thread | None = None
        self.error: BaseException | None = None
        self.done = threading.Event()
        self._cancel = threading.Event()

    @property
    def cancelled(self) -> bool:
        return self._cancel.is_set()

    def cancel(self) -> None:
        self._cancel.set()

    def check(self) -> None:
        if self._cancel.is_set():
            raise Cancelled(self.name)

    def __repr__(self) -> str:
        state = "cancelled" if self.cancelled else ("done" if self.done.is_set() else "running")
        return f"Job({self.gen}, {self.name!r}, {state})"


class Runner:
    """Runs one job at a time on a daemon thread; :meth:`submit` cancels the job in flight and starts
    the new one once the old one has stopped (so two jobs never use the models at once).

    ``background=False`` runs jobs inline (deterministic, for scripts and tests).
    """

    def __init__(self, background: bool = True, on_error=None):
        self.background = background
        self.on_error = on_error
        self._lock = threading.Lock()
        self._job: Job | None = None
        self._gen = 0
        self._threads: list[threading.Thread] = []

    @property
    def current(self) -> Job | None:
        return self._job

    def is_current(self, job: Job) -> bool:
        return job is self._job and not job.cancelled

    def cancel(self) -> None:
        """Cancel the job in flight (if any); nothing is current afterwards."""
        with self._lock:
            self._gen += 1
            if self._job is not None:
                self._job.cancel()
            self._job = None

    def submit(self, fn, name: str = "") -> Job:
        with self._lock:
            self._gen += 1
            prev, job = self._job, Job(self._gen, name)
            if prev is not None:
                prev.cancel()
            self._job = job
        if not self.background:
            self._run(job, fn, None)
            return job
        job.thread = threading.Thread(target=self._run, args=(job, fn, prev), daemon=True, name=f"kvlab-{name}")
        self._threads = [t for t in self._threads if t.is_alive()] + [job.thread]
        job.thread.start()
        return job

    def _run(self, job: Job, fn, prev: Job | None) -> None:
        try:
            if prev is not None and prev.thread is not None:
                prev.thread.join()
            job.check()
            fn(job)
        except Cancelled:
            pass
        except BaseException as e:  # shown to the user; never kills the kernel
            job.error = e
            if self.on_error is not None:
                try:
                    self.on_error(job, e)
                except Exception:
                    traceback.print_exc()
            else:
                traceback.print_exc()
        finally:
            job.done.set()

    def wait(self, timeout: float | None = None) -> bool:
        """Wait until every started job has finished (True) or ``timeout`` passes (False)."""
        end = None if timeout is None else time.monotonic() + timeout
        for t in list(self._threads):
            t.join(None if end is None else max(0.0, end - time.monotonic()))
        alive = [t for t in self._threads if t.is_alive()]
        self._threads = alive
        return not alive


class ModelGate:
    """Exclusive use of the models, handed over between decode steps.

    A background run holds the gate for its whole run and calls :meth:`pause_point` between steps;
    if someone waits (the step-through view), the gate passes to them for one step and comes back.
    MC-dropout probes put hooks on the student, so two users must never run a forward at once.
    """

    def __init__(self):
        self._lock = threading.Lock()
        self._waiting = 0
        self._count = threading.Lock()

    @contextmanager
    def hold(self):
        with self._count:
            self._waiting += 1
        self._lock.acquire()
        with self._count:
            self._waiting -= 1
        try:
            yield
        finally:
            self._lock.release()

    def pause_point(self) -> None:
        """Called by the holder between steps: let a waiter in, then take the gate back."""
        if not self._waiting:
            return
        self._lock.release()
        try:
            deadline = time.monotonic() + 5.0
            while self._waiting and time.monotonic() < deadline:
                time.sleep(0.0005)
        finally:
            self._lock.acquire()
