"""Every disco error class lives in `disco.errors` and is exported."""

import ast
import inspect
import pathlib

import disco
from disco import errors

PACKAGE = pathlib.Path(disco.__file__).parent
BUILTINS = {"Exception", "ValueError", "KeyError", "TypeError", "IndexError"}


def error_classes():
  return [
    value
    for value in vars(errors).values()
    if inspect.isclass(value) and issubclass(value, errors.DiscoError)
  ]


def test_every_error_is_exported_from_errors_and_the_package():
  names = {cls.__name__ for cls in error_classes()}
  assert set(errors.__all__) == names
  assert names <= set(disco.__all__)
  assert all(getattr(disco, name) is getattr(errors, name) for name in names)


def test_no_module_defines_or_raises_errors_of_its_own():
  for path in sorted(PACKAGE.rglob("*.py")):
    tree = ast.parse(path.read_text(), str(path))
    for node in ast.walk(tree):
      if isinstance(node, ast.ClassDef) and path.name != "errors.py":
        bases = {ast.unparse(base) for base in node.bases}
        assert not any(b.endswith("Error") for b in bases), (path, node.name)
      if isinstance(node, ast.Raise) and isinstance(node.exc, ast.Call):
        raised = ast.unparse(node.exc.func)
        # The base class only through a subclass; builtins only as the
        # abstract-method marker.
        assert raised not in BUILTINS | {"DiscoError"}, (path, node.lineno)
