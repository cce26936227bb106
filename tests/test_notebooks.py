"""The notebooks in ``notebooks/``: stored without outputs, and executed top to bottom.

Each notebook runs in a fresh kernel of this interpreter (nbclient). A cell that raises fails
the test with that cell and its traceback; each notebook ends with a cell of assertions on the
claims it makes. Every plotting cell must have rendered an image.
"""

from __future__ import annotations

import re
import sys
import time
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

NOTEBOOK_DIR = Path(__file__).resolve().parent.parent / "notebooks"
NOTEBOOKS = sorted(NOTEBOOK_DIR.glob("*.ipynb"))
# issue 7 asks for these three; more may be added
REQUIRED = {"quickstart", "observers", "sensitivity"}
# a plotting cell calls pyplot or a report's .plot()
_PLOTTING = re.compile(r"\bplt\.|\.plot\(")
# a hung kernel stops here; each notebook's budget is 2 minutes on a CPU (issue 7)
CELL_TIMEOUT_S = 600


def _code_cells(nb):
    return [(i, cell) for i, cell in enumerate(nb.cells) if cell.cell_type == "code"]


def _has_image(cell) -> bool:
    return any("image/png" in out.get("data", {}) for out in cell.get("outputs", []))


def test_required_notebooks_exist():
    assert REQUIRED <= {p.stem for p in NOTEBOOKS}, f"missing: {sorted(REQUIRED - {p.stem for p in NOTEBOOKS})}"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_stored_without_outputs(path):
    """The storage convention (notebooks/README.md): committed notebooks carry no outputs."""
    nb = nbformat.read(path, as_version=4)
    nbformat.validate(nb)
    dirty = [i for i, cell in _code_cells(nb) if cell.outputs or cell.execution_count is not None]
    assert not dirty, (
        f"{path.name}: cells {dirty} have outputs or execution counts; clear them before committing "
        f"(jupyter nbconvert --clear-output --inplace notebooks/{path.name})"
    )


@pytest.mark.slow
@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_runs(path):
    nb = nbformat.read(path, as_version=4)
    nb.cells.append(nbformat.v4.new_code_cell("import sys; print(sys.executable)"))
    client = NotebookClient(nb, kernel_name="python3", timeout=CELL_TIMEOUT_S,
                            resources={"metadata": {"path": str(NOTEBOOK_DIR)}})
    start = time.perf_counter()
    client.execute()  # raises CellExecutionError, naming the cell, if any cell raises
    elapsed = time.perf_counter() - start

    # the kernel is this interpreter (jupyter_client starts "python" kernels with sys.executable)
    kernel_python = nb.cells[-1].outputs[0]["text"].strip()
    assert Path(kernel_python).resolve() == Path(sys.executable).resolve(), (kernel_python, sys.executable)

    plotting = [i for i, cell in _code_cells(nb) if _PLOTTING.search(cell.source)]
    if path.stem in ("observers", "sensitivity"):
        assert plotting, f"{path.name} has no plotting cell"
    blank = [i for i in plotting if not _has_image(nb.cells[i])]
    assert not blank, f"{path.name}: plotting cells {blank} rendered no image/png output (ran in {elapsed:.0f} s)"
