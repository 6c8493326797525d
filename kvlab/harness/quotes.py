"""The building blocks of the numbers quoted in README.md and docs/*.md, shared by every study's quotes.

Each study says which of its tables the pages quote, in ``kvlab/studies/<study>/quotes.py``: ``VIEWS`` (a
:class:`View` — a handful of columns of one ``figures/*.csv`` with plain headers — or a function of the
figures folder returning Markdown) and, where the study has findings in README's key-results table,
``key_results(figures)`` (its rows: what, result, table). Here: reading a table (:func:`read`), picking one row
(:func:`pick`), formatting one cell (:func:`cell`), :class:`View`, the measured runs kept under
``docs/measured/`` (:func:`jsonl`, :func:`measured_note`) and :class:`DocsError`. The generator that walks
every study's contributions and rewrites the pages is ``kvlab.viz.docs``. Reads only ``figures/*.csv`` and
``docs/measured/``; writes nothing.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence, Union

import pandas as pd

from kvlab.harness.tableview import fmt

ROOT = Path(__file__).resolve().parents[2]          # the project: README.md, docs/, figures/
FIGURES = ROOT / "figures"

Cell = Union[str, tuple]


class DocsError(ValueError):
    """A marker names a table, row or column that ``figures/`` does not have."""


# ----------------------------------------------------------------------------------------------- cells
def as_number(v):
    """``v`` as a float where it is a number; strings and None as they are."""
    if v is None or isinstance(v, str):
        return v
    try:
        f = float(v)
    except (TypeError, ValueError):
        return v
    return f


def is_missing(v) -> bool:
    """None or NaN."""
    return v is None or (isinstance(v, float) and math.isnan(v))


def whole_columns(df: pd.DataFrame) -> set[str]:
    """Numeric columns of whole numbers, not all zero (counts: ``8``, not ``8.000``)."""
    out = set()
    for c in df.columns:
        v = pd.to_numeric(df[c], errors="coerce").dropna()
        if df[c].dtype.kind in "iuf" and len(v) and (v % 1 == 0).all() and (v != 0).any():
            out.add(c)
    return out


def cell(row: pd.Series, spec: Cell, digits: int = 3, ints: frozenset | set = frozenset()) -> str:
    """One cell: ``"col"`` the value; ``(mean, std)`` ``mean ± std``; ``(d, lo, hi)`` ``+d [lo, hi]``;
    ``("text", col)`` the column's text as written (labels, interval strings). Columns in ``ints`` are
    printed without decimals."""
    if isinstance(spec, str):
        v = as_number(row[spec])
        if not is_missing(v) and spec in ints:
            return str(int(v))
        return "–" if is_missing(v) else (v if isinstance(v, str) else fmt(v, digits))
    if spec[0] == "text":
        v = row[spec[1]]
        return "–" if is_missing(as_number(v)) else str(v)
    if len(spec) == 2:
        mean, std = (as_number(row[c]) for c in spec)
        return fmt(mean, digits) if is_missing(std) else f"{fmt(mean, digits)} ± {fmt(std, digits)}"
    d, lo, hi = (as_number(row[c]) for c in spec)
    if is_missing(lo) or is_missing(hi):
        return fmt(d, digits, signed=True)
    return f"{fmt(d, digits, signed=True)} [{fmt(lo, digits, signed=True)}, {fmt(hi, digits, signed=True)}]"


def columns_of(spec: Cell) -> list[str]:
    """The columns a cell spec reads."""
    if isinstance(spec, str):
        return [spec]
    return [spec[1]] if spec[0] == "text" else list(spec)


# ----------------------------------------------------------------------------------------------- views
@dataclass(frozen=True)
class View:
    """Columns of one CSV for people: ``columns`` is ``[(header, cell spec), …]``; ``rows`` (optional) keeps
    only the rows whose first column is listed, in that order; ``digits`` per view."""

    csv: str
    columns: Sequence[tuple[str, Cell]]
    rows: Sequence[str] | None = None
    digits: int = 3
    note: str = ""

    def render(self, figures: Path) -> str:
        df = read(figures, self.csv)
        for _, spec in self.columns:
            for c in columns_of(spec):
                if c not in df.columns:
                    raise DocsError(f"figures/{self.csv}.csv has no column {c!r} (columns: {', '.join(df.columns)})")
        key = df.columns[0]
        if self.rows is not None:
            missing = [r for r in self.rows if r not in set(df[key].astype(str))]
            if missing:
                raise DocsError(f"figures/{self.csv}.csv has no row {missing[0]!r} in column {key!r}")
            df = df.set_index(df[key].astype(str)).loc[list(self.rows)].reset_index(drop=True)
        lines = ["| " + " | ".join(h for h, _ in self.columns) + " |",
                 "|" + "---|" * len(self.columns)]
        ints = whole_columns(df)
        for _, row in df.iterrows():
            lines.append("| " + " | ".join(cell(row, spec, self.digits, ints) for _, spec in self.columns) + " |")
        src = f"*Generated from `figures/{self.csv}.csv`" + (f"; {self.note}" if self.note else "") + ".*"
        return "\n".join(lines) + "\n\n" + src


# ---------------------------------------------------------------------------------------------- tables
def read(figures: Path, name: str) -> pd.DataFrame:
    """``figures/NAME.csv``; a :class:`DocsError` naming the job to run when it is missing."""
    path = Path(figures) / f"{name}.csv"
    if not path.exists():
        raise DocsError(f"{path} does not exist: run `make figures` (or the job that writes {name}) first")
    return pd.read_csv(path)


def pick(df: pd.DataFrame, row: str, csv: str) -> pd.Series:
    """The one row ``row`` names: a first-column value, ``col=value&col=value``, or ``#i`` (the i-th row)."""
    if row.startswith("#") and row[1:].isdigit():
        if int(row[1:]) >= len(df):
            raise DocsError(f"figures/{csv}.csv has {len(df)} rows, no row {row}")
        return df.iloc[int(row[1:])]
    conds = [c.split("=", 1) for c in row.split("&")] if "=" in row else [(df.columns[0], row)]
    mask = pd.Series(True, index=df.index)
    for col, val in conds:
        if col not in df.columns:
            raise DocsError(f"figures/{csv}.csv has no column {col!r} (row selector {row!r})")
        try:
            f = float(val)
            mask &= pd.to_numeric(df[col], errors="coerce").sub(f).abs().lt(1e-12) | (df[col].astype(str) == val)
        except ValueError:
            mask &= df[col].astype(str) == val
    hits = df[mask]
    if len(hits) != 1:
        raise DocsError(f"figures/{csv}.csv: row selector {row!r} matches {len(hits)} rows, not 1")
    return hits.iloc[0]


