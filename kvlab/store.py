"""Finished runs on disk, keyed by their full config.

A run's key is the SHA-256 of its config (models' fingerprints, prompt, decode settings,
policy …) as canonical JSON. Each run is one JSON file written atomically, so a rerun reuses
what is there and a killed run loses only the unfinished one.
"""
from __future__ import annotations

import hashlib
import json
import os
import tempfile
from pathlib import Path


def run_key(config: dict) -> str:
    blob = json.dumps(config, sort_keys=True, default=str, separators=(",", ":"))
    return hashlib.sha256(blob.encode()).hexdigest()[:24]


def default_root() -> Path:
    """``$KVLAB_RUNS`` or ``runs/`` under the current directory."""
    return Path(os.environ.get("KVLAB_RUNS", "runs"))


class RunStore:
    def __init__(self, root=None):
        self.root = Path(root) if root is not None else default_root()

    def path(self, config: dict) -> Path:
        return self.root / f"{run_key(config)}.json"

    def get(self, config: dict) -> dict | None:
        p = self.path(config)
        if not p.is_file():
            return None
        try:
            data = json.loads(p.read_text())
        except json.JSONDecodeError:  # a torn file from a crash: treat as missing
            return None
        return data["result"] if data.get("config") == json.loads(json.dumps(config, default=str)) else None

    def put(self, config: dict, result: dict) -> Path:
        self.root.mkdir(parents=True, exist_ok=True)
        p = self.path(config)
        fd, tmp = tempfile.mkstemp(prefix=p.name, dir=self.root)
        with os.fdopen(fd, "w") as f:
            json.dump({"config": config, "result": result}, f, default=str)
        os.replace(tmp, p)
        return p

    def get_or_run(self, config: dict, fn) -> dict:
        """The stored result for ``config``, or ``fn()`` stored under it."""
        hit = self.get(config)
        if hit is not None:
            return hit
        result = fn()
        self.put(config, result)
        return result

    def __len__(self) -> int:
        return len(list(self.root.glob("*.json"))) if self.root.is_dir() else 0
