"""graphpipe: graph pipeline parallelism for JAX / Flax.

  graph = graphpipe.capture(loss_fn, model, batch)   # an operator DAG
  plan = graphpipe.plan(graph, num_devices=8, batch_size=64)
  report = graphpipe.simulate(plan, graph)           # samples/s, memory
  trainer = graphpipe.Trainer(plan, optax.adam(1e-3))

The package is layered, lowest first; a layer imports only those below it:
`core` (graph and plan data types), `frontend` (capture), `costs` (cost
models), `schedules`, `simulator`, `planning`, `runtime`. The model zoo,
`graphpipe.models`, sits beside them and is not imported here.

Docstring examples assume `import graphpipe, jax, optax`, `import jax.numpy
as jnp`, `import numpy as np`, `from flax import nnx` and `from
graphpipe.models import capture_zoo` (tests/graphpipe/test_docstrings.py
runs them all).
"""

from graphpipe.core.drawing import draw_graph
from graphpipe.core.graph import Edge, InputSpec, Node, OpGraph
from graphpipe.core.stages import Plan, Stage
from graphpipe.errors import (
  CaptureError,
  CostModelError,
  DecompositionError,
  GraphCutError,
  GraphError,
  GraphFormatError,
  GraphpipeError,
  LaunchError,
  ModelConfigError,
  NodeNotFoundError,
  PipelineRuntimeError,
  PlanError,
  PlotsUnavailableError,
  ProcessLostError,
  ScheduleError,
  SimulationError,
)
from graphpipe.frontend.tracer import capture
from graphpipe.planning.search import PLANNERS, plan
from graphpipe.planning.simulated import plan_and_simulate
from graphpipe.planning.splits import fastest_split
from graphpipe.planning.tightest import tightest_plan
from graphpipe.planning.validate import check_plan
from graphpipe.runtime import Trainer, TrainState
from graphpipe.runtime.memory import memory_report
from graphpipe.schedules.builders import schedule_for
from graphpipe.schedules.checker import check_schedule
from graphpipe.schedules.grid import Action, Schedule
from graphpipe.simulator.engine import Report, simulate

__all__ = [
  "PLANNERS",
  "Action",
  "CaptureError",
  "CostModelError",
  "DecompositionError",
  "Edge",
  "GraphCutError",
  "GraphError",
  "GraphFormatError",
  "GraphpipeError",
  "InputSpec",
  "LaunchError",
  "ModelConfigError",
  "Node",
  "NodeNotFoundError",
  "OpGraph",
  "PipelineRuntimeError",
  "Plan",
  "PlanError",
  "PlotsUnavailableError",
  "ProcessLostError",
  "Report",
  "Schedule",
  "ScheduleError",
  "SimulationError",
  "Stage",
  "TrainState",
  "Trainer",
  "capture",
  "check_plan",
  "check_schedule",
  "draw_graph",
  "fastest_split",
  "memory_report",
  "plan",
  "plan_and_simulate",
  "schedule_for",
  "simulate",
  "tightest_plan",
]
