"""Every example in the graphpipe docstrings runs and prints what it says.

Each module of the package (found by walking it, so a new module is tested
without being listed here) runs through `doctest` with the names of
`example_globals` added to its own: the modules the examples use (graphpipe,
jax, jnp, nnx, optax, np) and `capture_zoo`. `capture_zoo` is the zoo's,
memoised for the session: capturing a model costs seconds, and many examples
start from the same tiny one (`capture_zoo("two_branch", "tiny")`), which
then is traced once. Examples write their files (`graph.save("graph.json")`,
traces, charts) into a temporary directory.
"""

import doctest
import functools
import importlib
import pkgutil
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import graphpipe
from graphpipe import models

FLAGS = doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE


def _module_names() -> list[str]:
  found = pkgutil.walk_packages(graphpipe.__path__, prefix="graphpipe.")
  return ["graphpipe", *sorted(m.name for m in found)]


def _source_examples(module) -> int:
  """How many `>>>` lines the module's source holds (doctest, too, skips
  those that hold only a comment)."""
  with open(module.__file__) as f:
    source = f.read()
  return len(re.findall(r"^\s*>>> +[^#\s]", source, flags=re.MULTILINE))


@pytest.fixture(scope="module")
def example_globals() -> dict:
  return {
    "graphpipe": graphpipe,
    "jax": jax,
    "jnp": jnp,
    "nnx": nnx,
    "np": np,
    "optax": optax,
    "capture_zoo": functools.cache(models.capture_zoo),
  }


@pytest.mark.parametrize("name", _module_names())
def test_docstring_examples(name, example_globals, tmp_path, monkeypatch):
  monkeypatch.chdir(tmp_path)
  module = importlib.import_module(name)
  result = doctest.testmod(
    module, extraglobs=example_globals, optionflags=FLAGS, verbose=False
  )
  assert result.failed == 0
  # Every `>>>` line of the source ran, so a module with examples attempted
  # some, and an example that doctest stops collecting (moved out of a
  # docstring, or into an object the module imports rather than defines) is
  # noticed.
  assert result.attempted == _source_examples(module)
