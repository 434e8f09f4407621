"""Synthetic batches for the model zoo, real or abstract, from one spec.

Each model describes its batch once, as a dict of `Field`s; `sample` fills
it with deterministic random data and `abstract` gives the matching
`jax.ShapeDtypeStruct`s, so the two can never disagree.
"""

import dataclasses

import jax
import numpy as np

from graphpipe.errors import GraphpipeError


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
      raise GraphpipeError(
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
