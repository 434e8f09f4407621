"""Piper's partitioner: a DP over the down-sets of the operator DAG.

  PiperPartitioner(graph, costs, budget=PIPER_BUDGET)(micro_batch)

Piper (Tarnawski et al., NeurIPS 2021) cuts the operator DAG into a
sequence of stages S_1, ..., S_p with S_j = I_j - I_{j-1} for down-sets
(ideals) I_0 = {} < I_1 < ... < I_p = V: every stage is the difference of
two down-sets, so it is convex whatever the branch structure, and the
stages run as a sequential 1F1B pipeline (stage j of p holds p - j + 1
micro-batches in flight). Without tensor parallelism (the project's
scope) a stage is data parallel over k devices. Piper's DP, in its
optimisation form, for one micro-batch size b:

  f(I, a, k) = the smallest bottleneck time per sample that covers
               down-set I on at most k devices when `a` stages follow I
             = min over non-empty up-sets S of I (I - S is a down-set) and
               replica counts k' (dividing b, memory for a + 1 in flight)
               of max(time_per_sample(S, b, k'), f(I - S, a + 1, k - k')),
               f({}, a, k) = 0

with the planners' stage costs and memory rule
(`graphpipe.planning.stage_costs.StageCosts`); the table is a numpy array
over (a, k) per down-set, and the plan is read back from f(V, 0, N).
Piper's answer per micro-batch size is its partition; `graphpipe.plan`
then treats it like every planner's (spare devices, local search,
simulation).

The number of down-sets grows exponentially with the number of parallel
branches (a graph of B branches of L layers has about (L + 1)^B of them,
and about ((L + 1)(L + 2) / 2)^B nested pairs), which is why the GraphPipe
paper's Piper finds no plan for DLRM and CANDLE-Uno. Here the DP counts the
(down-set, up-set) pairs it prices and gives up after `budget` of them,
raising a `PlanError` that says so.
"""

from __future__ import annotations

import numpy as np

from graphpipe.core.graph import OpGraph
from graphpipe.errors import PlanError
from graphpipe.planning.bitsets import bits
from graphpipe.planning.candidates import Partition
from graphpipe.planning.stage_costs import StageCosts

# (Down-set, up-set) pairs priced, over all micro-batch sizes, before Piper
# gives up: about ten seconds of search on the 2-core development machine.
PIPER_BUDGET = 300_000


