"""Every notebook (jupytext percent script) executes top to bottom in its smoke setting."""
from __future__ import annotations

from pathlib import Path

import pytest

NOTEBOOKS = sorted((Path(__file__).resolve().parent.parent / "notebooks").glob("[0-9][0-9]_*.py"))


def test_notebooks_exist():
    assert NOTEBOOKS, "no notebooks/NN_*.py found"


@pytest.mark.integration
@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebook_runs(path, tmp_path, monkeypatch):
    import jupytext
    from nbclient import NotebookClient

    monkeypatch.setenv("KVLAB_SMOKE", "1")
    monkeypatch.setenv("KVLAB_RUNS", str(tmp_path / "runs"))
    monkeypatch.setenv("MPLBACKEND", "Agg")
    nb = jupytext.read(path)
    client = NotebookClient(nb, timeout=900, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}})
    client.execute()
    errors = [o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", []) if o.get("output_type") == "error"]
    assert not errors
