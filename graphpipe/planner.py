"""`plan`: partition an OpGraph into a stage graph (GraphPipe or a baseline).

  plan(graph, num_devices=8, batch_size=64, planner="graphpipe") -> Plan

Every planner answers the same question for each micro-batch size b (powers
of two dividing the batch, or the sizes given): which stages, on how many
devices each, minimise the bottleneck stage's time per sample
(`graphpipe.costs.StageCosts`) within the memory budget, and, among those,
have the fewest micro-batches in flight at the source. Each returns that
plan plus the fastest plans under a few smaller depth bounds (a shallower
pipeline with more data parallelism has a shorter warm-up). `plan` then
gives spare devices where they shorten the iteration, places stages on
devices, derives stage edges and in-flight counts, and keeps the candidate
with the shortest estimated iteration (`costs.estimate_iteration_time`);
candidates within 10% of the best are simulated (`graphpipe.simulate`, the
schedule the plan will run) and the fastest wins.

The GraphPipe partitioner (this module):

  merge glue nodes with one input that do no work into it  (sp.contract)
  tree = series-parallel decomposition of the graph         (sp.decompose)
  for each micro-batch size b:
    binary search the smallest target t among the candidate stages' times
    per sample such that feasible(t), where feasible asks the memoised DP
      g(X, D, d) = fewest devices that split sub-graph X into stages of
        time per sample <= t, with at most D stages on any path, when d
        stages follow X (so a stage of X holds 1 + d + (stages after it
        in X) micro-batches in flight, which memory must allow):
      base     X as one data-parallel stage on the fewest devices k | b
      series   X = X1 ; X2: the last stage covers children s..j whole
               (optionally with the tail of one branch of a parallel child
               just before s: how a join shares a stage with the last
               layers of one branch), or the last child is split on its
               own (depth D2) and the rest gets D - D2, d + D2 after it
      parallel X = X1 | X2 | ...: branches pipeline concurrently with the
               same D and d (a shared source thus takes the max in-flight
               count); neighbouring branches may share one stage
    and the smallest D with g(root, D, 0) <= num_devices.

Parallel branches are ordered by work, so that grouping neighbours groups
similar branches. The baselines live in `graphpipe.baselines`.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable, Sequence

from graphpipe import sp
from graphpipe.costs import (
  AnalyticCostModel,
  DeviceSpec,
  StageCosts,
  device_spec,
  estimate_iteration_time,
  graph_fingerprint,
)
from graphpipe.errors import GraphpipeError
from graphpipe.graph import OpGraph
from graphpipe.plan import (
  CostModel,
  Plan,
  Stage,
  in_flight_counts,
  stage_memory_bytes,
)
from graphpipe.simulate import simulate

PLANNERS = ("graphpipe", "sequential", "gpipe")
_INF = 1 << 40
# Candidates whose estimate is within 10% of the best are simulated, best
# estimate first, up to about a second of simulation (~20 us an action).
_CLOSE_CALL = 1.1
_SIMULATED_ACTIONS = 50_000
# A glue node is merged into a neighbour when it does under 1% of an average
# node's FLOPs and its weights (with gradients and Adam state) take under
# 1% of a device: it cannot be worth a device of its own.
_LIGHT_SHARE = 0.01


class PlanError(GraphpipeError):
  """No valid plan exists for the graph, devices, batch and memory given."""


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


def plan(
  graph: OpGraph,
  num_devices: int,
  batch_size: int,
  planner: str = "graphpipe",
  device: str | DeviceSpec = "v100",
  cost_model: CostModel | None = None,
  memory_bytes: float | None = None,
  micro_batch_sizes: Sequence[int] | None = None,
) -> Plan:
  """A stage graph for `graph` on `num_devices` devices.

  Example:
    >>> graph = capture_zoo("two_branch", "paper")
    >>> p = plan(graph, num_devices=8, batch_size=8)
    >>> print(p)                  # stages, devices, micro-batch, in flight
    >>> p.depth, plan(graph, 8, 8, planner="sequential").depth
    (5, 8)

  Args:
    graph: the operator graph (captured or loaded from JSON).
    num_devices: devices the plan may use.
    batch_size: samples per iteration (the mini-batch).
    planner: 'graphpipe' (graph pipeline), 'sequential' (PipeDream-style
      1F1B over the best linearisation) or 'gpipe' (balanced chain, GPipe
      schedule).
    device: a preset name of `graphpipe.costs.PRESETS` or a `DeviceSpec`;
      used when `cost_model` is None.
    cost_model: times of nodes and communication; default the analytic
      model of `device`.
    memory_bytes: per-device budget; default the cost model's capacity.
    micro_batch_sizes: sizes to search; default every power of two that
      divides `batch_size`.

  Raises:
    PlanError: no plan fits (the message names the smallest per-device
      memory, or device count, that would), bad arguments.
  """
  start = time.perf_counter()
  _check_arguments(graph, num_devices, batch_size, planner)
  if cost_model is None:
    spec = device_spec(device) if isinstance(device, str) else device
    cost_model = AnalyticCostModel(spec)
  device_name = device if isinstance(device, str) else device.name
  if memory_bytes is None:
    memory_bytes = cost_model.memory_bytes
  sizes = _micro_batch_sizes(batch_size, micro_batch_sizes)
  best = _search(
    graph, num_devices, batch_size, planner, cost_model, memory_bytes, sizes
  )
  if best is None:
    raise _no_plan_error(
      graph, num_devices, batch_size, planner, cost_model, memory_bytes, sizes
    )
  return dataclasses.replace(
    best,
    device=device_name,
    search_time_s=time.perf_counter() - start,
    graph=graph,
  )


def _check_arguments(graph, num_devices, batch_size, planner) -> None:
  if planner not in PLANNERS:
    raise PlanError(
      f"unknown planner {planner!r}; choose one of {', '.join(PLANNERS)}"
    )
  if not isinstance(num_devices, int) or num_devices < 1:
    raise PlanError(f"num_devices must be a positive int, got {num_devices!r}")
  if not isinstance(batch_size, int) or batch_size < 1:
    raise PlanError(f"batch_size must be a positive int, got {batch_size!r}")
  if not graph.nodes:
    raise PlanError("the graph has no nodes: capture a model first")


def _micro_batch_sizes(
  batch_size: int, requested: Sequence[int] | None
) -> list[int]:
  if requested is None:
    return [b for b in (2**i for i in range(31)) if batch_size % b == 0]
  sizes = sorted({int(b) for b in requested if b >= 1 and batch_size % b == 0})
  if not sizes:
    divisors = [b for b in range(1, batch_size + 1) if batch_size % b == 0]
    raise PlanError(
      f"batch size {batch_size} is not divisible by any micro-batch size in "
      f"{list(requested)}: use sizes among its divisors {divisors[:12]}"
      + ("..." if len(divisors) > 12 else "")
    )
  return sizes


def _partitioner(
  graph: OpGraph, planner: str, costs: StageCosts
) -> Callable[[int], list[Partition]]:
  if planner == "graphpipe":
    return GraphPipePartitioner(graph, costs)
  # The baselines build on this module's Partition: import them late.
  from graphpipe import baselines

  if planner == "sequential":
    return baselines.SequentialPartitioner(graph, costs)
  return baselines.GPipePartitioner(graph, costs)


def _search(
  graph, num_devices, batch_size, planner, cost_model, memory_bytes, sizes
) -> Plan | None:
  """The fastest candidate plan (see the module docstring), or None."""
  costs = StageCosts(graph, cost_model, batch_size, num_devices, memory_bytes)
  partition = _partitioner(graph, planner, costs)
  fingerprint = graph_fingerprint(graph)
  candidates = []
  for b in sizes:
    for part in partition(b):
      if part.schedule == "1f1b":
        part = spend_spare_devices(graph, part, costs)
      candidate = assemble(graph, part, costs, planner, fingerprint)
      estimate = estimate_iteration_time(candidate, graph, cost_model)
      candidates.append(
        (estimate, candidate.stages[0].in_flight, -b, candidate)
      )
  if not candidates:
    return None
  candidates.sort(key=lambda c: c[:3])
  # The estimate is within a few percent of the event simulation; close
  # calls are settled by simulating the schedule the plan will run.
  close = [c for c in candidates if c[0] <= _CLOSE_CALL * candidates[0][0]]
  if len(close) == 1:
    return close[0][3]
  timed, budget = [], _SIMULATED_ACTIONS
  for c in close:
    actions = 2 * c[3].num_microbatches * c[3].num_stages
    if timed and actions > budget:
      continue
    budget -= actions
    timed.append((simulate(c[3], graph, cost_model).iteration_time_s, *c[1:]))
  return min(timed, key=lambda c: c[:3])[3]


def _no_plan_error(
  graph, num_devices, batch_size, planner, cost_model, memory_bytes, sizes
) -> PlanError:
  """Says what memory (or how many devices) would have allowed a plan."""
  gib = 2**30
  unlimited = _search(
    graph, num_devices, batch_size, planner, cost_model, math.inf, sizes
  )
  if unlimited is None:
    return PlanError(
      f"no {planner} plan exists for {num_devices} devices even without a "
      "memory limit (internal: every stage time was infinite)"
    )
  low, high = float(memory_bytes), _peak_memory(unlimited, graph)
  # Bisect the per-device memory to 1%: feasibility is monotone in it.
  while high > low * 1.01:
    middle = math.sqrt(low * high)
    found = _search(
      graph, num_devices, batch_size, planner, cost_model, middle, sizes
    )
    low, high = (low, middle) if found is not None else (middle, high)
  more = None
  devices = num_devices
  while more is None and devices < min(4 * num_devices, 64):
    devices = min(2 * devices, 64)
    found = _search(
      graph, devices, batch_size, planner, cost_model, memory_bytes, sizes
    )
    more = devices if found is not None else None
  hint = f", or use at least {more} devices" if more else ""
  return PlanError(
    f"no {planner} plan for {graph.model or 'the graph'} fits "
    f"{memory_bytes / gib:.3g} GiB per device on {num_devices} devices "
    f"(batch {batch_size}, micro-batches {sizes}): the smallest per-device "
    f"memory that fits is about {high / gib:.3g} GiB; raise memory_bytes "
    f"or pick a device with more memory{hint}"
  )


def _peak_memory(p: Plan, graph: OpGraph) -> float:
  return max(
    stage_memory_bytes(
      graph,
      s.nodes,
      StageCosts.share(s.micro_batch_size, len(s.devices)),
      s.in_flight,
    )
    for s in p.stages
  )


def light_nodes(graph: OpGraph, memory_bytes: float) -> list[int]:
  """Glue nodes too small to deserve a stage (merged before the DP).

  Joins (several predecessors) are left alone: the DP lets a join share a
  stage with the tail of any one branch, and chooses which.

  Example:
    >>> light_nodes(capture_zoo("dlrm", "paper"), 16e9)   # the loss
    [38]

  Args:
    graph: the operator graph.
    memory_bytes: the per-device budget.
  """
  work = [n.fwd_flops + n.bwd_flops for n in graph.nodes]
  mean_work = sum(work) / len(work)
  saved = [n.saved_bytes for n in graph.nodes]
  mean_saved = sum(saved) / len(saved)
  return [
    n.id
    for n in graph.nodes
    if len(graph.predecessors(n.id)) <= 1
    and work[n.id] <= _LIGHT_SHARE * mean_work
    and 4 * n.param_bytes + n.state_bytes <= _LIGHT_SHARE * memory_bytes
    and n.saved_bytes <= _LIGHT_SHARE * mean_saved
  ]


class GraphPipePartitioner:
  """The GraphPipe DP over a series-parallel tree (see the module docstring).

  Calling it with a micro-batch size returns partitions on the frontier of
  bottleneck time against pipeline depth: the fastest bottleneck (and, for
  it, the fewest in-flight micro-batches at the source), then the fastest
  bottleneck under a few smaller depth bounds (shallower pipelines with
  more data parallelism have shorter warm-ups); `plan` keeps the fastest.

  Example:
    >>> costs = StageCosts(graph, model, 64, 8, 16e9)
    >>> partitions = GraphPipePartitioner(graph, costs)(4)  # b = 4
    >>> [(nodes, k) for nodes, k in partitions[0].stages]

  Args:
    graph: the operator graph.
    costs: stage costs for the batch, devices and memory budget.
  """

  def __init__(self, graph: OpGraph, costs: StageCosts):
    self.costs = costs
    merge = light_nodes(graph, costs.memory_bytes)
    dag = sp.contract(graph, merge) if merge else sp.Dag.of(graph)
    self.tree = sp.decompose(dag)
    self._build(dag)

  def _build(self, dag: sp.Dag) -> None:
    """Flattens the tree into arrays; numbers every candidate stage.

    Candidate stages: a leaf; a range of a series node's children; a range
    of (two or more) neighbouring branches of a parallel node; and, after a
    parallel node inside a series, a range of the following children that
    also absorbs the tail of one branch (how a join shares a stage with the
    last layers of one branch instead of needing a device of its own).
    """
    work = [n.fwd_flops + n.bwd_flops for n in self.costs.graph.nodes]
    self.kind, self.children, self.depth = [], [], []
    self.base_nodes: list[tuple[int, ...]] = []
    self.leaf_base: dict[int, int] = {}
    self.range_base: dict[tuple[int, int, int], int] = {}
    # (series x, first child s, last child j) -> [(branch i, cut c, base)]
    self.absorb_base: dict[tuple[int, int, int], list] = {}
    self.prefix_depth: dict[int, list[int]] = {}
    self.nodes: list[tuple[int, ...]] = []

    def add(tree) -> int:
      x = len(self.kind)
      self.kind.append(tree.kind)
      self.children.append([])
      self.depth.append(tree.depth)
      self.nodes.append(
        tuple(sorted(n for v in tree.vertices for n in dag.groups[v]))
      )
      kids = list(tree.children)
      ids = [add(c) for c in kids]
      if tree.kind == "parallel":
        ids.sort(key=lambda c: -sum(work[n] for n in self.nodes[c]))
      self.children[x] = ids
      if tree.kind == "leaf":
        self.leaf_base[x] = self._new_base(self.nodes[x])
        return x
      for j in range(len(ids)):
        for s in range(j + 1):
          if tree.kind == "parallel" and s == j:
            continue  # a lone branch is covered by its own sub-problem
          self.range_base[(x, s, j)] = self._new_base(
            self._union(ids[s : j + 1])
          )
      if tree.kind == "series":
        self.prefix_depth[x] = list(_running_sum([self.depth[c] for c in ids]))
        self._absorbing_stages(x, ids)
      return x

    self.root = add(self.tree)

  def _absorbing_stages(self, x: int, ids: list[int]) -> None:
    for p, par in enumerate(ids[:-1]):
      if self.kind[par] != "parallel":
        continue
      for j in range(p + 1, len(ids)):
        after = self._union(ids[p + 1 : j + 1])
        options = []
        for i, branch in enumerate(self.children[par]):
          parts = (
            self.children[branch] if self.kind[branch] == "series" else [branch]
          )
          # Longest tails last, so the DP can stop at the first misfit.
          for c in reversed(range(len(parts))):
            nodes = tuple(sorted(after + self._union(parts[c:])))
            options.append((i, c, self._new_base(nodes)))
        self.absorb_base[(x, p + 1, j)] = options

  def _union(self, ids) -> tuple[int, ...]:
    return tuple(sorted(n for c in ids for n in self.nodes[c]))

  def _new_base(self, nodes: tuple[int, ...]) -> int:
    self.base_nodes.append(nodes)
    return len(self.base_nodes) - 1

  def __call__(self, micro_batch: int) -> list[Partition]:
    """Frontier partitions for micro-batch size `micro_batch` (maybe [])."""
    costs = self.costs
    counts = [
      k for k in range(1, costs.num_devices + 1) if micro_batch % k == 0
    ]
    options = []
    targets = set()
    for nodes in self.base_nodes:
      row = []
      for k in counts:
        cap = costs.in_flight_capacity(nodes, micro_batch, k)
        if cap >= 1:
          tps = costs.time_per_sample(nodes, micro_batch, k)
          row.append((k, tps, cap))
          targets.add(tps)
      options.append(row)
    solver = _Solver(self, options)
    found = frontier(
      sorted(targets), self.depth[self.root], solver.feasible, solver.solve
    )
    return [Partition(tuple(stages), micro_batch) for stages in found]


def frontier(targets: list[float], max_depth: int, feasible, solve) -> list:
  """Fastest solutions for the full depth, then for smaller depth bounds.

  Binary search on the sorted candidate targets (bottleneck times per
  sample) for the smallest feasible one, first with `max_depth`, then with
  each depth of `DEPTH_GRID` below the depth that solution used.

  Example:
    >>> frontier(sorted(times), tree_depth, solver.feasible, solver.solve)

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


