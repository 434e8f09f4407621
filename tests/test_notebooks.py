"""The notebooks: each runs top to bottom; each is stored without outputs.

Every notebook in `notebooks/` is executed with nbclient in a fresh kernel
(the `test` extra brings nbclient, nbformat and ipykernel), working in a
temporary folder, importing this checkout's packages. The kernel gets no
device flags from the test run (the device count taken out of
`XLA_FLAGS`, `JAX_PLATFORMS` removed; `tests.child_env`): each notebook
must set up its simulated CPU devices itself, as it would for a user.
Stored notebooks carry no outputs and no execution counts, so their diffs
stay readable (`jupyter nbconvert --clear-output --inplace`
strips them).
"""

import os
import pathlib

import nbclient
import nbformat
import pytest

from tests.child_env import xla_flags_without_device_count

ROOT = pathlib.Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))
EXPECTED = {
  "graphpipe_quickstart",
  "graphpipe_paper_figures",
  "disco_quickstart",
}
# Per cell; a notebook takes about two minutes on the 2-core machine.
CELL_TIMEOUT_S = 600


def test_every_notebook_is_here():
  assert EXPECTED <= {path.stem for path in NOTEBOOKS}


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_is_stored_without_outputs(path):
  notebook = nbformat.read(path, as_version=4)
  nbformat.validate(notebook)
  for index, cell in enumerate(notebook.cells):
    if cell.cell_type != "code":
      continue
    assert cell.outputs == [], f"{path.name} cell {index} has outputs"
    assert cell.execution_count is None, (
      f"{path.name} cell {index} has an execution count"
    )


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_runs_top_to_bottom(path, tmp_path, monkeypatch):
  notebook = nbformat.read(path, as_version=4)
  flags = xla_flags_without_device_count()
  if flags:
    monkeypatch.setenv("XLA_FLAGS", flags)
  else:
    monkeypatch.delenv("XLA_FLAGS", raising=False)
  monkeypatch.delenv("JAX_PLATFORMS", raising=False)
  paths = [str(ROOT), os.environ.get("PYTHONPATH", "")]
  monkeypatch.setenv("PYTHONPATH", os.pathsep.join(p for p in paths if p))
  client = nbclient.NotebookClient(
    notebook,
    timeout=CELL_TIMEOUT_S,
    kernel_name="python3",
    resources={"metadata": {"path": str(tmp_path)}},
  )
  client.execute()  # raises CellExecutionError, with the cell, on any error
  code = [c for c in notebook.cells if c.cell_type == "code"]
  assert all(c.execution_count for c in code)
  errors = [o for c in code for o in c.outputs if o.output_type == "error"]
  assert not errors
  images = [
    o for c in code for o in c.outputs if "image/png" in o.get("data", {})
  ]
  assert images, f"{path.name} drew no figure"
