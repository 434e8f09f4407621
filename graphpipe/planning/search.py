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
they shorten the iteration (for GraphPipe also, as another candidate, to
the branches a stage grouped, which then run apart: `assemble.
split_branches`), places stages on devices, derives stage edges
and in-flight counts, ranks every candidate by `estimate_iteration_time`,
runs a local search (`graphpipe.planning.refine`) from the best plan of
the best few micro-batch sizes, and finally simulates candidates best
estimate first (`graphpipe.simulate`, the schedule each plan will run)
until the next estimate is no better than the fastest simulated plan.

The search itself is `graphpipe.planning.engine.run_search`; the errors
when nothing fits are in `graphpipe.planning.no_plan`. `tightest_plan`
(the plan under the smallest memory that fits, to make
small models really pipeline) is in `graphpipe.planning.tightest`,
`plan_and_simulate` in `graphpipe.planning.simulated`.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Sequence

from graphpipe.core.cost_model import CostModel, check_cost_model
from graphpipe.core.graph import OpGraph
from graphpipe.core.memory import KINDS, plan_memory
from graphpipe.core.stages import Plan
from graphpipe.costs import AnalyticCostModel, DeviceSpec, device_spec
from graphpipe.costs.analytic import PRESETS, spec_of
from graphpipe.errors import PlanError
from graphpipe.planning import engine
from graphpipe.planning.arguments import (
  PLANNERS,
  check_arguments,
  check_memory_bytes,
  check_shardings,
  searched_sizes,
)
from graphpipe.planning.engine import fits, run_search
from graphpipe.planning.no_plan import no_plan_error, padding_error
from graphpipe.planning.piper import PIPER_BUDGET

__all__ = ["PLANNERS", "plan"]


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
  stage_shardings: Sequence[str] = ("replicated",),
  lockstep: bool = False,
) -> Plan:
  """A stage graph for `graph` on `num_devices` devices.

  Example:
    >>> graph = capture_zoo("two_branch", "paper")   # the case study
    >>> p = plan(graph, num_devices=8, batch_size=8)
    >>> print(p)                  # stages, devices, micro-batch, in flight
    Plan[graphpipe] 3 stages, depth 2, b=4 x 2 micro-batches, 8 devices,
    schedule 1f1b
      stage 0: nodes [0, 1, 2] on devices [4, 5], b=4, in flight 2
      stage 1: nodes [4, 5, 6, 7] on devices [0, 1, 2, 3], b=4, in flight 2
      stage 2: nodes [3, 8] on devices [6, 7], b=4, in flight 1
      edges: [(0, 2), (1, 2)]
    >>> [len(s.nodes) for s in plan(graph, 8, 8, planner="sequential").stages]
    [4, 5]

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
      win; default `graphpipe.planning.engine.PADDING_TOLERANCE` (0.015).
      0 ranks by time alone.
    max_padding: a hard limit on the plan's `padding_fraction` (parameter
      and optimizer bytes devices hold beyond their own stage's, a share of
      all they hold): the fastest plan within it, data-parallel copies of
      the whole model included. None: no limit.
    stage_shardings: the layouts a stage may take
      (`graphpipe.core.stages.SHARDINGS`), the same for every planner:
      ('replicated',) as in the paper, or ('replicated', 'zero1') to let
      every stage on several devices shard its optimizer state (ZeRO-1,
      `graphpipe.runtime.zero`: a k-th of the optimizer state per device
      for the same communication, so such stages always take it, and the
      search counts the memory it frees).
    lockstep: choose among the simulated candidates by how
      `graphpipe.runtime` steps them (`simulate(..., lockstep=True)`: tick
      by tick, every backward adding gradients to slots the size of the
      largest stage's) instead of by the paper's asynchronous pipeline.
      The candidates and the local search are the same; the cost model
      needs `gradient_add_time`. Off by default, as in the paper.

  Raises:
    PlanError: no plan fits (the message names the smallest per-device
      memory, or device count, that would), no plan within memory meets
      `max_padding` (the message names the least padding one reaches),
      Piper ran out of budget, bad arguments.
  """
  start = time.perf_counter()
  if padding_tolerance is None:
    padding_tolerance = engine.PADDING_TOLERANCE
  check_arguments(
    graph,
    num_devices,
    batch_size,
    planner,
    padding_tolerance,
    max_padding,
    memory_kinds,
    piper_budget,
  )
  shardings = check_shardings(stage_shardings)
  num_devices, batch_size = int(num_devices), int(batch_size)
  device_name = recorded_name(device)
  if cost_model is None:
    cost_model = AnalyticCostModel(spec_of(device))
  check_cost_model(cost_model, PlanError)
  if not isinstance(lockstep, bool):
    raise PlanError(f"lockstep must be True or False, got {lockstep!r}")
  if lockstep and not hasattr(cost_model, "gradient_add_time"):
    raise PlanError(
      "lockstep=True simulates the runtime's gradient adds: the cost model "
      "needs gradient_add_time(num_bytes) (AnalyticCostModel and "
      "ProfiledCostModel have it)"
    )
  if memory_bytes is None:
    memory_bytes = cost_model.memory_bytes
  check_memory_bytes(memory_bytes)
  per_stage = per_stage_micro_batches and planner == "graphpipe"

  def search():
    sizes = searched_sizes(batch_size, micro_batch_sizes, graph)
    best = run_search(
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
      shardings=shardings,
      lockstep=lockstep,
    )
    return sizes, best

  sizes, best = search_tracing_chosen(graph, num_devices, search)
  if best is None:
    # The partitioners bound memory conservatively (non-series-parallel
    # graphs count dummy dependencies in their in-flight counts), so a plan
    # searched without the limit may fit where the bounded search found
    # none (tests/graphpipe/test_random_graphs.py found such graphs).
    args = (graph, num_devices, batch_size, planner, cost_model)
    options = {
      "padding_tolerance": padding_tolerance,
      "piper_budget": piper_budget,
      "shardings": shardings,
      "lockstep": lockstep,
    }
    unlimited = run_search(
      *args, math.inf, sizes, **options, max_padding=max_padding
    )
    if unlimited is not None and (
      plan_memory(graph, unlimited).largest_of(memory_kinds) <= memory_bytes
    ):
      best = unlimited
    elif max_padding is not None and fits(
      *args, memory_bytes, sizes, memory_kinds, piper_budget, shardings
    ):
      raise padding_error(
        *args,
        memory_bytes,
        sizes,
        max_padding,
        memory_kinds,
        piper_budget,
        shardings,
      )
    else:
      if max_padding is not None:
        unlimited = run_search(*args, math.inf, sizes, **options)
      raise no_plan_error(
        *args,
        memory_bytes,
        sizes,
        unlimited,
        memory_kinds,
        piper_budget,
        shardings,
      )
  return dataclasses.replace(
    best,
    device=device_name,
    search_time_s=time.perf_counter() - start,
    graph=graph,
    cost_model=cost_model,
  )


