"""Plots for people: each study's figures live in its own folder (``kvlab/studies/<study>/plots.py``, registered
in :mod:`kvlab.harness.figures`, rendered by :mod:`kvlab.viz.figures`) and are re-exported here for the notebooks;
this module adds the pictures of no study (who wrote each slot of one cache)."""
from __future__ import annotations

from kvlab.harness.figures import new_figure
from kvlab.studies.baselines.plots import POLICY_COLORS, baselines_figure, baselines_timing_figure  # noqa: F401
from kvlab.studies.mc.plots import (mc_entropy_figure, mc_real_figure, mc_triggers_figure,  # noqa: F401
                                    mc_variance_figure)
from kvlab.studies.refresh.plots import (NEXT_MARKERS, PROVENANCE_COLORS, REFRESH_COLORS, place_labels,  # noqa: F401
                                         plot_entropy_trace, plot_provenance, refresh_pareto_figure,
                                         refresh_provenance_figure)


def plot_cache_writers(writers, title: str = ""):
    """One bar per cache slot coloured by who wrote it (``KVCache.writers`` or a ledger's ``writer``
    column): teacher green, student orange."""
    writers = list(writers)
    fig = new_figure(figsize=(10, 1.5))
    ax = fig.subplots()
    ax.bar(range(len(writers)), 1, width=1.0, color=[PROVENANCE_COLORS.get(w, "gray") for w in writers])
    ax.set_yticks([])
    ax.set_xlim(-0.5, len(writers) - 0.5)
    ax.set_xlabel("cache slot")
    ax.set_title(title or "cache provenance: teacher prefill (green) → student decode (orange)")
    fig.tight_layout()
    return fig