# Depth bounds tried below the fastest plan's depth: a rough geometric grid,
# enough to find the shallow, data-parallel end of the frontier.
DEPTH_GRID = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64)


class _Solver:
  """feasible(t) of the module docstring, with the stages it chose."""

  def __init__(self, dp: GraphPipePartitioner, options):
    self.dp = dp
    self.options = options
    self.num_devices = dp.costs.num_devices
    self.target = None

  def _retarget(self, target: float) -> None:
    if target != self.target:
      self.target = target
      self.base_memo: dict[tuple[int, int], int] = {}
      self.memo: dict[tuple, tuple[int, tuple]] = {}

  def feasible(self, target: float, max_depth: int) -> bool:
    """Whether stages within t and max_depth fit the devices."""
    self._retarget(target)
    return self.g(self.dp.root, max_depth, 0)[0] <= self.num_devices

  def solve(self, target: float, max_depth: int):
    """(depth, stages) of the shallowest feasible plan within max_depth."""
    self._retarget(target)
    root = self.dp.root
    low, high = 1, max_depth
    while low < high:
      middle = (low + high) // 2
      if self.g(root, middle, 0)[0] <= self.num_devices:
        high = middle
      else:
        low = middle + 1
    stages = []
    self._collect(root, low, 0, stages)
    return low, stages

  def base(self, base_id: int, in_flight: int) -> int:
    """Fewest devices for one stage (time and memory), or _INF."""
    key = (base_id, in_flight)
    found = self.base_memo.get(key)
    if found is None:
      found = _INF
      for k, tps, cap in self.options[base_id]:
        if tps <= self.target and cap >= in_flight:
          found = k
          break
      self.base_memo[key] = found
    return found

  def g(self, x: int, depth: int, after: int) -> tuple[int, tuple]:
    depth = min(depth, self.dp.depth[x])
    kind = self.dp.kind[x]
    if kind == "leaf":
      k = self.base(self.dp.leaf_base[x], after + 1)
      return k, ("base", self.dp.leaf_base[x], k)
    if kind == "series":
      return self.series(x, len(self.dp.children[x]) - 1, depth, after)
    return self.parallel(x, depth, after)

  def series(self, x: int, j: int, depth: int, after: int):
    """Children 0..j of series node x (the DP runs from the sink back)."""
    if j < 0:
      return 0, None
    depth = min(depth, self.dp.prefix_depth[x][j])
    key = ("s", x, j, depth, after)
    if key in self.memo:
      return self.memo[key]
    best, choice = _INF, None
    for s in range(j, -1, -1):
      base_id = self.dp.range_base[(x, s, j)]
      k = self.base(base_id, after + 1)
      if k >= _INF:
        if self.base(base_id, 1) >= _INF:
          break  # longer ranges only get slower and larger
        continue
      if s == 0:
        total = k
      elif depth >= 2:
        total = k + self.series(x, s - 1, depth - 1, after + 1)[0]
      else:
        continue
      if total < best:
        best, choice = total, ("stage", s, base_id, k)
      if depth >= 2:
        for i, c, absorb_id, k2 in self._absorbing(x, s, j, after):
          rest = self.trimmed(x, s - 1, i, c, depth - 1, after + 1)[0]
          if k2 + rest < best:
            best, choice = k2 + rest, ("absorb", s, i, c, absorb_id, k2)
    child = self.dp.children[x][j]
    if self.dp.kind[child] != "leaf":
      top = min(depth, self.dp.depth[child])
      for inner in range(top, 0, -1) if j > 0 else (top,):
        own = self.g(child, inner, after)[0]
        if own >= _INF:
          break  # less depth for the child cannot help
        if j == 0:
          total = own
        elif depth - inner >= 1:
          total = own + self.series(x, j - 1, depth - inner, after + inner)[0]
        else:
          continue
        if total < best:
          best, choice = total, ("child", inner)
    self.memo[key] = (best, choice)
    return best, choice

  def _absorbing(self, x: int, s: int, j: int, after: int):
    """Feasible stages of children s..j plus one branch tail before s."""
    options = self.dp.absorb_base.get((x, s, j), ())
    last_branch, skip = None, False
    for i, c, absorb_id in options:
      if i != last_branch:
        last_branch, skip = i, False
      if skip:
        continue
      k = self.base(absorb_id, after + 1)
      if k >= _INF:
        skip = self.base(absorb_id, 1) >= _INF  # longer tails: no better
        continue
      yield i, c, absorb_id, k

  def trimmed(self, x, p, i, c, depth, after):
    """Children 0..p of series x, child p (parallel) cut to branch i's
    first c children (the rest of branch i sits in the next stage)."""
    key = ("t", x, p, i, c, depth, after)
    if key in self.memo:
      return self.memo[key]
    par = self.dp.children[x][p]
    best, choice = _INF, None
    for inner in range(min(depth, self.dp.depth[par]), 0, -1):
      own = self.parallel(par, inner, after, (i, c))[0]
      if own >= _INF:
        break
      if p == 0:
        best, choice = own, inner
        break
      if depth - inner >= 1:
        total = own + self.series(x, p - 1, depth - inner, after + inner)[0]
        if total < best:
          best, choice = total, inner
    self.memo[key] = (best, choice)
    return best, choice

  def parallel(self, x: int, depth: int, after: int, trim=None):
    """Branches of parallel node x, neighbours possibly sharing a stage.

    trim = (i, c): branch i keeps only its first c children.
    """
    key = ("p", x, depth, after, trim)
    if key in self.memo:
      return self.memo[key]
    kids = self.dp.children[x]
    cover = [0] + [_INF] * len(kids)
    back: list[tuple | None] = [None] * (len(kids) + 1)
    for i, kid in enumerate(kids):
      if trim is not None and trim[0] == i:
        own = self._head(kid, trim[1], depth, after)
      else:
        own = self.g(kid, depth, after)[0]
      if cover[i] + own < cover[i + 1]:
        cover[i + 1], back[i + 1] = cover[i] + own, ("branch", i)
      for s in range(i - 1, -1, -1):
        if trim is not None and s <= trim[0] <= i:
          break  # a cut branch cannot share a stage with its neighbours
        base_id = self.dp.range_base[(x, s, i)]
        k = self.base(base_id, after + 1)
        if k >= _INF:
          if self.base(base_id, 1) >= _INF:
            break
          continue
        if cover[s] + k < cover[i + 1]:
          cover[i + 1], back[i + 1] = cover[s] + k, ("group", s, base_id, k)
    result = (cover[-1], tuple(back))
    self.memo[key] = result
    return result

  def _head(self, branch: int, cut: int, depth: int, after: int) -> int:
    """Devices for the first `cut` children of a branch (0 if none)."""
    if cut == 0:
      return 0
    return self.series(branch, cut - 1, depth, after)[0]

  def _collect(self, x: int, depth: int, after: int, out: list) -> None:
    """Appends the stages of g(x, depth, after) to `out` (tree order)."""
    depth = min(depth, self.dp.depth[x])
    kind = self.dp.kind[x]
    if kind == "leaf":
      _, (_, base_id, k) = self.g(x, depth, after)
      out.append((self.dp.base_nodes[base_id], k))
    elif kind == "series":
      self._collect_series(x, len(self.dp.children[x]) - 1, depth, after, out)
    else:
      self._collect_parallel(x, depth, after, None, out)

  def _collect_parallel(self, x, depth, after, trim, out) -> None:
    _, back = self.parallel(x, depth, after, trim)
    kids = self.dp.children[x]
    parts = []
    i = len(kids)
    while i > 0:
      step = back[i]
      if step[0] == "branch":
        parts.append(("branch", i - 1))
        i -= 1
      else:
        parts.append(("group", step[2], step[3]))
        i = step[1]
    for part in reversed(parts):
      if part[0] == "group":
        out.append((self.dp.base_nodes[part[1]], part[2]))
      elif trim is not None and part[1] == trim[0]:
        if trim[1] > 0:
          self._collect_series(kids[part[1]], trim[1] - 1, depth, after, out)
      else:
        self._collect(kids[part[1]], depth, after, out)

  def _collect_series(self, x, j, depth, after, out) -> None:
    depth = min(depth, self.dp.prefix_depth[x][j])
    _, choice = self.series(x, j, depth, after)
    if choice[0] == "stage":
      _, s, base_id, k = choice
      if s > 0:
        self._collect_series(x, s - 1, depth - 1, after + 1, out)
      out.append((self.dp.base_nodes[base_id], k))
    elif choice[0] == "absorb":
      _, s, i, c, absorb_id, k = choice
      self._collect_trimmed(x, s - 1, i, c, depth - 1, after + 1, out)
      out.append((self.dp.base_nodes[absorb_id], k))
    else:
      inner = choice[1]
      if j > 0:
        self._collect_series(x, j - 1, depth - inner, after + inner, out)
      self._collect(self.dp.children[x][j], inner, after, out)

  def _collect_trimmed(self, x, p, i, c, depth, after, out) -> None:
    _, inner = self.trimmed(x, p, i, c, depth, after)
    if p > 0:
      self._collect_series(x, p - 1, depth - inner, after + inner, out)
    par = self.dp.children[x][p]
    self._collect_parallel(par, inner, after, (i, c), out)


