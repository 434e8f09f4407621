"""graphpipe: graph pipeline parallelism for JAX / Flax.

graph = graphpipe.capture(loss_fn, model, batch)   # an operator DAG
print(graph)                                       # node table
"""

from graphpipe import models
from graphpipe.capture import capture
from graphpipe.errors import (
  CaptureError,
  GraphCutError,
  GraphFormatError,
  GraphpipeError,
)
from graphpipe.graph import Edge, InputSpec, Node, OpGraph
from graphpipe.plan import Plan, Stage
from graphpipe.planner import PlanError, plan
from graphpipe.runtime import Trainer, TrainState
from graphpipe.schedule import Schedule, check_schedule, schedule_for
from graphpipe.simulate import simulate

__all__ = [
  "CaptureError",
  "Edge",
  "GraphCutError",
  "GraphFormatError",
  "GraphpipeError",
  "InputSpec",
  "Node",
  "OpGraph",
  "Plan",
  "PlanError",
  "Schedule",
  "Stage",
  "TrainState",
  "Trainer",
  "capture",
  "check_schedule",
  "models",
  "plan",
  "schedule_for",
  "simulate",
]
