"""Cost models: how long nodes, transfers, all-reduces and updates take.

Planners and the simulator ask a cost model (the `CostModel` protocol of
`graphpipe.plan`) for times in seconds. Two implementations:

- `AnalyticCostModel(device_spec('v100'))`: a roofline per node from its
  FLOPs and bytes, with an efficiency that falls for small micro-batches,
  and affine (latency + bytes / bandwidth) communication.
- `ProfiledCostModel(graph, analytic)`: each node's jitted forward and
  backward timed on the actual device at a few micro-batch sizes (cached on
  disk), interpolated in between; communication from the analytic model.

On top of any cost model, `StageCosts` prices candidate stages for the
planners (time per sample, in-flight capacity under the memory rule) and
`estimate_iteration_time` prices a whole plan.

Modules:

  graphpipe.analytic     `DeviceSpec`, presets (`device_spec`, `measure_cpu`)
                         and `AnalyticCostModel`, with its efficiency curve
  graphpipe.profiled     `ProfiledCostModel`
  graphpipe.stage_costs  `StageCosts`, `estimate_iteration_time`
  graphpipe.fingerprint  `graph_fingerprint`

This module gathers them, so that `graphpipe.costs.X` names all of them.
"""

from graphpipe.analytic import (
  PRESETS,
  AnalyticCostModel,
  CostModelError,
  DeviceSpec,
  device_spec,
  measure_cpu,
)
from graphpipe.fingerprint import graph_fingerprint
from graphpipe.profiled import ProfiledCostModel

# Private, but the tests of the interpolation reach it here.
from graphpipe.profiled import _interpolate as _interpolate
from graphpipe.stage_costs import StageCosts, estimate_iteration_time

__all__ = [
  "PRESETS",
  "AnalyticCostModel",
  "CostModelError",
  "DeviceSpec",
  "ProfiledCostModel",
  "StageCosts",
  "device_spec",
  "estimate_iteration_time",
  "graph_fingerprint",
  "measure_cpu",
]
