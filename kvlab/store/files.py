"""Files of the run store (:mod:`kvlab.store.results`): Parquet written whole under a temporary name and renamed into
place (so concurrent writers never tear a file), cell values any row's column can hold, sweep tags as directory names."""
from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from urllib.parse import quote

import pandas as pd


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


def _atomic_parquet(df: pd.DataFrame, target: Path, metadata: dict | None = None) -> Path:
    import pyarrow as pa
    import pyarrow.parquet as pq

    table = pa.Table.from_pandas(_arrow_safe(df), preserve_index=False)
    if metadata:
        table = table.replace_schema_metadata({**(table.schema.metadata or {}), **metadata})
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
    os.close(fd)
    try:
        pq.write_table(table, tmp)
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


def _tag_dir(tag: str) -> str:
    if not isinstance(tag, str) or not tag.strip():
        raise ValueError(f"tag={tag!r} must be a non-empty string (a sweep name)")
    return quote(tag, safe="")
