"""Synthetic batches for the model zoo, real or abstract, from one spec.

Each model describes its batch once, as a dict of `Field`s; `sample` fills
it with deterministic random data and `abstract` gives the matching
`jax.ShapeDtypeStruct`s, so the two can never disagree. `batch_functions`
turns a model's description into its `make_batch` and `abstract_batch`.
"""

import dataclasses
from collections.abc import Callable

import jax
import numpy as np

from graphpipe.errors import ModelConfigError


@dataclasses.dataclass(frozen=True)
class Field:
  """One array of a batch: its shape, dtype and value range.

  Float fields are standard normal; integer fields are uniform over
  `[0, high)`.

  Example:
    >>> Field((4, 100), np.int32, high=50)  # 4 bags of 100 table rows
    Field(shape=(4, 100), dtype=<class 'numpy.int32'>, high=50)

  Args:
    shape: array shape, batch dimension first.
    dtype: `np.float32` or `np.int32`.
    high: exclusive upper bound of integer values; None for floats.
  """

  shape: tuple[int, ...]
  dtype: type = np.float32
  high: int | None = None

  def __post_init__(self):
    integer = np.issubdtype(self.dtype, np.integer)
    if integer != (self.high is not None):
      raise ModelConfigError(
        f"a {np.dtype(self.dtype).name} field needs "
        f"{'an' if integer else 'no'} upper bound `high`, got {self.high}"
      )


def sample(fields: dict[str, Field], seed: int) -> dict[str, np.ndarray]:
  """Deterministic random arrays for `fields`, drawn in dict order.

  Example:
    >>> sample({"x": Field((2, 3))}, seed=0)["x"].shape
    (2, 3)

  Args:
    fields: the batch description.
    seed: seed of the numpy generator; the same seed gives the same batch.
  """
  rng = np.random.default_rng(seed)
  batch = {}
  for name, field in fields.items():
    if field.high is None:
      batch[name] = rng.standard_normal(field.shape, dtype=np.float32)
    else:
      batch[name] = rng.integers(0, field.high, field.shape, dtype=field.dtype)
  return batch


def abstract(fields: dict[str, Field]) -> dict[str, jax.ShapeDtypeStruct]:
  """The shapes and dtypes of `sample(fields, seed)`, without any data.

  Example:
    >>> abstract({"x": Field((2, 3))})["x"]
    ShapeDtypeStruct(shape=(2, 3), dtype=float32)

  Args:
    fields: the batch description.
  """
  return {
    name: jax.ShapeDtypeStruct(field.shape, np.dtype(field.dtype))
    for name, field in fields.items()
  }


def batch_functions(
  fields: Callable[..., dict[str, Field]],
) -> tuple[Callable, Callable]:
  """A zoo model's `make_batch` and `abstract_batch`, from its batch spec.

  Example:
    >>> make_batch, abstract_batch = batch_functions(
    ...   lambda config, batch_size: {"x": Field((batch_size, 3))})
    >>> make_batch(None, 2)["x"].shape, abstract_batch(None, 2)["x"].shape
    ((2, 3), (2, 3))

  Args:
    fields: `fields(config, batch_size)`, the model's batch description.
  """

  def make_batch(
    config, batch_size: int, seed: int = 0
  ) -> dict[str, np.ndarray]:
    """A deterministic synthetic batch of `batch_size` samples for `config`.

    Floats are standard normal, integers (labels, indices) uniform in their
    range; the keys and shapes are those `loss_fn` reads.

    Args:
      config: the model's sizes.
      batch_size: samples in the batch.
      seed: the same seed gives the same batch.
    """
    return sample(fields(config, batch_size), seed)

  def abstract_batch(
    config, batch_size: int
  ) -> dict[str, jax.ShapeDtypeStruct]:
    """Shapes and dtypes of `make_batch(config, batch_size)`, without data.

    Args:
      config: the model's sizes.
      batch_size: samples in the batch.
    """
    return abstract(fields(config, batch_size))

  # The model module binds them to these names: they read (and pickle) as
  # its own functions.
  for function in (make_batch, abstract_batch):
    function.__module__ = fields.__module__
    function.__qualname__ = function.__name__
  return make_batch, abstract_batch
