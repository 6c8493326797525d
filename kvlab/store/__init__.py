"""The run store: every finished run of kvlab, one key each (:mod:`.results`), its rows (:mod:`.rows`),
its provenance (:mod:`.provenance`) and a reader for older JSON runs (:mod:`.legacy`).

There is one store: :class:`kvlab.store.results.Store` (``RunStore`` here is the same class). Only this
package writes under the store's root (``$KVLAB_RUNS``, else the project's ``runs/``). Per-run JSON files
(``<config key>.<context key>.json``) are read only, by :func:`read_json_runs`, so
:meth:`kvlab.store.results.Store.import_json` (``python -m kvlab figures --from-results --import-runs DIR``)
can migrate them.
"""
from __future__ import annotations

from kvlab.store.legacy import read_json_runs
from kvlab.store.results import SESSION, CodeVersionMismatch, Store, StoredRun, StoreStats, default_root, run_key

RunStore = Store

__all__ = ["RunStore", "Store", "StoredRun", "StoreStats", "SESSION", "CodeVersionMismatch", "default_root",
           "run_key", "read_json_runs"]
