"""From a partition to a `Plan`: spare devices, placement, stage edges.

  part = spend_spare_devices(graph, part, costs)  # unused devices, if useful
  apart = split_branches(graph, part, costs)  # GraphPipe: another candidate
  p = assemble(graph, part, costs, "graphpipe")  # place, order, in-flight

`assemble` places stages on devices (`place_devices`), derives the stage
edges from the operator edges, numbers the stages in a topological order
and gives each its in-flight count under the partition's schedule.
"""

from __future__ import annotations

import dataclasses

from graphpipe.core.cost_model import CostModel
from graphpipe.core.graph import OpGraph
from graphpipe.core.stages import Plan, Stage, in_flight_counts
from graphpipe.errors import PlanError
from graphpipe.planning import sp
from graphpipe.planning.candidates import Partition
from graphpipe.planning.stage_costs import StageCosts


def spend_spare_devices(
  graph: OpGraph, part: Partition, costs: StageCosts
) -> Partition:
  """Gives unused devices to the stages where they shorten the iteration.

  The planners give each stage the fewest devices that meet the target
  bottleneck; devices left over may still speed up the bottleneck (a
  shorter period) or other stages on the critical path (a shorter warm-up
  and drain, which matters when there are few micro-batches). Greedily,
  one stage at a time, the next device count that divides the micro-batch
  goes where it cuts a quick estimate of the iteration (to one stage, or at
  once to all stages that cost the same, such as parallel copies of one
  branch: one of them alone would leave the others on the critical path),

    (m - 1) * slowest stage + longest path of stage times + slowest sync,

  (with per-stage sizes, the slowest of (m_s - 1) * stage time).

  while it does.

  Example:
    >>> from graphpipe.costs import AnalyticCostModel, device_spec
    >>> graph = capture_zoo("two_branch", "paper")   # the case study
    >>> costs = StageCosts(graph, AnalyticCostModel(device_spec("v100")),
    ...                    batch_size=8, num_devices=8, memory_bytes=16e9)
    >>> part = Partition((((0, 1), 1), ((4, 5, 6, 7), 2), ((2, 3, 8), 1)),
    ...                  micro_batch_size=2)     # 4 of the 8 devices
    >>> spend_spare_devices(graph, part, costs).stages   # one more: the join
    (((0, 1), 1), ((4, 5, 6, 7), 2), ((2, 3, 8), 2))

  Args:
    graph: the operator graph.
    part: a partition that may leave devices unused.
    costs: the stage costs it was made with.
  """
  sizes = [part.size(i) for i in range(len(part.stages))]
  counts = [k for _, k in part.stages]
  spare = costs.num_devices - sum(counts)
  if spare <= 0:
    return part
  edges = stage_edges(graph, part)
  order = _topological(part, edges)
  preds = {s: [a for a, t in edges if t == s] for s in order}
  # Stage i on k devices: (busy time per micro-batch, sync time), each
  # asked once (trials change one stage's count at a time).
  times: dict[tuple[int, int], tuple[float, float]] = {}

  def stage_times(i: int, k: int) -> tuple[float, float]:
    if (i, k) not in times:
      nodes = part.stages[i][0]
      times[i, k] = (
        costs.microbatch_time(nodes, sizes[i], k),
        costs.sync_time(nodes, k),
      )
    return times[i, k]

  def estimate(busy: list[float], syncs: list[float]) -> float:
    path = [0.0] * len(busy)
    for s in order:
      before = preds[s]
      path[s] = busy[s] + (max([path[a] for a in before]) if before else 0.0)
    steady = max(
      [
        (costs.batch_size // b - 1) * t
        for b, t in zip(sizes, busy, strict=True)
      ]
    )
    return steady + max(path) + max(syncs)

  def twins(ks):
    """Stages that cost the same (e.g. parallel copies of one branch):
    one of them alone with more devices leaves the others on the path."""
    groups = {}
    for i, (k, b) in enumerate(zip(ks, sizes, strict=True)):
      busy, sync = stage_times(i, k)
      key = (k, b, f"{busy:.12g}", f"{sync:.12g}")
      groups.setdefault(key, []).append(i)
    return [g for g in groups.values() if len(g) > 1]

  # The current counts' busy and sync times; a trial changes a group's.
  busy = [stage_times(i, k)[0] for i, k in enumerate(counts)]
  syncs = [stage_times(i, k)[1] for i, k in enumerate(counts)]
  current = estimate(busy, syncs)
  while spare > 0:
    best = None
    moves = [[i] for i in range(len(counts))] + twins(counts)
    for group in moves:
      k, b = counts[group[0]], sizes[group[0]]
      more = next(
        (
          k2
          for k2 in range(k + 1, k + spare // len(group) + 1)
          if k2 in costs.replica_counts(b)
        ),
        None,
      )
      if more is None:
        continue
      trial = [more if i in group else c for i, c in enumerate(counts)]
      trial_busy, trial_syncs = list(busy), list(syncs)
      for i in group:
        trial_busy[i], trial_syncs[i] = stage_times(i, more)
      time_taken = estimate(trial_busy, trial_syncs)
      if time_taken < current and (best is None or time_taken < best[0]):
        best = (time_taken, trial, trial_busy, trial_syncs)
    if best is None:
      break
    current, trial, busy, syncs = best
    spare -= sum(trial) - sum(counts)
    counts = trial
  stages = tuple(
    (nodes, k) for (nodes, _), k in zip(part.stages, counts, strict=True)
  )
  return dataclasses.replace(part, stages=stages)


def split_branches(
  graph: OpGraph, part: Partition, costs: StageCosts
) -> Partition:
  """Unused devices spent on running a stage's independent parts apart.

  The DPs give each stage the fewest devices that meet the target, so a
  stage may group parallel branches (parts of its nodes with no operator
  edge between them) where one device suffices for the bottleneck. With
  devices left over, those parts may run concurrently instead, each a
  stage on the group's replica count: that shortens the critical path
  where data parallelism would add an all-reduce (few micro-batches).
  Busiest stages first, while devices last. Each part of a convex stage
  is convex and the stage graph stays acyclic (a path between two parts
  through other stages would leave the stage and come back).

  Example:
    >>> from graphpipe.costs import AnalyticCostModel, device_spec
    >>> graph = capture_zoo("two_branch", "paper")   # branches 0-3, 4-7; 8
    >>> costs = StageCosts(graph, AnalyticCostModel(device_spec("v100")),
    ...                    batch_size=8, num_devices=4, memory_bytes=16e9)
    >>> part = Partition((((0, 1, 4, 5), 1), ((2, 3, 6, 7, 8), 1)),
    ...                  micro_batch_size=8)
    >>> split_branches(graph, part, costs).stages
    (((0, 1), 1), ((4, 5), 1), ((2, 3, 6, 7, 8), 1))

  Args:
    graph: the operator graph.
    part: a partition that may leave devices unused (not a chain: chain
      stages follow one another; one micro-batch size).
    costs: the stage costs it was made with.
  """
  spare = costs.num_devices - sum(k for _, k in part.stages)
  if spare <= 0 or part.chain or part.sizes:
    return part
  b = part.micro_batch_size
  # A stage's independent parts: the weakly connected components of the
  # operator edges inside it.
  neighbours = sp.adjacency(
    len(graph.nodes), ((e.src, e.dst) for e in graph.edges)
  )
  parts = [
    [tuple(c) for c in sp.components(sorted(nodes), neighbours)]
    for nodes, _ in part.stages
  ]
  busiest = sorted(
    range(len(part.stages)),
    key=lambda i: (
      -costs.microbatch_time(part.stages[i][0], b, part.stages[i][1])
    ),
  )
  split = set()
  for i in busiest:
    k = part.stages[i][1]
    extra = (len(parts[i]) - 1) * k
    if len(parts[i]) > 1 and extra <= spare:
      split.add(i)
      spare -= extra
  if not split:
    return part
  stages = []
  for i, (nodes, k) in enumerate(part.stages):
    pieces = parts[i] if i in split else [nodes]
    stages += [(piece, k) for piece in pieces]
  return dataclasses.replace(part, stages=tuple(stages))


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
    >>> from graphpipe.costs import AnalyticCostModel, device_spec
    >>> graph = capture_zoo("two_branch", "paper")   # the case study
    >>> costs = StageCosts(graph, AnalyticCostModel(device_spec("v100")),
    ...                    batch_size=8, num_devices=8, memory_bytes=16e9)
    >>> one_block_each = [((n,), 1) for n in (0, 1, 2, 4, 5, 6, 7)]
    >>> part = Partition((*one_block_each, ((3, 8), 1)), micro_batch_size=1)
    >>> p = assemble(graph, part, costs, "graphpipe")
    >>> p.depth, [s.in_flight for s in p.stages]
    (5, [4, 3, 2, 5, 4, 3, 2, 1])
    >>> p.stage_edges
    ((0, 1), (1, 2), (2, 7), (3, 4), (4, 5), (5, 6), (6, 7))

  Args:
    graph: the operator graph.
    part: stages and device counts.
    costs: the stage costs (for the bottleneck estimate).
    planner: the planner's name, recorded in the plan.
    fingerprint: `graph_fingerprint(graph)`.
  """
  devices = place_devices(
    graph, part, costs.cost_model, costs.num_devices, costs.block_times
  )
  edges = stage_edges(graph, part)
  order = _topological(part, edges)
  rank = {s: i for i, s in enumerate(order)}
  ranked_edges = tuple(sorted((rank[a], rank[b]) for a, b in edges))
  sizes = [part.size(s) for s in order]
  if part.schedule == "gpipe":
    in_flight = [costs.batch_size // b for b in sizes]
  else:
    # A stage never holds more micro-batches than it runs.
    counts = in_flight_counts(len(order), ranked_edges, sizes)
    in_flight = [
      min(c, costs.batch_size // b) for c, b in zip(counts, sizes, strict=True)
    ]
  stages = tuple(
    Stage(
      id=i,
      nodes=tuple(sorted(part.stages[s][0])),
      devices=devices[s],
      micro_batch_size=sizes[i],
      in_flight=in_flight[i],
      sharding=costs.sharding(len(devices[s])),
    )
    for i, s in enumerate(order)
  )
  bottleneck = max(
    costs.time_per_sample(s.nodes, s.micro_batch_size, len(s.devices))
    for s in stages
  )
  return Plan(
    planner=planner,
    stages=stages,
    stage_edges=ranked_edges,
    batch_size=costs.batch_size,
    num_devices=costs.num_devices,
    schedule=part.schedule,
    bottleneck_time_per_sample=bottleneck,
    graph_fingerprint=fingerprint,
  )


def place_devices(
  graph: OpGraph,
  part: Partition,
  cost_model: CostModel,
  num_devices: int,
  block_times: dict | None = None,
) -> list[tuple[int, ...]]:
  """Device blocks for the stages of a partition.

  Data-parallel stages go first, largest first, each to the free block
  where its gradient all-reduce is fastest (inside one node when it fits:
  with power-of-two sizes this never straddles a node boundary, which the
  planners' stage costs assume). Single-device stages then fill the free
  devices in the partition's order, so that neighbouring stages of a
  branch sit next to each other.

  Example:
    >>> from graphpipe.costs import AnalyticCostModel, device_spec
    >>> graph = capture_zoo("two_branch", "paper")
    >>> part = Partition((((0, 1), 2), ((4, 5, 6, 7), 4), ((2, 3, 8), 2)),
    ...                  micro_batch_size=4)
    >>> place_devices(graph, part, AnalyticCostModel(device_spec("v100")), 8)
    [(4, 5), (0, 1, 2, 3), (6, 7)]

  Args:
    graph: the operator graph (for parameter bytes).
    part: stages and device counts.
    cost_model: prices the all-reduces.
    num_devices: devices available, 0..num_devices - 1.
    block_times: a memo of the block starts ranked by their all-reduce
      time and of the placements made from them, for this cost model and
      device count (a search places thousands of partitions).
  """
  if block_times is None:
    block_times = {}

  def ranked_starts(params: int, k: int) -> tuple[int, ...]:
    """Every block start, fastest all-reduce first (ties: lowest); equal
    rankings are one object (placements are memoised by them)."""
    key = ("ranked", params, k)
    if key not in block_times:
      ranked = tuple(
        sorted(
          range(num_devices - k + 1),
          key=lambda s: (
            cost_model.allreduce_time(params, range(s, s + k)),
            s,
          ),
        )
      )
      block_times[key] = block_times.setdefault(("ranking", ranked), ranked)
    return block_times[key]

  # What the placement below reads of the partition: each stage's device
  # count and, on several devices, its ranking of block starts.
  rankings = [
    ranked_starts(graph.variable_bytes(nodes), k) if k > 1 else None
    for nodes, k in part.stages
  ]
  key = (
    "placed",
    tuple((k, id(r)) for (_, k), r in zip(part.stages, rankings, strict=True)),
  )
  if key in block_times:
    return list(block_times[key])
  free = [True] * num_devices
  devices: list[tuple[int, ...]] = [()] * len(part.stages)
  by_size = sorted(range(len(part.stages)), key=lambda i: -part.stages[i][1])
  for i in by_size:
    k = part.stages[i][1]
    if k == 1:  # the first free device (none left: no device)
      first = next((d for d in range(num_devices) if free[d]), None)
      devices[i] = () if first is None else (first,)
      if first is not None:
        free[first] = False
      continue
    # The fastest start of k free devices in a row.
    start = next((s for s in rankings[i] if all(free[s : s + k])), None)
    if start is None:  # fragmented by sizes that are not powers of two
      devices[i] = tuple([d for d in range(num_devices) if free[d]][:k])
    else:
      devices[i] = tuple(range(start, start + k))
    for d in devices[i]:
      free[d] = False
  block_times[key] = tuple(devices)
  return devices


def stage_edges(graph: OpGraph, part: Partition) -> set[tuple[int, int]]:
  """(stage, stage) pairs, as indices of `part.stages`, that need an edge.

  Operator edges across stages, plus consecutive pairs for a chain.

  Example:
    >>> graph = capture_zoo("two_branch", "paper")   # branches 0-3, 4-7; 8
    >>> part = Partition((((0, 1, 2, 3), 1), ((4, 5, 6, 7), 1), ((8,), 1)),
    ...                  micro_batch_size=2)
    >>> sorted(stage_edges(graph, part))      # both branches feed the join
    [(0, 2), (1, 2)]
    >>> chain = dataclasses.replace(part, chain=True)   # a sequential plan
    >>> sorted(stage_edges(graph, chain))     # also runs stage 1 after 0
    [(0, 1), (0, 2), (1, 2)]

  Args:
    graph: the operator graph.
    part: the partition.
  """
  owner = {n: i for i, (nodes, _) in enumerate(part.stages) for n in nodes}
  edges = {
    (owner[e.src], owner[e.dst])
    for e in graph.edges
    if owner[e.src] != owner[e.dst]
  }
  if part.chain:
    edges |= {(i, i + 1) for i in range(len(part.stages) - 1)}
  return edges


def _topological(part: Partition, edges) -> list[int]:
  """Stage indices in a topological order, smallest node id first."""
  first = [min(nodes) for nodes, _ in part.stages]
  order = sp.topological_order(
    range(len(part.stages)), edges, lambda i: first[i]
  )
  if len(order) != len(part.stages):
    raise PlanError(
      "the stages form a cycle (internal error: a stage is not convex)"
    )
  return order
