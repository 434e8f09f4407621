"""`Plan`: a stage graph (DAG of pipeline stages) for one OpGraph.

A stage is a convex set of operator nodes, a set of devices (more than one
means data parallelism inside the stage: each micro-batch is split evenly
over the stage's devices and gradients are all-reduced once per iteration),
a micro-batch size and an in-flight count: how many of its micro-batches'
activations it keeps stashed under 1F1B, n(sink) = 1, n(s) = 1 + max over
successors t of n(t) b_t / b_s.

Per-stage micro-batch sizes. Stages may use different sizes b_s, each
dividing the batch B, and each a multiple of every predecessor's size
(sizes never shrink along a stage edge). Stage s runs M_s = B / b_s
micro-batches; its micro-batch j holds samples [j b_s, (j + 1) b_s) of the
mini-batch. So across an edge s -> t with b_t = k b_s, t's micro-batch j
reads s's micro-batches jk .. jk + k - 1 (it runs once every k of them),
and the backward of t's micro-batch j returns its input gradients to s in
k pieces, one per s micro-batch. In samples, a stage holds b_s more than
its busiest successor chain: n(s) b_s = b_s + max over t of n(t) b_t.

Planners (`graphpipe.planning`) make plans; the schedules, the simulator and
the runtime read them. What a stage costs in memory is
`graphpipe.core.memory`.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Sequence

from graphpipe.core.files import read_json
from graphpipe.core.graph import OpGraph
from graphpipe.errors import GraphFormatError, PlanError


@dataclasses.dataclass(frozen=True)
class Stage:
  """One pipeline stage.

  Attributes:
    id: position in the plan's topological order of stages.
    nodes: OpGraph node ids (a convex set).
    devices: device indices; more than one = data parallel inside the stage.
    micro_batch_size: samples per micro-batch for this stage (split evenly
      over `devices`).
    in_flight: micro-batches whose activations the stage stashes (1F1B).
    sharding: how the stage's devices hold its weights (`SHARDINGS`):
      'replicated', every device a full copy of the parameters and the
      optimizer state; 'zero1', full parameters but the optimizer state
      sharded over the devices (ZeRO stage 1: the gradient all-reduce
      becomes a reduce-scatter, each device updates its share, and an
      all-gather of the updated parameters takes the all-reduce's second
      half; see `graphpipe.runtime.zero`). Only a stage on several devices
      can shard.
  """

  id: int
  nodes: tuple[int, ...]
  devices: tuple[int, ...]
  micro_batch_size: int
  in_flight: int = 1
  sharding: str = "replicated"

  def __str__(self) -> str:
    shard = ", ZeRO-1" if self.sharding == "zero1" else ""
    return (
      f"stage {self.id}: nodes {list(self.nodes)} on devices "
      f"{list(self.devices)}, b={self.micro_batch_size}, "
      f"in flight {self.in_flight}{shard}"
    )


# How a stage's devices may hold its weights (`Stage.sharding`).
SHARDINGS = ("replicated", "zero1")


def sharding_problem(stage: Stage) -> str | None:
  """What is wrong with a stage's `sharding`, or None."""
  if stage.sharding not in SHARDINGS:
    return (
      f"stage {stage.id}: sharding {stage.sharding!r} is not one of {SHARDINGS}"
    )
  if stage.sharding == "zero1" and len(stage.devices) < 2:
    return (
      f"stage {stage.id}: ZeRO-1 shards the optimizer state over the "
      "stage's devices, and it has one (make it 'replicated')"
    )
  return None


# Plan fields that live only in memory, never in the plan's JSON.
_IN_MEMORY = {"graph", "cost_model"}


