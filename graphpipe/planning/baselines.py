"""Sequential pipeline baselines: PipeDream-style 1F1B and GPipe.

Both linearise the operator graph into a chain and cut the chain into contiguous
stages (a range of a topological order is always convex). They get everything
GraphPipe gets: the same cost model and stage costs
(`graphpipe.planning.stage_costs.StageCosts`), the same micro-batch search and
the same memory rule, and the linearisation that suits them best (each of: node
id order, which keeps branches whole; level order, which interleaves them;
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
also carries the number of stages after the prefix (the table is computed
with numpy, a column per number of stages after). As for GraphPipe, the
partitioner offers the fewest stages at the best t, more stages at the same t,
shallower plans under smaller stage-count bounds, each with stages filled
from the front and from the back, under both stage metrics
(`graphpipe.planning.candidates.frontier`); `plan` spends spare devices and
refines the best the same way. Consecutive stages are chained (stage i
feeds stage i + 1).

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

import numpy as np

from graphpipe.core.graph import OpGraph
from graphpipe.core.memory import DEFAULT_OPTIMIZER_SLOTS, param_multiple
from graphpipe.planning.candidates import (
  DEPTH_GRID,
  Partition,
  distinct,
  frontier,
)
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
    self._boundary = None

  def nodes(self, first: int, last: int) -> tuple[int, ...]:
    return tuple(sorted(self.order[first : last + 1]))

  def boundary(self) -> tuple[np.ndarray, np.ndarray]:
    """(bytes in, bytes out) per sample of every range [first, last]
    (computed once: it does not depend on the micro-batch)."""
    if self._boundary is not None:
      return self._boundary
    n = len(self.order)
    incoming, outgoing = np.zeros((n, n)), np.zeros((n, n))
    for first in range(n):
      for last in range(first, n):
        incoming[first, last], outgoing[first, last] = (
          self.costs.boundary_bytes(self.nodes(first, last))
        )
    self._boundary = (incoming, outgoing)
    return self._boundary

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

  def __call__(self, micro_batch: int) -> list[Partition]:
    """Frontier partitions (stages against depth) of every linearisation,
    under both stage metrics, stages filled from the front and the back."""
    out = []
    for chain in self.chains:
      ranges = _RangeCosts(chain, self.costs, micro_batch)
      most = min(len(chain.order), self.costs.num_devices)
      for metric in (ranges.time_per_sample, ranges.steady_time_per_sample):
        solver = _ChainSolver(ranges, metric, self.costs.num_devices)
        for stages in frontier(
          solver.targets,
          most,
          solver.feasible,
          solver.solve,
          solver.fewest_stages,
        ):
          out.append(Partition(tuple(stages), micro_batch, chain=True))
    return distinct(out)


class _RangeCosts:
  """Every contiguous range of a chain on every replica count, as arrays.

  Indexed [first, last, replica option]: `time_per_sample` and
  `steady_time_per_sample` (as `StageCosts` defines them; infinite for
  first > last) and `capacity`, the most in-flight micro-batches that fit
  memory (0: not even one). `counts` are the replica options (divisors of
  the micro-batch, at most the devices).
  """

  def __init__(self, chain: _Chain, costs: StageCosts, micro_batch: int):
    graph, order = costs.graph, chain.order
    n = len(order)
    self.chain = chain
    self.counts = costs.replica_counts(micro_batch)
    m = costs.batch_size // micro_batch
    first, last = np.triu_indices(n)
    inside = np.full((n, n), False)
    inside[first, last] = True
    kinds = costs.memory_kinds
    params = _range_sums([graph.nodes[v].param_bytes for v in order])
    params -= _shared_excess(graph, order, "param")
    state = _range_sums(
      [graph.nodes[v].state_bytes * ("state" in kinds) for v in order]
    )
    if "state" in kinds:
      state -= _shared_excess(graph, order, "state")
    incoming, outgoing = chain.boundary()
    shape = (n, n, len(self.counts))
    self.time_per_sample = np.full(shape, np.inf)
    self.steady_time_per_sample = np.full(shape, np.inf)
    self.capacity = np.zeros(shape, dtype=np.int64)
    # Never let float rounding admit a stage the shared memory rule refuses.
    budget = costs.memory_bytes * (1 - 1e-9)
    # `stage_memory_bytes` over ranges, of the kinds the budget bounds (a
    # bound that left out the work term and a gradient copy let ranges
    # that `in_flight_capacity` refuses win the DP, and hid the chains
    # that fit).
    per_param = param_multiple([kind for kind in kinds if kind != "optimizer"])
    for i, k in enumerate(self.counts):
      share = costs.share(micro_batch, k)
      optimizer = 0
      if "optimizer" in kinds:  # a ZeRO-1 stage keeps a k-th of it
        optimizer = (
          4
          * DEFAULT_OPTIMIZER_SLOTS
          * np.ceil((params // 4) / costs.optimizer_share(k))
        )
      work = np.zeros((n, n))
      if "work" in kinds:
        work = np.ceil(
          _range_sums(
            [
              graph.nodes[v].cost("saved_bytes", share)
              + 2 * graph.nodes[v].cost("activation_bytes", share)
              for v in order
            ]
          )
        )
      static = params * per_param + optimizer + work + state
      fwd, bwd = costs.node_times(share)
      compute = _range_sums([fwd[v] + bwd[v] for v in order])
      saved = _range_sums(
        [
          graph.nodes[v].cost("kept_bytes", share) * ("stashes" in kinds)
          for v in order
        ]
      )
      comm = np.zeros((n, n))
      comm[first, last] = _each_once(
        costs.transfer_time,
        np.maximum(incoming[first, last], outgoing[first, last]) * share,
      )
      busy = m * np.maximum(compute, comm)
      sync = np.zeros((n, n))
      sync[first, last] = _each_once(
        lambda p, k=k: costs.sync_time_of(p, k), params[first, last]
      )
      steady = np.where(inside, busy / costs.batch_size, np.inf)
      self.steady_time_per_sample[:, :, i] = steady
      self.time_per_sample[:, :, i] = steady + sync / costs.batch_size
      with np.errstate(divide="ignore", invalid="ignore"):
        room = np.where(
          saved > 0,
          (budget - static) / saved,
          np.where(static <= budget, 1 << 30, -1),
        )
      cap = np.where(static <= budget, np.floor(np.minimum(room, 1 << 30)), 0)
      self.capacity[:, :, i] = np.where(inside, cap, 0).astype(np.int64)


def _each_once(fn, values: np.ndarray) -> np.ndarray:
  """[fn(float(v)) for v in values], calling `fn` once per distinct value
  (ranges share their boundary bytes: the cost model's scalar functions
  took a sixth of the chain search)."""
  distinct, where = np.unique(values, return_inverse=True)
  return np.array([fn(float(v)) for v in distinct], dtype=float)[where]


def _shared_excess(graph, order, kind: str) -> np.ndarray:
  """[i, j]: bytes counted more than once in the range order[i..j] of
  nodes (a variable several of them read: `OpGraph.variable_bytes`)."""
  n = len(order)
  excess = np.zeros((n, n))
  for key, readers in graph.shared_readers().items():
    if key.startswith(kind + ":"):
      count = _range_sums([float(v in readers) for v in order])
      excess += graph.shared[key] * np.maximum(count - 1, 0)
  return excess


def _range_sums(values) -> np.ndarray:
  """sums[first, last] = values[first] + ... + values[last] (first <= last)."""
  prefix = np.concatenate([[0.0], np.cumsum(np.asarray(values, float))])
  return prefix[None, 1:] - prefix[:-1, None]


# Stage counts tried before `_ChainSolver.fewest_stages` asks whether any
# cover fits the devices at all (most targets answer sooner).
_BOUND_AFTER = 8


class _ChainSolver:
  """PipeDream's DP in decision form for one metric, vectorised.

  `feasible(t, S)`: do stages of time per sample <= t, at most S of them,
  cover the chain on the devices? The table is

    devices[last, after] = fewest devices for the prefix 0..last when
      `after` stages follow it (so its last stage holds 1 + after
      micro-batches in flight, which memory must allow)
    = min over first of need[first, last, after]
                         + devices[first - 1, after + 1]

  where need is the fewest replicas of range first..last within t whose
  memory holds 1 + after in flight. Among equal device counts the last
  stage is the shortest (stages filled from the front) or the longest
  (filled from the back); `solve` returns both.
  """

  def __init__(self, ranges: _RangeCosts, metric: np.ndarray, devices: int):
    self.ranges = ranges
    self.metric = metric
    self.devices = devices
    finite = metric[np.isfinite(metric) & (ranges.capacity >= 1)]
    self.targets = sorted(set(finite.tolist()))
    self._need_memo: tuple = (None, None)
    # target -> the fewest stages of any cover (`feasible`).
    self._fewest: dict[float, int] = {}
    # The metric and capacity indexed [count, first, last] (sums over
    # counts run fastest along the first axis).
    self._by_count = tuple(
      np.ascontiguousarray(np.moveaxis(a, 2, 0))
      for a in (metric, ranges.capacity)
    )

  def _need(self, target: float, bound: int) -> np.ndarray:
    """need[first, last, after] for after < bound (_INF: none fits)."""
    if self._need_memo[0] != target:
      ranges = self.ranges
      # Prefix sums give equal ranges (identical layers) values that
      # differ in the last bits; they must compare equal.
      within = self.metric <= target * (1 + 1e-9)
      most = min(len(ranges.chain.order), self.devices)
      afters = np.arange(1, most + 1)
      n = len(ranges.chain.order)
      need = np.full((n, n, most), _INF, dtype=np.int64)
      # The fewest replicas that fit: counts ascend, so the smallest
      # count that fits is written last.
      for i in reversed(range(len(ranges.counts))):
        room = np.where(within[:, :, i], ranges.capacity[:, :, i], 0)
        need[room[:, :, None] >= afters] = ranges.counts[i]
      self._need_memo = (target, need)
    return self._need_memo[1][:, :, :bound]

  def fewest_stages(self, target: float) -> int:
    """The fewest stages of any cover within `target` on the devices
    (more than `most` stages: none).

    From the back: cover[first, s] = fewest devices for first..n-1 in
    exactly s stages (the stage starting at `first` has s - 1 after it,
    which its memory must hold in flight) = min over last of
    need[first, last, s - 1] + cover[last + 1, s - 1]. The class
    docstring's table answers one bound at a time; this answers every
    bound at once (`feasible`), computing need one column at a time and
    stopping at the first s that fits, or at s = `_BOUND_AFTER` when even
    the least devices each range needs (its need at s = 1) cannot cover
    the chain on the devices (no s can then).
    """
    if target not in self._fewest:
      ranges = self.ranges
      n = len(ranges.chain.order)
      most = min(n, self.devices)
      within = self._by_count[0] <= target * (1 + 1e-9)
      # [i, first, last]: the most in flight any of the first i + 1
      # counts holds within the target. Counts ascend, so the smallest
      # that holds s in flight is counts[number of entries below s].
      best = np.maximum.accumulate(
        np.where(within, self._by_count[1], 0), axis=0
      )
      counts = np.append(np.asarray(ranges.counts, dtype=np.int64), _INF)
      after = np.full(n + 1, _INF, dtype=np.int64)
      after[n] = 0  # nothing left, no stages
      found = most + 1
      for s in range(1, most + 1):
        need = counts[(best < s).sum(axis=0)]
        if s == 1:
          lowest = need  # no stage needs fewer devices than this
        elif s == _BOUND_AFTER and self._fewest_devices(lowest) > self.devices:
          break  # no cover of any length fits the devices
        cover = np.minimum((need + after[None, 1:]).min(axis=1), _INF)
        if cover[0] <= self.devices:
          found = s
          break
        after[:n] = cover
      self._fewest[target] = found
    return self._fewest[target]

  @staticmethod
  def _fewest_devices(need: np.ndarray) -> int:
    """The fewest devices of a cover by stages of any number, each range
    first..last costing need[first, last]."""
    n = need.shape[0]
    least = np.zeros(n + 1, dtype=np.int64)  # [i]: the prefix 0..i-1
    for last in range(n):
      least[last + 1] = min(
        (least[: last + 1] + need[: last + 1, last]).min(), _INF
      )
    return int(least[n])

  def _table(self, target: float, bound: int, backs: bool = False):
    """The device table (see the class docstring), with the back pointers
    (front- and back-filled) when `backs`."""
    need = self._need(target, bound)
    n = need.shape[0]
    # padded[f, a] = devices[f - 1, a]: row 0 is the empty prefix (no
    # devices, whatever follows), column `bound` a stage count over it.
    padded = np.full((n + 1, bound + 1), _INF, dtype=np.int64)
    padded[0, :] = 0
    front = np.zeros((n, bound), dtype=np.int64) if backs else None
    back = np.zeros((n, bound), dtype=np.int64) if backs else None
    # Column by column from the most stages after (each column reads only
    # the next): `bound` steps instead of one per prefix end. total[first,
    # last] is at least _INF where first > last (no such range), so it is
    # never a finite minimum; the back pointers are read only along
    # finite paths.
    for a in reversed(range(bound)):
      total = need[:, :, a] + padded[:n, a + 1, None]
      padded[1:, a] = np.minimum(total.min(axis=0), _INF)
      if backs:
        back[:, a] = total.argmin(axis=0)
        front[:, a] = n - 1 - total[::-1].argmin(axis=0)
    return padded[1:, :bound], need, front, back

  def feasible(self, target: float, bound: int) -> bool:
    return self.fewest_stages(target) <= bound

  def solve(self, target: float, bound: int, shallowest: bool):
    """(stages used, [front-filled stages, back-filled stages])."""
    low = bound
    if shallowest:
      low = 1
      while low < bound:
        middle = (low + bound) // 2
        if self.feasible(target, middle):
          bound = middle
        else:
          low = middle + 1
    table, need, *backs = self._table(target, low, backs=True)
    out = []
    for back in backs:
      stages, last, after = [], len(table) - 1, 0
      while last >= 0:
        first = int(back[last, after])
        stages.append(
          (self.ranges.chain.nodes(first, last), int(need[first, last, after]))
        )
        last, after = first - 1, after + 1
      out.append(stages[::-1])
    return len(out[0]), out


class GPipePartitioner:
  """Balanced chain stages, r replicas each, GPipe schedule (docstring).

  Example:
    >>> from graphpipe.costs import AnalyticCostModel, device_spec
    >>> graph = capture_zoo("two_branch", "paper")   # the case study
    >>> costs = StageCosts(graph, AnalyticCostModel(device_spec("v100")),
    ...                    batch_size=8, num_devices=8, memory_bytes=16e9)
    >>> partitions = GPipePartitioner(graph, costs)(4)    # b = 4
    >>> twice = [p for p in partitions if p.stages[0][1] == 2]
    >>> twice[0].stages             # 4 balanced stages, 2 replicas each
    (((0, 1), 2), ((2, 3), 2), ((4, 5), 2), ((6, 7, 8), 2))
    >>> [len(p.stages) for p in twice[:4]]   # and under smaller depths
    [4, 3, 2, 1]
    >>> twice[0].schedule
    'gpipe'

  Args:
    graph: the operator graph.
    costs: stage costs for the batch, devices and memory budget.
  """

  def __init__(self, graph: OpGraph, costs: StageCosts):
    self.costs = costs
    self.chains = [_Chain(o, costs) for o in linearisations(graph)]

  def __call__(self, micro_batch: int) -> list[Partition]:
    """Per (linearisation, replica count), the balanced cut under each
    depth bound of `DEPTH_GRID` up to the devices (the fastest cut may not
    fit a device's memory where a shallower one does)."""
    costs = self.costs
    in_flight = costs.batch_size // micro_batch
    out = []
    for chain in self.chains:
      for replicas in range(1, costs.num_devices + 1):
        if replicas not in costs.replica_counts(micro_batch):
          continue
        most = min(costs.num_devices // replicas, len(chain.order))
        bounds = [d for d in DEPTH_GRID if d < most] + [most]
        for stages in self._balanced(
          chain, micro_batch, replicas, bounds[::-1], in_flight
        ):
          out.append(
            Partition(
              tuple((nodes, replicas) for nodes in stages),
              micro_batch,
              chain=True,
              schedule="gpipe",
            )
          )
    return distinct(out)

  def _balanced(self, chain, b, replicas, bounds, in_flight):
    """The balanced cut under each depth bound of `bounds` (descending),
    until one has none (fewer stages do not fit either)."""
    length = len(chain.order)
    targets = set()
    for first in range(length):
      for last in range(first, length):
        tps, cap = chain.option(first, last, b, replicas)
        if cap < in_flight:
          break
        targets.add(tps)
    targets = sorted(targets)

    def cut(target, most):
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

    found = []
    for most in bounds:
      if not targets or cut(targets[-1], most) is None:
        break
      low, high = 0, len(targets) - 1
      while low < high:
        middle = (low + high) // 2
        if cut(targets[middle], most) is None:
          low = middle + 1
        else:
          high = middle
      found.append(cut(targets[high], most))
    return found
