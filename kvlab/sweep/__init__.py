"""Sweeps: a grid of decode configs over a prompt set, run resumably on this machine or on Ray,
every finished (config, prompt, seed) one row of the results table (:mod:`kvlab.store.results`). Only the
driver writes the run store; workers return their runs to it.

* :mod:`.spec` — the grid spec (TOML / flags) → configs → tasks with idempotent row ids
* :mod:`.families` — which policy families a grid can sweep (registries)
* :mod:`.students` — the student axis (variant × prune shape), the trained-student check before a sweep
* :mod:`.task` — one task: models once per process, run + score through the run store, a row
* :mod:`.engines` — local (in-process / processes) and Ray (actors)
* :mod:`.runner` — skip finished rows, run the rest with a progress bar, write rows as they finish
* :mod:`.tables` — the blog's tables and the Pareto figure from results rows
* :mod:`.command` — ``python -m kvlab sweep`` and ``figures --from-results``
* :mod:`.bench` — ``python -m kvlab bench sweep``

Names below are imported lazily (the CLI builds its parser without importing torch).
"""
from __future__ import annotations

_EXPORTS = {"GridSpec": ".spec", "SpecError": ".spec", "load_spec": ".spec", "parse_spec": ".spec",
            "SweepReport": ".runner", "run_sweep": ".runner"}

__all__ = sorted(_EXPORTS)


def __getattr__(name):
    if name in _EXPORTS:
        import importlib

        return getattr(importlib.import_module(_EXPORTS[name], __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