@dataclasses.dataclass(frozen=True)
class Plan:
  """A stage DAG for a graph, a batch size and a device count.

  Attributes:
    planner: 'graphpipe', 'sequential' or 'gpipe'.
    stages: stages in a topological order.
    stage_edges: (src stage id, dst stage id) pairs, src before dst.
    batch_size: samples per iteration (mini-batch).
    num_devices: devices the plan may use (stages use a subset).
    schedule: '1f1b' or 'gpipe'.
    device: name of the device preset the plan was made for.
    bottleneck_time_per_sample: the planner's estimate of the slowest
      stage's time per sample (seconds).
    search_time_s: time the planner took.
    graph_fingerprint: identifies the OpGraph the plan is for.
    graph: the OpGraph itself, when the planner had it (not saved to JSON;
      lets `graphpipe.Trainer(plan, optimizer)` find the program).
    cost_model: the cost model the planner priced with (not saved to
      JSON): `graphpipe.simulate(plan, graph)` times the plan with it.
  """

  planner: str
  stages: tuple[Stage, ...]
  stage_edges: tuple[tuple[int, int], ...]
  batch_size: int
  num_devices: int
  schedule: str = "1f1b"
  device: str = ""
  bottleneck_time_per_sample: float = 0.0
  search_time_s: float = 0.0
  graph_fingerprint: str = ""
  graph: OpGraph | None = dataclasses.field(
    default=None, compare=False, repr=False
  )
  cost_model: object = dataclasses.field(
    default=None, compare=False, repr=False
  )

  @property
  def micro_batch_size(self) -> int:
    """The smallest stage micro-batch size (all equal unless per-stage)."""
    return min(s.micro_batch_size for s in self.stages)

  @property
  def num_microbatches(self) -> int:
    """Micro-batches of the smallest size per iteration (the finest)."""
    return self.batch_size // self.micro_batch_size

  @property
  def micro_batch_sizes(self) -> tuple[int, ...]:
    """Each stage's micro-batch size, by stage id."""
    return tuple(s.micro_batch_size for s in self.stages)

  @property
  def stage_microbatches(self) -> tuple[int, ...]:
    """Micro-batches each stage runs per iteration, B / b_s, by stage id."""
    return tuple(self.batch_size // b for b in self.micro_batch_sizes)

  @property
  def per_stage_micro_batches(self) -> bool:
    """Whether stages use different micro-batch sizes."""
    return len(set(self.micro_batch_sizes)) > 1

  @property
  def num_stages(self) -> int:
    return len(self.stages)

  @property
  def depth(self) -> int:
    """Stages on the longest path of the stage DAG."""
    longest = {}
    for s in self.stages:
      preds = [a for a, b in self.stage_edges if b == s.id]
      longest[s.id] = 1 + max((longest[p] for p in preds), default=0)
    return max(longest.values(), default=0)

  def successors(self, stage: int) -> list[int]:
    return [b for a, b in self.stage_edges if a == stage]

  def predecessors(self, stage: int) -> list[int]:
    return [a for a, b in self.stage_edges if b == stage]

  def stage_of_node(self) -> dict[int, int]:
    """Map from OpGraph node id to the id of the stage holding it."""
    return {n: s.id for s in self.stages for n in s.nodes}

  def __str__(self) -> str:
    sizes = f"b={self.micro_batch_size} x {self.num_microbatches}"
    if self.per_stage_micro_batches:
      sizes = (
        f"b={'/'.join(str(b) for b in sorted(set(self.micro_batch_sizes)))}"
      )
    lines = [
      f"Plan[{self.planner}] {self.num_stages} stages, depth {self.depth}, "
      f"{sizes} micro-batches, "
      f"{self.num_devices} devices, schedule {self.schedule}"
    ]
    lines += [f"  {s}" for s in self.stages]
    lines.append(f"  edges: {list(self.stage_edges)}")
    return "\n".join(lines)

  def to_dict(self) -> dict:
    d = {
      f.name: getattr(self, f.name)
      for f in dataclasses.fields(self)
      if f.name not in _IN_MEMORY
    }
    d["stages"] = [dataclasses.asdict(s) for s in self.stages]
    d["stage_edges"] = [list(e) for e in self.stage_edges]
    d.update(
      depth=self.depth,
      num_stages=self.num_stages,
      micro_batch_size=self.micro_batch_size,
      num_microbatches=self.num_microbatches,
      micro_batch_sizes=list(self.micro_batch_sizes),
    )
    return d

  @classmethod
  def from_dict(cls, d: dict) -> Plan:
    """Inverse of `to_dict` (the graph is not restored)."""
    try:
      fields = {f.name for f in dataclasses.fields(cls)} - _IN_MEMORY
      kwargs = {k: v for k, v in d.items() if k in fields}
      kwargs["stages"] = tuple(
        Stage(
          id=s["id"],
          nodes=tuple(s["nodes"]),
          devices=tuple(s["devices"]),
          micro_batch_size=s["micro_batch_size"],
          in_flight=s["in_flight"],
          # (plans saved before stages could shard have no entry)
          sharding=s.get("sharding", "replicated"),
        )
        for s in d["stages"]
      )
      kwargs["stage_edges"] = tuple(tuple(e) for e in d["stage_edges"])
      return cls(**kwargs)
    except (KeyError, TypeError, AttributeError) as err:
      raise GraphFormatError(f"not a graphpipe plan: {err!r}") from err

  def save(self, path: str) -> None:
    """Writes the plan as JSON (without the graph)."""
    with open(path, "w") as f:
      json.dump(self.to_dict(), f, indent=1)

  @classmethod
  def load(cls, path: str) -> Plan:
    """Reads a plan written by `save`."""
    return cls.from_dict(read_json(path, "a plan"))


def in_flight_counts(
  num_stages: int,
  stage_edges: Sequence[tuple[int, int]],
  sizes: Sequence[int] | None = None,
) -> list[int]:
  """1F1B in-flight counts: n(sink) = 1, n(s) = 1 + max over successors t
  of n(t) b_t / b_s (with one size for all stages: 1 + max n(t)).

  Stage ids must be a topological order (every edge goes forward), and
  each stage's size a multiple of its predecessors' (module docstring).

  Example:
    >>> in_flight_counts(3, [(0, 1), (1, 2)])
    [3, 2, 1]
    >>> in_flight_counts(2, [(0, 1)], sizes=[2, 4])   # the sink takes 2
    [3, 1]

  Args:
    num_stages: stages, ids 0..num_stages - 1.
    stage_edges: (src, dst) pairs.
    sizes: micro-batch size per stage; None: all equal.
  """
  sizes = list(sizes) if sizes is not None else [1] * num_stages
  counts = [1] * num_stages
  successors: list[list[int]] = [[] for _ in range(num_stages)]
  for a, b in stage_edges:
    if 0 <= a < num_stages:
      successors[a].append(b)
  for s in reversed(range(num_stages)):
    succ = successors[s]
    if any(b <= s for b in succ):
      raise PlanError(
        f"stage ids must be a topological order: stage {s} has an edge "
        f"to {min(succ)}"
      )
    for b in succ:
      if sizes[b] % sizes[s]:
        raise PlanError(
          f"stage {b} takes micro-batches of {sizes[b]}, not a multiple of "
          f"its predecessor stage {s}'s {sizes[s]}: sizes may only grow "
          "along stage edges, by whole multiples"
        )
    counts[s] = 1 + max(
      (counts[b] * sizes[b] // sizes[s] for b in succ), default=0
    )
  return counts
