"""Brute-force plans for small graphs: every partition a planner could pick.

The planners are held to these in tests: on graphs of a few nodes, every
chain partition (any cut points of a linearisation, any replica counts that
divide the micro-batch) and every partition into convex stages whose stage
graph is series-parallel is built as a 1F1B plan, checked against the
memory rule and simulated. Nothing here uses the planners' own code.
"""

from __future__ import annotations

import dataclasses
import itertools
import random
from collections.abc import Iterator, Sequence

from graphpipe.core.graph import Edge, OpGraph
from graphpipe.core.memory import plan_memory, stage_memory_bytes
from graphpipe.core.stages import Plan, Stage, in_flight_counts
from graphpipe.planning import sp
from graphpipe.simulator.engine import simulate
from tests.graphpipe.test_costs import ff_node

Stages = list[tuple[tuple[int, ...], int]]


def random_graph(seed: int, num_nodes: int) -> OpGraph:
  """A random DAG of feed-forward layers of random widths (seeded)."""
  rng = random.Random(seed)
  nodes = []
  for i in range(num_nodes):
    nodes.append(ff_node(i, rng.choice([256, 1024, 4096])))
  edges = set()
  for b in range(1, num_nodes):
    # Mostly chains and forks, with some skips: every node but the first
    # reads one or two earlier nodes, most often its predecessor.
    reads = {b - 1 if rng.random() < 0.6 else rng.randrange(b)}
    if rng.random() < 0.3:
      reads.add(rng.randrange(b))
    edges |= {(a, b) for a in reads}
  return OpGraph(
    nodes,
    [Edge(a, b, nodes[a].activation_bytes) for a, b in sorted(edges)],
    model=f"random{seed}",
  )


def micro_batch_sizes(batch_size: int) -> list[int]:
  return [b for b in (2**i for i in range(31)) if batch_size % b == 0]


def replica_counts(num_stages: int, devices: int, b: int) -> Iterator:
  """Every tuple of replica counts dividing b with at most `devices`."""
  choices = [k for k in range(1, devices + 1) if b % k == 0]
  for counts in itertools.product(choices, repeat=num_stages):
    if sum(counts) <= devices:
      yield counts


def chain_partitions(
  order: Sequence[int], devices: int, b: int
) -> Iterator[Stages]:
  """Every cut of `order` into at most `devices` stages, with replicas."""
  n = len(order)
  for cuts in range(min(n, devices)):
    for positions in itertools.combinations(range(1, n), cuts):
      bounds = [0, *positions, n]
      ranges = [
        tuple(sorted(order[a:z])) for a, z in itertools.pairwise(bounds)
      ]
      for counts in replica_counts(len(ranges), devices, b):
        yield list(zip(ranges, counts, strict=True))


def _set_partitions(items: list[int], most: int) -> Iterator[list[list[int]]]:
  if not items:
    yield []
    return
  first, rest = items[0], items[1:]
  for part in _set_partitions(rest, most):
    for i in range(len(part)):
      yield part[:i] + [[first, *part[i]]] + part[i + 1 :]
    if len(part) < most:
      yield [[first], *part]


def _stage_order(graph: OpGraph, blocks: list[tuple[int, ...]]):
  """Blocks in a topological order of their stage graph and its edges, or
  None when the stage graph has a cycle."""
  owner = {v: i for i, block in enumerate(blocks) for v in block}
  edges = {
    (owner[e.src], owner[e.dst])
    for e in graph.edges
    if owner[e.src] != owner[e.dst]
  }
  order = sp.topological_order(range(len(blocks)), edges, lambda i: i)
  if len(order) != len(blocks):
    return None
  rank = {s: i for i, s in enumerate(order)}
  return [blocks[s] for s in order], sorted(
    (rank[a], rank[b]) for a, b in edges
  )


def _convex(graph: OpGraph, block: tuple[int, ...]) -> bool:
  inside = set(block)
  frontier = [w for v in block for w in graph.successors(v) if w not in inside]
  seen = set(frontier)
  while frontier:
    v = frontier.pop()
    for w in graph.successors(v):
      if w in inside:
        return False
      if w not in seen:
        seen.add(w)
        frontier.append(w)
  return True


