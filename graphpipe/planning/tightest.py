"""`tightest_plan`: a planner's plan under the smallest memory that fits.

Small models fit one device, so a planner would replicate them; under the
tightest per-device budget it cuts them into as many stages as a real model
of their shape would need. Experiments and tests use it to run real
pipelines on tiny models.
"""

from __future__ import annotations

import math

from graphpipe.core.graph import OpGraph
from graphpipe.core.memory import KINDS, SHAPE_KINDS, plan_memory
from graphpipe.core.stages import Plan
from graphpipe.costs import AnalyticCostModel, DeviceSpec
from graphpipe.costs.analytic import spec_of
from graphpipe.errors import PlanError
from graphpipe.planning.arguments import check_arguments, searched_sizes
from graphpipe.planning.engine import fits, unlimited_plan
from graphpipe.planning.piper import PIPER_BUDGET
from graphpipe.planning.search import plan

__all__ = ["tightest_plan"]


def tightest_plan(
  graph: OpGraph,
  num_devices: int,
  batch_size: int,
  planner: str = "graphpipe",
  device: str | DeviceSpec = "v100",
  steps: int = 18,
  piper_budget: int = PIPER_BUDGET,
) -> Plan:
  """The planner's plan under the smallest per-device memory that fits.

  Small models fit one device, so a planner happily replicates them; under
  the tightest memory budget it must cut them into as many stages as a real
  model of their shape would need. The budget bounds the kinds of memory
  that grow with a model and its micro-batches (weights, their gradients
  and optimizer state, stashes, transient work:
  `graphpipe.core.memory.SHAPE_KINDS`): the step's fixed bookkeeping (tick
  tables, channels, the batch) dominates a tiny model and says nothing
  about its shape. Experiments and tests use this to run
  real pipelines on tiny models. Binary search over the budget (feasibility
  grows with memory).

  Example:
    >>> graph = capture_zoo("two_branch", "tiny")
    >>> tightest_plan(graph, 8, 8).num_stages > 1
    True

  Args:
    graph: the operator graph.
    num_devices: devices the plan may use.
    batch_size: the mini-batch.
    planner: one of `PLANNERS`.
    device: the device preset or spec the planner costs with.
    steps: bisection steps.
    piper_budget: stages Piper may price per search before it gives up.
  """
  check_arguments(
    graph, num_devices, batch_size, planner, 0.0, None, KINDS, piper_budget
  )
  if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
    # 0 or fewer bisection steps returned the unconstrained plan.
    raise PlanError(f"steps must be an int >= 1, got {steps!r}")
  num_devices, batch_size = int(num_devices), int(batch_size)
  kwargs = {"planner": planner, "device": device, "piper_budget": piper_budget}
  # Feasibility as `plan` decides it, without building its error message.
  model = AnalyticCostModel(spec_of(device))
  args = (graph, num_devices, batch_size, planner, model)
  sizes = searched_sizes(batch_size, None, graph)
  unlimited = unlimited_plan(*args, sizes, piper_budget)
  peak = math.inf
  if unlimited is not None:
    peak = float(plan_memory(graph, unlimited).largest_of(SHAPE_KINDS))
  high = peak if math.isfinite(peak) else 8.0 * graph.totals()["param_bytes"]
  low, high, found = 1.0, high + 1e6, False
  for _ in range(steps):
    middle = (low + high) / 2
    if peak <= middle or fits(*args, middle, sizes, SHAPE_KINDS, piper_budget):
      high, found = middle, True
    else:
      low = middle
  if not found:
    return plan(graph, num_devices, batch_size, **kwargs)
  return plan(
    graph,
    num_devices,
    batch_size,
    memory_bytes=high,
    memory_kinds=SHAPE_KINDS,
    **kwargs,
  )
