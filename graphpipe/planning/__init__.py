"""Planning: an OpGraph and a device count in, a `Plan` (stage DAG) out.

Modules, in the order of the data flow:

  stage_costs    `StageCosts` (a candidate stage's time per sample and
                 in-flight capacity), `estimate_iteration_time`
  sp             series-parallel decomposition (non-SP graphs converted)
  stage_tree     the SP tree flattened, its candidate stages numbered
  candidates     `Partition` (what partitioners return), the depth frontier
  dp_solver      the GraphPipe DP for one target time
  graphpipe_dp   the GraphPipe partitioner (binary search over the DP)
  baselines      the sequential (PipeDream) and GPipe partitioners
  assemble       spare devices, device placement, stage edges: the `Plan`
  refine         local search around the partitioners' plans
  validate       `check_plan`: is a plan valid for its graph
  search         `plan`
  tightest       `tightest_plan`
  simulated      `plan_and_simulate`

A new planner is a partitioner (a callable from micro-batch size to
`Partition`s, like those of `baselines`) registered in `search`.
"""

from graphpipe.planning.candidates import Partition
from graphpipe.planning.search import PLANNERS, plan
from graphpipe.planning.simulated import plan_and_simulate
from graphpipe.planning.stage_costs import StageCosts, estimate_iteration_time
from graphpipe.planning.tightest import tightest_plan
from graphpipe.planning.validate import check_plan

__all__ = [
  "PLANNERS",
  "Partition",
  "StageCosts",
  "check_plan",
  "estimate_iteration_time",
  "plan",
  "plan_and_simulate",
  "tightest_plan",
]
