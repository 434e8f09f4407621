"""Reading and writing the slots of `graphpipe.core.slots` (jax and numpy).

The slot layout itself (`plan_slots`, `SlotLayout`) is plain Python in
`graphpipe.core.slots`, shared with the planner's memory rule.
"""

from __future__ import annotations

import math

import jax.numpy as jnp
import numpy as np
from jax import lax

from graphpipe.core.slots import SlotLayout, plan_slots

__all__ = [
  "SlotLayout",
  "host_slots",
  "host_values",
  "masks",
  "plan_slots",
  "read",
  "scatter",
  "write",
]


# Reading and writing slots inside the step.


# 32-bit integers that slots holding constants keep as bits (a float32
# holds integers exactly only up to 2^24). Parameter slots convert: the
# optimizer adds to them, and bits of small integers are subnormal floats
# that arithmetic may flush to zero.
_AS_BITS = ("int32", "uint32")


def read(
  slots, layout: SlotLayout, stage: int, keys, shapes, bits: bool = False
) -> dict:
  """The values of `keys` of `stage` from this device's `slots`.

  Args:
    slots: the device's tuple of flat float32 slots.
    layout: where each variable lives.
    stage: the device's stage.
    keys: the variables to read.
    shapes: key -> (shape, dtype).
    bits: 32-bit integers are held as their bits (`host_slots`).
  """
  out = {}
  for key in keys:
    slot, offset = layout.places[stage][key]
    shape, dtype = shapes[key]
    flat = slots[slot]
    if not layout.whole(stage, key):
      flat = flat[offset : offset + layout.lengths[key]]
    if bits and str(dtype) in _AS_BITS:
      out[key] = lax.bitcast_convert_type(flat, dtype).reshape(shape)
    else:
      out[key] = flat.reshape(shape).astype(dtype)
  return out


def scatter(layout: SlotLayout, stage: int, values: dict) -> tuple:
  """Full slots holding `values` (key -> array) of `stage`, zeros elsewhere.

  The runtime adds them to its gradient slots: one whole-slot add per slot
  is what XLA keeps in place, where several partial updates of one buffer
  make it copy the buffer. Slots `stage` does not use are zeros (XLA drops
  adding them where it sees them).
  """
  out = []
  contents = layout.slot_contents(stage)
  for slot, size in enumerate(layout.sizes):
    pieces, at = [], 0
    for offset, key in contents.get(slot, []):
      if offset > at:
        pieces.append(jnp.zeros((offset - at,), jnp.float32))
      pieces.append(values[key].reshape(-1).astype(jnp.float32))
      at = offset + layout.lengths[key]
    if at < size:
      pieces.append(jnp.zeros((size - at,), jnp.float32))
    out.append(pieces[0] if len(pieces) == 1 else jnp.concatenate(pieces))
  return tuple(out)


def write(layout: SlotLayout, stage: int, slots, values: dict) -> tuple:
  """This device's `slots` with `values` (key -> array, floating point)
  of `stage` written in."""
  out = list(slots)
  for key, value in values.items():
    slot, offset = layout.places[stage][key]
    flat = value.reshape(-1).astype(jnp.float32)
    out[slot] = lax.dynamic_update_slice_in_dim(out[slot], flat, offset, 0)
  return tuple(out)


def masks(layout: SlotLayout, stage: int, keys) -> list:
  """Per slot, a numpy bool mask of where `keys` of `stage` lie (None for
  a slot holding none of them)."""
  out = [None] * len(layout.sizes)
  for key in keys:
    slot, offset = layout.places[stage][key]
    if out[slot] is None:
      out[slot] = np.zeros(layout.sizes[slot], bool)
    out[slot][offset : offset + layout.lengths[key]] = True
  return out


# Host side.


def host_slots(
  layout: SlotLayout, stage: int, values: dict, bits: bool = False
) -> list:
  """numpy float32 slots of `stage` holding `values` (key -> array); with
  `bits`, 32-bit integers as their bits (exact beyond 2^24)."""
  slots = [np.zeros(size, np.float32) for size in layout.sizes]
  for key, (slot, offset) in layout.places[stage].items():
    n = layout.lengths[key]
    value = np.asarray(values[key])
    if bits and str(value.dtype) in _AS_BITS:
      value = value.view(np.float32)
    slots[slot][offset : offset + n] = np.asarray(value, np.float32).reshape(-1)
  return slots


def host_values(
  layout: SlotLayout, stage: int, slots, shapes, bits: bool = False
) -> dict:
  """Inverse of `host_slots`: key -> numpy array of its dtype and shape."""
  out = {}
  for key, (slot, offset) in layout.places[stage].items():
    shape, dtype = shapes[key]
    n = math.prod(shape)
    flat = np.asarray(slots[slot])[offset : offset + n]
    if bits and str(dtype) in _AS_BITS:
      out[key] = flat.view(dtype).reshape(shape)
    else:
      out[key] = flat.reshape(shape).astype(dtype)
  return out
