"""PipeDream's published partitioner, as an independent reference.

  python -m experiments.pipedream --models=mmt,candle_uno,transformer \\
    --devices=4,8,16 --out=/tmp/pipedream

PipeDream (Narayanan et al., SOSP 2019, section 3.1) cuts a linearised
operator chain with the dynamic program

  A(j, m) = min( T(1..j, m),
                 min over i < j, m' < m of
                   max(A(i, m - m'), 2 a_i / bw, T(i+1..j, m')) )
  T(i..j, m') = (compute of layers i..j + all-reduce of their weights
                 over m' replicas) / m'

A(j, m) is the slowest stage's time per iteration when layers 1..j run on
m devices, the last stage holding layers i+1..j on m' data-parallel
replicas, and a_i the bytes crossing the cut after layer i. This module
writes that recurrence down from the paper, on the same node costs as the
planners (a cost model's `node_time`, `transfer_time`, `allreduce_time`)
and nothing else of `graphpipe.planning`: it is the yardstick the tests
and `experiments.reproduce` hold the `sequential` planner to. Units: one
iteration of B samples in B / b micro-batches of b; compute is the
forward and backward of every micro-batch at b samples (the published T
divides it by m'); a_i is moved forward and back for every micro-batch on
the slowest link of the allocation. Replica counts must divide b (our
runtime splits each micro-batch over a stage's replicas). Ties are broken
by the first minimum in loop order (`tie="first"`) or the last
(`tie="last"`); both are checked. PipeDream ignores memory: a partition
that does not fit the plan's memory rule is reported and not counted.

The check (`check`): for each micro-batch size the planners search (powers
of two dividing B), PipeDream's partition of the operator id order (the
capture's topological order, branch by branch) becomes a 1F1B chain plan,
placed on consecutive devices and, separately, with the planners' device
placement; each is simulated with `graphpipe.simulate`, and the fastest is
compared with the `sequential` planner's plan.
"""

from __future__ import annotations

import dataclasses
import math
import time

from absl import app, flags

from experiments import common
from graphpipe import models, plan
from graphpipe.core.graph import OpGraph
from graphpipe.core.memory import stage_memory_bytes
from graphpipe.core.stages import Plan, Stage, in_flight_counts
from graphpipe.costs import AnalyticCostModel, device_spec
from graphpipe.planning.assemble import place_devices
from graphpipe.planning.candidates import Partition
from graphpipe.simulator.engine import simulate

_INF = math.inf


def cut_bytes(graph: OpGraph, order: tuple[int, ...]) -> list[float]:
  """Per position i, bytes per sample crossing the cut after order[i].

  A value read by several later nodes crosses once (its producer counts
  with its largest edge over the cut).
  """
  position = {v: i for i, v in enumerate(order)}
  out = []
  for i in range(len(order)):
    largest: dict[int, float] = {}
    for e in graph.edges:
      if position[e.src] <= i < position[e.dst]:
        largest[e.src] = max(largest.get(e.src, 0.0), e.bytes)
    out.append(sum(largest.values()))
  return out


