"""Piper's partitioner: a DP over the down-sets of the operator DAG.

  PiperPartitioner(graph, costs, budget=PIPER_BUDGET)(micro_batch)

Piper (Tarnawski et al., NeurIPS 2021) cuts the operator DAG into a
sequence of stages S_1, ..., S_p with S_j = I_j - I_{j-1} for down-sets
(ideals) I_0 = {} < I_1 < ... < I_p = V: every stage is the difference of
two down-sets, so it is convex whatever the branch structure, and the
stages run as a sequential 1F1B pipeline (stage j of p holds p - j + 1
micro-batches in flight). Without tensor parallelism (the project's
scope) a stage is data parallel over k devices. In the decision form the
other planners use, for a target time per sample t:

  g(I, a) = fewest devices that cover down-set I with stages of time per
            sample <= t when `a` stages follow I
          = min over non-empty up-sets S of I (I - S is a down-set) of
              need(S, a) + g(I - S, a + 1),       g({}, a) = 0

where need(S, a) is the fewest replicas k (dividing the micro-batch) with
time_per_sample(S, b, k) <= t whose memory holds a + 1 micro-batches
(`graphpipe.planning.stage_costs.StageCosts`, the planners' cost model and
memory rule). Binary search on t and the depth frontier are those of the
other planners (`graphpipe.planning.candidates.frontier`).

The bottleneck can be any stage's time, and the stages are too many to
list, so the binary search runs over a geometric grid of targets between a
lower bound (the slowest single node on its best device count) and an
upper one (0.2% steps).

The number of down-sets grows exponentially with the number of parallel
branches (a graph of B branches of L layers has about (L + 1)^B), which is
why the GraphPipe paper's Piper finds no plan for DLRM and CANDLE-Uno. Here
the search counts the stages it prices (pairs (I, S)) and gives up after
`budget` of them, raising a `PlanError` that says so.
"""

from __future__ import annotations

import numpy as np

from graphpipe.core.graph import OpGraph
from graphpipe.errors import PlanError
from graphpipe.planning.candidates import Partition, distinct, frontier
from graphpipe.planning.stage_costs import StageCosts

# Stages priced (down-set, up-set pairs) before Piper gives up: about a
# dozen seconds of search on the 2-core development machine.
PIPER_BUDGET = 1_000_000
# Targets on the geometric grid between the bounds.
_GRID = 4096

_INF = 1 << 40


class PiperPartitioner:
  """Piper's DP over down-sets (module docstring).

  Example:
    >>> partitions = PiperPartitioner(graph, costs)(4)   # b = 4
    >>> [len(p.stages) for p in partitions]

  Args:
    graph: the operator graph.
    costs: stage costs for the batch, devices and memory budget.
    budget: stages priced, over all calls, before the search gives up.
  """

  def __init__(self, graph: OpGraph, costs: StageCosts, budget: int):
    self.graph = graph
    self.costs = costs
    self.budget = budget
    self.priced = 0
    n = len(graph.nodes)
    self.all_nodes = (1 << n) - 1
    self.succ = [0] * n
    for e in graph.edges:
      self.succ[e.src] |= 1 << e.dst

  def __call__(self, micro_batch: int) -> list[Partition]:
    """Frontier partitions for one micro-batch size (maybe [])."""
    solver = _DownSetSolver(self, micro_batch)
    most = min(len(self.graph.nodes), self.costs.num_devices)
    found = frontier(
      solver.targets(),
      most,
      solver.feasible,
      solver.solve,
      from_below=True,
    )
    return distinct(
      [Partition(tuple(stages), micro_batch, chain=True) for stages in found]
    )


