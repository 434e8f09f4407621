"""Pieces several experiments share."""

from graphpipe.errors import GraphpipeError
from graphpipe.graph import OpGraph
from graphpipe.plan import Plan
from graphpipe.planner import plan


def tightest_plan(
  graph: OpGraph,
  num_devices: int,
  batch_size: int,
  planner: str,
  device="v100",
  steps: int = 18,
) -> Plan:
  """The planner's plan under the smallest per-device memory that fits.

  Small models fit one device, so a planner happily replicates them; under
  the tightest memory budget it must cut them into as many stages as a real
  model of their shape would need. Experiments and tests use this to run
  real pipelines on tiny models. Binary search over the budget (feasibility
  grows with memory).

  Args:
    graph: the operator graph.
    num_devices: devices the plan may use.
    batch_size: the mini-batch.
    planner: 'graphpipe', 'sequential' or 'gpipe'.
    device: the device preset or spec the planner costs with.
    steps: bisection steps.
  """
  best = plan(graph, num_devices, batch_size, planner=planner, device=device)
  low, high = 1.0, 8.0 * graph.totals()["param_bytes"] + 1e6
  for _ in range(steps):
    middle = (low + high) / 2
    try:
      best = plan(
        graph,
        num_devices,
        batch_size,
        planner=planner,
        device=device,
        memory_bytes=middle,
      )
      high = middle
    except GraphpipeError:
      low = middle
  return best
