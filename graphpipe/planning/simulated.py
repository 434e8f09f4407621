"""`plan_and_simulate`: plan a graph, schedule the plan, simulate it.

The three steps most experiments and notebooks take together, with the
same cost model throughout (analytic, or node times profiled on this
machine's device).
"""

from __future__ import annotations

from graphpipe.core.graph import OpGraph
from graphpipe.core.stages import Plan
from graphpipe.costs import AnalyticCostModel, DeviceSpec, ProfiledCostModel
from graphpipe.costs.analytic import spec_of
from graphpipe.errors import PlanError
from graphpipe.planning.search import plan
from graphpipe.schedules.builders import schedule_for
from graphpipe.schedules.grid import Schedule
from graphpipe.simulator.engine import Report, simulate


def plan_and_simulate(
  graph: OpGraph,
  *,
  num_devices: int,
  batch_size: int,
  planner: str = "graphpipe",
  device: str | DeviceSpec = "v100",
  profiled: bool = False,
  **plan_options,
) -> tuple[Plan, Schedule, Report]:
  """Plans `graph`, builds the plan's schedule and simulates one iteration.

  Example:
    >>> graph = capture_zoo("two_branch", "tiny")
    >>> p, schedule, report = plan_and_simulate(
    ...   graph, num_devices=4, batch_size=8, planner="graphpipe",
    ...   device="v100")
    >>> report.iteration_time_s > 0
    True

  Args:
    graph: the captured model.
    num_devices: devices the plan may use.
    batch_size: samples per iteration.
    planner: one of `PLANNERS`.
    device: a device preset of `graphpipe.costs` ('v100', 'a100', ...) or
      a `DeviceSpec`.
    profiled: time every node on this machine's device (cached on disk)
      instead of the analytic estimate; the preset still gives links,
      memory and the optimizer. Meaningful when the preset describes the
      device at hand (e.g. 'cpu' here, 'h200' on an H200).
    **plan_options: more options of `graphpipe.plan` (e.g.
      `padding_tolerance`, `per_stage_micro_batches`), not `cost_model`.
  """
  if "cost_model" in plan_options:
    # plan() was handed it twice (a raw TypeError).
    raise PlanError(
      "plan_and_simulate builds its cost model from device= and "
      "profiled=; to plan with a cost model of your own, call "
      "graphpipe.plan(..., cost_model=) and graphpipe.simulate"
    )
  cost_model = AnalyticCostModel(spec_of(device))
  if profiled:
    cost_model = ProfiledCostModel(graph, cost_model)
  chosen = plan(
    graph,
    num_devices,
    batch_size,
    planner=planner,
    device=device,
    cost_model=cost_model,
    **plan_options,
  )
  schedule = schedule_for(chosen)
  return chosen, schedule, simulate(chosen, graph, cost_model, schedule)
