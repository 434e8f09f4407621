"""Variables the loss updates while training: BatchNorm's running values.

A layer in training (BatchNorm with `use_running_average=False`, linen's
`mutable=['batch_stats']`) normalises by the statistics of the chunk a
device runs and updates its running values from them. The step carries a
device's state slots through its ticks: each forward writes the values
its chunk left (`write`), so they move on in micro-batch order, as GPipe
and torch pipelines do. A data-parallel stage's replicas each fold their
own rows of every micro-batch; after the loop the step averages them
(`average_replicas`), which for BatchNorm's update (affine in the
statistics) is the update by the replicas' mean statistics.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from graphpipe.core.slots import SlotLayout
from graphpipe.runtime import reduce, slots
from graphpipe.runtime.layout import Layout


class RunningValues:
  """Writing and averaging a layout's updated state in its slots.

  Args:
    layout: the step's layout (`StageLayout.updates` per stage).
    state: the slot layout of the non-trainable variables.
  """

  def __init__(self, layout: Layout, state: SlotLayout):
    self.layout, self.state = layout, state
    self.updates = any(s.updates for s in layout.stages)

  def write(self, state, stage: int, updates: dict):
    """The device's state slots with `updates` ('state:' key -> its value
    after the chunk) written in."""
    if not updates:
      return state
    return slots.write(self.state, stage, state, updates)

  def average_replicas(self, state, me, axis: str):
    """Each data-parallel stage's updated values averaged over its
    replicas; everything else in the slots as it is."""
    lay = self.layout
    replicated = [s for s in lay.stages if s.updates and len(s.devices) > 1]
    if not replicated:
      return state
    groups = [s.devices for s in lay.stages]
    sums = reduce.ring_sum(state, groups, lay.num_devices, axis)
    out = []
    for k, (old, total) in enumerate(zip(state, sums, strict=True)):
      # Per device: 1 / its stage's replicas where the updated values lie.
      scale = np.zeros((lay.num_devices, old.shape[0]), np.float32)
      for s in replicated:
        mask = slots.masks(self.state, s.id, dict(s.updates))[k]
        if mask is not None:
          scale[list(s.devices)] = np.where(mask, 1.0 / len(s.devices), 0.0)
      if not scale.any():
        out.append(old)
        continue
      mine = jnp.asarray(scale)[me]
      out.append(jnp.where(mine > 0, total * mine, old))
    return tuple(out)
