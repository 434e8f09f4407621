"""Values <-> float32 rows and flat vectors, the runtime's wire format."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from graphpipe.errors import PipelineRuntimeError
from graphpipe.runtime.layout import ValueSpec

_BITCAST = ("int32", "uint32")
# Narrow integers travel widened: every value is exact in float32.
_WIDENED_INTEGERS = ("int8", "uint8", "int16", "uint16")


def to_f32(x):
  """A float32 view of `x` that `from_f32` inverts exactly."""
  if str(x.dtype) in _BITCAST:
    return jax.lax.bitcast_convert_type(x, jnp.float32)
  return x.astype(jnp.float32)


def from_f32(x, dtype: str):
  """Inverse of `to_f32` for a value of `dtype`."""
  if dtype in _BITCAST:
    return jax.lax.bitcast_convert_type(jax.lax.stop_gradient(x), dtype)
  if dtype == "bool":
    return jax.lax.stop_gradient(x) != 0
  if dtype in _WIDENED_INTEGERS:  # exact in float32; no gradient
    return jax.lax.stop_gradient(x).astype(dtype)
  return x.astype(dtype)


def to_rows(x, spec: ValueSpec, rows: int):
  """[rows, width] float32: batch axis first, the rest flattened."""
  return to_f32(jnp.moveaxis(x, spec.batch_axis, 0)).reshape(rows, -1)


def from_rows(m, spec: ValueSpec, rows: int):
  """Inverse of `to_rows` for a chunk of `rows` samples."""
  shape = spec.shape_at(rows)
  moved = [shape[spec.batch_axis]] + [
    d for i, d in enumerate(shape) if i != spec.batch_axis
  ]
  value = from_f32(m.reshape(moved), spec.dtype)
  return jnp.moveaxis(value, 0, spec.batch_axis)


def pack_leaves(leaves) -> jax.Array:
  """Concatenates arrays of any supported dtype into one float32 vector."""
  if not leaves:
    return jnp.zeros((0,), jnp.float32)
  return jnp.concatenate([to_f32(x).reshape(-1) for x in leaves])


def pad_to(x, size: int):
  """`x` (1-D) zero-padded to `size` elements."""
  if x.shape[0] > size:
    raise PipelineRuntimeError(
      f"{x.shape[0]} elements do not fit in a buffer of {size}: the layout "
      "and the values disagree"
    )
  return jnp.pad(x, (0, size - x.shape[0]))
