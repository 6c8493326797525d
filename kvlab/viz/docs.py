"""Numbers in README.md and docs/*.md, generated from the committed tables (``figures/*.csv``), never typed.

A Markdown file marks each generated part; :func:`fill` rewrites what lies between the markers from the CSVs
and leaves everything else byte for byte:

* ``<!-- kvlab:table NAME -->`` … ``<!-- /kvlab:table -->`` — the table view ``NAME`` of :data:`VIEWS`
  (a handful of columns of one CSV with plain headers, every row, in the CSV's order); ``md:TABLE`` instead
  of a view name includes ``figures/TABLE.md`` as its job wrote it (a new table needs no view);
* ``<!-- kvlab:value CSV ROW COLUMNS [digits=N] -->`` … ``<!-- /kvlab:value -->`` — one number inline.
  ``ROW`` selects one row: a value of the CSV's first column (``periodic_T27``), ``col=value`` pairs
  joined by ``&`` (``p=0.1``), or ``#i`` for the i-th row; ``COLUMNS`` is one column (the value), two joined by ``,`` (``mean ± std``) or
  three (``d [lo, hi]``, a paired difference with its 95 % interval).

Each study contributes its views and its rows of README's key-results table from its own folder
(``kvlab/studies/<study>/quotes.py``: ``VIEWS`` and ``key_results``); :data:`STUDIES` lists them in a fixed
order and :data:`VIEWS` gathers them with the views of no study (``key_results``, ``phases``). The building
blocks (``View``, ``cell``, ``pick``, ``read``, ``DocsError``) are :mod:`kvlab.harness.quotes`.

Views select columns by name, so a table that gains columns or rows needs no change here; a column or row a
marker names that the table lacks is an error naming the file, the marker and the column. ``python -m kvlab
docs`` rewrites the files (``make figures`` runs it last, after the tables); ``python -m kvlab docs --check``
and ``tests/test_docs.py`` fail when a quoted number disagrees with its table. Reads only ``figures/*.csv``
and writes only the Markdown files it is given; no model, cache or run store is touched.
"""
from __future__ import annotations

import re
from pathlib import Path
from typing import Callable, Union

from kvlab.harness.quotes import (FIGURES, ROOT, DocsError, View, cell, jsonl, pick, read,  # noqa: F401
                                  whole_columns)
from kvlab.harness.tableview import fmt
from kvlab.studies.baselines import quotes as baselines
from kvlab.studies.bench import quotes as bench
from kvlab.studies.eviction import quotes as eviction
from kvlab.studies.mc import quotes as mc
from kvlab.studies.refresh import quotes as refresh
from kvlab.studies.training import quotes as training

# Every study's quotes, in the order their views are listed and their key results are shown in README.
STUDIES = (baselines, training, refresh, mc, eviction, bench)


def _key_results(figures: Path) -> str:
    """README's small table: one line per finding, each number from its own table, each study's rows from its
    ``key_results`` in :data:`STUDIES`' order. Decoder comparisons and refresh are read on ``kl_forced``
    (teacher-forced on a fixed reference, which loops cannot fool), each with its paired interval and the
    smallest difference detectable at that n (MDE)."""
    rows = [row for study in STUDIES for row in study.key_results(figures)]
    lines = ["| what | result | table |", "|---|---|---|"]
    # the third cell names a table under figures/ or, with a slash, a page of the project (a kept measured run's)
    lines += [f"| {a} | {b} | [`{Path(c).stem}`]({c if '/' in c else f'figures/{c}.md'}) |" for a, b, c in rows]
    return "\n".join(lines) + "\n\n*Generated from `figures/*.csv` by `python -m kvlab docs`.*"


def _key_results_audit(figures: Path) -> str:
    """One sentence on the key-results table: how many unadjusted intervals it quotes, how many exclude 0, which
    are fragile (an endpoint within a tenth of the MDE of 0; :mod:`kvlab.harness.intervals`)."""
    from kvlab.harness.intervals import audit_intervals, interval_summary

    return "*The table above holds " + interval_summary(audit_intervals(_key_results(figures))) + "*"


