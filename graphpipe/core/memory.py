"""The memory rule: what one device of a stage holds.

Planners, the simulator and the runtime's reports count the same bytes.
"""

from __future__ import annotations

from collections.abc import Sequence

from graphpipe.core.graph import OpGraph

# Adam keeps two fp32 moments per parameter; with the weights and their
# gradients a parameter costs four times its own bytes.
DEFAULT_OPTIMIZER_SLOTS = 2


def stage_memory_bytes(
  graph: OpGraph,
  nodes: Sequence[int],
  micro_batch_per_device: float,
  in_flight: int,
  optimizer_slots: int = DEFAULT_OPTIMIZER_SLOTS,
) -> float:
  """Peak bytes one device of a stage holds.

  Weights, gradients and optimizer slots of the stage's parameters (each a
  copy of the parameter bytes), its non-trainable state, and the saved
  activations of `in_flight` micro-batches of `micro_batch_per_device`
  samples. Every device of a data-parallel stage holds a full replica.
  """
  params = sum(graph.nodes[i].param_bytes for i in nodes)
  state = sum(graph.nodes[i].state_bytes for i in nodes)
  saved = sum(
    graph.nodes[i].cost("saved_bytes", micro_batch_per_device) for i in nodes
  )
  return params * (2 + optimizer_slots) + state + saved * in_flight
