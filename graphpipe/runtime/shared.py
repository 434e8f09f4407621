"""Parameters held by several stages stay one parameter.

A parameter read by nodes of several stages (a tied embedding read by the
first stage's lookup and the last stage's `attend`, a bias every layer
adds) has a copy in each holder stage's slots, initialised from the same
value. Each holder's backward gives its part of the gradient; before the
replicas' all-reduce and the optimizer, the parts are summed:

    parts <- this device's gradient of every shared parameter (zeros for
             those its stage does not hold)
    total <- psum(parts) over every device     # one all-reduce
    the first device of each holder stage writes `total` in place of its
    part, its replicas zeros (their ring all-reduce adds them back)

so every copy receives the same gradient and, with an elementwise
optimizer, stays bit-identical (Megatron-LM's embedding group, here on the
pipe axis).
"""

from __future__ import annotations

import math

import jax.numpy as jnp
from jax import lax


class SharedGradients:
  """The shared parameters of a layout and their gradient exchange.

  Args:
    layout: the step's layout.
    slots: the slot layout of the parameters (`Buffers.params`).
  """

  def __init__(self, layout, slots):
    self.layout, self.slots = layout, slots
    holders = {}
    for s in layout.stages:
      for key in s.params:
        holders.setdefault(key, []).append(s.id)
    self.keys = sorted(k for k, stages in holders.items() if len(stages) > 1)
    self.offsets, at = {}, 0
    for key in self.keys:
      self.offsets[key] = at
      at += math.prod(layout.param_shapes[key][0])
    self.size = at
    self.holders = {k: holders[k] for k in self.keys}

  def _branches(self, me, make, default):
    """`make(stage)` on the devices of stages holding shared parameters,
    `default` on the others."""
    device_stage = self.layout.stage_of_device()
    stages = sorted({s for k in self.keys for s in self.holders[k]})
    index = jnp.asarray(
      [
        1 + stages.index(device_stage[d])
        if device_stage.get(d) in stages
        else 0
        for d in range(self.layout.num_devices)
      ]
    )[me]
    branches = [default] + [make(s) for s in stages]
    return index, branches

  def exchange(self, gacc: tuple, me, axis: str) -> tuple:
    """`gacc` (this device's gradient slots) with every shared
    parameter's part replaced as the module docstring says (`axis`: the
    mesh axis of the devices)."""
    if not self.keys:
      return gacc

    def extract(stage):
      def run(g):
        parts = jnp.zeros((self.size,), jnp.float32)
        for key in self._held(stage):
          slot, offset = self.slots.places[stage][key]
          n = self.slots.lengths[key]
          at = self.offsets[key]
          parts = parts.at[at : at + n].set(g[slot][offset : offset + n])
        return parts

      return run

    index, branches = self._branches(
      me, extract, lambda g: jnp.zeros((self.size,), jnp.float32)
    )
    total = lax.psum(lax.switch(index, branches, gacc), axis)

    def write(stage):
      first = self.layout.stages[stage].devices[0]

      def run(g):
        g = list(g)
        for key in self._held(stage):
          slot, offset = self.slots.places[stage][key]
          n = self.slots.lengths[key]
          at = self.offsets[key]
          value = jnp.where(me == first, total[at : at + n], 0.0)
          g[slot] = g[slot].at[offset : offset + n].set(value)
        return tuple(g)

      return run

    index, branches = self._branches(me, write, lambda g: g)
    return lax.switch(index, branches, gacc)

  def _held(self, stage):
    return [k for k in self.keys if stage in self.holders[k]]
