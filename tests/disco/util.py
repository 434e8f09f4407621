"""Helpers shared by the disco tests."""

import numpy as np


def normal(seed: int, shape) -> np.ndarray:
  """Standard normal float32 test data from numpy.

  jax.random would compile its generator once per shape, which costs more
  than the tests themselves on a 2-core machine.

  Args:
    seed: the seed.
    shape: the shape.
  """
  return np.random.default_rng(seed).standard_normal(shape, np.float32)
