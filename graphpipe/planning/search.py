"""`plan`: partition an OpGraph into a stage graph (GraphPipe or a baseline).

  plan(graph, num_devices=8, batch_size=64, planner="graphpipe") -> Plan

Every planner answers the same question for each micro-batch size b (powers
of two dividing the batch, or the sizes given): which stages, on how many
devices each, minimise the bottleneck stage's time per sample
(`graphpipe.planning.stage_costs.StageCosts`) within the memory budget. A
DP's single answer is not always the fastest plan, so each partitioner
offers the plans its DP would discard but the simulator may prefer
(`graphpipe.planning.candidates.frontier`): the fewest stages at the best
target and more stages at the same target, shallower pipelines under
smaller depth bounds, stages filled from the front and from the back, and
all of these again under a second metric that leaves each stage's
all-reduce and optimizer step off the critical path
(`StageCosts.steady_time_per_sample`). `plan` gives spare devices where
they shorten the iteration, places stages on devices, derives stage edges
and in-flight counts, ranks every candidate by `estimate_iteration_time`,
runs a local search (`graphpipe.planning.refine`) from the best plan of
the best few micro-batch sizes, and finally simulates candidates best
estimate first (`graphpipe.simulate`, the schedule each plan will run)
until the next estimate is no better than the fastest simulated plan.

`tightest_plan` (the plan under the smallest memory that fits, to make
small models really pipeline) is in `graphpipe.planning.tightest`,
`plan_and_simulate` in `graphpipe.planning.simulated`.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import time
from collections.abc import Callable, Sequence

from graphpipe.core.cost_model import CostModel
from graphpipe.core.fingerprint import graph_fingerprint
from graphpipe.core.graph import OpGraph
from graphpipe.core.memory import (
  KINDS,
  over_budget_message,
  plan_memory,
)
from graphpipe.core.stages import Plan
from graphpipe.costs import AnalyticCostModel, DeviceSpec, device_spec
from graphpipe.errors import PlanError
from graphpipe.planning import baselines
from graphpipe.planning.arguments import (
  PLANNERS,
  check_arguments,
  searched_sizes,
)
from graphpipe.planning.assemble import assemble, spend_spare_devices
from graphpipe.planning.candidates import Partition
from graphpipe.planning.graphpipe_dp import GraphPipePartitioner
from graphpipe.planning.micro_batches import grow_micro_batches
from graphpipe.planning.piper import PIPER_BUDGET, PiperPartitioner
from graphpipe.planning.refine import refine
from graphpipe.planning.stage_costs import (
  NodeTimes,
  StageCosts,
  estimate_iteration_time,
)
from graphpipe.simulator.engine import simulate

__all__ = ["PLANNERS", "plan"]

# Simulation budget per search, in actions (~50 us each: about a second),
# and in plans.
_SIMULATED_ACTIONS = 20_000
_SIMULATED_PLANS = 32
# A plan this much slower than the fastest may win with less padding ...
PADDING_TOLERANCE = 0.05
# ... when its devices hold this much padding each on average (not tiny).
PADDING_MIN_BYTES = 2**20
# Local search starts from the best plan of this many micro-batch sizes.
_REFINED = 3


def plan(
  graph: OpGraph,
  num_devices: int,
  batch_size: int,
  planner: str = "graphpipe",
  device: str | DeviceSpec = "v100",
  cost_model: CostModel | None = None,
  memory_bytes: float | None = None,
  micro_batch_sizes: Sequence[int] | None = None,
  per_stage_micro_batches: bool = False,
  piper_budget: int = PIPER_BUDGET,
  memory_kinds: Sequence[str] = KINDS,
  padding_tolerance: float | None = None,
  max_padding: float | None = None,
) -> Plan:
  """A stage graph for `graph` on `num_devices` devices.

  Example:
    >>> graph = capture_zoo("two_branch", "paper")   # the case study
    >>> p = plan(graph, num_devices=8, batch_size=8)
    >>> print(p)                  # stages, devices, micro-batch, in flight
    Plan[graphpipe] 8 stages, depth 5, b=1 x 8 micro-batches, 8 devices,
    schedule 1f1b
      stage 0: nodes [0] on devices [0], b=1, in flight 4
      stage 1: nodes [1] on devices [1], b=1, in flight 3
      stage 2: nodes [2] on devices [2], b=1, in flight 2
      stage 3: nodes [4] on devices [3], b=1, in flight 5
      stage 4: nodes [5] on devices [4], b=1, in flight 4
      stage 5: nodes [6] on devices [5], b=1, in flight 3
      stage 6: nodes [7] on devices [6], b=1, in flight 2
      stage 7: nodes [3, 8] on devices [7], b=1, in flight 1
      edges: [(0, 1), (1, 2), (2, 7), (3, 4), (4, 5), (5, 6), (6, 7)]
    >>> p.depth, plan(graph, 8, 8, planner="sequential").depth
    (5, 2)

  Args:
    graph: the operator graph (captured or loaded from JSON).
    num_devices: devices the plan may use.
    batch_size: samples per iteration (the mini-batch).
    planner: 'graphpipe' (graph pipeline), 'sequential' (PipeDream-style
      1F1B over the best linearisation), 'gpipe' (balanced chain, GPipe
      schedule) or 'piper' (a 1F1B sequence of down-set differences,
      `graphpipe.planning.piper`).
    device: a preset name of `graphpipe.costs.PRESETS` or a `DeviceSpec`;
      used when `cost_model` is None.
    cost_model: times of nodes and communication; default the analytic
      model of `device`.
    memory_bytes: per-device budget; default the cost model's capacity.
    micro_batch_sizes: sizes to search; default every power of two that
      divides `batch_size`.
    per_stage_micro_batches: let GraphPipe's stages take micro-batches a
      power of two larger than their predecessors' where the estimate
      gains (`graphpipe.planning.micro_batches`). The simulator times such
      plans and `graphpipe.Trainer` runs them. Off by default, as in the
      paper (an optional extension).
    piper_budget: stages Piper may price before it gives up (its search
      is exponential in the number of parallel branches).
    memory_kinds: the kinds of `graphpipe.core.memory.KINDS` that
      `memory_bytes` bounds (default all: what the runtime's step holds on
      each device, `graphpipe.core.memory.plan_memory`).
    padding_tolerance: how much slower (a share of the fastest simulated
      plan's time) a plan whose devices hold less padding may be and still
      win; default `PADDING_TOLERANCE` (0.05). 0 ranks by time alone.
    max_padding: a hard limit on the plan's `padding_fraction` (parameter
      and optimizer bytes devices hold beyond their own stage's, a share of
      all they hold): the fastest plan within it, data-parallel copies of
      the whole model included. None: no limit.

  Raises:
    PlanError: no plan fits (the message names the smallest per-device
      memory, or device count, that would), Piper ran out of budget, bad
      arguments.
  """
  start = time.perf_counter()
  if padding_tolerance is None:
    padding_tolerance = PADDING_TOLERANCE
  check_arguments(
    graph, num_devices, batch_size, planner, padding_tolerance, max_padding
  )
  if cost_model is None:
    spec = device_spec(device) if isinstance(device, str) else device
    cost_model = AnalyticCostModel(spec)
  device_name = device if isinstance(device, str) else device.name
  if memory_bytes is None:
    memory_bytes = cost_model.memory_bytes
  if not isinstance(memory_bytes, int | float) or not memory_bytes > 0:
    raise PlanError(
      f"memory_bytes must be a number > 0 (per device), got {memory_bytes!r}"
    )
  sizes = searched_sizes(batch_size, micro_batch_sizes)
  per_stage = per_stage_micro_batches and planner == "graphpipe"
  best = _search(
    graph,
    num_devices,
    batch_size,
    planner,
    cost_model,
    memory_bytes,
    sizes,
    per_stage=per_stage,
    piper_budget=piper_budget,
    memory_kinds=memory_kinds,
    padding_tolerance=padding_tolerance,
    max_padding=max_padding,
  )
  if best is None:
    # The partitioners bound memory conservatively (non-series-parallel
    # graphs count dummy dependencies in their in-flight counts), so a plan
    # searched without the limit may fit where the bounded search found
    # none (tests/graphpipe/test_random_graphs.py found such graphs).
    args = (graph, num_devices, batch_size, planner, cost_model)
    options = {"padding_tolerance": padding_tolerance}
    unlimited = _search(
      *args, math.inf, sizes, **options, max_padding=max_padding
    )
    if unlimited is not None and (
      plan_memory(graph, unlimited).largest_of(memory_kinds) <= memory_bytes
    ):
      best = unlimited
    elif max_padding is not None and (
      _search(
        *args,
        memory_bytes,
        sizes,
        memory_kinds=memory_kinds,
        feasible_only=True,
      )
      is not None
    ):
      raise _padding_error(
        *args, memory_bytes, sizes, max_padding, memory_kinds
      )
    else:
      if max_padding is not None:
        unlimited = _search(*args, math.inf, sizes, **options)
      raise _no_plan_error(*args, memory_bytes, sizes, unlimited)
  return dataclasses.replace(
    best,
    device=device_name,
    search_time_s=time.perf_counter() - start,
    graph=graph,
  )


def _partitioner(
  graph: OpGraph, planner: str, costs: StageCosts, piper_budget: int
) -> Callable[[int], list[Partition]]:
  if planner == "graphpipe":
    return GraphPipePartitioner(graph, costs)
  if planner == "sequential":
    return baselines.SequentialPartitioner(graph, costs)
  if planner == "piper":
    return PiperPartitioner(graph, costs, piper_budget)
  return baselines.GPipePartitioner(graph, costs)


def _search(
  graph,
  num_devices,
  batch_size,
  planner,
  cost_model,
  memory_bytes,
  sizes,
  per_stage: bool = False,
  piper_budget: int = PIPER_BUDGET,
  memory_kinds: Sequence[str] = KINDS,
  padding_tolerance: float = PADDING_TOLERANCE,
  feasible_only: bool = False,
  max_padding: float | None = None,
) -> Plan | None:
  """The fastest candidate plan (see the module docstring), or None.

  With `feasible_only`, the best-estimated candidate as soon as the
  partitioners' candidates are priced (no local search, no simulation):
  None exactly when the full search gives None, for feasibility checks.
  With `max_padding`, candidates whose padding fraction is over it do not
  count, and data-parallel copies of the whole model are candidates too.
  """
  costs = StageCosts(graph, cost_model, batch_size, num_devices, memory_bytes)
  partitioners = [_partitioner(graph, planner, costs, piper_budget)]
  if max_padding is not None and planner == "graphpipe":
    # A chain is a graph pipeline too: under a padding limit the even
    # chains of the sequential DP are often the only plans that meet it.
    partitioners.append(baselines.SequentialPartitioner(graph, costs))
  fingerprint = graph_fingerprint(graph)
  timing = NodeTimes(cost_model)
  candidates: dict[Partition, tuple | None] = {}

  def evaluate(part: Partition) -> tuple | None:
    """(estimate, in flight at the source, -b, plan), None if over memory."""
    if part not in candidates:
      p = assemble(graph, part, costs, planner, fingerprint)
      fits = all(
        costs.in_flight_capacity(s.nodes, s.micro_batch_size, len(s.devices))
        >= s.in_flight
        for s in p.stages
      )
      candidates[part] = None
      # Every device holds what the largest stage needs (SPMD): the
      # runtime's per-device figure, not each stage's own, must fit.
      if fits:
        memory = plan_memory(graph, p)
        fits = memory.largest_of(memory_kinds) <= costs.memory_bytes
        if max_padding is not None:
          fits = fits and memory.padding_fraction <= max_padding
      if fits:
        estimate = estimate_iteration_time(p, graph, timing)
        candidates[part] = (
          estimate,
          p.stages[0].in_flight,
          -p.micro_batch_size,
          p,
        )
    return candidates[part]

  for b, partition in itertools.product(sizes, partitioners):
    for part in partition(b):
      if part.schedule == "1f1b":
        spent = spend_spare_devices(graph, part, costs)
        # Replicas hold their gradient sums: the partition as the DP gave
        # it (spare devices idle) may fit where the spent one does not.
        if evaluate(spent) is not None:
          continue
      evaluate(part)
  whole = (tuple(range(len(graph.nodes))), 1)
  if max_padding is not None:
    # No padding at all: the whole model on k devices, data parallel.
    for b in sizes:
      for k in range(1, num_devices + 1):
        if num_devices % k == 0 and b % k == 0:
          evaluate(Partition(((whole[0], k),), b))
  if not any(c is not None for c in candidates.values()):
    # Every device holds what the largest stage needs, and replicas hold
    # their gradient sums: where no pipeline fits, the whole model on one
    # device (the others idle) still may, and every planner can make it.
    schedule = "gpipe" if planner == "gpipe" else "1f1b"
    for b in sizes:
      evaluate(Partition((whole,), b, schedule=schedule))
  ranked = sorted(
    ((c[:3], part) for part, c in candidates.items() if c is not None),
    key=lambda x: x[0],
  )
  if not ranked:
    return None
  if feasible_only:
    return candidates[ranked[0][1]][3]
  # The DPs rank by the bottleneck; with few micro-batches, fill, drain and
  # the last optimizer step matter too: local search from the best plan of
  # each of the best few micro-batch sizes (near-copies of one plan would
  # all lead to the same place).
  by_size: dict[int, Partition] = {}
  for _, part in ranked:
    by_size.setdefault(part.micro_batch_size, part)
  starts = list(by_size.values())[:_REFINED]
  # Fewer sizes than starts (e.g. one size asked for): the next best plans
  # (of other estimates) start too.
  seen = {round(candidates[p][0], 12) for p in starts}
  for key, part in ranked:
    if len(starts) >= _REFINED:
      break
    if round(key[0], 12) not in seen:
      seen.add(round(key[0], 12))
      starts.append(part)

  def estimated(part: Partition) -> float | None:
    found = evaluate(part)
    return None if found is None else found[0]

  for part in starts:
    if part.schedule != "1f1b":
      continue
    refined = refine(
      graph,
      part,
      num_devices,
      estimated,
      lambda nodes, k, b=part.micro_batch_size: costs.microbatch_time(
        nodes, b, k
      ),
    )
    if per_stage:
      # Per-stage sizes (GraphPipe's extension): grow them from the
      # uniform plans found so far.
      for uniform in dict.fromkeys([part, refined]):
        grow_micro_batches(graph, uniform, batch_size, estimated)
  found = sorted(
    (c for c in candidates.values() if c is not None), key=lambda c: c[:3]
  )
  # The estimate is a few percent under the event simulation at most
  # (rarely a little over): simulate the schedule each plan will run, best
  # estimate first, until the next estimate is no better than the fastest
  # simulated plan (or the simulation budget is spent).
  # Plans within `padding_tolerance` of the fastest are simulated too: of
  # those, the one whose devices hold the least padding wins (every device
  # holds slots the size of the largest stage's parameters).
  best, budget, timed, close = None, _SIMULATED_ACTIONS, set(), []
  slack = 1.0  # 1 + padding_tolerance once the fastest plan pads much
  for c in found:
    if best is not None and (
      c[0] >= best[0] * slack or len(timed) == _SIMULATED_PLANS
    ):
      break
    # Plans the estimate cannot tell apart (mirror images: the same stages
    # on other branches or devices) are simulated once.
    twin = round(c[0], 12)
    actions = 2 * c[3].num_microbatches * c[3].num_stages
    if best is not None and (actions > budget or twin in timed):
      continue
    timed.add(twin)
    budget -= actions
    seconds = simulate(c[3], graph, cost_model).iteration_time_s
    close.append((seconds, *c[1:]))
    if best is None or (seconds, *c[1:3]) < best[:3]:
      best = (seconds, *c[1:])
      padding = sum(plan_memory(graph, c[3]).padding_bytes)
      heavy = padding >= PADDING_MIN_BYTES * c[3].num_devices
      slack = 1 + padding_tolerance if heavy else 1.0
  if slack == 1.0:  # else padding to 0.01, then time
    return best[3]
  return min(
    (c for c in close if c[0] <= best[0] * slack),
    key=lambda c: (round(plan_memory(graph, c[3]).padding_fraction, 2), c[:3]),
  )[3]


def _padding_error(
  graph, devices, batch, planner, model, memory, sizes, max_padding, kinds
) -> PlanError:
  """Says the least padding a plan that fits can have (bisected to 0.02)."""
  low, high, least = max_padding, 1.0, None
  while high - low > 0.02:
    middle = (low + high) / 2
    found = _search(
      graph,
      devices,
      batch,
      planner,
      model,
      memory,
      sizes,
      memory_kinds=kinds,
      feasible_only=True,
      max_padding=middle,
    )
    if found is None:
      low = middle
    else:
      high, least = middle, plan_memory(graph, found).padding_fraction
  reach = f"{least:.3f}" if least is not None else f"over {low:.2f}"
  return PlanError(
    f"no {planner} plan for {graph.model or 'the graph'} on {devices} "
    f"devices (batch {batch}) has a padding fraction <= {max_padding:g}: "
    f"the least padded of its candidates within memory has {reach} "
    "(searched to 0.02). "
    "Every device holds slots the size of the largest stage's parameters "
    "and optimizer state; raise max_padding, use fewer or more devices "
    "(stages of more even size), or a budget that fits the whole model "
    "data parallel."
  )


def _unbounded_fit(graph, devices, batch, planner, model, memory, sizes):
  """The plan searched without a memory limit, if it fits `memory`."""
  found = _search(graph, devices, batch, planner, model, math.inf, sizes)
  fits = found is not None and _peak_memory(found, graph) <= memory
  return found if fits else None


def _no_plan_error(
  graph, devices, batch, planner, model, memory, sizes, unlimited
):
  """Says what memory (or how many devices) would have allowed a plan;
  `unlimited` is the plan searched without a memory limit (or None)."""
  gib = 2**30
  if unlimited is None:
    return PlanError(
      f"no {planner} plan exists for {devices} devices even without a "
      "memory limit (internal: every stage time was infinite)"
    )
  # Bisect the per-device memory to 1% (a budget over the unlimited plan's
  # peak fits: `plan` falls back to that plan).
  low, high = float(memory), _peak_memory(unlimited, graph)
  while high > low * 1.01:
    middle = math.sqrt(low * high)
    found = _search(
      graph, devices, batch, planner, model, middle, sizes, feasible_only=True
    )
    low, high = (low, middle) if found is not None else (middle, high)
  more, more_devices = None, devices
  while more is None and more_devices < min(4 * devices, 64):
    more_devices = min(2 * more_devices, 64)
    args = (graph, more_devices, batch, planner, model, memory, sizes)
    feasible = _search(*args, feasible_only=True) is not None
    if feasible or _unbounded_fit(*args) is not None:
      more = more_devices
  hint = f", or use at least {more} devices" if more else ""
  return PlanError(
    f"no {planner} plan for {graph.model or 'the graph'} fits "
    f"{memory / gib:.3g} GiB per device on {devices} devices "
    f"(batch {batch}, micro-batches {sizes}): the smallest per-device "
    f"memory that fits is about {high / gib:.3g} GiB; raise memory_bytes "
    f"or pick a device with more memory{hint}. Without a limit, "
    + over_budget_message(
      graph, unlimited, plan_memory(graph, unlimited), memory
    )
  )


def _peak_memory(p: Plan, graph: OpGraph) -> float:
  return plan_memory(graph, p).largest
