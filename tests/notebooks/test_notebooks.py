"""The notebooks run top to bottom at their small setting, and each pair of files agrees.

Each notebook in ``notebooks/`` is kept twice: a jupytext percent-format ``.py`` (the
reviewable source) and the ``.ipynb`` users open, committed without outputs. The execution
test runs every ``.ipynb`` through ``nbclient`` on an IPython kernel of this interpreter with
``JAXPRUNE_NOTEBOOK_SMALL=1`` (each notebook's parameter cell picks a tiny setting) and the
non-interactive Agg backend; a cell that raises fails the test with the cell's traceback.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import jupytext
import nbclient
import nbformat
import pytest
from jupyter_client.kernelspec import KernelSpecManager
from jupyter_client.manager import KernelManager

ROOT = Path(__file__).resolve().parents[2]
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))
KERNEL = "jaxprune-notebook-test"


def _cells(notebook) -> list[tuple[str, str]]:
  return [(cell.cell_type, cell.source.strip()) for cell in notebook.cells]


def test_every_notebook_is_paired():
  sources = sorted((ROOT / "notebooks").glob("*.py"))
  assert NOTEBOOKS, "no notebooks found"
  assert [p.stem for p in NOTEBOOKS] == [p.stem for p in sources]


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_ipynb_matches_its_py_source(path):
  """The .ipynb holds the .py's cells (``jupytext --sync notebooks/*.py`` re-pairs them),
  with no outputs."""
  ipynb = jupytext.read(path)
  source = jupytext.read(path.with_suffix(".py"))
  assert _cells(ipynb) == _cells(source), f"run: jupytext --sync {path.with_suffix('.py')}"
  for cell in ipynb.cells:
    if cell.cell_type == "code":
      assert cell.outputs == [] and cell.execution_count is None, (
        f"{path.name} is committed with outputs; clear them (jupytext --sync does)"
      )


def test_notebooks_use_the_installed_library_not_the_experiments():
  """``experiments/`` runs from a checkout and is not installed: a notebook opened elsewhere
  must find everything it imports in ``jaxprune``."""
  for path in sorted((ROOT / "notebooks").glob("*.py")):
    imports = [
      line
      for line in path.read_text().splitlines()
      if line.startswith(("import ", "from ")) and line.split()[1].split(".")[0] == "experiments"
    ]
    assert not imports, (path.name, imports)


@pytest.fixture
def kernel_manager(tmp_path, monkeypatch):
  """A kernel of this interpreter (not whatever ``python3`` spec the machine has), whose
  ``import jaxprune`` finds this checkout, at the notebooks' small setting; it inherits the
  suite's compilation cache and XLA flags (tests/conftest.py) with this environment."""
  spec_dir = tmp_path / "kernels" / KERNEL
  spec_dir.mkdir(parents=True)
  spec = {
    "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
    "display_name": "jaxprune test",
    "language": "python",
  }
  (spec_dir / "kernel.json").write_text(json.dumps(spec))
  monkeypatch.setenv("JAXPRUNE_NOTEBOOK_SMALL", "1")
  monkeypatch.setenv("MPLBACKEND", "Agg")
  monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
  specs = KernelSpecManager(kernel_dirs=[str(tmp_path / "kernels")])
  return KernelManager(kernel_name=KERNEL, kernel_spec_manager=specs)


# Run after a notebook's own cells, in its kernel: on the Agg backend ``plt.show()`` leaves
# every figure open, so each can be drawn and its tick labels measured.
_CHECK_TICK_LABELS = """
import matplotlib.pyplot as _plt


def _overlapping_tick_labels():
  found = []
  for number in _plt.get_fignums():
    figure = _plt.figure(number)
    figure.canvas.draw()
    renderer = figure.canvas.get_renderer()
    for ax in figure.axes:
      for axis in (ax.xaxis, ax.yaxis):
        labels = [t for t in axis.get_ticklabels() if t.get_visible() and t.get_text()]
        boxes = [t.get_window_extent(renderer) for t in labels]
        for i in range(len(labels)):
          for j in range(i + 1, len(labels)):
            if boxes[i].overlaps(boxes[j]):
              found.append(f"figure {number} {ax.get_title()!r}: "
                           f"{labels[i].get_text()!r} overlaps {labels[j].get_text()!r}")
  return found


assert _plt.get_fignums(), "no figure left open to check"
_overlaps = _overlapping_tick_labels()
assert not _overlaps, "overlapping tick labels: " + "; ".join(_overlaps)
"""


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_runs_top_to_bottom(path, kernel_manager):
  """Every cell runs without error, and no figure has tick labels drawn over each other."""
  notebook = nbformat.read(path, as_version=4)
  notebook.cells.append(nbformat.v4.new_code_cell(_CHECK_TICK_LABELS))
  client = nbclient.NotebookClient(
    notebook,
    km=kernel_manager,
    timeout=600,
    resources={"metadata": {"path": str(path.parent)}},
  )
  client.execute()  # raises CellExecutionError naming the failing cell
  code = [cell for cell in notebook.cells if cell.cell_type == "code"]
  assert code and all(cell.execution_count is not None for cell in code)
  errors = [o for cell in code for o in cell.outputs if o.output_type == "error"]
  assert not errors
