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
