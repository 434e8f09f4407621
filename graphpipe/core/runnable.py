"""What the trainer can run: the plans planners may return for a graph.

Capture records where a model cannot be cut freely (`OpGraph.meta`):

  whole_batch_only  the loss is exact only with the whole batch in one
                    piece (a max or a product across samples): one
                    micro-batch, one device a stage;
  collective_axes   the model's code names a collective axis (a
                    BatchNorm(axis_name='batch') syncing statistics across
                    data-parallel replicas): one device a stage, holding
                    the micro-batch whole, so a statistic over the axis
                    is the micro-batch's (replicated stages would need a
                    collective inside each device's conditional branch,
                    which XLA:CPU cannot run: every device must join);
  cut_rules.apart   node pairs whose values hold samples apart along the
                    batch axis (time-major): both ends take chunks of one
                    size (no data-parallel split or micro-batch join
                    between them);
  cut_rules.joined  node pairs carrying a value without a batch axis (a
                    batch statistic, a transform of parameters): one
                    stage;
  cut_rules.statistics  nodes normalising by their chunk's statistics
                    (BatchNorm in training): chunks of one size;

and `OpGraph.traces_at(size)` says whether the model's code traces at a
chunk size. `refusal(graph, plan)` is None exactly when a plan respects all
of them; the planners drop candidates it refuses, and `replica_counts`
keeps the searches from offering them in the first place.

Example:
  >>> graph = capture_zoo("two_branch", "tiny")
  >>> refusal(graph, graphpipe.plan(graph, 4, 8)) is None
  True
"""

from __future__ import annotations

from graphpipe.core.graph import OpGraph
from graphpipe.core.stages import Plan


def replica_counts(graph: OpGraph, micro_batch: int, num_devices: int):
  """The data-parallel degrees k a stage of micro-batches of
  `micro_batch` may take: k divides it, the chunk traces, and only k = 1
  where the loss needs the whole batch or the model names a collective
  axis."""
  if graph.whole_batch_only or graph.collective_axes:
    return [1] if graph.traces_at(micro_batch) else []
  return [
    k
    for k in range(1, num_devices + 1)
    if micro_batch % k == 0 and graph.traces_at(micro_batch // k)
  ]


def micro_batch_sizes(graph: OpGraph, batch_size: int, sizes) -> list[int]:
  """Of `sizes`, those the model can run at (the whole batch alone where
  the loss needs it)."""
  if graph.whole_batch_only:
    sizes = [b for b in sizes if b == batch_size]
  return [b for b in sizes if graph.traces_at(b)]


def replication_refusal(graph: OpGraph, plan: Plan) -> str | None:
  """Why `plan` may not replicate a stage of `graph` (the model names a
  collective axis), or None; the Trainer checks it too."""
  if not graph.collective_axes:
    return None
  for s in plan.stages:
    if len(s.devices) > 1:
      return (
        f"stage {s.id} is data-parallel over {len(s.devices)} devices, but "
        f"the model's code names the collective axis "
        f"{', '.join(graph.collective_axes)} (e.g. BatchNorm(axis_name=...)):"
        " graphpipe runs each micro-batch of such a model whole on one "
        "device a stage, so statistics over the axis are the micro-batch's;"
        " plan with one device a stage (the planners do)"
      )
  return None


def refusal(graph: OpGraph, plan: Plan) -> str | None:
  """Why the trainer would refuse `plan` for `graph`, or None."""
  chunk = {s.id: s.micro_batch_size // len(s.devices) for s in plan.stages}
  if graph.whole_batch_only and any(
    c < plan.batch_size for c in chunk.values()
  ):
    return (
      "the plan splits the batch, but the loss is exact only on the whole "
      f"batch: {graph.whole_batch_only}"
    )
  replicated = replication_refusal(graph, plan)
  if replicated:
    return replicated
  for s in plan.stages:
    if not graph.traces_at(chunk[s.id]):
      return (
        f"stage {s.id} runs chunks of {chunk[s.id]} samples, at which the "
        "model's code does not trace"
      )
  owner = plan.stage_of_node()
  rules = graph.meta.get("cut_rules", {})
  for a, b in rules.get("joined", ()):
    if owner[a] != owner[b]:
      return (
        f"nodes {graph.nodes[a].name!r} and {graph.nodes[b].name!r} are in "
        "different stages, but a value without a batch axis passes between "
        "them"
      )
  same_chunk = {
    "apart": "a value between them holds samples apart along its batch axis",
    "statistics": "both normalise by their chunk's batch statistics "
    "(BatchNorm in training): give their stages one micro-batch size per "
    "device",
  }
  for rule, why in same_chunk.items():
    for a, b in rules.get(rule, ()):
      if owner[a] != owner[b] and chunk[owner[a]] != chunk[owner[b]]:
        return (
          f"nodes {graph.nodes[a].name!r} and {graph.nodes[b].name!r} take "
          f"chunks of different sizes, but {why}"
        )
  return None
