"""`simulate`: one training iteration of a plan, timed under a cost model.

The event model. Every stage runs its schedule's actions in order; all
devices of a data-parallel stage run each action together, on their share of
the micro-batch. An action starts when its stage is free and its inputs are
there, and lasts the sum of its nodes' times at the per-device micro-batch:

  forward  s, k: after the activations of micro-batch k arrived from every
                 predecessor stage;
  backward s, k: after its own forward of k, and after the gradients of k
                 arrived from every successor stage
(with per-stage sizes, "of k" means of the samples of s's micro-batch k).

When an action ends, its outputs (activations forward, activation gradients
backward) leave for each neighbouring stage: one transfer per pair of
sending and receiving devices (a stage edge between |D1| and |D2| devices
uses max(|D1|, |D2|) pairs, each carrying its share of edge bytes x
micro-batch). Transfers overlap with compute, but each directed device link
sends one transfer at a time, in order. With per-stage micro-batch sizes
(`graphpipe.core.stages`) a transfer carries the smaller end's
micro-batch: a stage k times larger than its predecessor waits for k of
its forwards, and its backward returns the gradients in k pieces. After
its last backward a data-parallel stage all-reduces its gradients over its
devices, then every device runs the optimizer step; the iteration ends
when the last device finishes.

Since every device's order is fixed, processing the actions by schedule tick
(each action's dependencies and device predecessor have smaller ticks) gives
exactly the times an event-driven run would.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from graphpipe.core.cost_model import CostModel, check_cost_model
from graphpipe.core.fingerprint import made_for
from graphpipe.core.graph import OpGraph
from graphpipe.core.memory import plan_holdings, plan_memory
from graphpipe.core.stages import Plan
from graphpipe.costs.analytic import PRESETS, AnalyticCostModel, device_spec
from graphpipe.errors import SimulationError
from graphpipe.schedules.builders import schedule_for
from graphpipe.schedules.checker import built_for, check_schedule
from graphpipe.schedules.grid import (
  BACKWARD,
  FORWARD,
  Action,
  Schedule,
  overlapping,
)
from graphpipe.simulator import timeline

_BUSY = ("forward", "backward", "allreduce", "exchange", "optimizer")


@dataclasses.dataclass(frozen=True)
class Report:
  """What `simulate` measured for one iteration of a plan.

  Example:
    >>> graph = capture_zoo("two_branch", "paper")   # the case study
    >>> plan = graphpipe.plan(graph, num_devices=8, batch_size=8)
    >>> report = simulate(plan, graph, AnalyticCostModel(device_spec("v100")))
    >>> print(report)
    graphpipe (1f1b): iteration 28.45 ms, 281.2 samples/s, bubble 20.1%,
    peak memory 2.18 GiB of 15.8 GiB, stash per stage [2, 2, 1]
    >>> report.save_trace("trace.json")   # open it in https://ui.perfetto.dev
    >>> report.save_gantt("schedule.png")

  Args:
    planner: the plan's planner.
    schedule_kind: '1f1b' or 'gpipe'.
    batch_size: samples per iteration.
    iteration_time_s: time from the first action to the last optimizer
      step.
    throughput_samples_per_s: batch_size / iteration_time_s.
    peak_memory_bytes: per device, what the runtime's step holds there
      (`graphpipe.core.memory.plan_memory`, the planner's rule): parameter
      and optimizer slots the size of the largest stage's, gradients,
      non-trainable state, stashes, channels, the batch, working memory.
    memory_capacity_bytes: one device's memory under the cost model.
    peak_stash: per stage, the most micro-batches stashed at once.
    busy_time_s: per device, time spent computing, all-reducing and
      updating.
    bubble_fraction: idle fraction of the used devices' time.
    device_stages: per device, the stage it runs (None: unused).
    events: the timeline (see `graphpipe.simulator.timeline`).
  """

  planner: str
  schedule_kind: str
  batch_size: int
  iteration_time_s: float
  throughput_samples_per_s: float
  peak_memory_bytes: tuple[float, ...]
  memory_capacity_bytes: float
  peak_stash: tuple[int, ...]
  busy_time_s: tuple[float, ...]
  bubble_fraction: float
  device_stages: tuple[int | None, ...]
  events: tuple[timeline.TraceEvent, ...] = dataclasses.field(repr=False)

  @property
  def max_peak_memory_bytes(self) -> float:
    """The largest per-device peak."""
    return max(self.peak_memory_bytes, default=0.0)

  @property
  def fits_memory(self) -> bool:
    """Whether every device's peak fits its memory."""
    return self.max_peak_memory_bytes <= self.memory_capacity_bytes

  def track_names(self) -> dict[int, str]:
    """A trace track name per used device, e.g. 'device 3 (stage 1)'."""
    return {
      d: f"device {d} (stage {s})"
      for d, s in enumerate(self.device_stages)
      if s is not None
    }

  def to_dict(self) -> dict:
    """The figures as a JSON-ready dict (without the events)."""
    out = {
      f.name: getattr(self, f.name)
      for f in dataclasses.fields(self)
      if f.name != "events"
    }
    out["max_peak_memory_bytes"] = self.max_peak_memory_bytes
    out["fits_memory"] = self.fits_memory
    return out

  def trace(self) -> dict:
    """The timeline in Chrome/Perfetto's trace format."""
    return timeline.chrome_trace(self.events, self.track_names(), self._facts())

  def save_trace(self, path: str) -> None:
    """Writes `trace()` as JSON (open it in https://ui.perfetto.dev)."""
    timeline.save_chrome_trace(
      path, self.events, self.track_names(), self._facts()
    )

  def save_gantt(self, path: str, title: str = "") -> None:
    """Draws the timeline as a Gantt chart PNG (needs matplotlib)."""
    title = title or self._title()
    timeline.save_gantt(path, self.events, self.track_names(), title)

  def draw_gantt(self, axes, title: str = "", end_s: float | None = None):
    """Draws the timeline on matplotlib `axes` (`timeline.draw_gantt`).

    Example:
      >>> from matplotlib.figure import Figure
      >>> graph = capture_zoo("two_branch", "tiny")
      >>> plans = [graphpipe.plan(graph, 4, 8, planner=p)
      ...          for p in ("graphpipe", "sequential")]
      >>> reports = [simulate(p, graph) for p in plans]
      >>> end = max(r.iteration_time_s for r in reports)   # one time scale
      >>> figure = Figure(figsize=(12, 5))
      >>> for i, r in enumerate(reports):
      ...   r.draw_gantt(figure.add_subplot(2, 1, i + 1), end_s=end)

    Args:
      axes: a matplotlib `Axes`.
      title: the chart title (default: planner, iteration time, bubble).
      end_s: the right end of the time axis in seconds.
    """
    timeline.draw_gantt(
      axes, self.events, self.track_names(), title or self._title(), end_s
    )

  def _title(self) -> str:
    return (
      f"{self.planner} ({self.schedule_kind}): "
      f"{self.iteration_time_s * 1e3:.3g} ms/iteration, bubble "
      f"{self.bubble_fraction:.0%}"
    )

  def _facts(self) -> dict:
    return {
      "planner": self.planner,
      "schedule": self.schedule_kind,
      "iteration_time_s": self.iteration_time_s,
      "bubble_fraction": self.bubble_fraction,
    }

  def __str__(self) -> str:
    gib = 2**30
    return (
      f"{self.planner} ({self.schedule_kind}): iteration "
      f"{self.iteration_time_s * 1e3:.4g} ms, "
      f"{self.throughput_samples_per_s:.4g} samples/s, bubble "
      f"{self.bubble_fraction:.1%}, peak memory "
      f"{self.max_peak_memory_bytes / gib:.3g} GiB of "
      f"{self.memory_capacity_bytes / gib:.3g} GiB, stash per stage "
      f"{list(self.peak_stash)}"
    )


def simulate(
  plan: Plan,
  graph: OpGraph,
  cost_model: CostModel | None = None,
  schedule: Schedule | None = None,
  lockstep: bool = False,
) -> Report:
  """Times one training iteration of `plan` (see the module docstring).

  Example:
    >>> graph = capture_zoo("two_branch", "paper")   # the case study
    >>> for planner in ("graphpipe", "sequential"):
    ...   report = simulate(graphpipe.plan(graph, 8, 8, planner=planner), graph)
    ...   print(planner, round(report.throughput_samples_per_s), "samples/s")
    graphpipe 281 samples/s
    sequential 222 samples/s

  Args:
    plan: the stage DAG.
    graph: the OpGraph the plan partitions (for node costs and edge bytes).
    cost_model: times of nodes, transfers, all-reduces and optimizer steps;
      default: the model the plan was made with, else (a plan read from
      JSON) the analytic model of the plan's device preset ('v100' when the
      plan names none).
    schedule: the action order; default `schedule_for(plan)`. A given one
      is checked first.
    lockstep: time the schedule as `graphpipe.runtime` executes it: tick by
      tick, every tick lasting until its slowest action and its transfers
      are done (one SPMD program with collectives at every tick), instead
      of each stage starting as soon as its inputs arrive; and every
      backward adding its gradient to accumulated slots the size of the
      largest stage's trainable parameters (SPMD slots: a light stage's
      device adds as many bytes as the heaviest's), priced by the cost
      model's `gradient_add_time`, which lockstep then needs.
  """
  if not isinstance(plan, Plan) or not isinstance(graph, OpGraph):
    raise SimulationError(
      f"simulate(plan, graph) takes a Plan and an OpGraph, got "
      f"{type(plan).__name__} and {type(graph).__name__}"
    )
  if schedule is not None and not isinstance(schedule, Schedule):
    raise SimulationError(
      f"schedule must be a Schedule (e.g. graphpipe.schedule_for(plan, "
      f"'gpipe')), got {schedule!r}"
    )
  if cost_model is None:
    cost_model = plan.cost_model
    if cost_model is None:
      cost_model = _preset_model(plan.device or "v100")
  check_cost_model(cost_model, SimulationError)
  if not isinstance(lockstep, bool):
    raise SimulationError(f"lockstep must be True or False, got {lockstep!r}")
  if schedule is None:
    schedule = schedule_for(plan)
  else:
    check_schedule(schedule)
  _check_fit(plan, graph, schedule)
  accumulate = _gradient_add(plan, graph, cost_model) if lockstep else 0.0
  iteration_time, events, device_end = _timeline(
    plan, graph, cost_model, schedule, lockstep, record=True, add=accumulate
  )
  num_stages = plan.num_stages

  busy = [0.0] * plan.num_devices
  for e in events:
    if e.category in _BUSY:
      busy[e.device] += e.duration_s
  used = sorted(device_end)
  capacity = len(used) * iteration_time
  bubble = 1.0 - sum(busy[d] for d in used) / capacity if capacity else 0.0
  peak_stash = tuple(_peak_stash(schedule, s) for s in range(num_stages))
  # The planner's and the runtime's rule: what the SPMD step holds on
  # every device (`graphpipe.core.memory.plan_memory`).
  memory = list(plan_memory(graph, plan, in_flight=peak_stash).totals)
  device_stages: list[int | None] = [None] * plan.num_devices
  for stage in plan.stages:
    for device in stage.devices:
      device_stages[device] = stage.id
  return Report(
    planner=plan.planner,
    schedule_kind=schedule.kind,
    batch_size=plan.batch_size,
    iteration_time_s=iteration_time,
    throughput_samples_per_s=(
      plan.batch_size / iteration_time if iteration_time > 0 else float("inf")
    ),
    peak_memory_bytes=tuple(memory),
    memory_capacity_bytes=float(cost_model.memory_bytes),
    peak_stash=peak_stash,
    busy_time_s=tuple(busy),
    bubble_fraction=max(0.0, bubble),
    device_stages=tuple(device_stages),
    events=tuple(events),
  )


def simulated_iteration_time(
  plan: Plan, graph: OpGraph, cost_model: CostModel, lockstep: bool = False
) -> float:
  """`simulate(plan, graph, cost_model, lockstep=lockstep).iteration_time_s`,
  without the report (no trace, memory or bubble figures): what a planner
  ranks its candidates by, thousands of times a search."""
  schedule = schedule_for(plan)
  _check_fit(plan, graph, schedule)
  add = _gradient_add(plan, graph, cost_model) if lockstep else 0.0
  return _timeline(
    plan, graph, cost_model, schedule, lockstep, record=False, add=add
  )[0]


def _gradient_add(plan: Plan, graph: OpGraph, cost_model: CostModel) -> float:
  """Seconds each backward of the runtime's step spends adding its
  gradient to the accumulated slots (`graphpipe.runtime.slots.scatter`:
  whole slots, the size of the largest stage's trainable parameters)."""
  if not any(graph.variable_bytes(s.nodes, "param") for s in plan.stages):
    return 0.0
  if not hasattr(cost_model, "gradient_add_time"):
    raise SimulationError(
      "lockstep=True times the runtime's step, whose backwards add their "
      "gradients to slot-sized accumulators: the cost model needs "
      "gradient_add_time(num_bytes) (AnalyticCostModel and "
      "ProfiledCostModel have it)"
    )
  slots = plan_holdings(graph, plan).param_elements
  return cost_model.gradient_add_time(4 * slots)


def _timeline(
  plan: Plan,
  graph: OpGraph,
  cost_model: CostModel,
  schedule: Schedule,
  lockstep: bool,
  record: bool,
  add: float = 0.0,
) -> tuple[float, list, dict]:
  """(iteration time, trace events (with `record`), per device its end);
  `add`: seconds added to every backward (`_gradient_add`)."""
  num_stages = plan.num_stages
  share = [_per_device(s.micro_batch_size, len(s.devices)) for s in plan.stages]
  compute = {
    kind: [
      sum(cost_model.node_time(graph.nodes[n], share[s.id], k) for n in s.nodes)
      for s in plan.stages
    ]
    for kind, k in ((FORWARD, "fwd"), (BACKWARD, "bwd"))
  }
  edge_bytes = _stage_edge_bytes(plan, graph)
  events: list[timeline.TraceEvent] = []
  stage_free = [0.0] * num_stages
  link_free: dict[tuple[int, int], float] = {}
  arrival: dict[Action, float] = {}
  finish: dict[Action, float] = {}

  counts = plan.stage_microbatches

  def send(action, src, dst, samples):
    """Transfers `samples` of `action`'s outputs from stage src to dst;
    returns their arrival."""
    per_sample, fixed = edge_bytes.get(
      (min(src, dst), max(src, dst)), (0.0, 0.0)
    )
    total = per_sample * samples + fixed
    senders, receivers = plan.stages[src].devices, plan.stages[dst].devices
    pairs = max(len(senders), len(receivers))
    latest = finish[action]
    for i in range(pairs):
      link = (senders[i % len(senders)], receivers[i % len(receivers)])
      duration = cost_model.transfer_time(total / pairs, *link)
      start = max(finish[action], link_free.get(link, 0.0))
      link_free[link] = start + duration
      latest = max(latest, start + duration)
      if record and duration > 0:
        what = "act" if action.kind == FORWARD else "grad"
        events.append(
          timeline.TraceEvent(
            f"{what} {action} {src}->{dst}",
            "transfer",
            link[1],
            start,
            duration,
            lane=f"from dev {link[0]}",
            args={"bytes": total / pairs, "from_device": link[0]},
          )
        )
    return latest

  ticks = schedule.ticks()
  tick_start, tick_end, current = 0.0, 0.0, -1
  for action in sorted(ticks, key=ticks.__getitem__):
    stage, k = action.stage, action.microbatch
    if lockstep and ticks[action] != current:
      current, tick_start = ticks[action], tick_end
    start = max(stage_free[stage], tick_start)
    if action.kind == BACKWARD:
      start = max(start, finish[Action(stage, FORWARD, k)])
    start = max(start, arrival.get(action, 0.0))
    duration = compute[action.kind][stage]
    if action.kind == BACKWARD:
      duration += add
    finish[action] = start + duration
    stage_free[stage] = start + duration
    for device in plan.stages[stage].devices if record else ():
      events.append(
        timeline.TraceEvent(
          str(action),
          "forward" if action.kind == FORWARD else "backward",
          device,
          start,
          duration,
          args={"stage": stage, "microbatch": k},
        )
      )
    if action.kind == FORWARD:
      neighbours = plan.successors(stage)
    else:
      neighbours = plan.predecessors(stage)
    tick_end = max(tick_end, finish[action])
    for other in neighbours:
      # One transfer per micro-batch of the other end that shares samples
      # with this one (k pieces back to a k times smaller predecessor).
      pieces = overlapping(k, counts[stage], counts[other])
      samples = min(
        plan.stages[stage].micro_batch_size,
        plan.stages[other].micro_batch_size,
      )
      for i in pieces:
        needed_by = Action(other, action.kind, i)
        arrival[needed_by] = max(
          arrival.get(needed_by, 0.0), send(action, stage, other, samples)
        )
        tick_end = max(tick_end, arrival[needed_by])

  if lockstep:  # the scan ends for every device at once
    stage_free = [tick_end] * num_stages
  # Copies of shared parameters: one all-reduce (`runtime.shared`).
  shared = graph.exchanged_bytes([s.nodes for s in plan.stages])
  every = range(plan.num_devices)
  exchange = cost_model.allreduce_time(shared, every) if shared else 0.0
  device_end = {}
  for stage in plan.stages:
    params = graph.variable_bytes(stage.nodes)
    clock = stage_free[stage.id]
    steps = []
    if exchange:
      steps.append(("exchange", exchange))
    if len(stage.devices) > 1 and params > 0:
      steps.append(
        ("allreduce", cost_model.allreduce_time(params, stage.devices))
      )
    if params > 0:
      # (a ZeRO-1 stage's devices each update a k-th)
      share = len(stage.devices) if stage.sharding == "zero1" else 1
      steps.append(("optimizer", cost_model.optimizer_time(params / share)))
    for name, duration in steps:
      for device in stage.devices if record else ():
        events.append(
          timeline.TraceEvent(
            f"{name} {stage.id}",
            name,
            device,
            clock,
            duration,
            args={"stage": stage.id, "param_bytes": params},
          )
        )
      clock += duration
    for device in stage.devices:
      device_end[device] = clock
  return max(device_end.values()), events, device_end


def _per_device(micro_batch: int, num_devices: int) -> int | float:
  """A device's share of a micro-batch (whole when it divides evenly)."""
  whole, rest = divmod(micro_batch, num_devices)
  return whole if not rest else micro_batch / num_devices


def _peak_stash(schedule: Schedule, stage: int) -> int:
  """The most forwards of `stage` whose backward had not yet run."""
  stashed = peak = 0
  for _, action in schedule.stage_actions(stage):
    stashed += 1 if action.kind == FORWARD else -1
    peak = max(peak, stashed)
  return peak


def _stage_edge_bytes(
  plan: Plan, graph: OpGraph
) -> dict[tuple[int, int], tuple[float, float]]:
  """(bytes per sample, fixed bytes) crossing each stage edge.

  A value read by several nodes of the receiving stage travels once, so a
  source node counts with its largest edge into that stage.
  """
  stage_of = plan.stage_of_node()
  largest: dict[tuple[int, int], dict[int, tuple[float, float]]] = {}
  for e in graph.edges:
    src, dst = stage_of[e.src], stage_of[e.dst]
    if src == dst:
      continue
    if (src, dst) not in plan.stage_edges:
      raise SimulationError(
        f"operator edge {e.src}->{e.dst} goes from stage {src} to stage "
        f"{dst}, but the plan has no stage edge {src}->{dst}: the plan does "
        "not match the graph (re-plan it for this graph)"
      )
    by_node = largest.setdefault((src, dst), {})
    old = by_node.get(e.src, (0.0, 0.0))
    by_node[e.src] = (max(old[0], e.bytes), max(old[1], e.fixed_bytes))
  return {
    edge: (sum(b for b, _ in v.values()), sum(f for _, f in v.values()))
    for edge, v in largest.items()
  }


def _check_fit(plan: Plan, graph: OpGraph, schedule: Schedule) -> None:
  """Raises `SimulationError` unless plan, graph and schedule match."""
  covered = sorted(n for s in plan.stages for n in s.nodes)
  if covered != list(range(len(graph.nodes))):
    raise SimulationError(
      f"the plan's stages hold nodes {_short(covered)} but the graph has "
      f"nodes 0..{len(graph.nodes) - 1}: every node must be in exactly one "
      "stage (re-plan for this graph)"
    )
  for stage in plan.stages:
    if plan.micro_batch_sizes[stage.id] % len(stage.devices):
      raise SimulationError(
        f"stage {stage.id}'s micro-batch of "
        f"{plan.micro_batch_sizes[stage.id]} does not split evenly over its "
        f"{len(stage.devices)} devices (check_plan and the runtime refuse "
        "it too)"
      )
  if not made_for(plan, graph):
    raise SimulationError(
      "this plan was made for another graph (fingerprints differ): plan "
      "the graph you simulate"
    )
  if not built_for(schedule, plan):
    raise SimulationError(
      "the schedule was built for another plan (stages, devices, edges or "
      "micro-batch counts differ): build it with schedule_for(plan)"
    )


def _preset_model(device: str) -> AnalyticCostModel:
  """The analytic model of the preset a plan names."""
  if device.lower() not in PRESETS:
    raise SimulationError(
      f"the plan was made for device {device!r}, not a preset: pass the "
      "cost model it was made with, simulate(plan, graph, cost_model)"
    )
  return AnalyticCostModel(device_spec(device))


def _short(ids: Sequence[int]) -> str:
  text = str(list(ids))
  return text if len(text) < 60 else text[:57] + "...]"
