"""The memory rule: what one device of a pipelined step holds.

Two levels, one rule:

- `stage_memory_bytes`: what a stage needs for itself (its own weights,
  gradients, optimizer slots and stashed activations). The planners' DPs
  use it to prune stages one at a time.
- `Holdings` -> `device_bytes`: what every device of the runtime's SPMD
  step really holds. The step has one set of array shapes on all devices,
  so each device holds parameter slots as large as the largest stage's
  parameters (`graphpipe.core.slots`), optimizer state over those slots,
  stashes sized to the largest stage input, output and residual times the
  most slots any device needs, channel buffers, its own rows of the batch
  leaves its stage reads (`graphpipe.core.feed`), and
  the working memory of its largest action. The planner fills a `Holdings`
  from the graph's figures (`plan_holdings`, an upper bound) and rejects
  plans over budget; the runtime fills one from the layout it builds
  (`graphpipe.runtime.memory.memory_report`) and the same `device_bytes`
  turns both into bytes by kind.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

from graphpipe.core.channels import channel_count
from graphpipe.core.feed import plan_feed_words
from graphpipe.core.graph import OpGraph
from graphpipe.core.stages import Plan
from graphpipe.core.zero import owned_elements
from graphpipe.errors import PlanError

# Adam keeps two fp32 moments per parameter; with the weights and their
# gradients a parameter costs four times its own bytes.
DEFAULT_OPTIMIZER_SLOTS = 2

# Bytes an optimizer may keep besides its per-parameter slots (Adam's
# step count), counted by the planner so that it never undercounts.
_OPTIMIZER_SCALARS = 64

KINDS = (
  "parameters",
  "gradients",
  "optimizer",
  "state",
  "stashes",
  "channels",
  "batch",
  "work",
  "tables",
)
# The kinds that grow with the model's weights.
MODEL_KINDS = ("parameters", "gradients", "optimizer", "state")
# The kinds that grow with the model's shape and its micro-batches: what
# `graphpipe.tightest_plan` squeezes (the step's bookkeeping, its tick
# tables, channels and batch rows, dominates a tiny model and says nothing
# about a real model of its shape).
SHAPE_KINDS = (*MODEL_KINDS, "stashes", "work")


def stage_memory_bytes(
  graph: OpGraph,
  nodes: Sequence[int],
  micro_batch_per_device: float,
  in_flight: int,
  optimizer_slots: int = DEFAULT_OPTIMIZER_SLOTS,
  kinds: Sequence[str] = KINDS,
  optimizer_share: int = 1,
) -> float:
  """Bytes of `kinds` a stage alone makes every device hold
  (`device_bytes`' kinds).

  `optimizer_share`: the devices a ZeRO-1 stage shards its optimizer
  state over (each keeps at least ceil(P / k) of its P parameters' slots;
  `graphpipe.core.zero`); 1 for a replicated stage.

  Its parameters (slots at least that large on every device), their
  gradients (accumulator and result), optimizer slots and the work term
  (parameter gradients and their slots: 2 x parameters, plus the largest
  action's transient), its non-trainable state, and the residuals the
  runtime stashes (`Node.kept_bytes`) of `in_flight` micro-batches of
  `micro_batch_per_device` samples; channels, batch rows and tables are
  the plan's, not a stage's. Each kind is a lower bound of that kind in
  `plan_memory` for any plan with this stage, so the sum over `kinds`
  bounds `largest_of(kinds)` and the DPs prune with it.
  """
  params = graph.variable_bytes(nodes, "param")
  state = 0
  if "state" in kinds:
    state = graph.variable_bytes(nodes, "state")
  saved = 0.0
  if "stashes" in kinds:
    saved = sum(
      graph.nodes[i].cost("kept_bytes", micro_batch_per_device) for i in nodes
    )
  work = 0
  if "work" in kinds:
    work = work_bytes(graph, nodes, micro_batch_per_device)
  per_param = param_multiple([k for k in kinds if k != "optimizer"])
  optimizer = 0
  if "optimizer" in kinds:
    optimizer = 4 * optimizer_slots * -(-(params // 4) // optimizer_share)
  return params * per_param + optimizer + work + state + saved * in_flight


def param_multiple(kinds, optimizer_slots=DEFAULT_OPTIMIZER_SLOTS) -> int:
  """Bytes of `kinds` a stage holds per byte of its parameters: weights 1,
  gradients 2, optimizer slots, work (gradients and their slots) 2."""
  per = {"parameters": 1, "gradients": 2, "optimizer": optimizer_slots}
  return sum({**per, "work": 2}.get(kind, 0) for kind in kinds)


@dataclasses.dataclass(frozen=True)
class Holdings:
  """The buffers every device of a step holds (the same on all devices).

  Attributes:
    param_elements: float32 elements of the parameter slots (the largest
      stage's parameters).
    state_elements: the same for the non-trainable variables.
    optimizer_bytes: the optimizer's state over the parameter slots.
    stash_elements: activation, gradient and residual stashes together.
    channel_elements: one [channels, largest transfer] block.
    batch_bytes: the batch vector: the longest device's feed
      (`graphpipe.core.feed`: its own rows of its stage's leaves).
    work_bytes: transient memory of the largest forward or backward.
    table_bytes: the step's tick tables (constants on every device).
    replicas: devices of the largest data-parallel stage.
    own_param_elements: per device, its own stage's parameter elements.
    stages: per device, its stage (-1: none).
    optimizer_elements: elements the optimizer state is kept over: the
      parameter slots (0, the default), or with ZeRO-1 stages the owned
      vector (`graphpipe.core.zero`).
    own_optimizer_elements: per device, the elements of it the device
      owns (default its own parameter elements).
  """

  param_elements: int
  state_elements: int
  optimizer_bytes: int
  stash_elements: int
  channel_elements: int
  batch_bytes: int
  work_bytes: int
  table_bytes: int
  replicas: int
  own_param_elements: tuple[int, ...]
  stages: tuple[int, ...]
  optimizer_elements: int = 0
  own_optimizer_elements: tuple[int, ...] = ()


def device_bytes(h: Holdings) -> dict[str, int]:
  """Bytes one device holds, by kind (`KINDS`).

  Gradients: the accumulator and the reduced result, both the size of the
  parameter slots; summing a data-parallel group (a ring all-reduce,
  `graphpipe.runtime.reduce`) is counted as two slots more, whatever the
  group's size: an upper bound of the ring's chunks in flight (about one
  slot per group size) and of a ZeRO-1 stage's reduce-scatter and
  all-gather (the ring's two halves; its owned vectors are smaller than
  the slot-size updates they replace).
  Channels: what arrived, and what the forward and the backward send.
  Work: the largest action's transient memory, the gradients of its
  parameters and the slots they are scattered into (an embedding's
  gradient is a dense table-sized array). Tables: the step's tick tables.
  """
  p = 4 * h.param_elements
  reduce_copies = 2 if h.replicas > 1 else 0
  return {
    "parameters": p,
    "gradients": p * (2 + reduce_copies),
    "optimizer": h.optimizer_bytes,
    "state": 4 * h.state_elements,
    "stashes": 4 * h.stash_elements,
    "channels": 3 * 4 * h.channel_elements,
    "batch": h.batch_bytes,
    "work": h.work_bytes + 2 * p,
    "tables": h.table_bytes,
  }


@dataclasses.dataclass(frozen=True)
class MemoryReport:
  """Per device, the bytes it holds by kind, and the padding among them.

  Attributes:
    per_device: per device, bytes by kind (`KINDS`).
    own_bytes: per device, its own stage's parameter and optimizer bytes.
    held_bytes: per device, the parameter and optimizer bytes it holds
      (the slots are the largest stage's size on every device).
    stages: per device, its stage (-1: none).
    source: 'planner' (graph figures, an upper bound) or 'runtime' (the
      runtime's own layout).
  """

  per_device: tuple[dict[str, int], ...]
  own_bytes: tuple[int, ...]
  held_bytes: tuple[int, ...]
  stages: tuple[int, ...]
  source: str

  @classmethod
  def from_holdings(cls, h: Holdings, source: str) -> MemoryReport:
    kinds = device_bytes(h)
    per_element = h.optimizer_bytes / max(
      1, h.optimizer_elements or h.param_elements
    )
    owned = h.own_optimizer_elements or h.own_param_elements
    held = kinds["parameters"] + kinds["optimizer"]
    return cls(
      per_device=tuple(dict(kinds) for _ in h.own_param_elements),
      own_bytes=tuple(
        round(4 * n + per_element * o)
        for n, o in zip(h.own_param_elements, owned, strict=True)
      ),
      held_bytes=tuple(held for _ in h.own_param_elements),
      stages=h.stages,
      source=source,
    )

  @property
  def totals(self) -> tuple[int, ...]:
    """Per device, all bytes it holds."""
    return tuple(sum(k.values()) for k in self.per_device)

  @property
  def largest(self) -> int:
    return max(self.totals, default=0)

  def largest_of(self, kinds: Sequence[str] = KINDS) -> int:
    """The most bytes of `kinds` any device holds."""
    return max(
      (sum(k[kind] for kind in kinds) for k in self.per_device), default=0
    )

  @property
  def padding_bytes(self) -> tuple[int, ...]:
    """Per device, parameter and optimizer bytes held beyond its own."""
    return tuple(
      h - o for h, o in zip(self.held_bytes, self.own_bytes, strict=True)
    )

  @property
  def padding_fraction(self) -> float:
    """Padding bytes / all parameter and optimizer bytes held."""
    held = sum(self.held_bytes)
    return sum(self.padding_bytes) / held if held else 0.0

  def to_dict(self) -> dict:
    return {
      "source": self.source,
      "memory_per_device": [dict(k) for k in self.per_device],
      "total_bytes_per_device": list(self.totals),
      "own_param_optimizer_bytes": list(self.own_bytes),
      "held_param_optimizer_bytes": list(self.held_bytes),
      "padding_bytes": list(self.padding_bytes),
      "padding_fraction": self.padding_fraction,
    }

  def describe(self, device: int | None = None) -> str:
    """One device's bytes by kind, largest first (default: the largest)."""
    if device is None:
      device = max(range(len(self.totals)), key=lambda d: self.totals[d])
    kinds = self.per_device[device]
    parts = ", ".join(
      f"{k} {_gib(v)}"
      for k, v in sorted(kinds.items(), key=lambda kv: -kv[1])
      if v >= 2**20 or v >= self.totals[device] / 100
    )
    stage = self.stages[device]
    where = f" (stage {stage})" if stage >= 0 else ""
    return f"device {device}{where} holds {_gib(self.totals[device])}: {parts}"


def _gib(n: float) -> str:
  return f"{n / 2**30:.3g} GiB"


# The planner's figures: the runtime's buffers, sized from the graph.


def plan_holdings(
  graph: OpGraph,
  plan: Plan,
  optimizer_slots: int = DEFAULT_OPTIMIZER_SLOTS,
  recompute: bool = False,
  in_flight: Sequence[int] | None = None,
) -> Holdings:
  """What every device of `plan`'s step will hold, from `graph`'s figures.

  An upper bound of the runtime's own figure
  (`graphpipe.runtime.memory.memory_report`): the parameter and state slots
  are the same (the largest stage's elements); each stash's slot count is
  the most micro-batches any stage keeps in flight (the runtime colours
  the schedule's lifetimes into no more), residuals are the sum of the
  nodes' `kept_bytes` (each node's inputs and matrix products' outputs:
  the runtime keeps the products and the stage's inputs only), and values
  crossing stages count once per operator edge.
  Parameters and transferred values are counted as float32, as the runtime
  stores them. `in_flight`: per stage, micro-batches stashed at once
  (default the plan's counts; the simulator passes what it observed).
  """
  owner = plan.stage_of_node()
  nodes = graph.nodes
  per_stage = []
  inputs = [0.0] * plan.num_stages
  outputs = [0.0] * plan.num_stages
  carried = set()
  for e in graph.edges:
    a, b = owner[e.src], owner[e.dst]
    if a != b:
      outputs[a] += e.bytes / 4
      inputs[b] += e.bytes / 4
      carried.add((a, b))
  # Stage edges without an operator edge carry a one-column token.
  for a, b in plan.stage_edges:
    if (a, b) not in carried:
      outputs[a] += 1
      inputs[b] += 1
  for s in plan.stages:
    chunk = s.micro_batch_size / len(s.devices)
    residual = 0.0
    if not recompute:
      residual = sum(nodes[n].cost("kept_bytes", chunk) for n in s.nodes) / 4
    per_stage.append(
      {
        "chunk": chunk,
        "params": graph.variable_bytes(s.nodes, "param") // 4,
        "state": graph.variable_bytes(s.nodes, "state") // 4,
        "in": math.ceil(inputs[s.id] * chunk),
        "out": math.ceil(outputs[s.id] * chunk),
        "res": math.ceil(residual),
        "work": work_bytes(graph, s.nodes, chunk),
      }
    )
  most = max(in_flight or [s.in_flight for s in plan.stages])
  transfer = max(
    [1]
    + [
      math.ceil(
        min(per_stage[a]["chunk"], per_stage[b]["chunk"])
        * max(
          per_stage[b]["in"] / per_stage[b]["chunk"],
          per_stage[a]["out"] / per_stage[a]["chunk"],
        )
      )
      for a, b in plan.stage_edges
    ]
  )
  # The runtime's ppermute channels, exactly (`graphpipe.core.channels`).
  channels = max(1, channel_count(plan))
  largest = lambda key: max(1, max(s[key] for s in per_stage))
  params = largest("params")
  owned = owned_elements(
    [
      (sizes["params"], len(s.devices), s.sharding == "zero1")
      for s, sizes in zip(plan.stages, per_stage, strict=True)
    ],
    # The slots are the largest stage's variables (or fewer, merged).
    slot_count=max(
      len({k for n in s.nodes for k in nodes[n].params}) for s in plan.stages
    ),
  )
  stage_of = [-1] * plan.num_devices
  own = [0] * plan.num_devices
  own_opt = [0] * plan.num_devices
  for s, sizes in zip(plan.stages, per_stage, strict=True):
    for d in s.devices:
      stage_of[d], own[d] = s.id, sizes["params"]
      own_opt[d] = owned.needed[s.id]
  kept = owned.length if owned.sharded else params
  return Holdings(
    param_elements=params,
    state_elements=largest("state"),
    # The optimizer's scalars (a step count) besides its slots.
    optimizer_bytes=4 * optimizer_slots * kept + _OPTIMIZER_SCALARS,
    stash_elements=(largest("in") + largest("out")) * most
    + 2 * transfer
    + (largest("res") * most if not recompute else 1),
    channel_elements=channels * transfer,
    # Each device is fed its own rows of its stage's leaves, exactly.
    batch_bytes=4 * plan_feed_words(graph, plan),
    work_bytes=max(s["work"] for s in per_stage),
    table_bytes=table_bytes(plan, channels),
    replicas=max(len(s.devices) for s in plan.stages),
    own_param_elements=tuple(own),
    stages=tuple(stage_of),
    optimizer_elements=kept,
    own_optimizer_elements=tuple(own_opt),
  )


def table_bytes(plan: Plan, channels: int, ticks: int | None = None) -> int:
  """Bytes of the step's int32 tick tables (at most 2 m S ticks)."""
  if ticks is None:
    ticks = 2 * max(plan.stage_microbatches) * plan.num_stages
  return 4 * ticks * plan.num_devices * (7 + 5 * channels)


def work_bytes(graph: OpGraph, nodes: Sequence[int], chunk: float) -> int:
  """Transient bytes of a stage's forward plus backward on `chunk` samples.

  Every intermediate the backward of its nodes reads (their full VJP
  residuals), the outputs and their cotangents: what a recomputing backward
  materialises at once, at most.
  """
  total = 0.0
  for n in nodes:
    node = graph.nodes[n]
    total += node.cost("saved_bytes", chunk)
    total += 2 * node.cost("activation_bytes", chunk)
  return math.ceil(total)


def memory_floor(
  graph: OpGraph,
  optimizer_slots: int = DEFAULT_OPTIMIZER_SLOTS,
  kinds: Sequence[str] = KINDS,
  shardings: Sequence[str] = ("replicated",),
) -> tuple[int, str]:
  """A lower bound of the bytes every device holds in any plan of `graph`,
  on any number of devices, and the node that sets it.

  Every plan puts the node with the most parameters in some stage, and
  every device holds slots the size of the largest stage's parameters (and
  the same for the non-trainable state); the bound is
  `device_bytes` of those slots alone (no stashes, channels, tables, batch
  rows (more devices feed each fewer) or transient work, no data-parallel
  copies), so it is never above
  `plan_memory(graph, p).largest` for any plan p. Each kind is bounded
  alone, so the sum over `kinds` bounds `largest_of(kinds)` too. Where
  `shardings` allow ZeRO-1 stages, a stage on enough devices keeps
  almost none of its optimizer state, and the bound counts none.
  """
  heaviest = max(graph.nodes, key=lambda n: n.param_bytes)
  params = max(1, heaviest.param_bytes // 4)
  kept = 0 if "zero1" in shardings else params
  floor = Holdings(
    param_elements=params,
    state_elements=max(1, max(n.state_bytes // 4 for n in graph.nodes)),
    optimizer_bytes=4 * optimizer_slots * kept + _OPTIMIZER_SCALARS,
    stash_elements=0,
    channel_elements=0,
    batch_bytes=0,
    work_bytes=0,
    table_bytes=0,
    replicas=1,
    own_param_elements=(),
    stages=(),
  )
  held = device_bytes(floor)
  return sum(held[kind] for kind in kinds), heaviest.name


def plan_memory(
  graph: OpGraph,
  plan: Plan,
  optimizer_slots: int = DEFAULT_OPTIMIZER_SLOTS,
  recompute: bool = False,
  in_flight: Sequence[int] | None = None,
) -> MemoryReport:
  """The planner's per-device memory of `plan` (`plan_holdings`)."""
  return MemoryReport.from_holdings(
    plan_holdings(graph, plan, optimizer_slots, recompute, in_flight),
    "planner",
  )


def check_memory(
  graph: OpGraph,
  plan: Plan,
  memory_bytes: float,
  optimizer_slots: int = DEFAULT_OPTIMIZER_SLOTS,
) -> MemoryReport:
  """`plan_memory(graph, plan)`, or `PlanError` if a device is over budget.

  The error names the device, its bytes by kind and what would help.
  """
  report = plan_memory(graph, plan, optimizer_slots)
  if report.largest <= memory_bytes:
    return report
  raise PlanError(over_budget_message(graph, plan, report, memory_bytes))


def over_budget_message(
  graph, plan, report, memory_bytes, devices_hint=True, kinds=KINDS
) -> str:
  """Why `plan` does not fit, and what to change.

  No remedy is offered where none can work: under `memory_floor` (of the
  `kinds` the budget bounds) no plan on any number of devices fits.
  `devices_hint=False` leaves out "more devices" (the no-plan error says
  itself whether more devices fit).
  """
  counted = [sum(k[kind] for kind in kinds) for k in report.per_device]
  device = max(range(len(counted)), key=lambda d: counted[d])
  text = report.describe(device)
  if set(kinds) != set(KINDS):
    # The budget bounds some kinds only: their sum is what is over it.
    text += f"; of it {', '.join(kinds)} take {_gib(counted[device])}"
  text += f", {over_budget(counted[device], memory_bytes)} per device"
  if memory_bytes < memory_floor(graph, kinds=kinds)[0]:
    return text
  hints = []
  heavy = max(
    plan.stages,
    key=lambda s: graph.variable_bytes(s.nodes),
  )
  if devices_hint:
    hints.append(
      "more devices (every device holds slots the size of the largest "
      f"stage, stage {heavy.id}; more stages make it smaller)"
    )
  saved = plan_memory(graph, plan, recompute=True).largest
  if saved < 0.99 * report.largest:
    hints.append(
      f"recompute=True (no residual stash: {_gib(saved)} per device)"
    )
  if plan.micro_batch_size > 1:
    hints.append(
      "a smaller micro-batch (stashes and working memory shrink with it)"
    )
  if not hints:
    return text
  return f"{text}; try {'; or '.join(hints)}"


def over_budget(total: float, budget: float) -> str:
  """'over the budget of X GiB', saying by how much where `total` and
  `budget` print alike (over by under 0.5%)."""
  text = _gib(budget)
  if text == _gib(total):
    excess = total - budget
    text += (
      f" (by {excess / 2**20:.3g} MiB)"
      if excess >= 2**20
      else f" (by {excess:,.0f} B)"
    )
  return f"over the budget of {text}"
