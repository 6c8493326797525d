"""The run store: every finished run of kvlab, one key each (:mod:`.results`), its rows (:mod:`.rows`),
its provenance (:mod:`.provenance`) and a reader for older JSON runs (:mod:`.legacy`).

There is one store: :class:`kvlab.store.results.Store` (``RunStore`` here is the same class, kept so
``RunStore()`` / ``store.get_or_run`` / ``store.get`` keep working). Earlier versions kept every run
as ``<config key>.<context key>.json`` in the store root; :func:`read_json_runs` still reads those
files so :meth:`kvlab.store.results.Store.import_json` (``python -m kvlab store import``) can migrate
them. Nothing writes them any more.
"""
from __future__ import annotations

from .legacy import read_json_runs
from .results import SESSION, CodeVersionMismatch, Store, StoredRun, StoreStats, default_root, run_key

RunStore = Store

__all__ = ["RunStore", "Store", "StoredRun", "StoreStats", "SESSION", "CodeVersionMismatch", "default_root",
           "run_key", "read_json_runs"]
