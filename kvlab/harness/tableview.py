"""Tables for people: a chosen handful of columns with human headers, numbers formatted for reading.

``show(table, COLUMNS)`` returns a :class:`View`: it displays the chosen columns (HTML in Jupyter,
aligned text elsewhere) and keeps the whole frame one attribute away (``view.full``). Cells:

* ``"col"`` — the value (``-0.000`` prints as ``0.000``);
* ``("mean", "std")`` — ``mean ± std``; the ``± std`` is left out when every row has one prompt (n = 1);
* ``("d", "lo", "hi")`` — a paired difference with its 95 % interval, ``+0.031 [−0.014, +0.077]``;
  just the difference when n = 1 (one prompt has no interval).
"""
from __future__ import annotations

import math
import numbers
from dataclasses import dataclass
from typing import Mapping, Sequence, Union

import pandas as pd

Cell = Union[str, tuple]

N_COLUMNS = ("n_prompts", "n", "n_runs")


def fmt(x, digits: int = 3, signed: bool = False) -> str:
    """A number for reading: ``–`` for NaN/None, no ``-0.000``, ints without decimals."""
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "–"
    if isinstance(x, (bool, str)):
        return str(x)
    if isinstance(x, int) or (isinstance(x, float) and x.is_integer() and abs(x) >= 10 ** digits):
        return f"{int(x):+d}" if signed and x else str(int(x))
    s = f"{float(x):.{digits}f}"
    if float(s) == 0.0:
        return f"{0.0:.{digits}f}"              # not "-0.000", not "+0.000"
    return "+" + s if signed and not s.startswith("-") else s


def plural(n: int, word: str, many: str | None = None) -> str:
    """``1 prompt``, ``2 prompts``."""
    n = int(n)
    return f"{n} {word if n == 1 else (many or word + 's')}"


def single_prompt(table: pd.DataFrame) -> bool:
    """True when every row summarises one prompt (no spread, no interval)."""
    for c in N_COLUMNS:
        if c in table.columns:
            return bool((pd.to_numeric(table[c], errors="coerce").fillna(1) <= 1).all())
    return False


def _cell(row: pd.Series, spec: Cell, digits: int, one: bool) -> str:
    if isinstance(spec, str):
        return fmt(_num(row.get(spec)), digits) if spec in row.index else "–"
    if len(spec) == 2:                       # mean ± std
        mean, std = (_num(row.get(c)) for c in spec)
        if one or std is None or (isinstance(std, float) and math.isnan(std)):
            return fmt(mean, digits)
        return f"{fmt(mean, digits)} ± {fmt(std, digits)}"
    d, lo, hi = (_num(row.get(c)) for c in spec)   # paired difference [95 % interval]
    if one or lo is None or (isinstance(lo, float) and math.isnan(lo)):
        return fmt(d, digits, signed=True)         # one prompt, or too few pairs: no interval
    return f"{fmt(d, digits, signed=True)} [{fmt(lo, digits, signed=True)}, {fmt(hi, digits, signed=True)}]"


def _num(v):
    if isinstance(v, bool) or not isinstance(v, numbers.Real):
        return v
    return int(v) if isinstance(v, numbers.Integral) else float(v)


def _whole(col: pd.Series) -> bool:
    """A numeric column of whole numbers (counts), not all zero (a metric that happens to be 0)."""
    v = pd.to_numeric(col, errors="coerce")
    if col.dtype == bool or v.isna().all() or not (v.dropna() % 1 == 0).all():
        return False
    return bool((v.dropna() != 0).any()) and col.dtype.kind in "iuf"


@dataclass(frozen=True)
class View:
    """The shown columns (``frame``, strings) and the whole table (``full``)."""

    frame: pd.DataFrame
    full: pd.DataFrame
    caption: str = ""

    def _repr_html_(self) -> str:
        cap = f"<caption style='caption-side: bottom; text-align: left'>{self.caption}</caption>" if self.caption else ""
        html = self.frame.to_html(index=False, escape=True, border=0)
        return html.replace("<thead>", cap + "<thead>", 1) if cap else html

    def to_markdown(self) -> str:
        cols = list(self.frame.columns)
        lines = ["| " + " | ".join(cols) + " |", "|" + "|".join("---" for _ in cols) + "|"]
        lines += ["| " + " | ".join(str(v) for v in row) + " |" for row in self.frame.itertuples(index=False)]
        return "\n".join(lines) + ("\n\n" + self.caption if self.caption else "") + "\n"

    def __repr__(self) -> str:
        return self.frame.to_string(index=False) + ("\n" + self.caption if self.caption else "")


def show(table: pd.DataFrame, columns: Mapping[str, Cell] | Sequence[str], digits: int = 3, caption: str = "") -> View:
    """The chosen ``columns`` (header → cell spec, see the module doc) of ``table`` as a :class:`View`.
    Columns the table lacks are skipped; ``view.full`` is ``table`` itself."""
    if not isinstance(columns, Mapping):
        columns = {c: c for c in columns}
    one = single_prompt(table)
    keep = {h: s for h, s in columns.items()
            if all(c in table.columns for c in ((s,) if isinstance(s, str) else s[:1]))}
    if one:    # n = 1: a std column alone says nothing
        keep = {h: s for h, s in keep.items() if not (isinstance(s, str) and s.endswith("_std"))}
    counts = {s for s in keep.values() if isinstance(s, str) and _whole(table[s])}   # e.g. tokens, prompts: "8"
    rows = [{h: (fmt(int(r[s])) if s in counts and pd.notna(r[s]) else _cell(r, s, digits, one)) for h, s in keep.items()}
            for _, r in table.iterrows()]
    return View(pd.DataFrame(rows, columns=list(keep)), table, caption)


__all__ = ["fmt", "plural", "single_prompt", "show", "View"]
