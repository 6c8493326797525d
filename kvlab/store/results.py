"""The run store: every finished run of kvlab, one key each, queryable as one table.

Every consumer goes through it: :func:`kvlab.harness.experiment.scored_run` (the tables, the training
helper, the playground), ``make figures``, sweeps (their driver writes what workers return) and the
notebooks (:func:`load`). One run = one key = one row.

**Key.** :func:`run_key` of the run's config (:func:`kvlab.harness.experiment.run_config`: the models'
fingerprints — name, architecture, dtype *and device type*, so a CPU fp32 run is never reused for a
CUDA bf16 request —, the prompt, the decode settings with seed and policies) and
:data:`kvlab.store.provenance.CODE_VERSION`: ``<config digest>-<code digest>``. A ``CODE_VERSION`` bump
gives every run a new key, so stale runs are recomputed, never reused. Sweep membership is *not*
in the key: a run shared by two sweeps is one row carrying both sweeps' tags.

**Layout** under the root (``$KVLAB_RUNS``, else the project's ``runs/`` found from the package's
location — not the working directory —, else ``<kvlab cache dir>/runs``)::

    traces/<key>.parquet       the run's per-step trace; its schema metadata holds the exact
                               {"config", "result", "meta"} (what a reuse returns). Written first.
    rows/<key>.parquet         its row: config columns, scores, costs, provenance (written second)
    compact/part-<hash>.parquet   many rows merged by :meth:`Store.compact`
    tags/<sweep>/<key>         empty marker: the run belongs to that sweep

Every file is written whole under a temporary name and renamed into place, so concurrent writers
(tables, sweeps, the playground) never corrupt the root; writing a run twice replaces its row.

**Reuse.** :meth:`Store.get` returns a stored result only if the run was computed on timing-
equivalent hardware (:func:`kvlab.store.provenance.machine_key`), so a table's timing columns come from
this machine; ``any_machine=True`` (what sweeps use to skip finished work) drops that condition.
Runs computed elsewhere (sweep workers) are written by :meth:`Store.put` with the worker's
provenance; a run whose ``code_version`` differs from this process's is refused
(:class:`CodeVersionMismatch`).

API (also used by the playground)::

    store = Store()                          # or Store(root); kvlab.store.RunStore is the same class
    store.get_or_run(config, fn)             # stored result, or fn() stored (counted in store.stats)
    store.get(config) / store.put(config, result, meta=..., tags=..., extra=...)
    store.load(sweep=None) -> DataFrame      # one row per run; column `sweeps` = tuple of tags
    store.trace(key) -> DataFrame            # per-step trace; store.stored(key) -> StoredRun
    kvlab.store.results.load(root=None, sweep=None)   # the same table

The per-run JSON files of older kvlab versions (``<config key>.<context>.json``) are read by
:meth:`Store.import_json` (``python -m kvlab figures --from-results --import-runs DIR``) and never written.
"""
from __future__ import annotations

import hashlib
import json
import time
from pathlib import Path
from typing import Iterator
from urllib.parse import unquote

import pandas as pd

from kvlab.store import provenance
from kvlab.store.files import _atomic_parquet, _clean, _tag_dir
from kvlab.store.keys import (SESSION, CodeVersionMismatch, StoredRun, StoreStats, _canon, code_digest,  # noqa: F401
                              config_digest, default_root, run_key)

ROWS, TRACES, COMPACT, TAGS = "rows", "traces", "compact", "tags"
AUTO_COMPACT = 512   # loose row files above which load() compacts
META_KEY = b"kvlab.run"


