"""Figures: they display themselves in IPython, the registry has no import circle, the Pareto
labels do not overlap, the new registered figures render from their tables."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pytest


def test_kvlab_figures_display_as_png_without_pyplot():
    from IPython.core.formatters import PNGFormatter

    from kvlab.harness.figures import new_figure

    fig = new_figure(figsize=(2, 1))
    fig.subplots().plot([0, 1], [1, 0])
    png = fig._repr_png_()
    assert png[:8] == b"\x89PNG\r\n\x1a\n"
    assert PNGFormatter()(fig)[:8] == b"\x89PNG\r\n\x1a\n"     # what IPython's display hook produces


def test_registry_has_no_import_circle_and_no_side_effects():
    code = ("import sys, matplotlib; b = matplotlib.get_backend.__module__; import kvlab.viz.plots; "
            "assert 'kvlab.viz.figures' not in sys.modules, 'plots imports figures'; "
            "import kvlab; assert 'matplotlib.pyplot' not in sys.modules, 'pyplot imported'; "
            "from kvlab.viz.figures import FIGURES, render; from kvlab.viz.figures import _load_registrations; "
            "_load_registrations(); print(sorted(FIGURES))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    for name in ("baselines", "baselines_timing", "refresh_pareto", "refresh_provenance", "mc_real", "mc_triggers"):
        assert name in r.stdout


def _refresh_tables(n=11):
    rng = np.random.default_rng(0)
    fam = ["none", "periodic", "periodic", "entropy", "entropy", "entropy", "entropy", "probe_kl", "speculative",
           "periodic", "periodic"][:n]
    nxt = ["", "rerun", "rerun", "rerun", "rerun", "rerun", "rerun", "rerun", "rerun", "student", "teacher"][:n]
    kl = np.r_[0.5, 0.5 + rng.normal(0, 0.002, n - 1)]      # nearly coincident points: labels must not pile up
    q = pd.DataFrame({"policy": [f"p{i}" for i in range(n)], "family": fam, "refresh_next": nxt, "kl": kl,
                      "teacher_ppl": 5 + kl, "d_kl": kl - 0.5, "d_kl_lo": kl - 0.52, "d_kl_hi": kl - 0.48,
                      "d_teacher_ppl": kl - 0.5, "d_teacher_ppl_lo": kl - 0.6, "d_teacher_ppl_hi": kl - 0.4,
                      "n_prompts": 2, "tokens": 16})
    over = np.r_[0.5, 10 + rng.normal(0, 0.3, n - 1)]
    t = pd.DataFrame({"policy": q.policy, "overhead_pct": over, "overhead_pct_q25": over - 2,
                      "overhead_pct_q75": over + 2, "pairs": 4})
    return {"refresh_all": q, "refresh_timing": t}


def test_pareto_labels_do_not_overlap_and_legend_is_outside_the_axes():
    from kvlab.viz.plots import refresh_pareto_figure

    fig = refresh_pareto_figure(_refresh_tables())
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    canvas = FigureCanvasAgg(fig)
    canvas.draw()
    renderer = canvas.get_renderer()
    for ax in fig.axes[:2]:
        from matplotlib.text import Text

        boxes = [Text.get_window_extent(a, renderer) for a in ax.texts]   # the label itself, not its leader line
        assert len(boxes) == 11
        overlaps = [(i, j) for i in range(len(boxes)) for j in range(i) if boxes[i].overlaps(boxes[j])]
        assert not overlaps, overlaps
        assert ax.get_legend() is None                      # the legend is the figure's, below the axes
    legend_box = fig.legends[0].get_window_extent(renderer)
    assert all(not legend_box.overlaps(ax.get_window_extent(renderer)) for ax in fig.axes[:2])
    assert fig.axes[2].tables                                # numbered points are named in a table


def test_mc_real_figure_renders_one_row_per_p(tmp_path):
    from kvlab.viz.figures import render

    rng = np.random.default_rng(1)
    tr = pd.DataFrame({"p": np.repeat([0.05, 0.1], 20), "entropy": rng.random(40), "u": rng.random(40),
                       "mi": rng.random(40), "flip": rng.random(40)})
    corr = pd.DataFrame({"p": [0.05, 0.1], "n_passes": 8, "steps": 20, "prompts": 2, "r_u": [0.1, 0.2],
                         "r_mi": [0.3, 0.4], "r_flip": [0.5, 0.6]})
    tr.to_csv(tmp_path / "mc_real_traces.csv", index=False)
    corr.to_csv(tmp_path / "mc_real_correlations.csv", index=False)
    assert render("mc_real", tmp_path).is_file()
    from kvlab.viz.plots import mc_real_figure

    fig = mc_real_figure({"mc_real_traces": tr, "mc_real_correlations": corr})
    assert len(fig.axes) == 6 and fig.axes[4].get_title() == "p=0.1: r = +0.40"


def test_all_job_includes_a_bounded_mc_real(monkeypatch):
    from argparse import Namespace

    from kvlab import cli
    from kvlab.studies.mc import cli as mc_cli

    assert "mc-real" in [name for name, _ in cli.JOBS]
    seen = {}
    monkeypatch.setattr(mc_cli, "cmd_mc_real", lambda a, **kw: seen.update(vars(a)) or [])
    mc_cli.mc_real_small(Namespace(prompts=50, tokens=1200, out="x"))
    assert seen["prompts"] == 16 and seen["tokens"] == 64 and seen["passes"] == 8 and seen["dropout"] == [0.1]
    assert str(seen["out"]) == str(Path("x") / "reduced")   # the committed three-p table is left as it is
