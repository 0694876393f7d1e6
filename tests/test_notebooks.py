"""The notebooks are executed, so that what they show and assert stays true."""

import pathlib

import nbformat
import pytest
from nbclient import NotebookClient

NOTEBOOKS = sorted((pathlib.Path(__file__).parent.parent / "notebooks").glob("*.ipynb"))


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_executes_without_error(path, tmp_path):
  notebook = nbformat.read(path, as_version=4)
  NotebookClient(notebook, timeout=300, kernel_name="python3",
                 resources={"metadata": {"path": str(tmp_path)}}).execute()
  images = [o for cell in notebook.cells if cell.cell_type == "code"
            for o in cell.get("outputs", []) if "image/png" in o.get("data", {})]
  assert images, "the notebook drew no plots"


def test_there_is_a_theorem_notebook():
  assert any(p.name == "theorem_verification.ipynb" for p in NOTEBOOKS)
