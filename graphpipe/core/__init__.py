"""The data types every layer shares; plain Python, no JAX.

graph     `OpGraph`, `Node`, `Edge`, `InputSpec`: the operator DAG
stages    `Plan`, `Stage`, `in_flight_counts`: the stage DAG
memory    `stage_memory_bytes`: the memory rule
cost_model  `CostModel`: what planners and the simulator ask of costs
fingerprint `graph_fingerprint`: ties plans and profiles to a graph
"""

from graphpipe.core.cost_model import CostModel
from graphpipe.core.fingerprint import graph_fingerprint
from graphpipe.core.graph import Edge, InputSpec, Node, OpGraph
from graphpipe.core.memory import DEFAULT_OPTIMIZER_SLOTS, stage_memory_bytes
from graphpipe.core.stages import Plan, Stage, in_flight_counts

__all__ = [
  "DEFAULT_OPTIMIZER_SLOTS",
  "CostModel",
  "Edge",
  "InputSpec",
  "Node",
  "OpGraph",
  "Plan",
  "Stage",
  "graph_fingerprint",
  "in_flight_counts",
  "stage_memory_bytes",
]
