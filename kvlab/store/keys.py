"""Run keys and records of the run store (:mod:`kvlab.store.results`): where the store lives, the key of a run's
config and code version, a stored run, and what a process's stores did (:class:`StoreStats`)."""
from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass, field
from pathlib import Path

from kvlab.store import provenance


def default_root() -> Path:
    """``$KVLAB_RUNS``; else ``<project>/runs`` from a source checkout; else ``<kvlab cache>/runs``."""
    env = os.environ.get("KVLAB_RUNS")
    if env:
        return Path(env).expanduser()
    root = provenance.source_root()
    if root is not None:
        return root / "runs"
    from kvlab.core.models import cache_dir

    return cache_dir() / "runs"


def _canon(config: dict) -> dict:
    return json.loads(json.dumps(config, default=str))


def config_digest(config: dict) -> str:
    blob = json.dumps(config, sort_keys=True, default=str, separators=(",", ":"))
    return hashlib.sha256(blob.encode()).hexdigest()[:24]


def code_digest(code_version: str | None = None) -> str:
    v = provenance.CODE_VERSION if code_version is None else code_version
    return hashlib.sha256(str(v).encode()).hexdigest()[:8]


def run_key(config: dict, code_version: str | None = None) -> str:
    """The run's key: its config's digest and the code version's (default: this process's)."""
    return f"{config_digest(config)}-{code_digest(code_version)}"


class CodeVersionMismatch(ValueError):
    """A run computed by another code version than this process's (e.g. a stale cluster worker)."""


@dataclass(frozen=True)
class StoredRun:
    """One stored run: its key, config, result and provenance ``meta``."""

    key: str
    config: dict
    result: dict
    meta: dict
    path: Path

    @property
    def current(self) -> bool:
        """Written by this code version on timing-equivalent hardware (what :meth:`Store.get` reuses)."""
        return (self.meta.get("code_version") == provenance.CODE_VERSION
                and self.meta.get("machine_key") == provenance.machine_key())


@dataclass
class StoreStats:
    """What :meth:`Store.get_or_run` did in this process."""

    reused: int = 0
    computed: int = 0
    replaced: int = 0     # of ``computed``: this run was stored, timed on another machine / from older code
    commits: set = field(default_factory=set)   # commits ("<sha>[+dirty]") of the runs reused or written

    def summary(self) -> str:
        s = f"{self.reused} reused, {self.computed} computed"
        if self.replaced:
            s += f" ({self.replaced} of them stale: older code version or another machine)"
        if self.commits:
            s += f"; runs from commit(s) {', '.join(sorted(str(c) for c in self.commits))}"
        return s


# Every Store of this process adds its counts here too, per root (the CLI prints them).
SESSION: dict[Path, StoreStats] = {}