class PiperPartitioner:
  """Piper's DP over down-sets (module docstring).

  Example:
    >>> from graphpipe.costs import AnalyticCostModel, device_spec
    >>> graph = capture_zoo("two_branch", "paper")   # the case study
    >>> costs = StageCosts(graph, AnalyticCostModel(device_spec("v100")),
    ...                    batch_size=8, num_devices=8, memory_bytes=16e9)
    >>> piper = PiperPartitioner(graph, costs, PIPER_BUDGET)
    >>> partitions = piper(4)                      # b = 4
    >>> partitions[0].stages        # a chain of 8 one-device stages
    (((0,), 1), ((1,), 1), ((2,), 1), ((3,), 1), ((4,), 1), ((5,), 1),
     ((6,), 1), ((7, 8), 1))
    >>> partitions[0].chain, piper.priced          # (down-set pairs priced)
    (True, 225)
    >>> PiperPartitioner(graph, costs, budget=100)(4)
    Traceback (most recent call last):
    ...
    graphpipe.errors.PlanError: piper found no plan within its search
    budget: it priced 100 stages (down-set pairs) of this 9-node graph,
    whose down-sets grow exponentially with its parallel branches; raise
    piper_budget or use planner='graphpipe'

  Args:
    graph: the operator graph.
    costs: stage costs for the batch, devices and memory budget.
    budget: pairs priced, over all calls, before the search gives up.
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
    """Piper's partitions for one micro-batch size (or [] if none fits).

    The first is Piper's answer, the smallest bottleneck on all devices;
    then, as every planner here offers what its DP discards, the best on
    fewer devices (read from the same table: f(V, 0, k) for k < N), whose
    spare devices `graphpipe.plan` then spends as replicas where they
    shorten the iteration (with few micro-batches, fewer and wider stages
    can beat the smallest bottleneck)."""
    solver = _DownSetSolver(self, micro_batch)
    found = {}
    for k in range(self.costs.num_devices, 0, -1):
      stages = solver.solve(k)
      if stages is None:
        break
      found.setdefault(tuple(stages), None)
    return [Partition(s, micro_batch, chain=True) for s in found]


class _DownSetSolver:
  """f(I, a, k) of the module docstring for one micro-batch size."""

  def __init__(self, owner: PiperPartitioner, micro_batch: int):
    self.owner = owner
    self.costs = owner.costs
    self.b = micro_batch
    self.devices = self.costs.num_devices
    self.counts = self.costs.replica_counts(micro_batch)
    self.depth = min(len(owner.graph.nodes), self.devices)
    self._options: dict[int, list[tuple[int, float, int]]] = {}
    self.memo: dict[int, np.ndarray] = {}

  def options(self, stage: int) -> list[tuple[int, float, int]]:
    """(k, time per sample, in-flight capacity) of a stage that fits."""
    if stage not in self._options:
      nodes = tuple(bits(stage))
      row = []
      for k in self.counts:
        cap = self.costs.in_flight_capacity(nodes, self.b, k)
        if cap >= 1:
          row.append((k, self.costs.time_per_sample(nodes, self.b, k), cap))
      self._options[stage] = row
    return self._options[stage]

  def solve(self, devices: int) -> list[tuple[tuple[int, ...], int]] | None:
    """The stages of f(V, 0, devices) in pipeline order, or None."""
    ideal, after, k = self.owner.all_nodes, 0, devices
    if not np.isfinite(self.f(ideal)[after, k]):
      return None
    stages = []
    while ideal:
      want = self.f(ideal)[after, k]
      # Reading the plan back prices no new stage: not counted.
      for stage, rest, option, cand in self._choices(ideal, count=False):
        if cand[after, k] == want:
          stages.append((tuple(bits(stage)), option[0]))
          ideal, after, k = rest, after + 1, k - option[0]
          break
    return stages[::-1]

  def f(self, ideal: int) -> np.ndarray:
    """The (stages after, devices) table of down-set `ideal`."""
    found = self.memo.get(ideal)
    if found is None:
      if ideal == 0:
        found = np.zeros((self.depth, self.devices + 1))
      else:
        found = np.full((self.depth, self.devices + 1), np.inf)
        for *_, cand in self._choices(ideal):
          np.minimum(found, cand, out=found)
      self.memo[ideal] = found
    return found

  def _choices(self, ideal: int, count: bool = True):
    """(S, I - S, option, candidate table) for every priced choice."""
    owner = self.owner
    for stage in self._upsets(ideal):
      rest = ideal & ~stage
      before = self.f(rest)
      for option in self.options(stage):
        k, tps, cap = option
        shifted = np.full((self.depth, self.devices + 1), np.inf)
        if rest:
          shifted[:-1, k:] = before[1:, : self.devices + 1 - k]
        else:
          shifted[:, k:] = 0.0
        cand = np.maximum(shifted, tps)
        cand[cap:, :] = np.inf  # memory holds `cap` in flight
        yield stage, rest, option, cand
      if not count:
        continue
      owner.priced += 1
      if owner.priced > owner.budget:
        raise PlanError(
          f"piper found no plan within its search budget: it priced "
          f"{owner.budget:,} stages (down-set pairs) of this "
          f"{len(owner.graph.nodes)}-node graph, whose down-sets grow "
          "exponentially with its parallel branches; raise piper_budget "
          "or use planner='graphpipe'"
        )

  def _upsets(self, ideal: int):
    """Non-empty up-sets S of `ideal` that fit memory on some device
    count, grown one maximal node at a time (a set that fits nowhere stops
    growing: weights and stashes only grow with it)."""
    succ = self.owner.succ
    seen = set()
    stack = [1 << v for v in bits(ideal) if not succ[v] & ideal]
    while stack:
      stage = stack.pop()
      if stage in seen:
        continue
      seen.add(stage)
      if not self.options(stage):
        continue
      yield stage
      rest = ideal & ~stage
      for v in bits(rest):
        # v may join when all its successors inside the ideal are in S.
        if not succ[v] & rest:
          stack.append(stage | 1 << v)
