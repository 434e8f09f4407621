"""`check_plan`: whether a plan is a valid stage graph for its graph.

Every planner's output passes it (the tests check each); it is the contract
the schedule, the simulator and the runtime rely on.
"""

from __future__ import annotations

from graphpipe.core.fingerprint import made_for
from graphpipe.core.graph import OpGraph
from graphpipe.core.memory import over_budget, plan_memory
from graphpipe.core.stages import Plan, in_flight_counts, sharding_problem
from graphpipe.errors import PlanError
from graphpipe.planning.arguments import check_memory_bytes


def check_plan(p: Plan, graph: OpGraph, memory_bytes: float) -> None:
  """Raises `PlanError` unless `p` is a valid plan for `graph`.

  Checks: stages partition the nodes and are convex; devices are disjoint
  and in range; each stage's micro-batch divides the batch, its device
  count divides its micro-batch, and its micro-batch is a multiple of each
  predecessor's; stage edges cover every operator edge across stages and
  go forward; in-flight counts follow the schedule; every device's memory
  (`graphpipe.core.memory.plan_memory`: what the runtime's SPMD step holds
  on each device) fits `memory_bytes`.

  Example:
    >>> graph = capture_zoo("two_branch", "paper")
    >>> p = graphpipe.plan(graph, num_devices=8, batch_size=8)
    >>> check_plan(p, graph, memory_bytes=16e9)   # passes silently
    >>> check_plan(p, graph, memory_bytes=0.1 * 2**30)    # 0.1 GiB
    Traceback (most recent call last):
    ...
    graphpipe.errors.PlanError: invalid plan: device 0 (stage 1) holds 2.18
    GiB: gradients 0.751 GiB, work 0.645 GiB, optimizer 0.375 GiB,
    parameters 0.188 GiB, stashes 0.184 GiB, channels 0.0352 GiB, batch
    0.00391 GiB, over the budget of 0.1 GiB

  Args:
    p: the plan.
    graph: the operator graph it partitions.
    memory_bytes: the per-device budget.
  """
  check_memory_bytes(memory_bytes)
  if not made_for(p, graph):
    raise PlanError(
      "invalid plan: it was made for another graph (fingerprints differ)"
    )
  problems = []
  owner = {}
  for s in p.stages:
    for n in s.nodes:
      if n in owner:
        problems.append(f"node {n} is in stages {owner[n]} and {s.id}")
      owner[n] = s.id
  if sorted(owner) != list(range(len(graph.nodes))):
    problems.append("the stages do not cover every node exactly once")
  used = [d for s in p.stages for d in s.devices]
  if len(used) != len(set(used)) or any(
    not 0 <= d < p.num_devices for d in used
  ):
    problems.append(f"devices {used} overlap or fall outside the plan")
  if [s.id for s in p.stages] != list(range(p.num_stages)):
    problems.append("stage ids are not 0..n-1 in order")
  if p.batch_size < 1:
    problems.append(f"batch size {p.batch_size} is not positive")
  for s in p.stages:
    if (
      s.micro_batch_size < 1
      or p.batch_size % s.micro_batch_size
      or s.micro_batch_size % len(s.devices)
    ):
      problems.append(f"stage {s.id}: micro-batch does not split evenly")
    problem = sharding_problem(s)
    if problem:
      problems.append(problem)
  if any(a >= b for a, b in p.stage_edges):
    problems.append("a stage edge goes backward")
  sizes = p.micro_batch_sizes
  for a, b in p.stage_edges:
    if 0 <= a < len(sizes) and 0 <= b < len(sizes) and sizes[b] % sizes[a]:
      problems.append(
        f"stage {b}'s micro-batch {sizes[b]} is not a multiple of stage "
        f"{a}'s {sizes[a]}"
      )
  if not problems:
    for e in graph.edges:
      a, b = owner[e.src], owner[e.dst]
      if a != b and (a, b) not in p.stage_edges:
        problems.append(f"operator edge {e.src}->{e.dst} has no stage edge")
    problems += _convexity_problems(p, graph, owner)
    if p.schedule == "gpipe":
      expected = list(p.stage_microbatches)
      least = expected
    else:
      # 1F1B's counts, or as many as a stage runs where that is fewer
      # (what the planner records; the larger count only overstates).
      expected = in_flight_counts(p.num_stages, p.stage_edges, sizes)
      least = [
        min(c, m) for c, m in zip(expected, p.stage_microbatches, strict=True)
      ]
    got = [s.in_flight for s in p.stages]
    bounds = zip(got, least, expected, strict=True)
    if any(not lo <= g <= hi for g, lo, hi in bounds):
      problems.append(f"in-flight counts are not {least}")
    memory = plan_memory(graph, p)
    if memory.largest > memory_bytes:
      problems.append(
        f"{memory.describe()}, {over_budget(memory.largest, memory_bytes)}"
      )
  if problems:
    raise PlanError("invalid plan: " + "; ".join(problems[:5]))


def _convexity_problems(p: Plan, graph: OpGraph, owner) -> list[str]:
  """A stage is convex when no path leaves it and comes back."""
  problems = []
  for s in p.stages:
    inside = set(s.nodes)
    # Nodes reachable from the stage through at least one outside node.
    frontier = [
      d for n in s.nodes for d in graph.successors(n) if d not in inside
    ]
    seen = set(frontier)
    while frontier:
      v = frontier.pop()
      for w in graph.successors(v):
        if w in inside:
          problems.append(f"stage {s.id} is not convex (path via node {v})")
          frontier = []
          break
        if w not in seen:
          seen.add(w)
          frontier.append(w)
  return problems
