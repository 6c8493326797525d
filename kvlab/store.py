"""Finished runs on disk, keyed by their full config, the code version and the machine.

A run's file is ``<config key>.<context key>.json``: the config key is the SHA-256 of its config
(models' fingerprints, prompt, decode settings, policy …) as canonical JSON; the context key hashes
:data:`kvlab.provenance.CODE_VERSION` and :func:`kvlab.provenance.machine_key`. So

* a change of decoding or scoring (a ``CODE_VERSION`` bump) makes every stored run stale: it is
  recomputed, never silently reused;
* a run timed on other hardware (or other torch/transformers versions) is not reused either, so
  the timing columns of a table always come from this machine. (Quality columns would survive a
  move, but a run is one record: it is recomputed whole.)

Each file holds ``{"config", "result", "meta"}`` (``meta``: code version, git commit, dirty
flag, machine info, time written), written atomically, so a rerun reuses what is there and a
killed run loses only the unfinished one. Files of older layouts (``<config key>.json`` without
``meta``) are still read by :meth:`RunStore.records`, never reused by :meth:`RunStore.get`.

The default store is ``$KVLAB_RUNS``, else the project's ``runs/`` when kvlab runs from a source
checkout (found from the package's location, not the working directory, so the CLI,
``make figures`` and the notebooks share it), else ``<kvlab cache dir>/runs``.
"""
from __future__ import annotations

import hashlib
import json
import os
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

from . import provenance


def run_key(config: dict) -> str:
    """The config's key (independent of code version and machine)."""
    blob = json.dumps(config, sort_keys=True, default=str, separators=(",", ":"))
    return hashlib.sha256(blob.encode()).hexdigest()[:24]


def context_key() -> str:
    """Key of what besides the config decides a run: code version + timing machine."""
    blob = f"{provenance.CODE_VERSION}|{provenance.machine_key()}"
    return hashlib.sha256(blob.encode()).hexdigest()[:10]


def default_root() -> Path:
    """``$KVLAB_RUNS``; else ``<project>/runs`` from a source checkout; else ``<kvlab cache>/runs``."""
    env = os.environ.get("KVLAB_RUNS")
    if env:
        return Path(env).expanduser()
    root = provenance.source_root()
    if root is not None:
        return root / "runs"
    from .models import cache_dir

    return cache_dir() / "runs"


@dataclass(frozen=True)
class StoredRun:
    """One stored file: its config, result, provenance ``meta`` (``{}`` for old-layout files)."""

    config: dict
    result: dict
    meta: dict
    path: Path

    @property
    def current(self) -> bool:
        """Written by this code version on timing-equivalent hardware (what :meth:`RunStore.get` reuses)."""
        return (self.meta.get("code_version") == provenance.CODE_VERSION
                and self.meta.get("machine_key") == provenance.machine_key())


@dataclass
class StoreStats:
    """What :meth:`RunStore.get_or_run` did in this process."""

    reused: int = 0
    computed: int = 0
    replaced: int = 0     # of ``computed``: a run of the same config existed from older code or other hardware
    commits: set = field(default_factory=set)   # commits ("<sha>[+dirty]") of the runs reused or written

    def summary(self) -> str:
        s = f"{self.reused} reused, {self.computed} computed"
        if self.replaced:
            s += f" ({self.replaced} of them stale: older code version or another machine)"
        if self.commits:
            s += f"; runs from commit(s) {', '.join(sorted(str(c) for c in self.commits))}"
        return s


# Every RunStore of this process adds its counts here too, per store root (the CLI prints them).
SESSION: dict[Path, StoreStats] = {}


def _label(meta: dict) -> str:
    sha = meta.get("git_commit")
    return "unknown commit" if not sha else sha + ("+dirty" if meta.get("git_dirty") else "")


def _canon(config: dict) -> dict:
    return json.loads(json.dumps(config, default=str))


class RunStore:
    def __init__(self, root=None):
        self.root = Path(root).expanduser() if root is not None else default_root()
        self.stats = StoreStats()

    def path(self, config: dict) -> Path:
        """Where ``config``'s run for this code version and machine lives."""
        return self.root / f"{run_key(config)}.{context_key()}.json"

    @staticmethod
    def _read(p: Path) -> dict | None:
        try:
            data = json.loads(p.read_text())
        except (OSError, json.JSONDecodeError):  # a torn file from a crash: treat as missing
            return None
        return data if isinstance(data, dict) and "config" in data and "result" in data else None

    def _get(self, config: dict) -> StoredRun | None:
        p = self.path(config)
        data = self._read(p)
        if data is None or data["config"] != _canon(config):
            return None
        rec = StoredRun(config=data["config"], result=data["result"], meta=data.get("meta") or {}, path=p)
        return rec if rec.current else None

    def get(self, config: dict) -> dict | None:
        """The stored result for ``config`` from this code version and machine, else ``None``."""
        rec = self._get(config)
        return None if rec is None else rec.result

    def put(self, config: dict, result: dict) -> Path:
        self.root.mkdir(parents=True, exist_ok=True)
        p = self.path(config)
        meta = {**provenance.stamp(), "written": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
        fd, tmp = tempfile.mkstemp(prefix=p.name, suffix=".tmp", dir=self.root)
        try:
            with os.fdopen(fd, "w") as f:
                json.dump({"config": config, "result": result, "meta": meta}, f, default=str)
            os.replace(tmp, p)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
        return p

    def has_stale(self, config: dict) -> bool:
        """A run of ``config`` is stored, but from another code version or machine."""
        mine = self.path(config).name
        key = run_key(config)
        return self.root.is_dir() and any(p.name != mine for p in self.root.glob(f"{key}*.json"))

    def get_or_run(self, config: dict, fn) -> dict:
        """The stored result for ``config``, or ``fn()`` stored under it (counted in :attr:`stats`)."""
        both = (self.stats, SESSION.setdefault(self.root.resolve(), StoreStats()))
        hit = self._get(config)
        if hit is not None:
            for st in both:
                st.reused += 1
                st.commits.add(_label(hit.meta))
            return hit.result
        stale = self.has_stale(config)
        result = fn()
        self.put(config, result)
        for st in both:
            st.computed += 1
            st.replaced += int(stale)
            st.commits.add(provenance.source_label())
        return result

    def records(self, current_only: bool = False) -> Iterator[StoredRun]:
        """Every readable stored run (any code version, machine or file layout), in file-name order;
        ``current_only``: only those :meth:`get` would reuse. Torn files are skipped."""
        if not self.root.is_dir():
            return
        for p in sorted(self.root.glob("*.json")):
            data = self._read(p)
            if data is None:
                continue
            rec = StoredRun(config=data["config"], result=data["result"], meta=data.get("meta") or {}, path=p)
            if not current_only or rec.current:
                yield rec

    def __iter__(self) -> Iterator[tuple[dict, dict]]:
        """``(config, result)`` of the runs this code version and machine would reuse."""
        for rec in self.records(current_only=True):
            yield rec.config, rec.result

    def __len__(self) -> int:
        """Runs stored for this code version and machine."""
        return len(list(self.root.glob(f"*.{context_key()}.json"))) if self.root.is_dir() else 0

    def __repr__(self) -> str:
        return f"RunStore({str(self.root)!r})"
