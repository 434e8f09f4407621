"""A lower bound on the simulated iteration time of every plan of a graph.

  floor = iteration_floor(graph, batch_size, num_devices, cost_model)
  floor.seconds, floor.node, floor.devices

Whatever the plan, each node sits in a stage on some k devices, and those
devices do, one after another (`graphpipe.simulate`'s event model): the
node's forward and backward over their share of the batch, the stage's
all-reduce (k > 1) and its optimizer step, both over at least the node's
parameters (the step over a k-th of them where plans may take ZeRO-1
stages, which split the update: `shardings`). The bound takes, for every
node, the fewest seconds that costs over k = 1 .. num_devices (the k
devices placed as close as they can be, the whole batch as one
micro-batch, nothing else in the stage), and the
largest of these over the nodes. No plan the simulator times under the
same cost model is faster, provided a node's time per sample does not grow
with the batch (true of the analytic presets, whose efficiency rises with
the batch; `tests/graphpipe/test_random_graphs.py` checks the bound on
every plan it draws). It is what one layer alone forces, e.g. the wide
layer after CANDLE-Uno's concatenation, so it caps what any planner can
gain over another.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

from graphpipe.core.cost_model import CostModel
from graphpipe.core.graph import OpGraph
from graphpipe.errors import GraphpipeError


@dataclasses.dataclass(frozen=True)
class Floor:
  """The bound and the node that sets it.

  Attributes:
    seconds: no plan's simulated iteration is shorter.
    node: the name of the node that sets it.
    devices: the device count at which that node costs least.
  """

  seconds: float
  node: str
  devices: int


def node_floor(
  graph: OpGraph,
  node_id: int,
  batch_size: int,
  num_devices: int,
  cost_model: CostModel,
  shardings: Sequence[str] = ("replicated",),
) -> tuple[float, int]:
  """(seconds, devices): the least a stage holding node `node_id` takes
  (with the layouts `shardings` allows, `graphpipe.plan`'s
  `stage_shardings`).

  Example:
    >>> from graphpipe.costs import AnalyticCostModel, device_spec
    >>> graph = capture_zoo("candle_uno", "paper")
    >>> v100 = AnalyticCostModel(device_spec("v100"))
    >>> head = next(n.id for n in graph.nodes if n.name == "head.layers.0")
    >>> seconds, devices = node_floor(graph, head, 1024, 32, v100)
    >>> round(seconds * 1e3, 1), devices  # ms at the batch of 32 devices
    (34.6, 4)
    >>> node_floor(graph, head, 1024, 32, v100, ("replicated", "zero1"))[0]
    0.0312...
  """
  node = graph.nodes[node_id]
  params = node.param_bytes
  best = (math.inf, 1)
  zero = "zero1" in shardings
  for k in range(1, num_devices + 1):
    share = batch_size / k
    seconds = cost_model.node_time(node, share, "fwd")
    seconds += cost_model.node_time(node, share, "bwd")
    if params > 0:
      if k > 1:
        seconds += cost_model.allreduce_time(params, tuple(range(k)))
      # (ZeRO-1 splits the update over the k devices)
      seconds += cost_model.optimizer_time(params / (k if zero else 1))
    best = min(best, (seconds, k))
  return best


def iteration_floor(
  graph: OpGraph,
  batch_size: int,
  num_devices: int,
  cost_model: CostModel,
  shardings: Sequence[str] = ("replicated",),
) -> Floor:
  """The module's bound: no plan of `graph` simulates faster.

  Args:
    graph: the operator graph.
    batch_size: samples per iteration.
    num_devices: devices a plan may use.
    cost_model: the cost model the plans are simulated with.
    shardings: the stage layouts plans may take (`graphpipe.plan`'s
      `stage_shardings`).
  """
  if batch_size < 1 or num_devices < 1:
    raise GraphpipeError(
      f"iteration_floor needs batch_size >= 1 and num_devices >= 1, got "
      f"{batch_size} and {num_devices}"
    )
  best = Floor(0.0, "", 1)
  for node in graph.nodes:
    seconds, devices = node_floor(
      graph, node.id, batch_size, num_devices, cost_model, shardings
    )
    if seconds > best.seconds:
      best = Floor(seconds, node.name, devices)
  return best
