"""Every example in the disco docstrings runs and prints what it says."""

import doctest
import importlib

import pytest

MODULES = [
  "disco",
  "disco.checkpoint",
  "disco.data",
  "disco.distributed",
  "disco.errors",
  "disco.exchange",
  "disco.hlo_bytes",
  "disco.layers",
  "disco.lowering",
  "disco.metrics",
  "disco.models",
  "disco.models.resnet",
  "disco.models.vit",
  "disco.observe",
  "disco.ops",
  "disco.prune",
  "disco.safe_pickle",
  "disco.splits",
  "disco.train",
  "disco.transformer",
]


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples(name):
  module = importlib.import_module(name)
  flags = doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE
  result = doctest.testmod(module, optionflags=flags, verbose=False)
  assert result.failed == 0