MEASURED_PHASES = "docs/measured/make_figures_timing.jsonl"


def _phases(figures: Path) -> str:
    """The main job's phase table: one measured ``make figures`` run from an empty model cache and run store
    (``all_timing.jsonl`` as ``python -m kvlab all`` wrote it, kept under ``docs/measured/``)."""
    if not (ROOT / MEASURED_PHASES).is_file():
        return (f"*No measured run is kept yet: copy the lines of one `make figures` run from `figures/all_timing.jsonl` "
                f"to `{MEASURED_PHASES}` and run `python -m kvlab docs`.*")
    rows = jsonl(MEASURED_PHASES)
    first = rows[0]
    wall = next((i for i, r in enumerate(rows) if r["job"] == "wall"), None)
    lines = ["| job | minutes |", "|---|---|"]
    lines += [f"| {r['job']} | {fmt(r['seconds'] / 60, 1)} |" for r in rows if r["job"] != "wall"]
    if wall is not None:   # --jobs > 1: the jobs overlapped; the total is the clock's (train + side-by-side jobs) + the rest
        total = rows[wall]["seconds"] + sum(r["seconds"] for r in rows[wall + 1:])
        how = f", {first.get('workers')} jobs side by side; **all** is the wall clock"
    else:
        total, how = sum(r["seconds"] for r in rows), ""
    lines.append(f"| **all** | **{fmt(total / 60, 1)}** |")
    return ("\n".join(lines) + f"\n\n*One run of `make figures` at {first['prompts']} prompts from an empty model cache "
            f"and run store, on {first.get('cpu') or 'the CPU'} with {first['threads']} threads ({first['device']}"
            f"{how}), started {first['started']}; from [`{MEASURED_PHASES}`]({MEASURED_PHASES}), excluding the "
            "install.*")


def _gather(studies, own: dict) -> dict:
    """Every study's ``VIEWS`` in order, then ``own``; a name given twice is an error naming both modules."""
    out, where = {}, {}
    for name, module, view in [(n, s.__name__, v) for s in studies for n, v in s.VIEWS.items()] + \
            [(n, __name__, v) for n, v in own.items()]:
        if name in out:
            raise ValueError(f"table view {name!r} is defined in both {where[name]} and {module}: rename one")
        out[name], where[name] = view, module
    return out


VIEWS: dict[str, Union[View, Callable[[Path], str]]] = _gather(STUDIES, {"key_results": _key_results,
                                                                         "key_results_audit": _key_results_audit,
                                                                         "phases": _phases})


# --------------------------------------------------------------------------------------------- markers
BLOCK = re.compile(r"(<!-- kvlab:table (?P<name>(?:md:)?[\w-]+) -->\n)(?P<body>.*?)(<!-- /kvlab:table -->)", re.S)
VALUE = re.compile(r"(<!-- kvlab:value (?P<args>[^>]*?) -->)(?P<body>.*?)(<!-- /kvlab:value -->)", re.S)


def render_view(name: str, figures: Path = FIGURES) -> str:
    if name.startswith("md:"):                      # a table's own Markdown, as its job wrote it
        path = Path(figures) / f"{name[3:]}.md"
        if not path.exists():
            raise DocsError(f"{path} does not exist: run `make figures` (or the job that writes {name[3:]}) first")
        return path.read_text().strip()
    if name not in VIEWS:
        raise DocsError(f"no table view {name!r}; known: {', '.join(VIEWS)}")
    v = VIEWS[name]
    return v.render(Path(figures)) if isinstance(v, View) else v(Path(figures))


def render_value(args: str, figures: Path = FIGURES) -> str:
    parts = args.split()
    digits = 3
    for p in list(parts):
        if p.startswith("digits="):
            digits = int(p.split("=", 1)[1])
            parts.remove(p)
    if len(parts) != 3:
        raise DocsError(f"kvlab:value {args!r}: expected 'CSV ROW COLUMNS [digits=N]'")
    csv, row, cols = parts
    df = read(figures, csv)
    spec = cols.split(",")
    for c in spec:
        if c not in df.columns:
            raise DocsError(f"figures/{csv}.csv has no column {c!r} (marker kvlab:value {args})")
    return cell(pick(df, row, csv), spec[0] if len(spec) == 1 else tuple(spec), digits, whole_columns(df))


