"""Every notebook in notebooks/ runs top to bottom in a fresh kernel, so none can rot."""

import glob
import json
import os

import nbformat
import pytest
from ipykernel.kernelspec import write_kernel_spec
from nbclient import NotebookClient

from conftest import REPO, USER_XLA_FLAGS
from test_analyze import assert_gpu_reports_meet_the_formulas

NOTEBOOKS = sorted(glob.glob(os.path.join(REPO, 'notebooks', '*.ipynb')))
CELL_TIMEOUT = 300  # seconds per cell

# What a test checks of a notebook's results, where the notebook computes what a test would
# compute again: code run in its kernel after its last cell prints them as JSON, and a check
# takes them. Notebook 03 compiles test_analyze's four configs for 8 H100s.
READ_BACK = {
    '03_collectives.ipynb': (
        'import json\n'
        "print(json.dumps({name: {'config': small_config(**axes).to_json(),\n"
        "                         'report': reports[name]} for name, axes in MESHES.items()}))",
        assert_gpu_reports_meet_the_formulas),
}


# Notebooks whose kernel compiles with a user's XLA flags (USER_XLA_FLAGS): 04 trains 40 steps,
# each ~2x faster than under the suite's cheap compiles. The others compile more than they run
# and keep the cheap compiles. Each notebook's code run alternately, CPU-s with the cheap flags
# against a user's: 02 6-9 against 13-18, 05 (10 MoE steps) 19-27 against 22-30, 04 32-43
# against 27-34. 01 took the same either way; 03 compiles for GPUs, which the flags leave alone.
USER_FLAGS = {'04_train_and_sample.ipynb'}


@pytest.fixture
def kernel_env(tmp_path, monkeypatch):
  """A `python3` kernel that is this interpreter, found first whatever else is registered
  (nothing is installed outside tmp_path); matplotlib without a display."""
  write_kernel_spec(os.path.join(tmp_path, 'kernels', 'python3'))
  monkeypatch.setenv('JUPYTER_PATH', str(tmp_path))
  monkeypatch.setenv('MPLBACKEND', 'Agg')


@pytest.mark.slow
@pytest.mark.parametrize('path', NOTEBOOKS, ids=os.path.basename)
def test_notebook_runs(path, kernel_env, monkeypatch):
  if os.path.basename(path) in USER_FLAGS:
    monkeypatch.setenv('XLA_FLAGS', USER_XLA_FLAGS)
  nb = nbformat.read(path, as_version=4)
  read_back, check = READ_BACK.get(os.path.basename(path), (None, None))
  if read_back:
    nb.cells.append(nbformat.v4.new_code_cell(read_back))
  client = NotebookClient(nb, kernel_name='python3', timeout=CELL_TIMEOUT,
                          resources={'metadata': {'path': os.path.dirname(path)}})
  client.execute()  # a failing cell raises CellExecutionError with its traceback
  if read_back:
    check(json.loads(''.join(o['text'] for o in nb.cells[-1].outputs
                             if o.get('name') == 'stdout')))


def test_notebooks_are_stored_without_outputs():
  assert len(NOTEBOOKS) >= 3, f'expected notebooks in {REPO}/notebooks'
  assert USER_FLAGS <= {os.path.basename(p) for p in NOTEBOOKS}
  for path in NOTEBOOKS:
    nb = nbformat.read(path, as_version=4)
    stored = [i for i, cell in enumerate(nb.cells)
              if cell.cell_type == 'code' and (cell.outputs or cell.execution_count)]
    assert not stored, (f'{os.path.basename(path)}: code cells {stored} hold outputs; clear '
                        'them before committing (Jupyter: Edit → Clear Outputs of All Cells)')
