"""Every error graphpipe raises, in one place.

Every error the package raises on bad input derives from `GraphpipeError`,
so callers can catch one class; each layer of the package has its own
subclass. Messages say what was wrong and what to do. Errors that callers
may reasonably catch as a builtin (a lookup that misses, a malformed value)
derive from that builtin too.
"""


class GraphpipeError(Exception):
  """Base class of every error graphpipe raises on bad input."""


# Data types (graphpipe.core).


class GraphError(GraphpipeError, ValueError):
  """An OpGraph that is not a valid DAG, or cannot do what was asked.

  E.g. edges that do not go forward, or running a graph loaded from JSON
  (it has no program).
  """


class NodeNotFoundError(GraphpipeError, KeyError):
  """A node or edge looked up by id or name is not in the graph."""


class GraphFormatError(GraphpipeError):
  """A saved graph or plan file is malformed or from another version."""


# Front end (graphpipe.frontend).


class CaptureError(GraphpipeError):
  """The model, loss or batch could not be traced into an operator graph."""


class GraphCutError(GraphpipeError):
  """The traced computation cannot be cut into more than one operator node."""


# Cost models (graphpipe.costs).


class CostModelError(GraphpipeError):
  """A device preset, profile or cost query that cannot be answered."""


# Schedules and the simulator.


class ScheduleError(GraphpipeError):
  """A plan cannot be scheduled, or a schedule breaks a pipeline rule."""


class SimulationError(GraphpipeError):
  """A plan, graph and schedule that do not fit together."""


class PlotsUnavailableError(GraphpipeError):
  """A figure was asked for but matplotlib (the `plots` extra) is missing."""


# Planning (graphpipe.planning).


class DecompositionError(GraphpipeError):
  """A graph that cannot be decomposed into a series-parallel tree."""


class PlanError(GraphpipeError):
  """No valid plan exists for the graph, devices, batch and memory given."""


# Runtime (graphpipe.runtime).


class PipelineRuntimeError(GraphpipeError):
  """A plan, schedule, graph or batch that the runtime cannot execute."""


class LaunchError(GraphpipeError):
  """Local worker processes could not be started or one of them failed.

  Attributes:
    process_id: the process that failed first (None when none did, e.g. a
      time-out).
    returncode: its exit status (negative: killed by that signal).
    outputs: every process's whole output, by process id.
  """

  def __init__(self, message, *, process_id=None, returncode=None, outputs=()):
    super().__init__(message)
    self.process_id = process_id
    self.returncode = returncode
    self.outputs = list(outputs)


class ProcessLostError(LaunchError):
  """Another process of a multi-process run died or cannot be reached."""


# The model zoo (graphpipe.models).


class ModelConfigError(GraphpipeError, ValueError):
  """A zoo model name, configuration or batch request that is not valid."""


__all__ = [
  "CaptureError",
  "CostModelError",
  "DecompositionError",
  "GraphCutError",
  "GraphError",
  "GraphFormatError",
  "GraphpipeError",
  "LaunchError",
  "ModelConfigError",
  "NodeNotFoundError",
  "PipelineRuntimeError",
  "PlanError",
  "PlotsUnavailableError",
  "ProcessLostError",
  "ScheduleError",
  "SimulationError",
]
