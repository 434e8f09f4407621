"""Which device pairs a plan's step sends between, grouped into channels.

Plain Python, shared by the planner's memory rule (`graphpipe.core.memory`)
and the runtime (`graphpipe.runtime.layout`, `graphpipe.runtime.tables`),
so the channel count the planner charges is the one the runtime builds.

Along a stage edge, a micro-batch of b samples is split over the source's
k devices in rows [i b / k, (i + 1) b / k) and over the destination's in
the same way; a destination k times larger than its source takes the
source's micro-batches as k pieces. Each (source device, destination
device, piece) whose rows overlap is a transfer; activations go forward
along it and gradients back. The step sends with one `ppermute` per
*channel*: a group of such items in which every device sends at most once
and receives at most once.

Example:
  Stage 0 on devices (0, 1) feeds stage 1 on device 2, micro-batch 4:

  >>> overlaps([(0, 1), (2,)], [4, 4], [(0, 1)])
  [(0, 0, 2, 0, 0, 0, 2), (0, 1, 2, 0, 0, 2, 2)]
  >>> color_pairs(channel_items(overlaps([(0, 1), (2,)], [4, 4], [(0, 1)])))
  [[(0, 2, 'F', 0), (2, 0, 'B', 0)], [(1, 2, 'F', 0), (2, 1, 'B', 0)]]

  Two channels: device 2 receives from 0 and 1, so those go on different
  ones; each carries one way forward and the way back.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

from graphpipe.core.stages import Plan


def overlaps(
  devices: Sequence[Sequence[int]],
  sizes: Sequence[int],
  edges: Sequence[tuple[int, int]],
) -> list[tuple[int, int, int, int, int, int, int]]:
  """Every transfer of a plan's stage edges.

  Args:
    devices: per stage, its devices.
    sizes: per stage, its micro-batch size.
    edges: (source stage, destination stage) pairs.

  Returns:
    (edge index in sorted(edges), source device, destination device, piece,
    first row in the source's chunk, first row in the destination's chunk,
    rows) per transfer.
  """
  found = []
  for e, (a, b) in enumerate(sorted(edges)):
    src_size, dst_size = sizes[a], sizes[b]
    src_chunk = src_size // len(devices[a])
    dst_chunk = dst_size // len(devices[b])
    # Rows of the destination's micro-batch: piece p of it is the source's
    # micro-batch rows shifted by p times the source's size.
    for piece in range(dst_size // src_size):
      base = piece * src_size
      for i, sd in enumerate(devices[a]):
        for j, dd in enumerate(devices[b]):
          lo = max(base + i * src_chunk, j * dst_chunk)
          hi = min(base + (i + 1) * src_chunk, (j + 1) * dst_chunk)
          if lo < hi:
            found.append(
              (e, sd, dd, piece, lo - base - i * src_chunk, lo - j * dst_chunk,
               hi - lo)
            )  # fmt: skip
  return found


def channel_items(transfers) -> list[tuple[int, int, str, int]]:
  """(sender, receiver, 'F' or 'B', piece) of every transfer, both ways:
  activations forward, gradients back."""
  items = []
  for _, src, dst, piece, *_ in transfers:
    items.append((src, dst, "F", piece))
    items.append((dst, src, "B", piece))
  return items


def color_pairs(pairs: Sequence[tuple]) -> list[list[tuple]]:
  """Groups (src, dst, ...) items into permutations (ppermute calls).

  A bipartite edge colouring: each group has unique sources and unique
  destinations (the first two entries of each item; further entries tell
  apart items of one device pair, which then get groups of their own).
  Greedy by first fit, enough for pipeline fan-in/fan-out.
  """
  groups: list[list[tuple]] = []
  # Per sender and per receiver, a bit for each group it is in: the first
  # group free for both is the lowest bit clear in the two masks (a new
  # group where every existing one is taken).
  sends: dict = {}
  receives: dict = {}
  for pair in sorted(set(pairs)):
    src, dst = pair[0], pair[1]
    taken = sends.get(src, 0) | receives.get(dst, 0)
    free = ~taken & (taken + 1)  # the lowest clear bit
    index = free.bit_length() - 1
    if index == len(groups):
      groups.append([])
    groups[index].append(pair)
    sends[src] = sends.get(src, 0) | free
    receives[dst] = receives.get(dst, 0) | free
  return groups


def plan_channels(plan: Plan) -> list[list[tuple]]:
  """The channels of `plan`'s step: its transfers' items, coloured."""
  return color_pairs(
    channel_items(
      overlaps(
        [s.devices for s in plan.stages],
        [s.micro_batch_size for s in plan.stages],
        plan.stage_edges,
      )
    )
  )


def channel_count(plan: Plan) -> int:
  """How many channels `plan`'s step uses (`len(plan_channels(plan))`).

  Memoised on what the channels depend on (each stage's devices and
  micro-batch size, the stage edges): the planners' local search prices
  thousands of plans that differ only in which nodes a stage holds.
  """
  return _channel_count(
    tuple(s.devices for s in plan.stages),
    tuple(s.micro_batch_size for s in plan.stages),
    tuple(plan.stage_edges),
  )


@functools.lru_cache(maxsize=1 << 14)
def _channel_count(devices, sizes, edges) -> int:
  return len(color_pairs(channel_items(overlaps(devices, sizes, edges))))
