"""Sweeps: a grid of decode configs over a prompt set, run resumably on this machine or on Ray,
every finished (config, prompt, seed) one row of the results table (:mod:`kvlab.results`).

* :mod:`.spec` — the grid spec (TOML / flags) → configs → tasks with idempotent row ids
* :mod:`.families` — which policy families a grid can sweep (registries)
* :mod:`.task` — one task: models once per process, run + score through the run store, a row
* :mod:`.engines` — local (in-process / processes) and Ray (actors)
* :mod:`.runner` — skip finished rows, run the rest with a progress bar, write rows as they finish
* :mod:`.tables` — the blog's tables and the Pareto figure from results rows
"""
from .runner import SweepReport, run_sweep
from .spec import GridSpec, SpecError, load_spec, parse_spec

__all__ = ["GridSpec", "SpecError", "SweepReport", "load_spec", "parse_spec", "run_sweep"]
