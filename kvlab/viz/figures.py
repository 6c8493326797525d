"""Figures registered by name. Each is a function of stored tables (CSV files written by the
experiments into an output folder) that returns a matplotlib Figure; :func:`render_all` saves
every figure whose inputs exist. Plot functions never call ``savefig`` themselves. The registry
and the figure class are in :mod:`kvlab.harness.figures`.
"""
from __future__ import annotations

from pathlib import Path

from kvlab.harness.figures import FIGURES, figure, new_figure  # noqa: F401  (the registry lives there)
from kvlab.harness.figures import render as _render


def render(name: str, out) -> Path | None:
    """Render one registered figure from the CSVs in ``out`` into ``out/<name>.png`` (None if inputs missing)."""
    _load_registrations()
    return _render(name, out)


def render_all(out) -> list[Path]:
    _load_registrations()
    return [p for name in FIGURES if (p := render(name, out)) is not None]


def _load_registrations() -> None:
    """Import the modules that register figures (kept lazy: no import-time side effects;
    they import :mod:`kvlab.harness.figures`, never this module)."""
    from kvlab.studies.baselines import plots as _baselines  # noqa: F401
    from kvlab.studies.eviction import long_plots as _evict_long  # noqa: F401
    from kvlab.studies.eviction import plots as _eviction  # noqa: F401
    from kvlab.studies.mc import plots as _mc  # noqa: F401
    from kvlab.studies.refresh import plots as _refresh  # noqa: F401
    from kvlab.studies.training import plots as _training  # noqa: F401
    from kvlab.viz import plots  # noqa: F401
