"""Figure objects and the figure registry, shared by :mod:`kvlab.viz.figures` (rendering) and the
modules that draw (:mod:`kvlab.viz.plots`, :mod:`kvlab.studies.mc.sim`, :mod:`kvlab.uncertainty.mc`, :mod:`kvlab.viz.livemap`).
Figures are matplotlib objects in memory; they write a file only when asked to save.

This module imports none of them, so there is no import circle: drawing modules import this one,
:mod:`kvlab.viz.figures` imports this one and (lazily) the drawing modules.

Every kvlab figure is a :class:`KvFigure`: a plain matplotlib ``Figure`` (no pyplot state, no
backend switch: ``savefig`` renders with Agg, so the CLI works headless) that also displays
itself in Jupyter/IPython through ``_repr_png_`` — a notebook shows it whether or not it ran
``%matplotlib inline``.
"""
from __future__ import annotations

import io
from pathlib import Path
from typing import Callable

# name -> (CSV stems the figure needs, fn(tables) -> Figure)
FIGURES: dict[str, tuple[tuple[str, ...], Callable]] = {}

DISPLAY_DPI = 100


def figure(name: str, needs: tuple[str, ...]):
    """Register ``fn(tables: dict[str, DataFrame]) -> Figure`` under ``name``; ``needs`` are CSV stems."""
    def deco(fn):
        FIGURES[name] = (tuple(needs), fn)
        return fn
    return deco


_KV_FIGURE = None


def figure_class():
    """:class:`KvFigure` (built on first use, so importing kvlab does not import matplotlib)."""
    global _KV_FIGURE
    if _KV_FIGURE is None:
        from matplotlib.figure import Figure

        class KvFigure(Figure):
            """A matplotlib Figure that IPython displays as PNG (``_repr_png_``)."""

            def _repr_png_(self) -> bytes:
                buf = io.BytesIO()
                self.savefig(buf, format="png", dpi=DISPLAY_DPI, bbox_inches="tight")
                return buf.getvalue()

        _KV_FIGURE = KvFigure
    return _KV_FIGURE


def new_figure(**kwargs):
    """A new :class:`KvFigure` (``figsize=...`` etc. as for ``matplotlib.figure.Figure``)."""
    return figure_class()(**kwargs)


def render(name: str, out) -> Path | None:
    """Render figure ``name`` from the CSVs in ``out`` into ``out/<name>.png`` (None if an input is missing, or the
    drawing function returns None: nothing in the inputs for it).
    The module that registers ``name`` must have been imported (a study imports its own ``plots``;
    :func:`kvlab.viz.figures.render` imports them all first)."""
    import pandas as pd

    if name not in FIGURES:
        raise KeyError(f"figure {name!r} is not registered; import the study module that draws it "
                       "(its plots.py), or render through kvlab.viz.figures, which imports them all")
    needs, fn = FIGURES[name]
    out = Path(out)
    paths = {n: out / f"{n}.csv" for n in needs}
    if not all(p.is_file() for p in paths.values()):
        return None
    fig = fn({n: pd.read_csv(p) for n, p in paths.items()})
    if fig is None:             # the inputs hold nothing this figure draws
        return None
    target = out / f"{name}.png"
    fig.savefig(target, dpi=120, bbox_inches="tight")
    return target