class Recurrence:
  """The terms of PipeDream's recurrence on one chain and micro-batch size.

  `stage_time(first, last, m')` is T(first..last, m') and `comm[i]` the
  2 a_i / bw term of the cut after position i (module docstring).

  Args:
    graph: the operator graph.
    cost_model: node, transfer and all-reduce times.
    num_devices: machines.
    batch_size: samples per iteration.
    micro_batch: samples per micro-batch.
    order: the linearisation (node ids).
  """

  def __init__(
    self, graph, cost_model, num_devices, batch_size, micro_batch, order
  ):
    self.order = tuple(order)
    self.micro_batch = micro_batch
    self.micro_batches = batch_size // micro_batch
    self.cost_model = cost_model
    step = [
      cost_model.node_time(graph.nodes[v], micro_batch, "fwd")
      + cost_model.node_time(graph.nodes[v], micro_batch, "bwd")
      for v in self.order
    ]
    self.prefix_step = [0.0]
    self.prefix_weights = [0.0]
    for v, s in zip(self.order, step, strict=True):
      self.prefix_step.append(self.prefix_step[-1] + s)
      self.prefix_weights.append(
        self.prefix_weights[-1] + graph.nodes[v].param_bytes
      )
    slow_link = (0, max(num_devices - 1, 0))
    self.comm = [
      2
      * self.micro_batches
      * cost_model.transfer_time(a * micro_batch, *slow_link)
      for a in cut_bytes(graph, self.order)
    ]

  def stage_time(self, first: int, last: int, replicas: int) -> float:
    """T(first..last, replicas): infinite if replicas do not divide b."""
    if self.micro_batch % replicas:
      return _INF
    compute = self.micro_batches * (
      self.prefix_step[last + 1] - self.prefix_step[first]
    )
    params = self.prefix_weights[last + 1] - self.prefix_weights[first]
    reduce = 0.0
    if replicas > 1 and params > 0:
      reduce = self.cost_model.allreduce_time(params, range(replicas))
    return (compute + reduce) / replicas

  def bottleneck(self, stages: list[tuple[int, int, int]]) -> float:
    """The objective of a partition [(first, last, replicas)] in order."""
    times = [self.stage_time(f, z, k) for f, z, k in stages]
    cuts = [self.comm[z] for _, z, _ in stages[:-1]]
    return max(times + cuts)


def partition(
  graph: OpGraph,
  cost_model,
  num_devices: int,
  batch_size: int,
  micro_batch: int,
  tie: str = "first",
  order: tuple[int, ...] | None = None,
) -> list[tuple[tuple[int, ...], int]] | None:
  """PipeDream's partition: [(node ids, replicas)] in chain order, or None.

  Example:
    >>> partition(graph, AnalyticCostModel(device_spec("v100")), 8, 256, 64)
    [((0, 1, 2, 3), 1), ...]

  Args:
    graph: the operator graph.
    cost_model: node, transfer and all-reduce times.
    num_devices: machines (PipeDream uses all of them).
    batch_size: samples per iteration.
    micro_batch: samples per micro-batch (replica counts divide it).
    tie: 'first' or 'last' minimum in loop order.
    order: the linearisation; default the node id order.
  """
  order = tuple(order if order is not None else range(len(graph.nodes)))
  terms = Recurrence(
    graph, cost_model, num_devices, batch_size, micro_batch, order
  )
  n, m_total = len(order), num_devices

  def better(new: float, old: float) -> bool:
    return new < old if tie == "first" else new <= old

  # best[j][m]: (A(j, m), choice) for layers 0..j on exactly m machines.
  best = [[(_INF, None)] * (m_total + 1) for _ in range(n)]
  for j in range(n):
    for m in range(1, m_total + 1):
      value, choice = terms.stage_time(0, j, m), ("whole",)
      if value == _INF:
        choice = None
      for i in range(j):
        for replicas in range(1, m):
          before = best[i][m - replicas][0]
          if before == _INF:
            continue
          candidate = max(
            before, terms.comm[i], terms.stage_time(i + 1, j, replicas)
          )
          if candidate < _INF and better(candidate, value):
            value, choice = candidate, (i, replicas)
      best[j][m] = (value, choice)
  machines = next(
    (m for m in range(m_total, 0, -1) if best[n - 1][m][0] < _INF), None
  )
  if machines is None:
    return None
  stages, j, m = [], n - 1, machines
  while True:
    _, choice = best[j][m]
    if choice[0] == "whole":
      stages.append((tuple(sorted(order[: j + 1])), m))
      break
    i, replicas = choice
    stages.append((tuple(sorted(order[i + 1 : j + 1])), replicas))
    j, m = i, m - replicas
  return stages[::-1]