class _DownSetSolver:
  """g(I, a) of the module docstring for one micro-batch size."""

  def __init__(self, owner: PiperPartitioner, micro_batch: int):
    self.owner = owner
    self.costs = owner.costs
    self.b = micro_batch
    self.counts = [
      k for k in range(1, self.costs.num_devices + 1) if micro_batch % k == 0
    ]
    self._options: dict[int, list[tuple[int, float, int]]] = {}
    self.target = None
    self.bound = 0
    self.memo: dict[int, np.ndarray] = {}

  def options(self, stage: int) -> list[tuple[int, float, int]]:
    """(k, time per sample, in-flight capacity) of a stage that fits."""
    if stage not in self._options:
      nodes = tuple(_bits(stage))
      row = []
      for k in self.counts:
        cap = self.costs.in_flight_capacity(nodes, self.b, k)
        if cap >= 1:
          row.append((k, self.costs.time_per_sample(nodes, self.b, k), cap))
      self._options[stage] = row
    return self._options[stage]

  def targets(self) -> list[float]:
    """The geometric grid of targets (module docstring); [] if some node
    fits no device count."""
    nodes = range(len(self.owner.graph.nodes))
    single = [[t for _, t, _ in self.options(1 << v)] for v in nodes]
    if not all(single):
      return []
    low = max(min(times) for times in single)
    whole = [t for _, t, _ in self.options(self.owner.all_nodes)]
    high = max(min(whole, default=0.0), sum(max(t) for t in single)) * 1.01
    ratio = (high / low) ** (1 / _GRID)
    return [low * ratio**i for i in range(_GRID + 1)]

  def feasible(self, target: float, bound: int) -> bool:
    return self._devices(target, bound)[0] <= self.costs.num_devices

  def _devices(self, target: float, bound: int) -> np.ndarray:
    if (target, bound) != (self.target, self.bound):
      self.target, self.bound, self.memo = target, bound, {}
    return self.g(self.owner.all_nodes)

  def need(self, stage: int) -> np.ndarray | None:
    """need(S, a) for a < bound; None when no device count is within t."""
    options = [
      (k, cap) for k, t, cap in self.options(stage) if t <= self.target
    ]
    if not options:
      return None
    out = np.full(self.bound, _INF, dtype=np.int64)
    for k, cap in reversed(options):  # fewest devices last, so they win
      out[: min(cap, self.bound)] = k
    return out

  def g(self, ideal: int) -> np.ndarray:
    """Fewest devices per `a` (stages after) for down-set `ideal`."""
    if ideal == 0:
      return np.zeros(self.bound, dtype=np.int64)
    found = self.memo.get(ideal)
    if found is not None:
      return found
    best = np.full(self.bound, _INF, dtype=np.int64)
    for stage, need in self._upsets(ideal):
      if stage == ideal:  # the first stage: nothing before it
        np.minimum(best, need, out=best)
        continue
      rest = self.g(ideal & ~stage)
      shifted = np.empty(self.bound, dtype=np.int64)
      shifted[:-1] = rest[1:]
      shifted[-1] = _INF
      np.minimum(best, np.minimum(need + shifted, _INF), out=best)
    self.memo[ideal] = best
    return best

  def _upsets(self, ideal: int):
    """Non-empty up-sets S of `ideal` that some device count runs within
    the target, with need(S, .). Grown one maximal node at a time; a set
    too slow or too large on every device count stops growing (compute,
    weights and stashes only grow with it)."""
    owner = self.owner
    succ = owner.succ
    seen = set()
    stack = []
    for v in _bits(ideal):
      if not succ[v] & ideal:
        stack.append(1 << v)
    while stack:
      stage = stack.pop()
      if stage in seen:
        continue
      seen.add(stage)
      owner.priced += 1
      if owner.priced > owner.budget:
        raise PlanError(
          f"piper found no plan within its search budget: it priced "
          f"{owner.budget:,} stages (down-set pairs) of this "
          f"{len(owner.graph.nodes)}-node graph, whose down-sets grow "
          "exponentially with its parallel branches; raise piper_budget "
          "or use planner='graphpipe'"
        )
      if not self._may_fit(stage):
        continue
      need = self.need(stage)
      if need is not None:
        yield stage, need
      rest = ideal & ~stage
      for v in _bits(rest):
        # v may join when all its successors inside the ideal are in S.
        if not succ[v] & rest:
          stack.append(stage | 1 << v)

  def _may_fit(self, stage: int) -> bool:
    """Whether any device count could run `stage` within the target (a
    bound that only grows with the set: compute, sync and memory)."""
    nodes = tuple(_bits(stage))
    costs = self.costs
    m = costs.batch_size // self.b
    for k in self.counts:
      if costs.in_flight_capacity(nodes, self.b, k) < 1:
        continue
      fwd, bwd = costs.compute_time(nodes, self.b, k)
      lower = (m * (fwd + bwd) + costs.sync_time(nodes, k)) / costs.batch_size
      if lower <= self.target * (1 + 1e-9):
        return True
    return False

  def solve(self, target: float, bound: int, shallowest: bool):
    """(stages used, [stages in order]) within target and bound."""
    low = bound
    if shallowest:
      low = 1
      while low < bound:
        middle = (low + bound) // 2
        if self.feasible(target, middle):
          bound = middle
        else:
          low = middle + 1
    self._devices(target, low)
    stages, ideal, after = [], self.owner.all_nodes, 0
    while ideal:
      want = self.g(ideal)[after]
      for stage, need in self._upsets(ideal):
        tail = 0
        if stage != ideal:
          rest = self.g(ideal & ~stage)
          tail = rest[after + 1] if after + 1 < low else _INF
        if need[after] + tail == want:
          stages.append((tuple(_bits(stage)), int(need[after])))
          ideal, after = ideal & ~stage, after + 1
          break
    return len(stages), [stages[::-1]]


def _bits(mask: int):
  while mask:
    low = mask & -mask
    yield low.bit_length() - 1
    mask ^= low
