"""The results table: one row per finished (config, prompt, seed), as Parquet.

Layout under the results root (``$KVLAB_RESULTS``, default ``<run store>/results``)::

    rows/<row_id>.parquet       one row each, written atomically (tmp file + rename)
    traces/<row_id>.parquet     that run's per-step trace (written before its row)
    compact/part-<hash>.parquet many rows merged by :meth:`Results.compact`

Every writer writes only whole files under a fresh temporary name and renames them into place, so
any number of concurrent sweeps (or Ray drivers) can share a root without corrupting it; a row
id is a hash of what the row *means* (models, prompt, decode config, code version), so writing a
row twice replaces it with an equivalent one instead of duplicating it. :func:`load` reads the
compacted parts plus the loose rows and keeps the newest row per id.

The per-run JSON store (:mod:`kvlab.store`) stays valid: :meth:`Results.import_store` turns its
runs into rows (``engine == "import"``) without rerunning anything.
"""
from __future__ import annotations

import hashlib
import json
import os
import tempfile
from pathlib import Path

import pandas as pd

from .store import default_root as _runs_root

ROWS, TRACES, COMPACT = "rows", "traces", "compact"
AUTO_COMPACT = 512   # loose row files above which load() compacts


def default_root() -> Path:
    """``$KVLAB_RESULTS``, else ``results/`` inside the run store (``$KVLAB_RUNS`` or ``runs/``)."""
    env = os.environ.get("KVLAB_RESULTS")
    return Path(env) if env else _runs_root() / "results"


def _arrow_safe(df: pd.DataFrame) -> pd.DataFrame:
    """Object columns whose values mix kinds (e.g. a policy parameter that is a string in one row
    and a number in another) become strings, so any set of rows can be written to one file."""
    out = None
    for c in df.columns:
        if df[c].dtype != object:
            continue
        kinds = {("num" if isinstance(v, (int, float)) and not isinstance(v, bool) else type(v).__name__)
                 for v in df[c] if v is not None and not (isinstance(v, float) and v != v)}
        if len(kinds) > 1:
            out = df.copy() if out is None else out
            out[c] = [None if v is None or (isinstance(v, float) and v != v) else str(v) for v in df[c]]
    return df if out is None else out


def _atomic_parquet(df: pd.DataFrame, target: Path) -> Path:
    import pyarrow as pa
    import pyarrow.parquet as pq

    df = _arrow_safe(df)

    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
    os.close(fd)
    try:
        pq.write_table(pa.Table.from_pandas(df, preserve_index=False), tmp)
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target


def _clean(v):
    """A cell value Parquet can store in a column of any row (dicts/lists as JSON)."""
    if isinstance(v, (dict, list, tuple)):
        return json.dumps(v, default=str)
    return v


class Results:
    """A results root: write rows and traces, read them back as DataFrames."""

    def __init__(self, root=None):
        self.root = Path(root) if root is not None else default_root()

    # ----------------------------------------------------------------- writing
    def write(self, row: dict, trace: pd.DataFrame | None = None) -> Path:
        """Store one row (and its per-step trace first, so a row always has its trace)."""
        rid = row.get("row_id")
        if not isinstance(rid, str) or not rid:
            raise ValueError("row needs a non-empty 'row_id' string")
        if trace is not None and len(trace):
            _atomic_parquet(trace, self.root / TRACES / f"{rid}.parquet")
        df = pd.DataFrame([{k: _clean(v) for k, v in row.items()}])
        return _atomic_parquet(df, self.root / ROWS / f"{rid}.parquet")

    # ----------------------------------------------------------------- reading
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
        if "row_id" in df and "finished_at" in df:
            df = df.sort_values("finished_at", kind="stable").drop_duplicates("row_id", keep="last")
        return df.reset_index(drop=True)

    def load(self, compact: bool | None = None) -> pd.DataFrame:
        """Every stored row (newest per ``row_id``). ``compact=None`` compacts when more than
        :data:`AUTO_COMPACT` loose row files exist; ``True`` always, ``False`` never."""
        loose = self._loose()
        if compact or (compact is None and len(loose) > AUTO_COMPACT):
            self.compact()
            loose = self._loose()
        return self._read(self._parts() + loose)

    def row_ids(self, status: str | None = "ok") -> set[str]:
        """Ids of stored rows (only those with ``status`` unless None): what a resumed sweep skips."""
        if not self._parts():
            # fast path: only loose files; a file's name is its row id
            if status is None:
                return {p.stem for p in self._loose()}
        df = self.load(compact=False)
        if not len(df):
            return set()
        if status is not None and "status" in df:
            df = df[df["status"] == status]
        return set(df["row_id"])

    def trace(self, row_id: str) -> pd.DataFrame:
        """The per-step trace of one row (one line per generated token)."""
        p = self.root / TRACES / f"{row_id}.parquet"
        if not p.is_file():
            raise FileNotFoundError(f"row_id={row_id!r} has no trace under {self.root / TRACES}")
        return pd.read_parquet(p)

    def __len__(self) -> int:
        return len(self.load(compact=False))

    # ----------------------------------------------------------------- maintenance
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
        digest = hashlib.sha256(",".join(sorted(df["row_id"].astype(str))).encode()).hexdigest()[:16]
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

    def import_store(self, store_root=None) -> int:
        """Rows for every run in a per-run JSON store (:class:`kvlab.store.RunStore`, any code
        version or file layout) that has no row yet. Returns how many rows were written. Nothing is
        rerun; the JSON files stay. A row's ``code_version`` / ``machine_key`` say where it came from."""
        from .store import RunStore, run_key
        from .sweep.task import row_from_stored

        store = RunStore(store_root) if store_root is not None else RunStore()
        have = self.row_ids(status=None)
        n = 0
        for rec in store.records():
            built = row_from_stored(run_key(rec.config), {"config": rec.config, "result": rec.result,
                                                          "meta": rec.meta})
            if built is None or built[0]["row_id"] in have:
                continue
            self.write(*built)
            have.add(built[0]["row_id"])
            n += 1
        return n

def load(root=None, compact: bool | None = None) -> pd.DataFrame:
    """The results table as a DataFrame (see :class:`Results`)."""
    return Results(root).load(compact=compact)


def trace(row_id: str, root=None) -> pd.DataFrame:
    """One row's per-step trace."""
    return Results(root).trace(row_id)