def chain_plans(
  graph: OpGraph,
  stages: list[tuple[tuple[int, ...], int]],
  batch_size: int,
  num_devices: int,
  micro_batch: int,
  cost_model,
) -> list[Plan]:
  """A 1F1B chain plan of a partition, on consecutive devices and placed
  by the planners' rule (data-parallel groups inside a node)."""
  owner = {v: s for s, (nodes, _) in enumerate(stages) for v in nodes}
  edges = {
    (owner[e.src], owner[e.dst])
    for e in graph.edges
    if owner[e.src] != owner[e.dst]
  }
  edges |= {(s, s + 1) for s in range(len(stages) - 1)}
  edges = tuple(sorted(edges))
  in_flight = in_flight_counts(len(stages), edges)
  consecutive, first = [], 0
  for _, k in stages:
    consecutive.append(tuple(range(first, first + k)))
    first += k
  placed = place_devices(
    graph, Partition(tuple(stages), micro_batch), cost_model, num_devices
  )
  plans = []
  for devices in dict.fromkeys([tuple(consecutive), tuple(placed)]):
    plans.append(
      Plan(
        planner="pipedream",
        stages=tuple(
          Stage(s, nodes, devices[s], micro_batch, in_flight[s])
          for s, (nodes, _) in enumerate(stages)
        ),
        stage_edges=edges,
        batch_size=batch_size,
        num_devices=num_devices,
      )
    )
  return plans


def fits(plan: Plan, graph: OpGraph, memory_bytes: float) -> bool:
  """Whether every stage fits memory under the plans' memory rule."""
  return all(
    stage_memory_bytes(
      graph, s.nodes, s.micro_batch_size / len(s.devices), s.in_flight
    )
    <= memory_bytes
    for s in plan.stages
  )


@dataclasses.dataclass
class Comparison:
  """PipeDream's best simulated partition against the `sequential` plan.

  Attributes:
    model: the graph's model name.
    num_devices: devices.
    batch_size: samples per iteration.
    sequential_s: the sequential plan's simulated iteration time.
    pipedream_s: the fastest PipeDream partition that fits memory
      (infinite if none does).
    pipedream_best: that partition's stages (node counts and replicas),
      micro-batch and tie rule.
    over_memory: PipeDream partitions refused by the memory rule.
    search_time_s: PipeDream's DP time over all micro-batch sizes.
  """

  model: str
  num_devices: int
  batch_size: int
  sequential_s: float
  pipedream_s: float
  pipedream_best: dict
  over_memory: int
  search_time_s: float

  @property
  def pipedream_speedup(self) -> float:
    """How much faster PipeDream's partition simulates (> 1: it wins)."""
    return self.sequential_s / self.pipedream_s


def check(
  graph: OpGraph,
  num_devices: int,
  batch_size: int,
  cost_model,
  sequential: Plan,
) -> Comparison:
  """PipeDream's partitions (every micro-batch size, both tie rules)
  simulated against the `sequential` plan (module docstring)."""
  sizes = [b for b in (2**i for i in range(31)) if batch_size % b == 0]
  best_time, best, over, search = _INF, {}, 0, 0.0
  for b in sizes:
    for tie in ("first", "last"):
      start = time.perf_counter()
      stages = partition(graph, cost_model, num_devices, batch_size, b, tie)
      search += time.perf_counter() - start
      if stages is None:
        continue
      for p in chain_plans(
        graph, stages, batch_size, num_devices, b, cost_model
      ):
        if not fits(p, graph, cost_model.memory_bytes):
          over += 1
          continue
        seconds = simulate(p, graph, cost_model).iteration_time_s
        if seconds < best_time:
          best_time = seconds
          best = {
            "micro_batch_size": b,
            "tie": tie,
            "stages": [[len(nodes), k] for nodes, k in stages],
            "devices": [list(s.devices) for s in p.stages],
          }
  return Comparison(
    model=graph.model,
    num_devices=num_devices,
    batch_size=batch_size,
    sequential_s=simulate(sequential, graph, cost_model).iteration_time_s,
    pipedream_s=best_time,
    pipedream_best=best,
    over_memory=over,
    search_time_s=search,
  )


