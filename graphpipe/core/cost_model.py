"""`CostModel`: what planners and the simulator ask of a cost model.

Implementations live in `graphpipe.costs` (analytic, profiled); any object
with these members works.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from graphpipe.core.graph import Node


class CostModel(Protocol):
  """What planners and the simulator ask of a cost model (all in seconds)."""

  memory_bytes: float  # capacity of one device

  def node_time(self, node: Node, batch: int, kind: str) -> float:
    """Compute time of `node` on `batch` samples; kind is 'fwd' or 'bwd'."""
    ...

  def transfer_time(self, num_bytes: float, src: int, dst: int) -> float:
    """Point-to-point time to move `num_bytes` from device src to dst."""
    ...

  def allreduce_time(self, num_bytes: float, devices: Sequence[int]) -> float:
    """Time of an all-reduce of `num_bytes` over `devices`."""
    ...

  def optimizer_time(self, param_bytes: float) -> float:
    """Time of the optimizer update of `param_bytes` of parameters."""
    ...

  # Optional: `gradient_add_time(num_bytes)`, one micro-batch's gradient
  # added to accumulated slots of `num_bytes` (the runtime does it at every
  # backward); `simulate(..., lockstep=True)` asks for it.


_MEMBERS = (
  "memory_bytes",
  "node_time",
  "transfer_time",
  "allreduce_time",
  "optimizer_time",
)


def check_cost_model(cost_model, error) -> None:
  """Raises `error` unless `cost_model` has the members of `CostModel`
  (a preset's name given where a model is expected failed later with an
  AttributeError from inside the planner or the simulator)."""
  missing = [m for m in _MEMBERS if not hasattr(cost_model, m)]
  if missing:
    raise error(
      f"cost_model must be a cost model (e.g. graphpipe.costs."
      f"AnalyticCostModel(device_spec('v100'))), got {cost_model!r} "
      f"without {', '.join(missing)}; a preset's name goes to device="
    )