def quote(figures: Path, csv: str, row: str, spec: Cell, digits: int = 3) -> str:
    """One cell of one row of ``figures/CSV.csv`` (:func:`pick`, :func:`cell`)."""
    return cell(pick(read(figures, csv), row, csv), spec, digits)


def mde_note(r: pd.Series, col: str = "d_kl_forced_mde", digits: int = 2) -> str:
    """`` (MDE x)``: the smallest difference row ``r``'s prompts could detect, from column ``col`` (default the
    ``kl_forced`` one) at ``digits`` decimals; empty without one."""
    v = as_number(r.get(col))
    return "" if is_missing(v) else f" (MDE {fmt(v, digits)})"


def jsonl(rel: str) -> list[dict]:
    """The rows of a measured run kept under the project (``docs/measured/*.jsonl``)."""
    import json

    path = ROOT / rel
    if not path.is_file():
        raise DocsError(f"{path} does not exist: keep one run of its benchmark there (docs/benchmarks.md)")
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    if not rows:
        raise DocsError(f"{path} is empty")
    return rows


def measured_note(rows: list[dict], rel: str) -> str:
    """The note under a table of a kept measured run: its command, commit, device (and machine, where the run
    recorded it) and start."""
    r = rows[0]
    where = f" ({r['machine']})" if r.get("machine") else ""
    return (f"*One run of `{r.get('command', '?')}` at commit `{r.get('commit', '?')}`, {r.get('device', '?')} "
            f"{str(r.get('dtype', '')).replace('torch.', '')}{where}, started {r.get('utc', '?')}; from "
            f"[`{rel}`]({rel}).*")


__all__ = ["ROOT", "FIGURES", "Cell", "DocsError", "as_number", "is_missing", "whole_columns", "cell", "columns_of",
           "View", "read", "pick", "quote", "mde_note", "jsonl", "measured_note"]
