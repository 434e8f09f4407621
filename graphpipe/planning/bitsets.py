"""Node sets as int bit masks (bit v set: node v in the set).

The planners' searches (the series-parallel decomposition, Piper's
down-sets, the local search's moves) keep sets of nodes this way: union,
difference and subset tests are one integer operation each.

Example:
  >>> mask = mask_of([0, 3, 5])
  >>> mask, list(bits(mask))
  (41, [0, 3, 5])
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator


def mask_of(nodes: Iterable[int]) -> int:
  """The mask of a set of node ids."""
  out = 0
  for v in nodes:
    out |= 1 << v
  return out


def bits(mask: int) -> Iterator[int]:
  """The node ids of a mask, smallest first."""
  while mask:
    low = mask & -mask
    yield low.bit_length() - 1
    mask ^= low
