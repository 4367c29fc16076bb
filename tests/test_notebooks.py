"""Every notebook runs top to bottom without an error (on a copy; the committed outputs stay).

To refresh the committed outputs after editing a notebook::

    python tests/test_notebooks.py            # executes notebooks/*.ipynb in place
"""

import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOKS = ROOT / "notebooks"
PATHS = sorted(NOTEBOOKS.glob("*.ipynb"))


def checkout_first_path():
    """A PYTHONPATH for the kernel with this checkout first, so it imports the speedswap beside the notebooks
    (not another one installed elsewhere, such as an editable install of a different worktree)."""
    return os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))


def execute(path):
    """Run a notebook in a fresh kernel started in ``notebooks/``; returns the executed copy.

    Raises:
        nbclient.exceptions.CellExecutionError: a cell raised (its traceback is in the message).
    """
    import nbformat
    from nbclient import NotebookClient

    notebook = nbformat.read(path, as_version=4)
    NotebookClient(notebook, timeout=300, kernel_name="python3",
                   resources={"metadata": {"path": str(NOTEBOOKS)}}).execute()
    return notebook


def test_there_are_notebooks():
    assert [p.name for p in PATHS] == ["01_transfer_speed.ipynb", "02_word2vec_offload.ipynb",
                                       "03_streaming_npy.ipynb"]


@pytest.mark.slow
@pytest.mark.parametrize("path", PATHS, ids=[p.stem for p in PATHS])
def test_notebook_runs(path, monkeypatch):
    pytest.importorskip("nbclient")
    pytest.importorskip("matplotlib")
    # The kernel inherits the environment: one torch thread keeps tiny steps
    # fast when the suite shares a small machine.
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.setenv("PYTHONPATH", checkout_first_path())
    notebook = execute(path)
    outputs = [out for cell in notebook.cells if cell.cell_type == "code" for out in cell.outputs]
    assert not [out for out in outputs if out.output_type == "error"]
    assert any(out.output_type == "display_data" for out in outputs), "expected at least one chart"


if __name__ == "__main__":
    import nbformat

    os.environ["PYTHONPATH"] = checkout_first_path()
    for notebook_path in PATHS if len(sys.argv) < 2 else map(Path, sys.argv[1:]):
        print("executing", notebook_path)
        nbformat.write(execute(notebook_path), notebook_path)
