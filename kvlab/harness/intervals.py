"""How many intervals a page's quoted table holds, and which are fragile (issue 37).

README's key-results table quotes paired differences as ``Δ +0.087 [+0.054, +0.121] (MDE 0.05)``: each
bracket is an unadjusted bootstrap 95 % interval, and a table of ~20 of them will hold about one that
excludes 0 by chance. :func:`audit_intervals` reads every ``[lo, hi]`` in the Markdown table rows of one
section, pairs it with the ``(MDE x)`` that follows it in the same cell (if any) and marks it **fragile**
when an endpoint lies within a tenth of the MDE of zero (:data:`FRAGILE_FRACTION`): a result that one
prompt more or less could move across 0. Intervals quoted without an MDE cannot be judged this way
(``fragile`` is None). :func:`audit_section` cuts the section out of a page by its heading;
:func:`interval_summary` says it in one sentence. Reads text only.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

FRAGILE_FRACTION = 0.1           # an endpoint within FRAGILE_FRACTION × MDE of zero: fragile

_NUM = r"[+\-−]?\d+(?:\.\d+)?"
_INTERVAL = re.compile(rf"\[\s*({_NUM})\s*,\s*({_NUM})\s*\]")
_MDE = re.compile(rf"\(MDE\s+({_NUM})\)")


def _num(s: str) -> float:
    return float(s.replace("−", "-"))


@dataclass(frozen=True)
class QuotedInterval:
    """One ``[lo, hi]`` quoted in a table row: the row's first cell, the endpoints, the MDE quoted after it."""

    row: str
    lo: float
    hi: float
    mde: float | None = None

    @property
    def excludes_zero(self) -> bool:
        return self.lo > 0 or self.hi < 0

    @property
    def nearest_endpoint(self) -> float:
        """|endpoint| closest to zero."""
        return min(abs(self.lo), abs(self.hi))

    @property
    def fragile(self) -> bool | None:
        """An endpoint within a tenth of the MDE of zero; None when no MDE is quoted with it."""
        if self.mde is None:
            return None
        return self.nearest_endpoint <= FRAGILE_FRACTION * self.mde


def _cells(line: str) -> list[str]:
    return [c.strip() for c in line.strip().strip("|").split("|")]


def audit_intervals(markdown: str) -> list[QuotedInterval]:
    """Every interval in the Markdown table rows of ``markdown`` (header and rule rows skipped), in order."""
    out = []
    for line in markdown.splitlines():
        if not line.lstrip().startswith("|") or set(line.strip()) <= set("|-: "):
            continue
        cells = _cells(line)
        for c in cells[1:]:
            found = list(_INTERVAL.finditer(c))
            for k, m in enumerate(found):
                end = found[k + 1].start() if k + 1 < len(found) else len(c)
                mde = _MDE.search(c, m.end(), end)
                out.append(QuotedInterval(cells[0], _num(m.group(1)), _num(m.group(2)),
                                          None if mde is None else _num(mde.group(1))))
    return out


def section(markdown: str, heading: str) -> str:
    """The text under the Markdown heading ``heading`` (any level, exact title) up to the next heading of
    the same or a higher level; a ValueError naming the headings there are when it is missing."""
    lines = markdown.splitlines()
    heads = [(i, len(m.group(1)), m.group(2).strip()) for i, l in enumerate(lines)
             if (m := re.match(r"^(#+)\s+(.*)$", l))]
    for j, (i, level, title) in enumerate(heads):
        if title == heading:
            end = next((k for k, lv, _ in heads[j + 1:] if lv <= level), len(lines))
            return "\n".join(lines[i + 1:end])
    raise ValueError(f"heading={heading!r} is not a heading of the page (headings: {', '.join(t for *_, t in heads)})")


def audit_section(path: Path | str, heading: str = "Key results") -> list[QuotedInterval]:
    """:func:`audit_intervals` of one section of the page at ``path`` (default README's key results)."""
    return audit_intervals(section(Path(path).read_text(), heading))


def interval_summary(intervals: list[QuotedInterval]) -> str:
    """One sentence: how many intervals, how many exclude 0, which are fragile, how many have no MDE."""
    n = len(intervals)
    fragile = [q for q in intervals if q.fragile]
    no_mde = sum(q.fragile is None for q in intervals)
    text = (f"{n} unadjusted 95 % intervals, {sum(q.excludes_zero for q in intervals)} of them excluding 0; "
            f"{len(fragile)} fragile (an endpoint within {FRAGILE_FRACTION:g} × MDE of 0)")
    if fragile:
        text += ": " + "; ".join(f"{q.row} [{q.lo:+g}, {q.hi:+g}] (MDE {q.mde:g})" for q in fragile)
    if no_mde:
        text += f"; {no_mde} quoted without an MDE (not judged)"
    return text + "."


__all__ = ["FRAGILE_FRACTION", "QuotedInterval", "audit_intervals", "section", "audit_section", "interval_summary"]
