"""Every notebook in notebooks/ runs top to bottom in a fresh kernel, so none can rot."""

import glob
import os

import nbformat
import pytest
from ipykernel.kernelspec import write_kernel_spec
from nbclient import NotebookClient

from conftest import REPO

NOTEBOOKS = sorted(glob.glob(os.path.join(REPO, 'notebooks', '*.ipynb')))
CELL_TIMEOUT = 300  # seconds per cell


@pytest.fixture
def kernel_env(tmp_path, monkeypatch):
  """A `python3` kernel that is this interpreter, found first whatever else is registered
  (nothing is installed outside tmp_path); matplotlib without a display."""
  write_kernel_spec(os.path.join(tmp_path, 'kernels', 'python3'))
  monkeypatch.setenv('JUPYTER_PATH', str(tmp_path))
  monkeypatch.setenv('MPLBACKEND', 'Agg')


@pytest.mark.parametrize('path', NOTEBOOKS, ids=os.path.basename)
def test_notebook_runs(path, kernel_env):
  nb = nbformat.read(path, as_version=4)
  client = NotebookClient(nb, kernel_name='python3', timeout=CELL_TIMEOUT,
                          resources={'metadata': {'path': os.path.dirname(path)}})
  client.execute()  # a failing cell raises CellExecutionError with its traceback


def test_notebooks_are_stored_without_outputs():
  assert len(NOTEBOOKS) >= 3, f'expected notebooks in {REPO}/notebooks'
  for path in NOTEBOOKS:
    nb = nbformat.read(path, as_version=4)
    stored = [i for i, cell in enumerate(nb.cells)
              if cell.cell_type == 'code' and (cell.outputs or cell.execution_count)]
    assert not stored, (f'{os.path.basename(path)}: code cells {stored} hold outputs; clear '
                        'them before committing (Jupyter: Edit → Clear Outputs of All Cells)')
