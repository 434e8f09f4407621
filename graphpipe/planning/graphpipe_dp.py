"""The GraphPipe partitioner: a DP over the series-parallel tree.

  merge glue nodes with one input that do no work into it  (sp.contract)
  tree = series-parallel decomposition of the graph         (sp.decompose)
  for each micro-batch size b:
    binary search the smallest target t among the candidate stages' times
    per sample such that feasible(t), where feasible asks the memoised DP
      g(X, D, d) = fewest devices that split sub-graph X into stages of
        time per sample <= t, with at most D stages on any path, when d
        stages follow X (so a stage of X holds 1 + d + (stages after it
        in X) micro-batches in flight, which memory must allow):
      base     X as one data-parallel stage on the fewest devices k | b
      series   X = X1 ; X2: the last stage covers children s..j whole
               (optionally with the tail of one branch of a parallel child
               just before s: how a join shares a stage with the last
               layers of one branch), or the last child is split on its
               own (depth D2) and the rest gets D - D2, d + D2 after it
      parallel X = X1 | X2 | ...: branches pipeline concurrently with the
               same D and d (a shared source thus takes the max in-flight
               count); neighbouring branches may share one stage
    and the smallest D with g(root, D, 0) <= num_devices.

Parallel branches are ordered by work, so that grouping neighbours groups
similar branches. The tree's candidate stages are numbered by
`graphpipe.planning.stage_tree.StageTree`; this module prices them and runs
the searches (`graphpipe.planning.candidates.frontier`); the DP itself is
`graphpipe.planning.dp_solver.DPSolver`.
"""

from __future__ import annotations

from graphpipe.core.graph import OpGraph
from graphpipe.planning import sp
from graphpipe.planning.candidates import Partition, distinct, frontier
from graphpipe.planning.dp_solver import DPSolver
from graphpipe.planning.stage_costs import StageCosts
from graphpipe.planning.stage_tree import StageTree

# A glue node is merged into a neighbour when it does under 1% of an average
# node's FLOPs and its weights (with gradients and Adam state) take under
# 1% of a device: it cannot be worth a device of its own.
_LIGHT_SHARE = 0.01


def light_nodes(graph: OpGraph, memory_bytes: float) -> list[int]:
  """Glue nodes too small to deserve a stage (merged before the DP).

  Joins (several predecessors) are left alone: the DP lets a join share a
  stage with the tail of any one branch, and chooses which.

  Example:
    >>> from graphpipe.core import Edge, Node
    >>> layer = dict(fwd_flops=1e9, bwd_flops=2e9, saved_bytes=1e6)
    >>> graph = OpGraph([Node(0, "layer0", **layer), Node(1, "layer1", **layer),
    ...                  Node(2, "loss", fwd_flops=1e3)],
    ...                 [Edge(0, 1, bytes=4e3), Edge(1, 2, bytes=4e3)])
    >>> light_nodes(graph, 16e9)        # the loss
    [2]

  Args:
    graph: the operator graph.
    memory_bytes: the per-device budget.
  """
  work = [n.fwd_flops + n.bwd_flops for n in graph.nodes]
  mean_work = sum(work) / len(work)
  saved = [n.saved_bytes for n in graph.nodes]
  mean_saved = sum(saved) / len(saved)
  return [
    n.id
    for n in graph.nodes
    if len(graph.predecessors(n.id)) <= 1
    and work[n.id] <= _LIGHT_SHARE * mean_work
    and 4 * n.param_bytes + n.state_bytes <= _LIGHT_SHARE * memory_bytes
    and n.saved_bytes <= _LIGHT_SHARE * mean_saved
  ]


class GraphPipePartitioner:
  """The GraphPipe DP over a series-parallel tree (see the module docstring).

  Calling it with a micro-batch size returns partitions on the frontier of
  bottleneck time against pipeline depth: the fastest bottleneck (and, for
  it, the fewest in-flight micro-batches at the source), then the fastest
  bottleneck under a few smaller depth bounds (shallower pipelines with
  more data parallelism have shorter warm-ups); `plan` keeps the fastest.

  Example:
    >>> from graphpipe.costs import AnalyticCostModel, device_spec
    >>> graph = capture_zoo("two_branch", "paper")   # the case study
    >>> costs = StageCosts(graph, AnalyticCostModel(device_spec("v100")),
    ...                    batch_size=8, num_devices=8, memory_bytes=16e9)
    >>> partitions = GraphPipePartitioner(graph, costs)(1)  # b = 1
    >>> partitions[0].stages        # both branches pipelined side by side
    (((0,), 1), ((1,), 1), ((2,), 1), ((4,), 1), ((5,), 1), ((6,), 1),
     ((7,), 1), ((3, 8), 1))

  Args:
    graph: the operator graph.
    costs: stage costs for the batch, devices and memory budget.
  """

  def __init__(self, graph: OpGraph, costs: StageCosts):
    self.costs = costs
    merge = light_nodes(graph, costs.memory_bytes)
    dag = sp.contract(graph, merge) if merge else sp.Dag.of(graph)
    work = [n.fwd_flops + n.bwd_flops for n in graph.nodes]
    self.tree = StageTree.build(sp.decompose(dag), dag, work)

  def __call__(self, micro_batch: int) -> list[Partition]:
    """Frontier partitions for micro-batch size `micro_batch` (maybe []),
    under both stage metrics, stages filled from the front and the back."""
    costs = self.costs
    counts = costs.replica_counts(micro_batch)
    # (k, in-flight capacity) per candidate stage, for both metrics.
    fitting = []
    for nodes in self.tree.base_nodes:
      fitting.append([])
      for k in counts:
        cap = costs.in_flight_capacity(nodes, micro_batch, k)
        if cap >= 1:
          fitting[-1].append((k, cap))
    found = []
    for metric in (costs.time_per_sample, costs.steady_time_per_sample):
      options = []
      targets = set()
      for nodes, fits in zip(self.tree.base_nodes, fitting, strict=True):
        row = []
        for k, cap in fits:
          tps = metric(nodes, micro_batch, k)
          row.append((k, tps, cap))
          targets.add(tps)
        options.append(row)
      front = DPSolver(self.tree, options, costs.num_devices)
      back = DPSolver(self.tree, options, costs.num_devices, fill="back")

      def solve(target, bound, shallowest, front=front, back=back):
        depth, stages = front.solve(target, bound, shallowest)
        return depth, stages + back.solve(target, depth, False)[1]

      found += frontier(
        sorted(targets),
        # Every stage takes a device, so no plan is deeper than the devices.
        min(self.tree.depth[self.tree.root], costs.num_devices),
        front.feasible,
        solve,
      )
    return distinct([Partition(tuple(stages), micro_batch) for stages in found])
