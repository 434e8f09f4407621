"""Sphinx configuration of the graphpipe + disco site.

Build (BUILD.md, "Documentation"):

  python -m sphinx -W --keep-going -b html docs docs/_build/html

Pages are MyST Markdown; notebooks are rendered by myst-nb from the copies
`docs/_ext/sitegen.py` makes of `notebooks/*.ipynb`, never executed here (the
test suite executes them); API pages are autodoc over each package's
public names; `docs/_ext/sitegen.py` also lists each experiment's absl flags
from its module and checks that every dotted `graphpipe.*`, `disco.*` or
`experiments.*` name cited in a docstring or a page resolves.
"""

import os
import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "docs" / "_ext")]
# The API pages import the packages; JAX on the CPU is enough for that.
os.environ.setdefault("JAX_PLATFORMS", "cpu")

project = "graphpipe + disco"
author = "graphpipe + disco authors"
copyright = "2026, the graphpipe + disco authors"

extensions = [
  "myst_nb",
  "sphinx.ext.autodoc",
  "sphinx.ext.napoleon",
  "sphinx.ext.viewcode",
  "sitegen",
]

source_suffix = {".md": "myst-nb", ".ipynb": "myst-nb"}
exclude_patterns = ["_build", "_ext", "**/.ipynb_checkpoints"]
myst_enable_extensions = ["colon_fence", "deflist", "dollarmath"]
myst_heading_anchors = 3
nb_execution_mode = "off"
suppress_warnings = ["myst.header"]

autodoc_default_options = {"members": True, "show-inheritance": True}
autodoc_member_order = "bysource"
autodoc_typehints = "description"
autodoc_mock_imports = []
napoleon_google_docstring = True
napoleon_numpy_docstring = False
napoleon_use_ivar = True

html_theme = "furo"
html_title = "graphpipe + disco"
