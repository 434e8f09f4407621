"""Hundreds of random graphs through every planner and both schedules.

Each drawn graph (`random_graphs.op_graphs`: chains, fan-out, fan-in, skips,
non-series-parallel crossings, several loss nodes, unequal branches,
parameter- and activation-heavy nodes) is planned by every planner of
`graphpipe.PLANNERS` on 1-5 devices under a roomy or a tight memory budget,
and each plan is held to the invariants: `check_plan`; every node in exactly
one stage; stages convex; every device within the budget by the shared
memory rule, in the plan and in the simulated schedule; `check_schedule` of
both schedules; the simulated iteration no shorter than the plan's work
spread over all devices and no longer than running every action one after
another (one device's compute at the plan's micro-batch, every transfer,
all-reduce and optimizer step); the same plan when planned again.

GRAPHPIPE_RANDOM_GRAPHS=N raises the number of graphs (default 500; e.g.
20000 before a release). Hypothesis is derandomised (root conftest), so a
run is reproducible; GRAPHPIPE_HYPOTHESIS_PROFILE=explore draws new graphs.
"""

import dataclasses
import os

import pytest
from hypothesis import HealthCheck, Phase, given, note, settings
from hypothesis import strategies as st

import graphpipe
from graphpipe import costs
from graphpipe.core.memory import MODEL_KINDS, memory_floor, plan_memory
from graphpipe.core.stages import Plan, Stage
from graphpipe.errors import PlanError
from graphpipe.planning.stage_costs import StageCosts
from graphpipe.simulator import iteration_floor
from tests.graphpipe.brute_force import _convex
from tests.graphpipe.random_graphs import op_graphs

NUM_GRAPHS = int(os.environ.get("GRAPHPIPE_RANDOM_GRAPHS", "500"))
V100 = costs.AnalyticCostModel(costs.device_spec("v100"))
# Piper's search is exponential in the number of branches: a small budget
# keeps the test fast, and running out of it is an allowed answer.
PIPER_BUDGET = 2_000
TOL = 1e-9


def _one_device_bytes(graph, batch, micro_batch, devices=1) -> float:
  """One stage on one device holding every micro-batch in flight: a plan
  every planner can make (GPipe's; 1F1B's holds fewer), so any budget at
  least this must be met."""
  everything = tuple(range(len(graph.nodes)))
  count = batch // micro_batch
  stage = Stage(0, everything, (0,), micro_batch, count)
  # On device 0 of the plan's devices (the others idle): the per-device
  # tables grow a little with the device count.
  one = Plan("gpipe", (stage,), (), batch, devices, schedule="gpipe")
  return plan_memory(graph, one).largest


def _plan(graph, devices, batch, micro_batch, planner, memory):
  # One micro-batch size per search keeps each plan cheap; the drawn sizes
  # cover them all.
  return graphpipe.plan(
    graph,
    devices,
    batch,
    planner=planner,
    cost_model=V100,
    memory_bytes=memory,
    micro_batch_sizes=[micro_batch],
    piper_budget=PIPER_BUDGET,
  )


def _bounds(p, graph):
  """(work / devices, serial time) of plan `p` in the V100 model."""
  counts = p.stage_microbatches
  work = serial = 0.0
  for s in p.stages:
    k = len(s.devices)
    share = StageCosts.share(s.micro_batch_size, k)
    action = sum(
      V100.node_time(graph.nodes[v], share, kind)
      for v in s.nodes
      for kind in ("fwd", "bwd")
    )
    work += k * counts[s.id] * action
    # One device at the plan's micro-batch is no faster than a share of it.
    serial += counts[s.id] * sum(
      V100.node_time(graph.nodes[v], s.micro_batch_size, kind)
      for v in s.nodes
      for kind in ("fwd", "bwd")
    )
    params = sum(graph.nodes[v].param_bytes for v in s.nodes)
    if params:
      serial += V100.optimizer_time(params)
      if k > 1:
        serial += V100.allreduce_time(params, s.devices)
  stage_of = p.stage_of_node()
  for a, b in p.stage_edges:
    sa, sb = p.stages[a], p.stages[b]
    b_min = min(sa.micro_batch_size, sb.micro_batch_size)
    total = sum(
      e.bytes * b_min + e.fixed_bytes
      for e in graph.edges
      if (stage_of[e.src], stage_of[e.dst]) == (a, b)
    )
    pairs = max(len(sa.devices), len(sb.devices))
    worst = max(
      V100.transfer_time(total, x, y) for x in sa.devices for y in sb.devices
    )
    # Activations forward and gradients backward, per micro-batch.
    serial += 2 * max(counts[a], counts[b]) * pairs * worst
  return work / p.num_devices, serial


