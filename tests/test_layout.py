"""The package layout: layers import downward only, no cycles, small files.

graphpipe's layers, lowest first: core (data types), frontend (capture),
costs, schedules, simulator, planning, runtime; the zoo (graphpipe.models)
sits beside them and the library never imports it. Every import statement
counts, including those inside functions.
"""

import ast
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGES = ("graphpipe", "disco", "experiments")
LAYERS = (
  "core",
  "frontend",
  "costs",
  "schedules",
  "simulator",
  "planning",
  "runtime",
)
# Layers that are plain Python over the data types: no JAX, no Flax.
NO_JAX = ("core", "schedules", "simulator", "planning")
# A module is cut by concept, and its size follows; this bound only catches
# a file that has grown into several concepts (500 made modules split to
# meet it rather than by concept: experiments/reproduction/).
MAX_LINES = 800


def _modules() -> dict[str, pathlib.Path]:
  out = {}
  for package in PACKAGES:
    for path in (ROOT / package).rglob("*.py"):
      parts = list(path.relative_to(ROOT).with_suffix("").parts)
      if parts[-1] == "__init__":
        parts = parts[:-1]
      out[".".join(parts)] = path
  return out


MODULES = _modules()


def _imports(name: str, path: pathlib.Path) -> set[str]:
  """Every module `name` imports (`from pkg import sub` counts as sub)."""
  is_package = path.name == "__init__.py"
  found = set()
  for node in ast.walk(ast.parse(path.read_text())):
    if isinstance(node, ast.Import):
      found.update(alias.name for alias in node.names)
    elif isinstance(node, ast.ImportFrom):
      if node.level:
        base = name.split(".")
        base = base if is_package else base[:-1]
        base = base[: len(base) - node.level + 1]
        module = ".".join(base + ([node.module] if node.module else []))
      else:
        module = node.module
      for alias in node.names:
        child = f"{module}.{alias.name}"
        found.add(child if child in MODULES else module)
  return found


IMPORTS = {name: _imports(name, path) for name, path in MODULES.items()}


def _layer(module: str):
  """graphpipe layer index, 'zoo', 'errors', 'face' or None (not ours)."""
  parts = module.split(".")
  if parts[0] != "graphpipe":
    return None
  if len(parts) == 1:
    return "face"
  if parts[1] == "errors":
    return "errors"
  if parts[1] == "models":
    return "zoo"
  return LAYERS.index(parts[1])


def test_every_graphpipe_module_sits_in_a_layer():
  for module in MODULES:
    if module.startswith("graphpipe"):
      parts = module.split(".")
      assert len(parts) == 1 or parts[1] in LAYERS + ("errors", "models"), (
        f"{module} is outside the layers {LAYERS}: move it into one"
      )


def test_graphpipe_layers_import_downward_only():
  problems = []
  for module, imported in IMPORTS.items():
    mine = _layer(module)
    if mine is None:
      continue
    for other in imported:
      theirs = _layer(other)
      if theirs is None or theirs == "errors":
        continue
      if theirs == "zoo" and mine != "zoo":
        problems.append(f"{module} imports the zoo {other}")
      elif theirs == "face" and mine != "zoo":
        problems.append(f"{module} imports the package face {other}")
      elif isinstance(mine, int) and isinstance(theirs, int) and theirs > mine:
        problems.append(
          f"{module} ({LAYERS[mine]}) imports {other} ({LAYERS[theirs]}), "
          "a higher layer"
        )
      elif mine == "errors":
        problems.append(f"{module} (errors) imports {other}")
  assert not problems, "\n".join(problems)


def test_data_types_schedules_simulator_and_planning_use_no_jax():
  problems = []
  for module, imported in IMPORTS.items():
    layer = _layer(module)
    if isinstance(layer, int) and LAYERS[layer] in NO_JAX:
      for other in imported:
        if other.split(".")[0] in ("jax", "jaxlib", "flax", "optax"):
          problems.append(f"{module} imports {other}")
  assert not problems, "\n".join(problems)