def search_tracing_chosen(graph: OpGraph, num_devices: int, search):
  """`search()` -> (sizes, best plan or None), run as if the model traced
  at every size not yet refused, then made true: the chosen plan's chunk
  sizes are traced and a plan holding one that fails is searched again
  without it; where no plan is found, every size the search could have
  asked about is traced and, if one fails, searched again.

  Where the model traces at every size (every zoo model), the answer is
  the search's with every size traced beforehand, without the traces the
  plan never needed (a second each at paper size). Where it refuses a
  size the plan never holds it, but need not be the one a search that
  knew every refusal beforehand finds: that search's candidates never
  held the refused sizes, this one's did until they were chosen.
  """
  while True:
    with graph.assuming_traces():
      sizes, best = search()
    if best is not None:
      chunks = {s.micro_batch_size // len(s.devices) for s in best.stages}
      chunks |= {s.micro_batch_size for s in best.stages}
      if all([graph.traces_at(c) for c in sorted(chunks)]):
        return sizes, best
      continue
    asked = chunk_sizes(sizes, num_devices)
    if all([graph.traces_at(c) for c in asked]):
      return sizes, None


def chunk_sizes(sizes: Sequence[int], num_devices: int) -> list[int]:
  """Every chunk a search over micro-batch `sizes` may ask the model to
  trace at: b / k for each size b and each replica count k dividing it."""
  return sorted(
    {b // k for b in sizes for k in range(1, num_devices + 1) if b % k == 0}
  )


def recorded_name(device: str | DeviceSpec) -> str:
  """The device name a plan records: a preset's name, or for a spec that
  is not a preset (e.g. a preset with more memory) its name with
  ' (custom)', which no preset lookup mistakes for the preset.

  Example:
    >>> v100 = device_spec("v100")
    >>> recorded_name("v100"), recorded_name(v100)
    ('v100', 'v100')
    >>> recorded_name(dataclasses.replace(v100, memory_bytes=32 * 2**30))
    'v100 (custom)'
  """
  if isinstance(device, str):
    return device
  if not isinstance(device, DeviceSpec):
    raise PlanError(
      f"device must be a preset name ({', '.join(PRESETS)}) or a "
      f"DeviceSpec, got a {type(device).__name__}"
    )
  if device.name.lower() in PRESETS and device == device_spec(device.name):
    return device.name
  return f"{device.name} (custom)"