def run_check(
  model_names: list[str],
  device_counts: list[int],
  device: str = "v100",
  graphs: dict | None = None,
) -> list[dict]:
  """`check` for every model x device count (paper configs, zoo batches).

  Args:
    model_names: zoo models.
    device_counts: device counts.
    device: the device preset.
    graphs: captured graphs by model name (captured when missing).
  """
  cost_model = AnalyticCostModel(device_spec(device))
  graphs = dict(graphs or {})
  rows = []
  progress = common.Progress(
    len(model_names) * len(device_counts), "pipedream check"
  )
  for name in model_names:
    if name not in graphs:
      graphs[name] = models.capture_zoo(name, "paper")
    graph = graphs[name]
    for num_devices in device_counts:
      batch = models.default_batch_size(name, num_devices)
      ours = plan(
        graph, num_devices, batch, planner="sequential", device=device
      )
      found = check(graph, num_devices, batch, cost_model, ours)
      row = dataclasses.asdict(found)
      row["pipedream_speedup"] = found.pipedream_speedup
      row["passes"] = found.pipedream_speedup <= 1.02
      rows.append(row)
      progress.step(
        f"{name} {num_devices} devices: PipeDream / sequential speed "
        f"{found.pipedream_speedup:.3f}"
      )
  return rows


def reproduce_rows(setup, through: dict, par: dict, progress) -> dict:
  """`experiments.reproduce`'s `pipedream_check`: PipeDream's partitions
  against the sequential plans it already made (`through`: throughput,
  `par`: parity; rows carry their `plan`)."""
  rows = []
  model = setup.cost_model()
  made = {
    (r["model"], r["num_devices"]): r
    for r in through["rows"] + par["rows"]
    if r["planner"] == "sequential" and "plan" in r
  }
  for name in ("mmt", "candle_uno", "transformer"):
    for devices in [d for d in setup.devices if d <= 16]:
      ours = made.get((name, devices))
      if ours is None:
        continue
      found = check(
        setup.graph(name), devices, ours["batch_size"], model, ours["plan"]
      )
      row = dataclasses.asdict(found)
      row["model"] = name
      row["pipedream_speedup"] = found.pipedream_speedup
      row["passes"] = found.pipedream_speedup <= 1.02
      rows.append(row)
      progress.step(
        f"PipeDream {name} {devices}: {found.pipedream_speedup:.3f} of "
        "sequential"
      )
  return {"rows": rows}


def define_flags() -> None:
  """This experiment's flags (defined when run, so tests import freely)."""
  common.define_flags()
  flags.DEFINE_list(
    "models", ["mmt", "candle_uno", "transformer"], "Zoo models."
  )
  flags.DEFINE_list("devices", ["4", "8", "16"], "Device counts.")
  from graphpipe.costs.analytic import PRESETS

  flags.DEFINE_enum("device", "v100", PRESETS, "Device preset.")
  common.check_choices("models", models.NAMES)
  common.check_int_list("devices")
  common.define_out()


def main(argv):
  common.start(argv)
  options = flags.FLAGS
  rows = run_check(
    options.models, [int(d) for d in options.devices], options.device
  )
  common.write_results(options.out, {"pipedream_check": rows})
  for r in rows:
    verdict = "ok" if r["passes"] else "PIPEDREAM WINS"
    print(
      f"{r['model']:<12} {r['num_devices']:>3} devices: PipeDream / "
      f"sequential speed {r['pipedream_speedup']:.3f} ({verdict})"
    )
  failed = [r for r in rows if not r["passes"]]
  print(
    f"{len(rows) - len(failed)}/{len(rows)}: no PipeDream partition more "
    "than 2% faster than sequential's plan"
  )


if __name__ == "__main__":
  define_flags()
  app.run(main)
