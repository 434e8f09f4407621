"""What every device of a pipelined step holds, and what its branches get.

`Buffers` sizes the per-device buffers (the same on all devices: SPMD
needs one shape); `Operands` is what every branch of the tick's
conditionals receives.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax

from graphpipe.core.slots import SlotLayout


class Operands(NamedTuple):
  """What every branch of the tick's two `lax.switch`es receives."""

  params: tuple  # this device's parameter slots
  state: tuple  # its non-trainable variable slots
  batch: jax.Array  # this device's batch words (`graphpipe.runtime.feed`)
  act: jax.Array  # activation stash (all slots, flat)
  grad: jax.Array  # gradient stash
  res: jax.Array  # residual stash
  gacc: tuple  # accumulated parameter gradients, slots like `params`
  loss: jax.Array  # the loss's sums over the batch, accumulated
  forward: jax.Array  # the tick's forward: 0 none, 1 + i forward_devices[i]
  backward: jax.Array  # 0 none, 1 + i backward or fused branch i
  microbatch: jax.Array  # the action's micro-batch
  act_slot: jax.Array  # its slots in the three stashes
  grad_slot: jax.Array
  res_slot: jax.Array
  seeds: jax.Array  # d loss / d sums: the backward's seed for the sums
  statistics: dict  # the batch's data statistics ('global:k' keys)


@dataclasses.dataclass(frozen=True)
class Buffers:
  """Sizes (float32 elements; the feed in 32-bit words) of the per-device
  buffers; all devices alike.

  `params` and `state` are the slot layouts of the trainable and the
  non-trainable variables (`graphpipe.runtime.slots`).
  """

  params: SlotLayout
  state: SlotLayout
  act_slot: int
  act_slots: int
  grad_slot: int
  grad_slots: int
  res_slot: int
  res_slots: int
  channel: int
  channels: int
  feed: int  # words of the per-device batch vector

  def stash_bytes(self) -> int:
    return 4 * (
      self.act_slot * self.act_slots
      + self.grad_slot * self.grad_slots
      + self.res_slot * self.res_slots
    )
