"""Every notebook (jupytext percent script) executes top to bottom in its smoke setting and shows
every figure it draws as an image (not as ``<Figure size ...>`` text)."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

NOTEBOOKS = sorted((Path(__file__).resolve().parent.parent / "notebooks").glob("[0-9][0-9]_*.py"))

# A code cell that calls one of these draws a figure and must show it as image/png.
FIGURE_CALL = re.compile(r"\b(\w+_figure|plot_\w+|plt\.(subplots|figure|show))\s*\(")


def figure_problems(nb) -> list[str]:
    """Cells that draw a figure without an image/png output, and outputs that show a Figure only as text."""
    problems = []
    for i, cell in enumerate(nb.cells):
        if cell.cell_type != "code":
            continue
        outputs = cell.get("outputs", [])
        pngs = [o for o in outputs if "image/png" in o.get("data", {})]
        for o in outputs:
            text = o.get("data", {}).get("text/plain", "")
            if "<Figure size" in text and "image/png" not in o.get("data", {}):
                problems.append(f"cell {i}: a figure shown as text only: {text.strip()[:60]!r}")
        if FIGURE_CALL.search(cell.source) and not pngs:
            problems.append(f"cell {i}: draws a figure ({FIGURE_CALL.search(cell.source).group(0)}...) "
                            "but has no image/png output")
    return problems


def test_notebooks_exist():
    assert NOTEBOOKS, "no notebooks/NN_*.py found"


def test_figure_check_catches_text_only_figures():
    """The check fails a cell whose Figure shows as text, and a drawing cell without an image."""
    import nbformat

    text_only = nbformat.v4.new_code_cell("fig = baselines_figure(t)\nfig", outputs=[
        nbformat.v4.new_output("execute_result", data={"text/plain": "<Figure size 1100x320 with 1 Axes>"},
                               execution_count=1)])
    silent = nbformat.v4.new_code_cell("plot_provenance(m, 3)\n_ = 1", outputs=[])
    shown = nbformat.v4.new_code_cell("plot_provenance(m, 3)", outputs=[
        nbformat.v4.new_output("display_data", data={"image/png": "iVBOR", "text/plain": "<Figure size 1x1>"})])
    nb = nbformat.v4.new_notebook(cells=[text_only, silent, shown])
    problems = figure_problems(nb)
    assert len(problems) == 3 and all(p.startswith(("cell 0", "cell 1")) for p in problems)


@pytest.mark.integration
@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebook_runs(path, tmp_path, monkeypatch):
    import jupytext
    from nbclient import NotebookClient

    monkeypatch.setenv("KVLAB_SMOKE", "1")
    monkeypatch.setenv("KVLAB_RUNS", str(tmp_path / "runs"))
    # No inline backend: kvlab figures must display themselves, without a %matplotlib magic.
    monkeypatch.setenv("MPLBACKEND", "Agg")
    nb = jupytext.read(path)
    client = NotebookClient(nb, timeout=900, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}})
    client.execute()
    errors = [o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", []) if o.get("output_type") == "error"]
    assert not errors
    problems = figure_problems(nb)
    assert not problems, "\n".join(problems)
