"""The run store's old import path, and a reader for the per-run JSON files of older kvlab.

There is one store: :class:`kvlab.results.Store` (``RunStore`` here is the same class, kept so
``RunStore()`` / ``store.get_or_run`` / ``store.get`` keep working). Earlier versions kept every run
as ``<config key>.<context key>.json`` in the store root; :func:`read_json_runs` still reads those
files so :meth:`kvlab.results.Store.import_json` (``python -m kvlab store import``) can migrate
them. Nothing writes them any more.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Iterator

from .results import SESSION, CodeVersionMismatch, Store, StoredRun, StoreStats, default_root, run_key

RunStore = Store

__all__ = ["RunStore", "Store", "StoredRun", "StoreStats", "SESSION", "CodeVersionMismatch", "default_root",
           "run_key", "read_json_runs"]


def read_json_runs(root) -> Iterator[tuple[dict, dict, dict]]:
    """``(config, result, meta)`` of every readable old-layout JSON run file directly under ``root``
    (``meta`` is ``{}`` for files without one); torn files are skipped."""
    root = Path(root)
    if not root.is_dir():
        return
    for p in sorted(root.glob("*.json")):
        try:
            data = json.loads(p.read_text())
        except (OSError, json.JSONDecodeError):
            continue
        if isinstance(data, dict) and isinstance(data.get("config"), dict) and isinstance(data.get("result"), dict):
            yield data["config"], data["result"], data.get("meta") or {}
