"""A reader for the per-run JSON files of older kvlab (``python -m kvlab store import`` migrates them)."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Iterator


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
