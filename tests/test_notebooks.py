"""Executes every notebook in examples/ top to bottom; a failing cell fails the test.

Needs nbclient, nbformat and ipykernel (in the ``test`` extra). Each notebook
runs in a fresh kernel whose working directory is ``examples/``.
"""

import glob
import os

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")
pytest.importorskip("ipykernel")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLES = os.path.join(ROOT, "examples")
NOTEBOOKS = sorted(glob.glob(os.path.join(EXAMPLES, "*.ipynb")))


def test_notebooks_exist():
  names = {os.path.basename(p) for p in NOTEBOOKS}
  assert {"quickstart.ipynb", "blockwise_recipe.ipynb",
          "sharding_packed_sequences.ipynb"} <= names


@pytest.mark.parametrize("path", NOTEBOOKS, ids=os.path.basename)
def test_notebook_runs(path, monkeypatch):
  # The kernel inherits this environment: make the repo importable and keep
  # matplotlib off any display.
  monkeypatch.setenv("PYTHONPATH", os.pathsep.join(
      p for p in (ROOT, os.environ.get("PYTHONPATH")) if p))
  monkeypatch.setenv("MPLBACKEND", "Agg")
  monkeypatch.setenv("JAX_PLATFORMS", os.environ.get("JAX_PLATFORMS", "cpu"))
  nb = nbformat.read(path, as_version=4)
  client = nbclient.NotebookClient(
      nb, timeout=300, kernel_name="python3",
      resources={"metadata": {"path": EXAMPLES}})
  try:
    client.execute()
  except nbclient.exceptions.CellExecutionError as e:  # pragma: no cover - the failure path
    pytest.fail(f"{os.path.basename(path)}: a cell failed:\n{str(e)[-4000:]}")
  errors = [o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", [])
            if o.get("output_type") == "error"]
  assert not errors, errors
