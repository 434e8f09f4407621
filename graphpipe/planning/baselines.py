"""Sequential pipeline baselines: PipeDream-style 1F1B and GPipe.

Both linearise the operator graph into a chain and cut the chain into
contiguous stages (a range of a topological order is always convex). They
get everything GraphPipe gets: the same cost model and stage costs
(`graphpipe.costs.StageCosts`), the same micro-batch search and the same
memory rule, and the linearisation that suits them best (each of: node id
order, which keeps branches whole; level order, which interleaves them;
reverse-level order; `plan` keeps the fastest result).

sequential (PipeDream-2BW / PipeDream-Flush planner). PipeDream's DP
  A(j, m) = min over i < j, m' < m of
            max(A(i, m - m'), 2 a_i / bw, T(i + 1..j, m'))
(the best bottleneck for the first j layers on m devices, the last stage
holding layers i + 1..j on m' data-parallel replicas) is solved in its
decision form: binary search on the bottleneck time per sample t, and for
each t the fewest devices covering a prefix with every stage's time per
sample (compute, transfers and gradient all-reduce, as `StageCosts`
counts them) at most t. The decision form lets the memory rule see each
stage's 1F1B in-flight count, p - i + 1 for stage i of p, so the DP state
also carries the number of stages after the prefix; among plans that reach
t it keeps the fewest stages (fewest micro-batches in flight at the first
stage). As for GraphPipe, the fastest plans under a few smaller stage-count
bounds are offered too, and `plan` spends spare devices the same way.
Consecutive stages are chained (stage i feeds stage i + 1).

gpipe (Huang et al. 2019). The chain is cut into at most num_devices / r
stages balanced by time (binary search on t, greedy cut: optimal for
contiguous partitions), each on r data-parallel replicas (GPipe replicates
its pipeline for data parallelism); schedule 'gpipe', all m micro-batches
in flight on every stage. Every r that divides the micro-batch is tried.
GPipe's re-materialisation is not modelled: all schedules keep their
activations.
"""

from __future__ import annotations

from collections.abc import Sequence

from graphpipe.core.graph import OpGraph
from graphpipe.planning.candidates import Partition, frontier
from graphpipe.planning.stage_costs import StageCosts

_INF = 1 << 40


def linearisations(graph: OpGraph) -> list[tuple[int, ...]]:
  """Distinct topological orders a sequential planner may cut.

  Example:
    >>> graph = capture_zoo("two_branch", "tiny")  # branches 0-3, 4-7; 8
    >>> linearisations(graph)       # id order first, then level order
    [(0, 1, 2, 3, 4, 5, 6, 7, 8), (0, 4, 1, 5, 2, 6, 3, 7, 8)]

  Args:
    graph: the operator graph.
  """
  n = len(graph.nodes)
  level = [0] * n
  for v in range(n):
    level[v] = 1 + max((level[u] for u in graph.predecessors(v)), default=-1)
  height = [0] * n
  for v in reversed(range(n)):
    height[v] = 1 + max((height[w] for w in graph.successors(v)), default=-1)
  top = max(height, default=0)
  orders = [
    tuple(range(n)),
    tuple(sorted(range(n), key=lambda v: (level[v], v))),
    tuple(sorted(range(n), key=lambda v: (top - height[v], v))),
  ]
  return list(dict.fromkeys(orders))


class _Chain:
  """Stage costs of contiguous ranges of one linearisation."""

  def __init__(self, order: Sequence[int], costs: StageCosts):
    self.order = tuple(order)
    self.costs = costs

  def nodes(self, first: int, last: int) -> tuple[int, ...]:
    return tuple(sorted(self.order[first : last + 1]))

  def option(self, first, last, b, k) -> tuple[float, int]:
    """(time per sample, in-flight capacity) of range first..last on k."""
    nodes = self.nodes(first, last)
    cap = self.costs.in_flight_capacity(nodes, b, k)
    if cap < 1:
      return float("inf"), cap
    return self.costs.time_per_sample(nodes, b, k), cap


