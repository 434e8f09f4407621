"""Stage and plan costs on top of any cost model: what the planners minimise.

  costs = StageCosts(graph, cost_model, batch_size=64, num_devices=8,
                     memory_bytes=16e9)
  costs.time_per_sample(nodes, micro_batch=4, num_devices=2)
  estimate_iteration_time(plan, graph, cost_model)

`StageCosts` prices candidate stages for the planners (time per sample,
in-flight capacity under the memory rule); `estimate_iteration_time`
prices a whole plan from its critical path.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from graphpipe.core.cost_model import CostModel
from graphpipe.core.graph import OpGraph
from graphpipe.core.memory import KINDS, stage_memory_bytes
from graphpipe.core.runnable import replica_counts
from graphpipe.core.stages import Plan


class StageCosts:
  """Time and memory of candidate stages: what every planner minimises.

  A stage on k devices runs each micro-batch of b samples as k replicas of
  b / k samples (k must divide b). Per iteration of B samples (m = B / b
  micro-batches) it is busy for

    m * max(compute(b / k), transfers(b / k)) + all-reduce + optimizer

  where compute is the forward and backward of its nodes, transfers the
  busier direction of its boundary traffic (transfers overlap compute), the
  all-reduce that of its parameter bytes over its k devices, and the
  optimizer Adam's update. Divided by B that is the stage's time per sample;
  the bottleneck stage's bounds the pipeline's throughput. Memory here is
  each stage's own (`graphpipe.core.memory.stage_memory_bytes`); whole
  plans must also fit the per-device rule (`plan_memory`).

  Transfers are priced on the slowest link the plan may use (between nodes
  once it spans nodes) and all-reduces on devices 0..k-1, since device
  placement comes after partitioning.

  Example:
    >>> from graphpipe.costs import AnalyticCostModel, device_spec
    >>> graph = capture_zoo("two_branch", "paper")   # the case study
    >>> costs = StageCosts(graph, AnalyticCostModel(device_spec("v100")),
    ...                    batch_size=8, num_devices=8, memory_bytes=16e9)
    >>> costs.time_per_sample((0, 1), micro_batch=4, num_devices=2)  # s
    0.00233...
    >>> costs.in_flight_capacity((0, 1), micro_batch=4, num_devices=2)
    257

  Args:
    graph: the operator graph.
    cost_model: any `graphpipe.core.cost_model.CostModel`.
    batch_size: samples per iteration.
    num_devices: devices the plan may use.
    memory_bytes: capacity of one device.
    memory_kinds: the kinds of `graphpipe.core.memory.KINDS` that
      `memory_bytes` bounds (`graphpipe.plan`'s `memory_kinds`).
    shardings: the stage layouts plans may use
      (`graphpipe.core.stages.SHARDINGS`); with 'zero1' every stage on
      several devices shards its optimizer state (ZeRO-1: the same
      communication as the all-reduce, a k-th of the optimizer's state
      and update, so it is never the worse layout), and its memory and
      optimizer time count that.
  """

  def __init__(
    self,
    graph: OpGraph,
    cost_model,
    batch_size: int,
    num_devices: int,
    memory_bytes: float,
    memory_kinds: Sequence[str] = KINDS,
    shardings: Sequence[str] = ("replicated",),
  ):
    self.graph = graph
    self.memory_kinds = tuple(memory_kinds)
    self.shardings = tuple(shardings)
    self.zero = "zero1" in self.shardings
    self.cost_model = cost_model
    self.batch_size = batch_size
    self.num_devices = num_devices
    self.memory_bytes = float(memory_bytes)
    self._far_device = num_devices - 1
    self._times: dict[float, tuple[np.ndarray, np.ndarray]] = {}
    self._cache: dict[tuple, object] = {}
    # ('ranked', parameter bytes, devices) -> every block start, fastest
    # all-reduce first (`graphpipe.planning.assemble.place_devices`).
    self.block_times: dict[tuple, list[int]] = {}

  def replica_counts(self, micro_batch: int) -> list[int]:
    """Data-parallel degrees a stage of `micro_batch` may take
    (`graphpipe.core.runnable.replica_counts`)."""
    key = ("replicas", micro_batch)
    if key not in self._cache:
      self._cache[key] = replica_counts(
        self.graph, micro_batch, self.num_devices
      )
    return self._cache[key]

  @staticmethod
  def share(micro_batch: int, num_devices: int) -> int | float:
    """Samples per device: micro_batch / num_devices (int when it divides)."""
    whole, rest = divmod(micro_batch, num_devices)
    return whole if not rest else micro_batch / num_devices

  def node_times(self, share: float) -> tuple[np.ndarray, np.ndarray]:
    """Forward and backward time of every node at `share` samples."""
    if share not in self._times:
      nodes = self.graph.nodes
      model = self.cost_model
      self._times[share] = (
        np.array([model.node_time(n, share, "fwd") for n in nodes]),
        np.array([model.node_time(n, share, "bwd") for n in nodes]),
      )
    return self._times[share]

  def work_floor(self, micro_batch: int) -> float:
    """Seconds no plan of `micro_batch`-sample micro-batches estimates
    under (`estimate_iteration_time`): every node's forward and backward
    over the batch, each at the replica count that makes it cheapest per
    sample, spread evenly over all devices.

    A stage on k devices spends k x (B / b) x (its forward and backward at
    b / k samples) device-seconds per iteration, its nodes' sums, and no
    estimate is shorter than its stages' (B / b) x (forward + backward):
    the stages' device-seconds, at most (devices) x the estimate, are at
    least this floor's.
    """
    key = ("floor", micro_batch)
    if key not in self._cache:
      cheapest = None
      for k in self.replica_counts(micro_batch):
        share = self.share(micro_batch, k)
        fwd, bwd = self.node_times(share)
        per_sample = (fwd + bwd) / share
        cheapest = (
          per_sample if cheapest is None else np.minimum(cheapest, per_sample)
        )
      work = 0.0 if cheapest is None else float(cheapest.sum())
      self._cache[key] = work * self.batch_size / self.num_devices
    return self._cache[key]

  def compute_time(
    self, nodes: Sequence[int], micro_batch: int, num_devices: int
  ) -> tuple[float, float]:
    """(forward, backward) seconds of one micro-batch on each replica."""
    fwd, bwd = self.node_times(self.share(micro_batch, num_devices))
    index = list(nodes)
    return float(fwd[index].sum()), float(bwd[index].sum())

  def boundary_bytes(self, nodes: Sequence[int]) -> tuple[float, float]:
    """(bytes in, bytes out) per sample across the stage's boundary.

    A value read by several nodes of the stage travels once, so each
    outside producer counts with its largest edge (as in the simulator).
    """
    key = ("boundary", tuple(nodes))
    if key not in self._cache:
      inside = set(nodes)
      incoming: dict[int, float] = {}
      outgoing: dict[int, float] = {}
      for e in self.graph.edges:
        if (e.src in inside) == (e.dst in inside):
          continue
        side = outgoing if e.src in inside else incoming
        side[e.src] = max(side.get(e.src, 0.0), e.bytes)
      self._cache[key] = (sum(incoming.values()), sum(outgoing.values()))
    return self._cache[key]

  def transfer_time(self, num_bytes: float) -> float:
    """A point-to-point transfer on the slowest link the plan may use."""
    return self.cost_model.transfer_time(num_bytes, 0, self._far_device)

  def sync_time(self, nodes: Sequence[int], num_devices: int) -> float:
    """All-reduce (over k devices) plus optimizer step, once per iteration."""
    key = ("sync", tuple(nodes), num_devices)
    if key not in self._cache:
      params = float(self.graph.variable_bytes(nodes))
      self._cache[key] = self.sync_time_of(params, num_devices)
    return self._cache[key]

  def sync_time_of(self, params: float, num_devices: int) -> float:
    """`sync_time` of a stage holding `params` parameter bytes."""
    if params <= 0:
      return 0.0
    key = ("sync of", params, num_devices)
    if key not in self._cache:
      reduce = 0.0
      if num_devices > 1:
        reduce = self.cost_model.allreduce_time(params, range(num_devices))
      self._cache[key] = reduce + self.cost_model.optimizer_time(
        params / self.optimizer_share(num_devices)
      )
    return self._cache[key]

  def optimizer_share(self, num_devices: int) -> int:
    """Devices a stage on `num_devices` shards its optimizer over (1: it
    replicates it)."""
    return num_devices if self.zero and num_devices > 1 else 1

  def sharding(self, num_devices: int) -> str:
    """The layout a stage on `num_devices` takes."""
    return "zero1" if self.optimizer_share(num_devices) > 1 else "replicated"

  def microbatch_time(
    self, nodes: Sequence[int], micro_batch: int, num_devices: int
  ) -> float:
    """Busy time per micro-batch: compute, or transfers if they are slower."""
    key = ("busy", tuple(nodes), micro_batch, num_devices)
    if key not in self._cache:
      fwd, bwd = self.compute_time(nodes, micro_batch, num_devices)
      share = self.share(micro_batch, num_devices)
      incoming, outgoing = self.boundary_bytes(nodes)
      comm = self.transfer_time(max(incoming, outgoing) * share)
      self._cache[key] = max(fwd + bwd, comm)
    return self._cache[key]

  def time_per_sample(
    self, nodes: Sequence[int], micro_batch: int, num_devices: int
  ) -> float:
    """The stage's busy time per iteration divided by the batch size."""
    key = ("tps", tuple(nodes), micro_batch, num_devices)
    if key not in self._cache:
      m = self.batch_size // micro_batch
      busy = m * self.microbatch_time(nodes, micro_batch, num_devices)
      busy += self.sync_time(nodes, num_devices)
      self._cache[key] = busy / self.batch_size
    return self._cache[key]

  def steady_time_per_sample(
    self, nodes: Sequence[int], micro_batch: int, num_devices: int
  ) -> float:
    """`time_per_sample` without the all-reduce and optimizer step.

    The planners' second metric: a stage that finishes its last backward
    before the pipeline drains does its gradient all-reduce and optimizer
    step while upstream stages still run, off the critical path; with few
    micro-batches per iteration, that is what the iteration time sees.
    """
    key = ("steady", tuple(nodes), micro_batch, num_devices)
    if key not in self._cache:
      m = self.batch_size // micro_batch
      busy = m * self.microbatch_time(nodes, micro_batch, num_devices)
      self._cache[key] = busy / self.batch_size
    return self._cache[key]

  def in_flight_capacity(
    self, nodes: Sequence[int], micro_batch: int, num_devices: int
  ) -> int:
    """Most in-flight micro-batches that fit memory (-1: not even weights)."""
    share = self.share(micro_batch, num_devices)
    key = ("cap", tuple(nodes), share, self.optimizer_share(num_devices))
    if key not in self._cache:
      nodes = list(nodes)
      kinds = {
        "kinds": self.memory_kinds,
        "optimizer_share": self.optimizer_share(num_devices),
      }
      static = stage_memory_bytes(self.graph, nodes, share, 0, **kinds)
      per_flight = (
        stage_memory_bytes(self.graph, nodes, share, 1, **kinds) - static
      )
      room = self.memory_bytes - static
      if room < 0:
        cap = -1
      elif per_flight <= 0 or math.isinf(room):
        cap = 1 << 30
      else:
        cap = int(room // per_flight)
        # Rounding must never let the planner exceed the shared rule.
        while cap > 0 and (
          stage_memory_bytes(self.graph, nodes, share, cap, **kinds)
          > self.memory_bytes
        ):
          cap -= 1
      self._cache[key] = cap
    return self._cache[key]


def estimate_iteration_time(
  p: Plan, graph: OpGraph, cost_model: CostModel
) -> float:
  """Seconds per iteration of `p`, from the pipeline's critical path.

  Per stage s with M_s micro-batches of b_s samples, forward f_s and
  backward g_s per micro-batch, n_s in flight and w_s = min(M_s, n_s)
  warm-up forwards:

  pace: warm-up forwards run back to back, at f_s or at the pace of
    predecessors that run theirs back to back (per sample);
  cadence: late in the iteration a stage that holds all its micro-batches
    in flight (M_s <= n_s) still runs forwards only (f_s); any other
    alternates forward and backward (f_s + g_s, or its busiest link) and
    its backwards wait for its successors' cadence;
  forwards: the first input arrives (a stage of b_s = k b_p takes k of a
    predecessor's micro-batches), w_s forwards follow at the pace, the
    other M_s - w_s one per cadence; the last forward also waits for every
    predecessor's last forward.
  drain: after its last forward a stage runs the w_s backwards it holds,
    from when the first of their gradients is back (a successor's last
    backwards run back to back, earlier ones at its cadence); the last
    also waits for the last gradients from every successor (they return
    in k pieces to a stage of b_p = b_s / k);
  end: each stage's all-reduce and optimizer step start after its own last
    backward; the iteration ends with the last of them.

  Example:
    >>> from graphpipe.costs import AnalyticCostModel, device_spec
    >>> graph = capture_zoo("two_branch", "paper")
    >>> p = graphpipe.plan(graph, num_devices=8, batch_size=8)
    >>> v100 = AnalyticCostModel(device_spec("v100"))
    >>> round(estimate_iteration_time(p, graph, v100) * 1e3, 2)   # ms
    28.45
    >>> report = graphpipe.simulate(p, graph, v100)   # the events agree
    >>> round(report.iteration_time_s * 1e3, 2)
    28.45

  Args:
    p: the plan.
    graph: its operator graph.
    cost_model: the cost model to time it with.
  """
  n = p.num_stages
  stages = p.stages
  size = [s.micro_batch_size for s in stages]
  count = [p.batch_size // b for b in size]
  share = [StageCosts.share(s.micro_batch_size, len(s.devices)) for s in stages]
  if isinstance(cost_model, NodeTimes):
    times = [
      cost_model.stage_times(graph, s.nodes, share[s.id]) for s in stages
    ]
    fwd = [f for f, _ in times]
    bwd = [b for _, b in times]
  else:
    fwd = [
      sum(
        cost_model.node_time(graph.nodes[i], share[s.id], "fwd")
        for i in s.nodes
      )
      for s in stages
    ]
    bwd = [
      sum(
        cost_model.node_time(graph.nodes[i], share[s.id], "bwd")
        for i in s.nodes
      )
      for s in stages
    ]
  owner = p.stage_of_node()
  # A value read by several nodes of a stage travels once (as simulated).
  largest: dict[tuple[int, int], dict[int, tuple[float, float]]] = {}
  for e in graph.edges:
    a, b = owner[e.src], owner[e.dst]
    if a != b:
      by_src = largest.setdefault((a, b), {})
      old = by_src.get(e.src, (0.0, 0.0))
      by_src[e.src] = (max(old[0], e.bytes), max(old[1], e.fixed_bytes))
  preds = [[] for _ in range(n)]
  succs = [[] for _ in range(n)]
  for a, b in p.stage_edges:
    succs[a].append(b)
    preds[b].append(a)
  # One transfer carries the smaller micro-batch of the two ends; the
  # larger end sends or receives `pieces` of them per own micro-batch.
  transfer, pieces = {}, {}
  for a, b in p.stage_edges:
    src, dst = stages[a], stages[b]
    pairs = max(len(src.devices), len(dst.devices))
    unit = min(size[a], size[b])
    values = largest.get((a, b), {}).values()
    total = sum(x * unit + fixed for x, fixed in values)
    transfer[(a, b)] = cost_model.transfer_time(
      total / pairs, src.devices[0], dst.devices[0]
    )
    pieces[(a, b)] = (size[a] // unit, size[b] // unit)
  busy = [fwd[s] + bwd[s] for s in range(n)]
  for (a, b), t in transfer.items():
    busy[a] = max(busy[a], pieces[(a, b)][0] * t)
    busy[b] = max(busy[b], pieces[(a, b)][1] * t)
  warm = [min(count[s], stages[s].in_flight) for s in range(n)]
  free = [count[s] <= stages[s].in_flight for s in range(n)]
  # Per sample: the pace of back-to-back forwards fed by predecessors that
  # also run back to back (warm-up), and the cadence late in the
  # iteration. (Explicit loops rather than max() over lists: the search
  # estimates thousands of plans.)
  early = [fwd[s] / size[s] for s in range(n)]
  for s in range(n):
    pace = early[s]
    for a in preds[s]:
      if early[a] > pace:
        pace = early[a]
    early[s] = pace
  cadence = [(fwd[s] if free[s] else busy[s]) / size[s] for s in range(n)]
  for s in reversed(range(n)):
    if not free[s]:
      slowest = cadence[s]
      for t in succs[s]:
        if cadence[t] > slowest:
          slowest = cadence[t]
      cadence[s] = slowest
  first_end = [0.0] * n
  forward_end = [0.0] * n
  for s in range(n):
    arrival = 0.0
    last = 0.0  # the last of the predecessors' last forwards here
    for a in preds[s]:
      moved = transfer[(a, s)]
      ready = first_end[a] + (size[s] // size[a] - 1) * early[a] * size[a]
      ready += moved
      arrival = ready if ready > arrival else arrival
      done = forward_end[a] + moved
      last = done if done > last else last
    first_end[s] = arrival + fwd[s]
    start = (
      arrival
      + (warm[s] - 1) * early[s] * size[s]
      + (count[s] - warm[s]) * cadence[s] * size[s]
    )
    # The last forward also waits for every predecessor's last forward.
    forward_end[s] = fwd[s] + (last if preds[s] and last > start else start)
  # Shared parameters held by several stages: their gradients are summed
  # by one all-reduce over every device (`graphpipe.runtime.shared`).
  shared = graph.exchanged_bytes([st.nodes for st in stages])
  exchange = 0.0
  if shared:
    every = sorted({d for st in stages for d in st.devices})
    exchange = cost_model.allreduce_time(shared, every)
  end = 0.0
  backward_end = [0.0] * n

  def gradient_ready(t: int, microbatch: int) -> float:
    """When stage t's backward of its micro-batch `microbatch` ends: its
    last w_t backwards run back to back, earlier ones at its cadence."""
    behind = count[t] - 1 - microbatch
    if behind < warm[t]:
      return backward_end[t] - behind * bwd[t]
    return (
      backward_end[t]
      - (warm[t] - 1) * bwd[t]
      - (behind - warm[t] + 1) * cadence[t] * size[t]
    )

  for s in reversed(range(n)):
    # After its last forward a stage owes the backwards of the w_s
    # micro-batches it holds (all of them under GPipe): they start when
    # the first of their gradients is back and end no sooner than the
    # last gradient allows.
    first = (count[s] - warm[s]) * size[s]  # its first owed sample
    start = forward_end[s]
    for t in succs[s]:
      back = gradient_ready(t, first // size[t]) + transfer[(s, t)]
      start = back if back > start else start
    finish = start + warm[s] * bwd[s]
    for t in succs[s]:
      back = backward_end[t] + pieces[(s, t)][0] * transfer[(s, t)] + bwd[s]
      finish = back if back > finish else finish
    backward_end[s] = finish
    sync = exchange
    update, reduce = _update_times(graph, stages[s], cost_model)
    if update is not None:
      sync += update
      if reduce is not None:
        sync += reduce
    end = max(end, backward_end[s] + sync)
  return end


def _update_times(graph: OpGraph, stage, cost_model) -> tuple:
  """(optimizer step, gradient all-reduce or None) of a stage, (None,
  None) without parameters; memoised by a `NodeTimes` model."""
  key = ("update", stage.nodes, stage.devices, stage.sharding)
  memo = cost_model._times if isinstance(cost_model, NodeTimes) else {}
  if key not in memo:
    params = graph.variable_bytes(stage.nodes)
    update = reduce = None
    if params > 0:
      update = cost_model.optimizer_time(params / updated_share(stage))
      if len(stage.devices) > 1:
        reduce = cost_model.allreduce_time(params, stage.devices)
    memo[key] = (update, reduce)
  return memo[key]


class NodeTimes:
  """A cost model whose answers are memoised (one search, one graph)."""

  def __init__(self, cost_model: CostModel):
    self.model = cost_model
    self.memory_bytes = cost_model.memory_bytes
    self._times: dict[tuple, float] = {}

  def node_time(self, node, batch, kind) -> float:
    key = (node.id, batch, kind)
    if key not in self._times:
      self._times[key] = self.model.node_time(node, batch, kind)
    return self._times[key]

  def stage_times(self, graph, nodes: tuple[int, ...], batch) -> tuple:
    """(forward, backward): the sums of `nodes`' node times, memoised (the
    same stages recur across the plans of a search)."""
    key = (nodes, batch)
    if key not in self._times:
      self._times[key] = tuple(
        sum(self.node_time(graph.nodes[i], batch, kind) for i in nodes)
        for kind in ("fwd", "bwd")
      )
    return self._times[key]

  def transfer_time(self, num_bytes, src, dst) -> float:
    key = ("transfer", num_bytes, src, dst)
    if key not in self._times:
      self._times[key] = self.model.transfer_time(num_bytes, src, dst)
    return self._times[key]

  def allreduce_time(self, num_bytes, devices) -> float:
    key = ("allreduce", num_bytes, tuple(devices))
    if key not in self._times:
      self._times[key] = self.model.allreduce_time(num_bytes, devices)
    return self._times[key]

  def optimizer_time(self, param_bytes) -> float:
    key = ("optimizer", param_bytes)
    if key not in self._times:
      self._times[key] = self.model.optimizer_time(param_bytes)
    return self._times[key]


def updated_share(stage) -> int:
  """The devices a planned stage's optimizer update is split over (ZeRO-1:
  each updates a k-th)."""
  return len(stage.devices) if stage.sharding == "zero1" else 1