LINK = re.compile(r"\]\((?P<path>[^)\s]+)\)")


def rebase_links(md: str, base: str) -> str:
    """``md``'s relative links, written from the project root (``figures/x.md``, ``docs/measured/y.jsonl``), as
    seen from the folder ``base`` of the file they go into (``docs`` → ``../figures/x.md``, ``measured/y.jsonl``)."""
    import os

    if not base:
        return md

    def one(m):
        path = m.group("path")
        if re.match(r"^(?:[a-z][a-z0-9+.-]*:|/|#|\.\./)", path):     # a URL, absolute, an anchor, or rebased
            return m.group(0)
        return "](" + os.path.relpath(path, base).replace(os.sep, "/") + ")"

    return LINK.sub(one, md)


def fill(text: str, figures: Path = FIGURES, where: str = "", base: str = "") -> str:
    """``text`` with every marked block regenerated from the CSVs in ``figures``; ``base`` is the folder of the
    file the text goes into, relative to the project root (``""``: README.md; ``"docs"``), so the generated
    links, written from the root, resolve from there (:func:`rebase_links`)."""
    def table(m):
        try:
            return m.group(1) + rebase_links(render_view(m.group("name"), figures), base) + "\n" + m.group(4)
        except DocsError as e:
            raise DocsError(f"{where}: {e}") from None

    def value(m):
        try:
            return m.group(1) + render_value(m.group("args"), figures) + m.group(4)
        except DocsError as e:
            raise DocsError(f"{where}: {e}") from None

    return VALUE.sub(value, BLOCK.sub(table, text))


def doc_files(root: Path = ROOT) -> list[Path]:
    """README.md and every docs/*.md of the project."""
    return [p for p in [root / "README.md", *sorted((root / "docs").glob("*.md"))] if p.exists()]


def stale(root: Path = ROOT, figures: Path | None = None) -> list[Path]:
    """The files whose generated parts differ from what the tables give now."""
    figures = Path(figures) if figures is not None else root / "figures"
    return [p for p in doc_files(root) if fill(p.read_text(), figures, str(p), _base(p, root)) != p.read_text()]


def _base(path: Path, root: Path) -> str:
    """``path``'s folder relative to ``root`` (``""`` for a file at the root)."""
    rel = Path(path).resolve().parent.relative_to(Path(root).resolve())
    return "" if str(rel) == "." else rel.as_posix()


def write(root: Path = ROOT, figures: Path | None = None) -> list[Path]:
    """Regenerate every marked block in README.md and docs/*.md; returns the files that changed."""
    figures = Path(figures) if figures is not None else root / "figures"
    changed = []
    for p in doc_files(root):
        old = p.read_text()
        new = fill(old, figures, str(p), _base(p, root))
        if new != old:
            p.write_text(new)
            changed.append(p)
    return changed


def cmd_docs(args) -> list[Path]:
    """``python -m kvlab docs [--check]``: fill (or check) the generated numbers of README.md and docs/."""
    figures = Path(args.out).resolve() if getattr(args, "out", None) else FIGURES
    if figures != FIGURES.resolve():
        print(f"docs: skipped ({figures} is not the project's figures/ folder; the docs quote that one)")
        return []
    if getattr(args, "check", False):
        bad = stale(ROOT, figures)
        if bad:
            raise DocsError("generated numbers disagree with figures/ in " + ", ".join(str(p) for p in bad)
                            + ": run `python -m kvlab docs`")
        print(f"docs: {len(doc_files())} files agree with figures/")
        return []
    changed = write(ROOT, figures)
    for p in changed:
        print(f"docs: regenerated {p}")
    if not changed:
        print("docs: already up to date")
    return changed
