"""Every third-party import is declared in setup.cfg, where it is needed.

Walks every import statement (ast; imports inside functions too) of the
packages, the tests and the notebooks' code cells, maps import names to
distribution names, and checks them against setup.cfg:

- the packages (graphpipe, disco, experiments): declared in
  `install_requires` or an extra; those imported when a module is imported
  (at module level) in `install_requires`, since an extra may be absent;
- the tests: `install_requires` or an extra, module-level ones in
  `install_requires` or the `test` extra;
- the notebooks: `install_requires` or the extras the README installs
  (`test`, `plots`, `data`), except imports tried under `except
  ImportError` (graphviz, when installed, draws the DAG).

Every declared requirement has a lower bound (the versions it was tested
with; BUILD.md says how).
"""

import ast
import configparser
import json
import pathlib
import re
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
OWN = {"graphpipe", "disco", "experiments", "tests", "conftest"}
# Import names that differ from their distribution's name.
DISTRIBUTION = {
  "absl": "absl-py",
  "sklearn": "scikit-learn",
  "skimage": "scikit-image",
  "pywt": "pywavelets",
  "yaml": "pyyaml",
  "orbax": "orbax-checkpoint",
  "PIL": "pillow",
  "IPython": "ipython",
  "google": "protobuf",
  "jaxlib": "jax",  # jaxlib comes with jax
}


def _normalise(name: str) -> str:
  return re.sub(r"[-_.]+", "-", name).lower()


def _requirements() -> dict[str, dict[str, str]]:
  """{group: {distribution: requirement}}; group 'install' or an extra."""
  config = configparser.ConfigParser()
  config.read(ROOT / "setup.cfg")
  groups = {"install": config["options"]["install_requires"]}
  groups.update(config["options.extras_require"])
  out = {}
  for group, text in groups.items():
    out[group] = {}
    for line in text.strip().splitlines():
      line = line.strip()
      if line:
        name = re.match(r"[A-Za-z0-9_.\-]+", line).group(0)
        out[group][_normalise(name)] = line
  return out


REQUIREMENTS = _requirements()


def _imports(
  tree: ast.AST, module_level_only: bool, optional_ok: bool = False
) -> set[str]:
  """Top-level names of third-party modules imported in `tree`."""
  if module_level_only:
    nodes = []
    stack = list(tree.body)
    while stack:  # module body, and inside module-level if / try blocks
      node = stack.pop()
      nodes.append(node)
      if isinstance(node, ast.If | ast.Try):
        stack.extend(node.body + node.orelse)
        stack.extend(getattr(node, "finalbody", []))
        for handler in getattr(node, "handlers", []):
          stack.extend(handler.body)
  else:
    nodes = list(ast.walk(tree))
  if optional_ok:  # imports under `try: ... except ImportError:` are optional
    guarded = {
      id(inner)
      for node in ast.walk(tree)
      if isinstance(node, ast.Try)
      and any(_catches_import_error(h) for h in node.handlers)
      for stmt in node.body
      for inner in ast.walk(stmt)
    }
    nodes = [n for n in nodes if id(n) not in guarded]
  names = set()
  for node in nodes:
    if isinstance(node, ast.Import):
      names.update(alias.name for alias in node.names)
    elif isinstance(node, ast.ImportFrom) and node.level == 0:
      names.add(node.module)
  tops = {name.split(".")[0] for name in names}
  return {t for t in tops if t not in sys.stdlib_module_names | OWN}


def _catches_import_error(handler: ast.ExceptHandler) -> bool:
  kinds = (
    handler.type.elts if isinstance(handler.type, ast.Tuple) else [handler.type]
  )
  return any(
    isinstance(k, ast.Name) and k.id in ("ImportError", "ModuleNotFoundError")
    for k in kinds
  )


def _distribution(import_name: str) -> str:
  return _normalise(DISTRIBUTION.get(import_name, import_name))


def _python_files(*folders: str) -> list[pathlib.Path]:
  return sorted(p for f in folders for p in (ROOT / f).rglob("*.py"))


def _notebook_code(path: pathlib.Path) -> ast.Module:
  cells = json.loads(path.read_text())["cells"]
  code = ["".join(c["source"]) for c in cells if c["cell_type"] == "code"]
  # IPython magics and shell lines are not Python.
  lines = [
    line
    for cell in code
    for line in cell.splitlines()
    if not line.lstrip().startswith(("%", "!"))
  ]
  return ast.parse("\n".join(lines))


def _groups(*names: str) -> set[str]:
  return {d for group in names for d in REQUIREMENTS.get(group, {})}


def _missing(files, allowed, module_level_only, optional_ok=False):
  missing = {}
  for path in files:
    tree = (
      _notebook_code(path)
      if path.suffix == ".ipynb"
      else ast.parse(path.read_text())
    )
    for name in _imports(tree, module_level_only, optional_ok):
      if _distribution(name) not in allowed:
        missing.setdefault(name, []).append(str(path.relative_to(ROOT)))
  return missing


EVERYTHING = _groups(*REQUIREMENTS)


def test_the_packages_imports_are_declared():
  files = _python_files("graphpipe", "disco", "experiments")
  assert len(files) > 50
  assert _missing(files, EVERYTHING, module_level_only=False) == {}
  core = _groups("install")
  assert _missing(files, core, module_level_only=True) == {}, (
    "imported when the module is imported, so it must be in "
    "install_requires (or import it inside the function that needs it)"
  )


def test_the_tests_imports_are_declared():
  files = _python_files("tests") + [ROOT / "conftest.py"]
  assert _missing(files, EVERYTHING, module_level_only=False) == {}
  allowed = _groups("install", "test")
  assert _missing(files, allowed, module_level_only=True) == {}


def test_the_notebooks_imports_are_declared():
  files = sorted((ROOT / "notebooks").glob("*.ipynb"))
  assert files
  allowed = _groups("install", "test", "plots", "data")
  # A notebook may try an optional tool (graphviz) and fall back without it.
  assert _missing(files, allowed, False, optional_ok=True) == {}


def test_the_walk_sees_what_the_runtime_imports():
  # orbax arrives through flax, but the runtime imports it itself.
  files = _python_files("graphpipe")
  found = set().union(
    *(_imports(ast.parse(p.read_text()), False) for p in files)
  )
  assert {"jax", "flax", "optax", "numpy", "orbax"} <= found
  assert _distribution("orbax") in REQUIREMENTS["install"]


@pytest.mark.parametrize(
  "group,name",
  [(g, n) for g, names in REQUIREMENTS.items() for n in names],
)
def test_every_requirement_has_a_lower_bound(group, name):
  assert ">=" in REQUIREMENTS[group][name], REQUIREMENTS[group][name]