def _check_invariants(p, graph, memory):
  graphpipe.check_plan(p, graph, memory)
  owners = sorted(v for s in p.stages for v in s.nodes)
  assert owners == list(range(len(graph.nodes)))
  for s in p.stages:
    assert _convex(graph, s.nodes), (s, p)
  # Every device within the budget by the shared per-device rule (SPMD
  # padding included), and never below the floor the no-plan error uses.
  report = plan_memory(graph, p)
  largest = report.largest
  assert largest <= memory * (1 + TOL)
  assert memory_floor(graph)[0] <= largest
  floor = memory_floor(graph, kinds=MODEL_KINDS)[0]
  assert floor <= report.largest_of(MODEL_KINDS)
  low, high = _bounds(p, graph)
  # No plan on these devices beats the floor of its slowest node alone.
  fastest = iteration_floor(graph, p.batch_size, p.num_devices, V100)
  for kind in ("1f1b", "gpipe"):
    schedule = graphpipe.schedule_for(p, kind)
    graphpipe.check_schedule(schedule)
    report = graphpipe.simulate(p, graph, V100, schedule)
    t = report.iteration_time_s
    assert low * (1 - TOL) <= t <= high * (1 + TOL), (kind, low, t, high)
    assert fastest.seconds <= t * (1 + TOL), (kind, fastest, t)
    if kind == p.schedule:
      # The schedule stashes no more than the plan's in-flight counts.
      assert report.max_peak_memory_bytes <= memory * (1 + TOL)


@settings(
  max_examples=NUM_GRAPHS,
  deadline=None,
  suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
  # Shrinking a failure takes minutes here; the note gives the graph.
  phases=[Phase.explicit, Phase.reuse, Phase.generate],
)
@given(
  op_graphs(),
  st.integers(1, 5),
  st.sampled_from([4, 8, 16]),
  st.sampled_from([1, 2, 4, 8, 16]),
  st.sampled_from([0.5, 1.0, 1.5, 4.0]),
)
def test_random_graphs_through_every_planner(
  graph, devices, batch, micro_batch, factor
):
  micro_batch = min(micro_batch, batch)
  note(f"nodes {[dataclasses.astuple(v)[:11] for v in graph.nodes]}")
  note(f"edges {[(e.src, e.dst) for e in graph.edges]}")
  fits_one_device = _one_device_bytes(graph, batch, micro_batch, devices)
  memory = factor * fits_one_device
  for planner in graphpipe.PLANNERS:
    try:
      p = _plan(graph, devices, batch, micro_batch, planner, memory)
    except PlanError as err:
      text = str(err)
      if planner == "piper" and "search budget" in text:
        continue
      # Only a budget under the one-device plan's may go unmet (where no
      # pipeline fits, every planner falls back to the whole model on one
      # device), and the memory the error names must lie between the two.
      assert factor < 1, (planner, text)
      assert "smallest per-device memory" in text, text
      named = text.split("finds one is about ")[1].split(" GiB")[0]
      named = float(named) * 2**30
      assert memory < named <= 1.02 * fits_one_device * 1.001, text
      continue
    assert p.planner == planner
    _check_invariants(p, graph, memory)
    # Determinism: one planner per graph plans it again (in turn, so
    # each is checked on a quarter of the graphs; all would cost 25%).
    turn = graphpipe.PLANNERS[(len(graph.edges) + devices) % 4]
    if planner != turn:
      continue
    again = _plan(graph, devices, batch, micro_batch, planner, memory)
    assert (again.stages, again.stage_edges, again.schedule) == (
      p.stages,
      p.stage_edges,
      p.schedule,
    )


def test_the_generator_draws_every_shape():
  """The strategy really produces the shapes the module promises."""
  from graphpipe.planning import sp

  seen = {"fan_out": 0, "fan_in": 0, "skip": 0, "non_sp": 0, "losses": 0}

  @settings(max_examples=150, deadline=None, database=None)
  @given(op_graphs(min_nodes=4))
  def look(graph):
    succ = [len(graph.successors(v)) for v in range(len(graph.nodes))]
    pred = [len(graph.predecessors(v)) for v in range(len(graph.nodes))]
    seen["fan_out"] += max(succ) > 1
    seen["fan_in"] += max(pred) > 1
    seen["losses"] += len(graph.loss_nodes) > 1
    seen["skip"] += any(
      e.src in graph.predecessors(w)
      for e in graph.edges
      for w in graph.predecessors(e.dst)
    )
    dag = sp.Dag(
      tuple((v,) for v in range(len(graph.nodes))),
      tuple((e.src, e.dst) for e in graph.edges),
    )
    seen["non_sp"] += sp.decompose(dag).added_dependencies > 0

  look()
  assert min(seen.values()) >= 10, seen


if __name__ == "__main__":
  pytest.main([__file__])
