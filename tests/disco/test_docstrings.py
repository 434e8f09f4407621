"""Every example in the disco docstrings runs and prints what it says.

The modules are found by walking the package, so a new module is tested
without being listed, and each must have examples and run all of them (an
example that doctest skips or never finds does not count as run).
`graphpipe.models.attention` is tested here too: disco's attention is it.
"""

import doctest
import importlib
import pkgutil

import pytest

import disco

MODULES = ["disco", "graphpipe.models.attention"] + sorted(
  info.name for info in pkgutil.walk_packages(disco.__path__, "disco.")
)


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples(name):
  module = importlib.import_module(name)
  examples = sum(
    len(test.examples) for test in doctest.DocTestFinder().find(module)
  )
  assert examples > 0, f"{name} has no docstring example"
  flags = doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE
  result = doctest.testmod(module, optionflags=flags, verbose=False)
  assert result.failed == 0
  assert result.attempted == examples