def _running_sum(values):
  total = 0
  for v in values:
    total += v
    yield total


def spend_spare_devices(
  graph: OpGraph, part: Partition, costs: StageCosts
) -> Partition:
  """Gives unused devices to the stages where they shorten the iteration.

  The planners give each stage the fewest devices that meet the target
  bottleneck; devices left over may still speed up the bottleneck (a
  shorter period) or other stages on the critical path (a shorter warm-up
  and drain, which matters when there are few micro-batches). Greedily,
  one stage at a time, the next device count that divides the micro-batch
  goes where it cuts a quick estimate of the iteration,

    (m - 1) * slowest stage + longest path of stage times + slowest sync,

  while it does.

  Example:
    >>> spend_spare_devices(graph, partition, costs).stages

  Args:
    graph: the operator graph.
    part: a partition that may leave devices unused.
    costs: the stage costs it was made with.
  """
  b = part.micro_batch_size
  m = costs.batch_size // b
  counts = [k for _, k in part.stages]
  spare = costs.num_devices - sum(counts)
  if spare <= 0:
    return part
  owner = {n: i for i, (nodes, _) in enumerate(part.stages) for n in nodes}
  edges = {
    (owner[e.src], owner[e.dst])
    for e in graph.edges
    if owner[e.src] != owner[e.dst]
  }
  if part.chain:
    edges |= {(i, i + 1) for i in range(len(counts) - 1)}
  order = _topological(part, edges)
  preds = {s: [a for a, t in edges if t == s] for s in order}

  def estimate(ks):
    busy = [
      costs.microbatch_time(nodes, b, k)
      for (nodes, _), k in zip(part.stages, ks, strict=True)
    ]
    path = {}
    for s in order:
      path[s] = busy[s] + max((path[a] for a in preds[s]), default=0.0)
    sync = max(
      costs.sync_time(nodes, k)
      for (nodes, _), k in zip(part.stages, ks, strict=True)
    )
    return (m - 1) * max(busy) + max(path.values()) + sync

  current = estimate(counts)
  while spare > 0:
    best = None
    for i, k in enumerate(counts):
      more = next(
        (k2 for k2 in range(k + 1, k + spare + 1) if b % k2 == 0), None
      )
      if more is None:
        continue
      trial = counts[:i] + [more] + counts[i + 1 :]
      time_taken = estimate(trial)
      if time_taken < current and (best is None or time_taken < best[0]):
        best = (time_taken, i, more)
    if best is None:
      break
    current, i, more = best
    spare -= more - counts[i]
    counts[i] = more
  stages = tuple(
    (nodes, k) for (nodes, _), k in zip(part.stages, counts, strict=True)
  )
  return dataclasses.replace(part, stages=stages)


