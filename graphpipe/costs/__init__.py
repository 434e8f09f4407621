"""Cost models: how long nodes, transfers, all-reduces and updates take.

Planners and the simulator ask a cost model (the `CostModel` protocol of
`graphpipe.core.cost_model`) for times in seconds. Two implementations:

- `AnalyticCostModel(device_spec('v100'))`: a roofline per node from its
  FLOPs and bytes, with an efficiency that falls for small micro-batches,
  and affine (latency + bytes / bandwidth) communication.
- `ProfiledCostModel(graph, analytic)`: each node's jitted forward and
  backward timed on the actual device at a few micro-batch sizes (cached on
  disk), interpolated in between; communication from the analytic model.

Modules:

  analytic   `DeviceSpec`, presets (`device_spec`, `measure_cpu`) and
             `AnalyticCostModel`, with its efficiency curve
  profiled   `ProfiledCostModel`, `time_node` (one node's measured times)

What the planners build on top of any cost model (stage time per sample,
in-flight capacity, a plan's estimated iteration) is
`graphpipe.planning.stage_costs`.
"""

from graphpipe.costs.analytic import (
  PRESETS,
  AnalyticCostModel,
  DeviceSpec,
  device_spec,
  measure_cpu,
)
from graphpipe.costs.profiled import ProfiledCostModel, time_node

__all__ = [
  "PRESETS",
  "AnalyticCostModel",
  "DeviceSpec",
  "ProfiledCostModel",
  "device_spec",
  "measure_cpu",
  "time_node",
]