class SequentialPartitioner:
  """PipeDream's DP over the best linearisation (module docstring).

  Example:
    >>> from graphpipe.costs import AnalyticCostModel, device_spec
    >>> graph = capture_zoo("two_branch", "paper")   # the case study
    >>> costs = StageCosts(graph, AnalyticCostModel(device_spec("v100")),
    ...                    batch_size=8, num_devices=8, memory_bytes=16e9)
    >>> partitions = SequentialPartitioner(graph, costs)(1)   # b = 1
    >>> partitions[0].stages        # a chain of 8 one-device stages
    (((0,), 1), ((1,), 1), ((2,), 1), ((3,), 1), ((4,), 1), ((5,), 1),
     ((6,), 1), ((7, 8), 1))
    >>> partitions[0].chain
    True

  Args:
    graph: the operator graph.
    costs: stage costs for the batch, devices and memory budget.
  """

  def __init__(self, graph: OpGraph, costs: StageCosts):
    self.costs = costs
    self.chains = [_Chain(o, costs) for o in linearisations(graph)]
    self._within_cache = (None, None, None)

  def __call__(self, micro_batch: int) -> list[Partition]:
    """Frontier partitions (stages against depth) of every linearisation."""
    out = []
    for chain in self.chains:
      targets, options = self._options(chain, micro_batch)
      most = min(len(chain.order), self.costs.num_devices)

      def feasible(target, max_stages, options=options):
        return self._fits(options, target, max_stages)

      def solve(target, max_stages, chain=chain, options=options):
        return self._solve(chain, options, target, max_stages)

      for stages in frontier(targets, most, feasible, solve):
        out.append(Partition(tuple(stages), micro_batch, chain=True))
    return out

  def _options(self, chain: _Chain, b: int):
    """Candidate targets and, per range, (k, time per sample, capacity)."""
    length = len(chain.order)
    counts = [k for k in range(1, self.costs.num_devices + 1) if b % k == 0]
    options = [[[] for _ in range(length)] for _ in range(length)]
    targets = set()
    for last in range(length):
      for first in range(last, -1, -1):
        row = []
        for k in counts:
          tps, cap = chain.option(first, last, b, k)
          if cap >= 1:
            row.append((k, tps, cap))
            targets.add(tps)
        options[first][last] = row
        if not row:
          break  # longer ranges do not fit either
    return sorted(targets), options

  def _fits(self, options, target: float, max_stages: int) -> bool:
    table, _ = self._devices(options, target, max_stages)
    return table[len(options) - 1][0] <= self.costs.num_devices

  def _solve(self, chain: _Chain, options, target: float, max_stages: int):
    """(stages used, stages) with every time per sample <= target and the
    fewest stages up to max_stages (which must be feasible)."""
    low, high = 1, max_stages
    while low < high:
      middle = (low + high) // 2
      if self._fits(options, target, middle):
        high = middle
      else:
        low = middle + 1
    _, back = self._devices(options, target, low)
    stages, last, after = [], len(options) - 1, 0
    while last >= 0:
      first, k = back[last][after]
      stages.append((chain.nodes(first, last), k))
      last, after = first - 1, after + 1
    return low, stages[::-1]

  @staticmethod
  def _within(options, target: float):
    """Per range, the (k, capacity) pairs within target, capacity rising."""
    length = len(options)
    within = [[()] * length for _ in range(length)]
    for first in range(length):
      for last in range(first, length):
        pairs, most = [], -1
        for k, tps, cap in options[first][last]:
          if tps <= target and cap > most:
            pairs.append((k, cap))
            most = cap
        if not pairs:
          break  # longer ranges only get slower and larger
        within[first][last] = tuple(pairs)
    return within

  def _devices(self, options, target: float, max_stages: int):
    """table[j][d]: fewest devices for the prefix 0..j with d stages after.

    Only prefixes whose stages, with the d after them, number at most
    `max_stages` count; a stage's in-flight count is 1 + stages after it.
    """
    # The binary searches ask for the same target several times in a row.
    cached_options, cached_target, within = self._within_cache
    if cached_options is not options or cached_target != target:
      within = self._within(options, target)
      self._within_cache = (options, target, within)
    length = len(options)
    table = [[_INF] * max_stages for _ in range(length)]
    back = [[None] * max_stages for _ in range(length)]
    for last in range(length):
      best, choice = table[last], back[last]
      for first in range(last, -1, -1):
        pairs = within[first][last]
        if not pairs:
          break
        before = table[first - 1] if first else None
        index, count = 0, len(pairs)
        for after in range(max_stages):
          while index < count and pairs[index][1] <= after:
            index += 1
          if index == count:
            break  # more in flight fits no device count either
          k = pairs[index][0]
          if before is None:
            total = k
          elif after + 1 < max_stages:
            total = k + before[after + 1]
          else:
            break
          if total < best[after]:
            best[after], choice[after] = total, (first, k)
    return table, back


class GPipePartitioner:
  """Balanced chain stages, r replicas each, GPipe schedule (docstring).

  Example:
    >>> from graphpipe.costs import AnalyticCostModel, device_spec
    >>> graph = capture_zoo("two_branch", "paper")   # the case study
    >>> costs = StageCosts(graph, AnalyticCostModel(device_spec("v100")),
    ...                    batch_size=8, num_devices=8, memory_bytes=16e9)
    >>> partitions = GPipePartitioner(graph, costs)(4)    # b = 4
    >>> partitions[1].stages        # 4 balanced stages, 2 replicas each
    (((0, 1), 2), ((2, 3), 2), ((4, 5), 2), ((6, 7, 8), 2))
    >>> partitions[1].schedule
    'gpipe'

  Args:
    graph: the operator graph.
    costs: stage costs for the batch, devices and memory budget.
  """

  def __init__(self, graph: OpGraph, costs: StageCosts):
    self.costs = costs
    self.chains = [_Chain(o, costs) for o in linearisations(graph)]

  def __call__(self, micro_batch: int) -> list[Partition]:
    """One partition per (linearisation, replica count) that fits."""
    costs = self.costs
    in_flight = costs.batch_size // micro_batch
    out = []
    for chain in self.chains:
      for replicas in range(1, costs.num_devices + 1):
        if micro_batch % replicas:
          continue
        most = min(costs.num_devices // replicas, len(chain.order))
        stages = self._balanced(chain, micro_batch, replicas, most, in_flight)
        if stages is not None:
          out.append(
            Partition(
              tuple((nodes, replicas) for nodes in stages),
              micro_batch,
              chain=True,
              schedule="gpipe",
            )
          )
    return out

  def _balanced(self, chain, b, replicas, most, in_flight):
    length = len(chain.order)
    targets = set()
    for first in range(length):
      for last in range(first, length):
        tps, cap = chain.option(first, last, b, replicas)
        if cap < in_flight:
          break
        targets.add(tps)
    targets = sorted(targets)

    def cut(target):
      stages, first = [], 0
      while first < length:
        last = first - 1
        while last + 1 < length:
          tps, cap = chain.option(first, last + 1, b, replicas)
          if tps > target or cap < in_flight:
            break
          last += 1
        if last < first or len(stages) == most:
          return None
        stages.append(chain.nodes(first, last))
        first = last + 1
      return stages

    if not targets or cut(targets[-1]) is None:
      return None
    low, high = 0, len(targets) - 1
    while low < high:
      middle = (low + high) // 2
      if cut(targets[middle]) is None:
        low = middle + 1
      else:
        high = middle
    return cut(targets[high])
