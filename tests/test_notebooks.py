"""The example notebooks run top to bottom in a real Jupyter kernel (nbclient + ipykernel)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")
pytest.importorskip("ipykernel")
pytest.importorskip("matplotlib")

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
NOTEBOOKS = sorted(EXAMPLES.glob("*.ipynb"))


def test_the_three_notebooks_are_there() -> None:
    names = {p.stem for p in NOTEBOOKS}
    assert {"sparsity_tour", "relu_vs_silu", "bring_your_own_model"} <= names


@pytest.mark.slow
@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebook_runs_and_draws(path, tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("POWERPY_FIGURES", str(tmp_path))  # keep docs/ as committed
    monkeypatch.setenv("TQDM_DISABLE", "1")
    nb = nbformat.read(path, as_version=4)
    client = nbclient.NotebookClient(
        nb, timeout=900, kernel_name="python3", resources={"metadata": {"path": str(EXAMPLES)}}
    )
    client.execute()  # raises CellExecutionError, naming the cell, when one fails
    images = [
        o
        for cell in nb.cells
        if cell.cell_type == "code"
        for o in cell.outputs
        if "image/png" in o.get("data", {})
    ]
    assert len(images) >= 3, f"{path.name} drew {len(images)} figures"
    errors = [
        o for c in nb.cells if c.cell_type == "code" for o in c.outputs if o.output_type == "error"
    ]
    assert not errors
    assert os.listdir(tmp_path) or path.stem == "bring_your_own_model"
