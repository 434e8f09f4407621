"""What every partitioner returns, and the depth-frontier search they share.

A partitioner (`graphpipe.partitioner.GraphPipePartitioner`, the baselines
of `graphpipe.baselines`) is called with a micro-batch size and returns
`Partition`s: stages as node sets with device counts. `graphpipe.assemble`
turns one into a `Plan`; `graphpipe.planner.plan` keeps the fastest.
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class Partition:
  """Stages one partitioner chose for one micro-batch size.

  Attributes:
    stages: (node ids, device count) per stage, in the partitioner's order
      (branch by branch; `place_devices` keeps neighbours together).
    micro_batch_size: samples per micro-batch.
    chain: consecutive stages depend on each other (a sequential pipeline),
      besides the edges the operator graph implies.
    schedule: '1f1b' or 'gpipe'.
  """

  stages: tuple[tuple[tuple[int, ...], int], ...]
  micro_batch_size: int
  chain: bool = False
  schedule: str = "1f1b"


# Depth bounds tried below the fastest plan's depth: a rough geometric grid,
# enough to find the shallow, data-parallel end of the frontier.
DEPTH_GRID = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64)


def frontier(targets: list[float], max_depth: int, feasible, solve) -> list:
  """Fastest solutions for the full depth, then for smaller depth bounds.

  Binary search on the sorted candidate targets (bottleneck times per
  sample) for the smallest feasible one, first with `max_depth`, then with
  each depth of `DEPTH_GRID` below the depth that solution used.

  Example:
    A toy model of 4 s of work per sample: a bottleneck of t seconds needs
    4 / t stages on a path (rounded up). Solutions are (t, depth) pairs:

    >>> def stages_needed(target):
    ...   return next(d for d in range(1, 5) if target * d >= 4)
    >>> def feasible(target, depth):
    ...   return stages_needed(target) <= depth
    >>> def solve(target, depth):
    ...   return stages_needed(target), (target, stages_needed(target))
    >>> frontier([1, 1.5, 2, 4], 4, feasible, solve)
    [(1, 4), (1.5, 3), (2, 2), (4, 1)]

  Args:
    targets: candidate bottleneck times, ascending.
    max_depth: the largest depth any solution can have.
    feasible: `feasible(target, depth)` -> bool, monotone: true stays true
      when the target is raised or the depth bound grows.
    solve: `solve(target, depth)` -> (depth used, solution) for a feasible
      pair, the solution of fewest depth.
  """
  if not targets or not feasible(targets[-1], max_depth):
    return []

  def fastest(low: int, depth: int) -> int:
    high = len(targets) - 1
    while low < high:
      middle = (low + high) // 2
      if feasible(targets[middle], depth):
        high = middle
      else:
        low = middle + 1
    return low

  index = fastest(0, max_depth)
  depth, best = solve(targets[index], max_depth)
  found = [best]
  for bound in [d for d in DEPTH_GRID if d < depth][::-1]:
    if not feasible(targets[-1], bound):
      break
    index = fastest(index, bound)
    found.append(solve(targets[index], bound)[1])
  return found