def assemble(
  graph: OpGraph,
  part: Partition,
  costs: StageCosts,
  planner: str,
  fingerprint: str = "",
) -> Plan:
  """The `Plan` of a partition: devices, stage edges, order, in-flight.

  Devices: see `place_devices`. Stage edges follow operator edges (plus
  consecutive pairs for a chain); stages are numbered in a topological
  order (ties: smallest node id first).

  Example:
    >>> p = assemble(graph, partition, costs, "graphpipe")
    >>> p.depth, [s.in_flight for s in p.stages]

  Args:
    graph: the operator graph.
    part: stages and device counts.
    costs: the stage costs (for the bottleneck estimate).
    planner: the planner's name, recorded in the plan.
    fingerprint: `graph_fingerprint(graph)`.
  """
  devices = place_devices(graph, part, costs.cost_model, costs.num_devices)
  owner = {n: i for i, (nodes, _) in enumerate(part.stages) for n in nodes}
  edges = {
    (owner[e.src], owner[e.dst])
    for e in graph.edges
    if owner[e.src] != owner[e.dst]
  }
  if part.chain:
    edges |= {(i, i + 1) for i in range(len(part.stages) - 1)}
  order = _topological(part, edges)
  rank = {s: i for i, s in enumerate(order)}
  stage_edges = tuple(sorted((rank[a], rank[b]) for a, b in edges))
  b = part.micro_batch_size
  if part.schedule == "gpipe":
    in_flight = [costs.batch_size // b] * len(order)
  else:
    in_flight = in_flight_counts(len(order), stage_edges)
  stages = tuple(
    Stage(
      id=i,
      nodes=tuple(sorted(part.stages[s][0])),
      devices=devices[s],
      micro_batch_size=b,
      in_flight=in_flight[i],
    )
    for i, s in enumerate(order)
  )
  bottleneck = max(
    costs.time_per_sample(s.nodes, b, len(s.devices)) for s in stages
  )
  return Plan(
    planner=planner,
    stages=stages,
    stage_edges=stage_edges,
    batch_size=costs.batch_size,
    num_devices=costs.num_devices,
    schedule=part.schedule,
    bottleneck_time_per_sample=bottleneck,
    graph_fingerprint=fingerprint,
  )


def place_devices(
  graph: OpGraph, part: Partition, cost_model: CostModel, num_devices: int
) -> list[tuple[int, ...]]:
  """Device blocks for the stages of a partition.

  Data-parallel stages go first, largest first, each to the free block
  where its gradient all-reduce is fastest (inside one node when it fits:
  with power-of-two sizes this never straddles a node boundary, which the
  planners' stage costs assume). Single-device stages then fill the free
  devices in the partition's order, so that neighbouring stages of a
  branch sit next to each other.

  Example:
    >>> place_devices(graph, partition, cost_model, 8)
    [(4, 5, 6, 7), (0,), (1,), (2,), (3,)]

  Args:
    graph: the operator graph (for parameter bytes).
    part: stages and device counts.
    cost_model: prices the all-reduces.
    num_devices: devices available, 0..num_devices - 1.
  """
  free = [True] * num_devices
  devices: list[tuple[int, ...]] = [()] * len(part.stages)
  by_size = sorted(range(len(part.stages)), key=lambda i: -part.stages[i][1])
  for i in by_size:
    nodes, k = part.stages[i]
    params = sum(graph.nodes[n].param_bytes for n in nodes)
    starts = [s for s in range(num_devices - k + 1) if all(free[s : s + k])]
    if not starts:  # fragmented by sizes that are not powers of two
      devices[i] = tuple([d for d in range(num_devices) if free[d]][:k])
    elif k > 1:
      start = min(
        starts,
        key=lambda s: (cost_model.allreduce_time(params, range(s, s + k)), s),
      )
      devices[i] = tuple(range(start, start + k))
    else:
      devices[i] = (starts[0],)
    for d in devices[i]:
      free[d] = False
  return devices


def _topological(part: Partition, edges) -> list[int]:
  """Stage indices in a topological order, smallest node id first."""
  n = len(part.stages)
  indeg = [0] * n
  succ = [[] for _ in range(n)]
  for a, b in edges:
    succ[a].append(b)
    indeg[b] += 1
  first = [min(nodes) for nodes, _ in part.stages]
  ready = sorted((first[i], i) for i in range(n) if indeg[i] == 0)
  order = []
  while ready:
    _, s = ready.pop(0)
    order.append(s)
    for t in succ[s]:
      indeg[t] -= 1
      if indeg[t] == 0:
        ready.append((first[t], t))
        ready.sort()
  if len(order) != n:
    raise PlanError(
      "the stages form a cycle (internal error: a stage is not convex)"
    )
  return order


def check_plan(p: Plan, graph: OpGraph, memory_bytes: float) -> None:
  """Raises `PlanError` unless `p` is a valid plan for `graph`.

  Checks: stages partition the nodes and are convex; devices are disjoint
  and in range; the micro-batch divides the batch and each stage's device
  count divides the micro-batch; stage edges cover every operator edge
  across stages and go forward; in-flight counts follow the schedule;
  every device's memory (`stage_memory_bytes`) fits `memory_bytes`.

  Example:
    >>> check_plan(plan(graph, 8, 64), graph, 16e9)

  Args:
    p: the plan.
    graph: the operator graph it partitions.
    memory_bytes: the per-device budget.
  """
  problems = []
  owner = {}
  for s in p.stages:
    for n in s.nodes:
      if n in owner:
        problems.append(f"node {n} is in stages {owner[n]} and {s.id}")
      owner[n] = s.id
  if sorted(owner) != list(range(len(graph.nodes))):
    problems.append("the stages do not cover every node exactly once")
  used = [d for s in p.stages for d in s.devices]
  if len(used) != len(set(used)) or any(
    not 0 <= d < p.num_devices for d in used
  ):
    problems.append(f"devices {used} overlap or fall outside the plan")
  if [s.id for s in p.stages] != list(range(p.num_stages)):
    problems.append("stage ids are not 0..n-1 in order")
  for s in p.stages:
    if p.batch_size % s.micro_batch_size or s.micro_batch_size % len(s.devices):
      problems.append(f"stage {s.id}: micro-batch does not split evenly")
  if any(a >= b for a, b in p.stage_edges):
    problems.append("a stage edge goes backward")
  if not problems:
    for e in graph.edges:
      a, b = owner[e.src], owner[e.dst]
      if a != b and (a, b) not in p.stage_edges:
        problems.append(f"operator edge {e.src}->{e.dst} has no stage edge")
    problems += _convexity_problems(p, graph, owner)
    if p.schedule == "gpipe":
      expected = [p.num_microbatches] * p.num_stages
    else:
      expected = in_flight_counts(p.num_stages, p.stage_edges)
    if [s.in_flight for s in p.stages] != expected:
      problems.append(f"in-flight counts are not {expected}")
    for s in p.stages:
      share = StageCosts.share(s.micro_batch_size, len(s.devices))
      need = stage_memory_bytes(graph, s.nodes, share, s.in_flight)
      if need > memory_bytes:
        problems.append(
          f"stage {s.id} needs {need / 2**30:.3g} GiB per device, over "
          f"{memory_bytes / 2**30:.3g} GiB"
        )
  if problems:
    raise PlanError("invalid plan: " + "; ".join(problems[:5]))


def _convexity_problems(p: Plan, graph: OpGraph, owner) -> list[str]:
  """A stage is convex when no path leaves it and comes back."""
  problems = []
  for s in p.stages:
    inside = set(s.nodes)
    # Nodes reachable from the stage through at least one outside node.
    frontier = [
      d for n in s.nodes for d in graph.successors(n) if d not in inside
    ]
    seen = set(frontier)
    while frontier:
      v = frontier.pop()
      for w in graph.successors(v):
        if w in inside:
          problems.append(f"stage {s.id} is not convex (path via node {v})")
          frontier = []
          break
        if w not in seen:
          seen.add(w)
          frontier.append(w)
  return problems
