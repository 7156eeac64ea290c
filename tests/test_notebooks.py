"""Every notebook in notebooks/ executes top to bottom (stored without outputs), and its figures render."""

import os
import pathlib

import nbformat
import pytest
from jupyter_client import AsyncKernelManager
from nbclient import NotebookClient
from nbclient.util import run_sync

ROOT = pathlib.Path(__file__).parent.parent
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))


@pytest.fixture(scope="module")
def kernel():
    """One kernel for the notebooks of this worker, emptied before each (`%reset -f`): a new kernel per notebook
    cost ~5 s of CPU each in start-up and imports (jax, moejax, matplotlib), the suite's time."""
    # The kernel imports this checkout's moejax, not whichever copy is installed (a worktree, an editable install).
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    # Compile time dominates the notebooks' cells and their figures do not depend on XLA:CPU's LLVM optimisation:
    # compile with the cheap pipeline (the option the tests' tolerance-checked jits use).
    fast = "--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true"
    env["XLA_FLAGS"] = " ".join(filter(None, [os.environ.get("XLA_FLAGS"), fast]))
    # nbclient's own manager class: with the blocking one a kernel that dies mid-cell hangs the client for good.
    manager = AsyncKernelManager(kernel_name="python3")
    run_sync(manager.start_kernel)(env=env, cwd=str(ROOT / "notebooks"))
    yield manager
    run_sync(manager.shutdown_kernel)(now=True)


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_executes(kernel, path):
    if not run_sync(kernel.is_alive)():  # an earlier notebook crashed it: that one failed, this one gets a new one
        run_sync(kernel.restart_kernel)(now=True)
    notebook = nbformat.read(path, as_version=4)
    code = [cell for cell in notebook.cells if cell.cell_type == "code"]
    assert all(not cell.get("outputs") for cell in code), "stored with outputs"
    # No name of an earlier notebook is left (every import must be the notebook's own), and the notebook's folder
    # is the working directory, as in a fresh kernel started there.
    reset = nbformat.v4.new_code_cell(f"%reset -f\n__import__('os').chdir({str(path.parent)!r})")
    notebook.cells.insert(0, reset)
    NotebookClient(notebook, km=kernel, timeout=300).execute()
    assert not any(output.get("output_type") == "error" for output in reset.outputs), reset.outputs
    for cell in code:  # every figure shown became an image in the cell's outputs
        images = sum("image/png" in output.get("data", {}) for output in cell.outputs)
        assert images >= cell.source.count("plt.show()"), cell.source[:200]


def test_there_is_a_quickstart():
    assert any(p.name == "01_quickstart.ipynb" for p in NOTEBOOKS)


def test_there_are_the_routing_parallel_and_numerics_notebooks():
    names = {p.name for p in NOTEBOOKS}
    assert {"02_routing.ipynb", "03_expert_parallel.ipynb", "04_numerics.ipynb"} <= names
