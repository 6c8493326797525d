"""Figures registered by name. Each is a function of stored tables (CSV files written by the
experiments into an output folder) that returns a matplotlib Figure; :func:`render_all` saves
every figure whose inputs exist. Plot functions never call ``savefig`` themselves. The registry
and the figure class are in :mod:`kvlab.viz.base`.
"""
from __future__ import annotations

from pathlib import Path

import pandas as pd

from kvlab.viz.base import FIGURES, figure, new_figure  # noqa: F401  (the registry lives in figbase)


def render(name: str, out) -> Path | None:
    """Render one registered figure from the CSVs in ``out`` into ``out/<name>.png`` (None if inputs missing)."""
    _load_registrations()
    needs, fn = FIGURES[name]
    out = Path(out)
    paths = {n: out / f"{n}.csv" for n in needs}
    if not all(p.is_file() for p in paths.values()):
        return None
    fig = fn({n: pd.read_csv(p) for n, p in paths.items()})
    target = out / f"{name}.png"
    fig.savefig(target, dpi=120, bbox_inches="tight")
    return target


def render_all(out) -> list[Path]:
    _load_registrations()
    return [p for name in FIGURES if (p := render(name, out)) is not None]


def _load_registrations() -> None:
    """Import the modules that register figures (kept lazy: no import-time side effects;
    they import :mod:`kvlab.viz.base`, never this module)."""
    from kvlab.eviction import plots as evict_plots  # noqa: F401
    from kvlab.viz import plots
    from kvlab.train import plots as _train_plots  # noqa: F401
