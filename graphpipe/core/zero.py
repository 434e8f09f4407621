"""What each device owns of the optimizer state when stages shard (ZeRO-1).

Plain Python, shared by the planner's memory rule (`graphpipe.core.memory`)
and the runtime (`graphpipe.runtime.zero`), so both size the same buffers.

Every device stores its stage's parameters in flat slots of one set of
sizes (`graphpipe.core.slots`). A 'zero1' stage on n devices cuts each slot
of S elements into n chunks of ceil(S / n); each device owns one chunk of
every slot: it receives those chunks' summed gradients (a reduce-scatter
of the slot, in place of the all-reduce), keeps the optimizer state of
them alone, updates them and the devices all-gather the updated chunks.
A device of any other stage owns its whole stage, packed (its variables
end to end, P elements). The step is one SPMD program, so the owned
vector has one length on every device: the most any device owns.

Example (slots of 60 and 40 elements; a stage of 100 on 4 devices, one
of 30 on one device):
  >>> owned = owned_elements([(100, 4, True), (30, 1, False)], (60, 40))
  >>> owned.chunks, owned.length, owned.needed
  ({4: 25}, 30, (25, 30))
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence


@dataclasses.dataclass(frozen=True)
class Owned:
  """The owned-elements layout of a step.

  Attributes:
    chunks: group size n -> elements a device of a zero1 stage on n
      devices owns (its chunk of every slot).
    length: elements of the owned vector on every device (at least 1).
    per_stage: per stage, the elements each of its devices owns.
    needed: per stage, the elements each of its devices needs (a zero1
      device: ceil(P / n) of its stage's P; the rest of its chunks is slot
      padding).
  """

  chunks: dict[int, int]
  length: int
  per_stage: tuple[int, ...]
  needed: tuple[int, ...]

  @property
  def sharded(self) -> bool:
    """Whether any stage shards its optimizer state."""
    return bool(self.chunks)


def owned_elements(
  stages: Sequence[tuple[int, int, bool]],
  slots: Sequence[int] = (),
  slot_count: int = 0,
) -> Owned:
  """The owned layout of stages given as (parameter elements, devices,
  zero1).

  Args:
    stages: per stage, (parameter elements, devices, whether zero1).
    slots: the slot sizes (the runtime's, `Buffers.params.sizes`).
    slot_count: without `slots`, at most how many slots there are; the
      chunks are then bounded from the largest stage's elements (the
      slots' total), as the planner does.
  """
  largest = max([1, *(params for params, _, _ in stages)])
  chunks: dict[int, int] = {}
  for _, devices, zero in stages:
    if zero and devices > 1 and devices not in chunks:
      if slots:
        chunks[devices] = sum(-(-s // devices) for s in slots)
      else:
        # sum of ceil(S_j / n) over m slots <= ceil(total / n) + m - 1
        chunks[devices] = -(-largest // devices) + max(0, slot_count - 1)
  per_stage = tuple(
    chunks[devices] if zero and devices > 1 else params
    for params, devices, zero in stages
  )
  needed = tuple(
    -(-params // devices) if zero and devices > 1 else params
    for params, devices, zero in stages
  )
  length = max([1, *per_stage])
  return Owned(dict(sorted(chunks.items())), length, per_stage, needed)
