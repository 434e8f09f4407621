"""What every partitioner returns, and the depth-frontier search they share.

A partitioner (`graphpipe.planning.graphpipe_dp.GraphPipePartitioner`, the
baselines of `graphpipe.planning.baselines`) is called with a micro-batch
size and returns `Partition`s: stages as node sets with device counts.
`graphpipe.planning.assemble` turns one into a `Plan`;
`graphpipe.planning.search.plan` keeps the fastest.
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
    sizes: per stage, its own micro-batch size when stages differ
      (`graphpipe.core.stages`); empty: `micro_batch_size` for all.
  """

  stages: tuple[tuple[tuple[int, ...], int], ...]
  micro_batch_size: int
  chain: bool = False
  schedule: str = "1f1b"
  sizes: tuple[int, ...] = ()

  def size(self, stage: int) -> int:
    """The micro-batch size of stage `stage` (an index of `stages`)."""
    return self.sizes[stage] if self.sizes else self.micro_batch_size


# Depth bounds tried besides the fastest plan's own: a rough geometric grid,
# enough to find the shallow, data-parallel end of the frontier and the
# deep end (more stages, fewer devices each) at the same target.
DEPTH_GRID = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64)


def frontier(
  targets: list[float], max_depth: int, feasible, solve, fewest=None
) -> list:
  """Solutions on the frontier of bottleneck time against pipeline depth.

  Binary search on the sorted candidate targets (bottleneck times per
  sample) for the smallest feasible one under `max_depth`; there, the
  solution of fewest depth and the solutions under each deeper bound of
  `DEPTH_GRID` up to `max_depth` (more stages at the same target: fewer
  devices per stage, shorter stages, more devices left to spend); then,
  for each bound of `DEPTH_GRID` below the fewest depth, the fastest
  solution under it (shallower pipelines with more data parallelism have
  shorter warm-ups).

  Example:
    A toy model of 4 s of work per sample: a bottleneck of t seconds needs
    4 / t stages on a path (rounded up), and any more stages also do.
    Solutions are (t, depth) pairs:

    >>> def stages_needed(target):
    ...   return next(d for d in range(1, 5) if target * d >= 4)
    >>> def feasible(target, depth):
    ...   return stages_needed(target) <= depth
    >>> def solve(target, depth, shallowest):
    ...   used = stages_needed(target) if shallowest else depth
    ...   return used, [(target, used)]
    >>> frontier([1, 1.5, 2, 4], 6, feasible, solve)
    [(1, 4), (1, 6), (1.5, 3), (2, 2), (4, 1)]

    The fastest target (1 s) at its fewest stages (4) and at the depth
    bound (6), then the fastest target under each shallower bound.

  Args:
    targets: candidate bottleneck times, ascending.
    max_depth: the largest depth any solution can have.
    feasible: `feasible(target, depth)` -> bool, monotone: true stays true
      when the target is raised or the depth bound grows.
    solve: `solve(target, depth, shallowest)` -> (depth used, solutions)
      for a feasible pair: the solutions of fewest depth when
      `shallowest`, else those the DP finds under the bound itself (a
      partitioner may return several, e.g. stages filled from the front
      and from the back).
    fewest: optional `fewest(target)` -> the fewest stages of any solution
      (`feasible(t, d)` is `fewest(t) <= d`), asked instead of `feasible`:
      each answer then settles a target for every depth bound. Either
      way each binary search starts from what earlier answers (and the
      depths of `solve`'s shallowest solutions) settled: the same result
      as searching from scratch, fewer calls.
  """
  if not targets:
    return []
  # What the answers so far say of fewest(targets[i]), the fewest stages
  # of any solution at target i: more than below[i], at most atmost[i].
  # Feasibility is monotone in the target and the depth, so each search
  # starts between the indices they already settle.
  below: dict[int, int] = {}
  atmost: dict[int, int] = {}

  def learn(index: int, more_than: int, at_most: int | None) -> None:
    below[index] = max(below.get(index, 0), more_than)
    if at_most is not None:
      atmost[index] = min(atmost.get(index, at_most), at_most)

  def ok(index: int, depth: int) -> bool:
    if atmost.get(index, depth + 1) <= depth:
      return True
    if below.get(index, 0) >= depth:
      return False
    if fewest is not None:
      least = fewest(targets[index])
      learn(index, least - 1, least)
      return least <= depth
    answer = feasible(targets[index], depth)
    if answer:
      learn(index, 0, depth)
    else:
      learn(index, depth, None)
    return answer

  def fastest(low: int, depth: int) -> int | None:
    """The smallest feasible index from `low` on, or None."""
    high = min(
      [i for i, d in atmost.items() if d <= depth], default=len(targets) - 1
    )
    low = max(
      [low] + [i + 1 for i, d in below.items() if d >= depth and i < high]
    )
    if not ok(high, depth):
      return None
    while low < high:
      middle = (low + high) // 2
      if ok(middle, depth):
        high = middle
      else:
        low = middle + 1
    return low

  def shallowest(index: int, bound: int) -> tuple[int, list]:
    """The solutions of fewest depth at targets[index] (feasible under
    `bound`): their depth is fewest(targets[index])."""
    depth, found = solve(targets[index], bound, True)
    learn(index, depth - 1, depth)
    return depth, list(found)

  index = fastest(0, max_depth)
  if index is None:
    return []
  depth, found = shallowest(index, max_depth)
  deeper = [d for d in DEPTH_GRID if depth < d < max_depth]
  for bound in deeper + ([max_depth] if depth < max_depth else []):
    found += solve(targets[index], bound, False)[1]
  for bound in [d for d in DEPTH_GRID if d < depth][::-1]:
    index = fastest(index, bound)
    if index is None:
      break
    found += shallowest(index, bound)[1]
  return found


def distinct(partitions: list[Partition]) -> list[Partition]:
  """`partitions` without repeats (same stages, micro-batch and schedule)."""
  return list(dict.fromkeys(partitions))