def sp_partitions(graph: OpGraph, devices: int, b: int) -> Iterator[Stages]:
  """Every partition into convex stages with a series-parallel stage graph
  (and an acyclic one), at most `devices` stages, with replicas."""
  for blocks in _set_partitions(list(range(len(graph.nodes))), devices):
    blocks = [tuple(sorted(block)) for block in blocks]
    if not all(_convex(graph, block) for block in blocks):
      continue
    ordered = _stage_order(graph, blocks)
    if ordered is None:
      continue
    blocks, edges = ordered
    dag = sp.Dag(tuple((i,) for i in range(len(blocks))), tuple(edges))
    if sp.decompose(dag).added_dependencies:
      continue
    for counts in replica_counts(len(blocks), devices, b):
      yield list(zip(blocks, counts, strict=True))


def down_set_sequences(
  graph: OpGraph, devices: int, b: int
) -> Iterator[Stages]:
  """Every sequence of stages S_j = I_j - I_{j-1} over down-sets I_j
  (Piper's plans), at most `devices` stages, with replicas."""
  n = len(graph.nodes)
  preds = [set(graph.predecessors(v)) for v in range(n)]

  def sequences(done: frozenset, left: int):
    if len(done) == n:
      yield []
      return
    if left == 0:
      return
    rest = [v for v in range(n) if v not in done]
    for size in range(1, len(rest) + 1):
      for stage in itertools.combinations(rest, size):
        grown = done | set(stage)
        if all(preds[v] <= grown for v in stage):
          for tail in sequences(grown, left - 1):
            yield [stage, *tail]

  for blocks in sequences(frozenset(), devices):
    for counts in replica_counts(len(blocks), devices, b):
      yield list(zip(blocks, counts, strict=True))


def plan_of(
  graph: OpGraph,
  stages: Stages,
  batch_size: int,
  b: int,
  num_devices: int,
  chain: bool,
) -> Plan:
  """The 1F1B plan of stages (in a topological order), consecutive devices."""
  owner = {v: i for i, (block, _) in enumerate(stages) for v in block}
  edges = {
    (owner[e.src], owner[e.dst])
    for e in graph.edges
    if owner[e.src] != owner[e.dst]
  }
  if chain:
    edges |= {(i, i + 1) for i in range(len(stages) - 1)}
  edges = tuple(sorted(edges))
  in_flight = in_flight_counts(len(stages), edges)
  out, first = [], 0
  for i, (block, k) in enumerate(stages):
    devices = tuple(range(first, first + k))
    first += k
    out.append(Stage(i, block, devices, b, in_flight[i]))
  return Plan("brute", tuple(out), edges, batch_size, num_devices)


def fits(plan: Plan, graph: OpGraph, memory_bytes: float) -> bool:
  """Each stage's own rule and every device's figure (the planner's)."""
  if plan_memory(graph, plan).largest > memory_bytes:
    return False
  return all(
    stage_memory_bytes(
      graph, s.nodes, s.micro_batch_size / len(s.devices), s.in_flight
    )
    <= memory_bytes
    for s in plan.stages
  )


@dataclasses.dataclass
class Best:
  """The fastest simulated brute-force plan and how many were tried."""

  seconds: float = float("inf")
  plan: Plan | None = None
  tried: int = 0


def best_plan(
  graph: OpGraph,
  num_devices: int,
  batch_size: int,
  cost_model,
  memory_bytes: float,
  kind: str,
) -> Best:
  """The fastest plan of `kind` ('chain': id order; 'sp': SP stage graphs;
  'down-sets': sequences of down-set differences)."""
  best = Best()
  for b in micro_batch_sizes(batch_size):
    if kind == "chain":
      found = chain_partitions(range(len(graph.nodes)), num_devices, b)
    elif kind == "down-sets":
      found = down_set_sequences(graph, num_devices, b)
    else:
      found = sp_partitions(graph, num_devices, b)
    for stages in found:
      chain = kind != "sp"
      p = plan_of(graph, stages, batch_size, b, num_devices, chain)
      if not fits(p, graph, memory_bytes):
        continue
      best.tried += 1
      seconds = simulate(p, graph, cost_model).iteration_time_s
      if seconds < best.seconds:
        best.seconds, best.plan = seconds, p
  return best