class Store:
    """The run store at ``root`` (see the module docstring)."""

    def __init__(self, root=None):
        self.root = Path(root).expanduser() if root is not None else default_root()
        self.stats = StoreStats()

    def __repr__(self) -> str:
        return f"Store({str(self.root)!r})"

    # ----------------------------------------------------------------- keys and runs
    key = staticmethod(run_key)

    def _trace_path(self, key: str) -> Path:
        return self.root / TRACES / f"{key}.parquet"

    def stored(self, key: str) -> StoredRun | None:
        """The run stored under ``key`` (any machine), or None (also for a torn file)."""
        import pyarrow.parquet as pq

        p = self._trace_path(key)
        try:
            md = pq.read_schema(p).metadata or {}
            data = json.loads(md[META_KEY])
        except (OSError, KeyError, ValueError):
            return None
        return StoredRun(key, data["config"], data["result"], data.get("meta") or {}, p)

    def _get(self, config: dict, any_machine: bool) -> StoredRun | None:
        rec = self.stored(run_key(config))
        if rec is None or rec.config != _canon(config):
            return None
        if not any_machine and rec.meta.get("machine_key") != provenance.machine_key():
            return None
        return rec

    def get(self, config: dict, any_machine: bool = False) -> dict | None:
        """The stored result of ``config`` from this code version (and this machine unless
        ``any_machine``), else ``None``."""
        rec = self._get(config, any_machine)
        return None if rec is None else rec.result

    def has_stale(self, config: dict) -> bool:
        """A run of ``config`` is stored from another code version, or timed on another machine."""
        d = self.root / TRACES
        if not d.is_dir():
            return False
        mine = self._trace_path(run_key(config))
        if mine.is_file() and self._get(config, any_machine=False) is None:
            return True
        return any(p != mine for p in d.glob(f"{config_digest(config)}-*.parquet"))

    def put(self, config: dict, result: dict, *, meta: dict | None = None, tags=(), extra: dict | None = None) -> str:
        """Store a finished run (trace first, then its row); returns its key. ``meta``: provenance of
        the process that computed it (default: this one); a ``code_version`` other than this
        process's raises :class:`CodeVersionMismatch` and stores nothing. ``extra``: columns saying
        how it ran (engine, worker, wall_s …); ``tags``: sweeps it belongs to."""
        meta = dict(meta) if meta is not None else {**provenance.stamp(), "written": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
        if meta.get("code_version") != provenance.CODE_VERSION:
            raise CodeVersionMismatch(
                f"refused a run computed by kvlab code version {meta.get('code_version')!r} (this process runs "
                f"{provenance.CODE_VERSION!r}): the worker runs other code; ship this code to it "
                "(the Ray engine does so with a runtime_env) or update it")
        from kvlab.store.rows import build_row, trace_frame

        config = _canon(config)
        key = run_key(config)
        blob = json.dumps({"config": config, "result": result, "meta": meta}, default=str).encode()
        _atomic_parquet(trace_frame(result), self._trace_path(key), {META_KEY: blob})
        row = build_row(key, config, result, meta, {**(extra or {}), "finished_at": time.time()})
        _atomic_parquet(pd.DataFrame([{k: _clean(v) for k, v in row.items()}]), self.root / ROWS / f"{key}.parquet")
        self.tag(key, *tags)
        return key

    def put_error(self, key: str, columns: dict, error: str, *, meta: dict | None = None, tags=()) -> str:
        """Record a run that failed (status ``error``): a row only, never reused; a later success
        under the same key replaces it."""
        from kvlab.store.rows import meta_columns

        meta = meta if meta is not None else provenance.stamp()
        row = {"run_key": key, **columns, **meta_columns(meta), "status": "error", "error": error,
               "finished_at": time.time()}
        _atomic_parquet(pd.DataFrame([{k: _clean(v) for k, v in row.items()}]), self.root / ROWS / f"{key}.parquet")
        self.tag(key, *tags)
        return key

    def forget(self, keys) -> int:
        """Remove the rows and tags of ``keys`` that are not finished runs (error rows that no longer
        stand for anything, e.g. a sweep's load-error rows once the pair loads); returns how many rows
        went. Finished runs are never removed. A compaction running at the same moment may keep a row."""
        import pyarrow.parquet as pq

        keys = set(keys) - self.ok_keys()
        if not keys:
            return 0
        gone = set()
        for k in keys:
            p = self.root / ROWS / f"{k}.parquet"
            if p.is_file():
                p.unlink(missing_ok=True)
                gone.add(k)
        for part in self._parts():
            try:
                have = set(pq.read_table(part, columns=["run_key"]).column("run_key").to_pylist()) & keys
            except (OSError, KeyError, ValueError):
                continue
            if not have:
                continue
            df = pd.read_parquet(part)
            rest = df[~df["run_key"].isin(have)]
            if len(rest):
                digest = hashlib.sha256(",".join(sorted(rest["run_key"].astype(str))).encode()).hexdigest()[:16]
                _atomic_parquet(rest, self.root / COMPACT / f"part-{digest}.parquet")
            part.unlink(missing_ok=True)
            gone |= have
        d = self.root / TAGS
        if gone and d.is_dir():
            for td in d.iterdir():
                for k in gone:
                    (td / k).unlink(missing_ok=True)
        return len(gone)

    def tag(self, key: str, *tags: str) -> None:
        """Mark run ``key`` as part of each sweep in ``tags`` (idempotent)."""
        for t in tags:
            if isinstance(t, (list, tuple, set)):
                self.tag(key, *t)
                continue
            d = self.root / TAGS / _tag_dir(t)
            d.mkdir(parents=True, exist_ok=True)
            (d / key).touch()

    def reused(self, config: dict, tags=()) -> dict | None:
        """The stored result for ``config`` (this code version and machine), counted as reused in
        :attr:`stats` and tagged with ``tags``; ``None`` (nothing counted) when it must be computed."""
        hit = self._get(config, any_machine=False)
        if hit is None:
            return None
        for st in (self.stats, SESSION.setdefault(self.root.resolve(), StoreStats())):
            st.reused += 1
            st.commits.add(provenance.commit_label(hit.meta.get("git_commit"), hit.meta.get("git_dirty")))
        if tags:
            self.tag(hit.key, *tags)
        return hit.result

    def get_or_run(self, config: dict, fn, tags=(), extra: dict | None = None) -> dict:
        """The stored result for ``config``, or ``fn()`` stored under it (counted in :attr:`stats`;
        ``extra``: row columns saying how it ran; ``tags``: sweeps it belongs to)."""
        hit = self.reused(config, tags)
        if hit is not None:
            return hit
        both = (self.stats, SESSION.setdefault(self.root.resolve(), StoreStats()))
        stale = self.has_stale(config)
        result = fn()
        self.put(config, result, tags=tags, extra=extra)
        for st in both:
            st.computed += 1
            st.replaced += int(stale)
            st.commits.add(provenance.source_label())
        return result

    def ok_keys(self) -> set[str]:
        """Keys of every finished run (any machine): what a sweep skips."""
        d = self.root / TRACES
        return {p.stem for p in d.glob("*.parquet")} if d.is_dir() else set()

    def records(self, current_only: bool = False) -> Iterator[StoredRun]:
        """Every readable stored run in key order; ``current_only``: those :meth:`get` would reuse."""
        for key in sorted(self.ok_keys()):
            rec = self.stored(key)
            if rec is not None and (not current_only or rec.current):
                yield rec

    def __iter__(self) -> Iterator[tuple[dict, dict]]:
        """``(config, result)`` of the runs this code version and machine would reuse."""
        for rec in self.records(current_only=True):
            yield rec.config, rec.result

    def __len__(self) -> int:
        """Finished runs of this code version (any machine)."""
        suffix = f"-{code_digest()}"
        return sum(k.endswith(suffix) for k in self.ok_keys())

    # ----------------------------------------------------------------- the table
    def _loose(self) -> list[Path]:
        d = self.root / ROWS
        return sorted(d.glob("*.parquet")) if d.is_dir() else []

    def _parts(self) -> list[Path]:
        d = self.root / COMPACT
        return sorted(d.glob("part-*.parquet")) if d.is_dir() else []

    def _read(self, paths) -> pd.DataFrame:
        frames = []
        for p in paths:
            try:
                frames.append(pd.read_parquet(p))
            except FileNotFoundError:   # compacted away between listing and reading
                continue
        frames = [f for f in frames if len(f)]
        if not frames:
            return pd.DataFrame()
        df = pd.concat(frames, ignore_index=True, sort=False)
        if "run_key" in df and "finished_at" in df:
            df = df.sort_values("finished_at", kind="stable").drop_duplicates("run_key", keep="last")
        return df.reset_index(drop=True)

    def tags(self) -> dict[str, set[str]]:
        """Run key -> the sweeps it belongs to."""
        out: dict[str, set[str]] = {}
        d = self.root / TAGS
        if d.is_dir():
            for td in d.iterdir():
                if td.is_dir():
                    name = unquote(td.name)
                    for p in td.iterdir():
                        out.setdefault(p.name, set()).add(name)
        return out

    def load(self, sweep: str | None = None, compact: bool | None = None) -> pd.DataFrame:
        """One row per stored run (newest per key), with ``sweeps`` (sorted tuple of sweep tags);
        ``sweep``: only that sweep's runs. ``compact=None`` compacts when more than
        :data:`AUTO_COMPACT` loose row files exist; ``True`` always, ``False`` never."""
        loose = self._loose()
        if compact or (compact is None and len(loose) > AUTO_COMPACT):
            self.compact()
            loose = self._loose()
        df = self._read(self._parts() + loose)
        if not len(df):
            return df
        tags = self.tags()
        df["sweeps"] = [tuple(sorted(tags.get(k, ()))) for k in df["run_key"]]
        if sweep is not None:
            df = df[[sweep in t for t in df["sweeps"]]].reset_index(drop=True)
        return df

    def trace(self, key: str) -> pd.DataFrame:
        """The per-step trace of one run (one line per generated token)."""
        p = self._trace_path(key)
        if not p.is_file():
            raise FileNotFoundError(f"run_key={key!r} has no trace under {self.root / TRACES}")
        return pd.read_parquet(p)

    def compact(self) -> Path | None:
        """Merge every part and loose row into one part file; remove what it replaced.

        Safe beside running writers: the new part is written atomically before anything is
        removed, and a loose file is removed only if it is unchanged since it was read (a row
        rewritten meanwhile stays, and wins on read as the newer one)."""
        loose, parts = self._loose(), self._parts()
        if len(loose) + len(parts) <= 1 and not loose:
            return parts[0] if parts else None
        seen = {}
        for p in loose:
            try:
                st = p.stat()
                seen[p] = (st.st_mtime_ns, st.st_ino)
            except FileNotFoundError:
                continue
        df = self._read(parts + list(seen))
        if not len(df):
            return None
        digest = hashlib.sha256(",".join(sorted(df["run_key"].astype(str))).encode()).hexdigest()[:16]
        target = _atomic_parquet(df, self.root / COMPACT / f"part-{digest}.parquet")
        for p in parts:
            if p != target:
                p.unlink(missing_ok=True)
        for p, sig in seen.items():
            try:
                st = p.stat()
            except FileNotFoundError:
                continue
            if (st.st_mtime_ns, st.st_ino) == sig:
                p.unlink(missing_ok=True)
        return target

    # ----------------------------------------------------------------- old JSON files
    def import_json(self, json_root=None) -> int:
        """Migrate the per-run JSON files of older kvlab versions (under ``json_root``, default this
        root) that were written by this code version: each becomes a run of this store (same
        result and provenance; nothing is rerun). Returns how many were imported. Files of other
        code versions are skipped: their runs would not be reused anyway."""
        from kvlab.store.legacy import read_json_runs

        n = 0
        have = self.ok_keys()
        for config, result, meta in read_json_runs(json_root if json_root is not None else self.root):
            if meta.get("code_version") != provenance.CODE_VERSION or run_key(config) in have:
                continue
            self.put(config, result, meta=meta, extra={"engine": "import"})
            n += 1
        return n


Results = Store     # the name sweeps and notebook 07 used for the results table: the same store


def load(root=None, sweep: str | None = None, compact: bool | None = None) -> pd.DataFrame:
    """The store's table as a DataFrame (see :meth:`Store.load`)."""
    return Store(root).load(sweep=sweep, compact=compact)


def trace(key: str, root=None) -> pd.DataFrame:
    """One run's per-step trace."""
    return Store(root).trace(key)