def test_no_import_cycles_deferred_ones_included():
  graph = {
    m: {o for o in imported if o in MODULES and o != m}
    for m, imported in IMPORTS.items()
  }
  # A package's __init__ importing its own submodules is how a package
  # shows its face; a submodule importing its package's __init__ back is
  # the cycle that matters, and it is an edge like any other here.
  state, cycles = {}, []

  def visit(module, stack):
    state[module] = "open"
    stack.append(module)
    for other in sorted(graph[module]):
      if state.get(other) == "open":
        cycles.append(" -> ".join(stack[stack.index(other) :] + [other]))
      elif other not in state:
        visit(other, stack)
    stack.pop()
    state[module] = "done"

  for module in sorted(graph):
    if module not in state:
      visit(module, [])
  assert not cycles, "import cycles:\n" + "\n".join(cycles)


def test_no_module_over_the_line_bound():
  long = {
    m: n
    for m, p in MODULES.items()
    if (n := len(p.read_text().splitlines())) > MAX_LINES
  }
  assert not long, f"modules over {MAX_LINES} lines: {long}"


def test_library_never_imports_experiments():
  for module, imported in IMPORTS.items():
    if module.split(".")[0] in ("graphpipe", "disco"):
      assert not any(o.split(".")[0] == "experiments" for o in imported), module


@pytest.mark.parametrize("name", ["capture", "plan", "simulate"])
def test_public_functions_are_not_shadowed_by_modules(name):
  import graphpipe

  assert callable(getattr(graphpipe, name))
  clashes = [
    m
    for m in MODULES
    if m.startswith("graphpipe.") and m.split(".")[-1] == name
  ]
  assert not clashes, f"modules named like graphpipe.{name}: {clashes}"


def test_import_graphpipe_does_not_import_the_zoo():
  code = (
    "import sys, graphpipe; "
    "print(sorted(m for m in sys.modules if m.startswith('graphpipe.models')))"
  )
  done = subprocess.run(
    [sys.executable, "-c", code],
    capture_output=True,
    text=True,
    cwd=ROOT,
    timeout=120,
  )
  assert done.returncode == 0, done.stderr[-2000:]
  assert done.stdout.strip() == "[]"


def test_every_error_class_lives_in_its_package_errors_module():
  for package in ("graphpipe", "disco"):
    home = f"{package}.errors"
    for module, path in MODULES.items():
      if module.split(".")[0] != package or module == home:
        continue
      for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ClassDef):
          bases = {getattr(b, "id", getattr(b, "attr", "")) for b in node.bases}
          assert not any(b.endswith(("Error", "Exception")) for b in bases), (
            f"{module} defines the error {node.name}: move it to {home}"
          )


def test_error_modules_export_every_class():
  import importlib

  for package in ("graphpipe", "disco"):
    errors = importlib.import_module(f"{package}.errors")
    top = importlib.import_module(package)
    classes = [
      name
      for name, value in vars(errors).items()
      if isinstance(value, type)
      and issubclass(value, Exception)
      and value.__module__ == errors.__name__
    ]
    assert sorted(classes) == sorted(errors.__all__)
    for name in classes:
      assert getattr(top, name) is getattr(errors, name), (package, name)
      assert name in top.__all__, (package, name)


def test_library_raises_no_bare_builtin_errors():
  problems = []
  for module, path in MODULES.items():
    if module.split(".")[0] not in ("graphpipe", "disco"):
      continue
    for node in ast.walk(ast.parse(path.read_text())):
      if isinstance(node, ast.Raise) and node.exc is not None:
        exc = node.exc.func if isinstance(node.exc, ast.Call) else node.exc
        if getattr(exc, "id", None) in ("ValueError", "KeyError", "TypeError"):
          problems.append(f"{module}:{node.lineno} raises {exc.id}")
  assert not problems, "\n".join(problems)
