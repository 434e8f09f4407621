"""Micro-batch sizes priced in order of their work floor, the hopeless
ones deferred (`graphpipe.planning.engine.run_search`): the same plans as
pricing every size, and the floor under every plan it bounds."""

import math
import os

import pytest
from hypothesis import HealthCheck, Phase, given, note, settings
from hypothesis import strategies as st

from graphpipe import costs
from graphpipe.planning import engine
from graphpipe.planning.arguments import searched_sizes
from graphpipe.planning.assemble import assemble, spend_spare_devices
from graphpipe.planning.stage_costs import StageCosts, estimate_iteration_time
from tests.graphpipe.random_graphs import op_graphs
from tests.graphpipe.test_random_graphs import _one_device_bytes

V100 = costs.AnalyticCostModel(costs.device_spec("v100"))
NUM_GRAPHS = int(os.environ.get("GRAPHPIPE_RANDOM_GRAPHS", "500")) // 5
PLANNERS = ("graphpipe", "sequential", "gpipe")
SETTINGS = {
  "max_examples": NUM_GRAPHS,
  "deadline": None,
  "suppress_health_check": [HealthCheck.too_slow, HealthCheck.data_too_large],
  "phases": [Phase.explicit, Phase.reuse, Phase.generate],
}


def _search(graph, devices, batch, planner, memory, defer, **options):
  was = engine._DEFER
  engine._DEFER = defer
  try:
    return engine.run_search(
      graph,
      devices,
      batch,
      planner,
      V100,
      memory,
      searched_sizes(batch, None),
      piper_budget=2_000,
      **options,
    )
  finally:
    engine._DEFER = was


def _same(a, b) -> bool:
  if a is None or b is None:
    return a is b
  return (a.stages, a.stage_edges, a.schedule, a.micro_batch_size) == (
    b.stages,
    b.stage_edges,
    b.schedule,
    b.micro_batch_size,
  )


@settings(**SETTINGS)
@given(
  op_graphs(min_nodes=2),
  st.integers(1, 8),
  st.sampled_from([16, 32]),
  st.sampled_from([0.0, 0.5, 0.9, 1.0, engine._DEFER]),
  st.sampled_from([1.0, 4.0, math.inf]),
  st.booleans(),
  st.sampled_from([None, 0.5, 10.0]),
)
def test_deferring_sizes_plans_what_pricing_all_of_them_plans(
  graph, devices, batch, defer, factor, per_stage, tolerance
):
  # A factor of 0 defers every size after the first priced (the local
  # search's starts then need the deferred ones: priced after all), 1
  # those over the best estimate; a padding tolerance lets the
  # simulations go further where plans pad much.
  note(f"edges {[(e.src, e.dst) for e in graph.edges]}")
  memory = factor * _one_device_bytes(graph, batch, 1, devices)
  for planner in PLANNERS:
    options = {
      "per_stage": per_stage and planner == "graphpipe",
      "padding_tolerance": tolerance,
    }
    args = (graph, devices, batch, planner, memory)
    every = _search(*args, math.inf, **options)
    deferring = _search(*args, defer, **options)
    assert _same(every, deferring), planner


@settings(**SETTINGS)
@given(op_graphs(min_nodes=2), st.integers(1, 8), st.sampled_from([8, 32]))
def test_no_plan_of_a_size_estimates_under_its_work_floor(
  graph, devices, batch
):
  stage_costs = StageCosts(graph, V100, batch, devices, math.inf)
  for planner in PLANNERS:
    partitioner = engine._partitioner(graph, planner, stage_costs, 2_000)
    for b in searched_sizes(batch, None):
      floor = stage_costs.work_floor(b)
      for part in partitioner(b):
        for each in (part, spend_spare_devices(graph, part, stage_costs)):
          p = assemble(graph, each, stage_costs, planner)
          estimate = estimate_iteration_time(p, graph, V100)
          assert estimate >= floor * (1 - 1e-9), (planner, b, each)


@pytest.mark.parametrize("name, devices", [("dlrm", 16), ("candle_uno", 8)])
def test_paper_configs_defer_sizes_and_plan_the_same(
  name, devices, monkeypatch
):
  from graphpipe import models

  asked = []
  make = engine._partitioner

  def recording(*args):
    partition = make(*args)
    return lambda b: asked.append(b) or partition(b)

  monkeypatch.setattr(engine, "_partitioner", recording)

  graph = models.capture_zoo(name, "paper")
  batch = models.default_batch_size(name, devices)
  stage_costs = StageCosts(graph, V100, batch, devices, V100.memory_bytes)
  floors = [stage_costs.work_floor(b) for b in searched_sizes(batch, None)]
  # The floor falls with the micro-batch (larger shares run faster per
  # sample), steeply at the small sizes the search defers.
  assert floors == sorted(floors, reverse=True)
  assert floors[0] > 10 * floors[-1]
  for planner in ("graphpipe", "sequential"):
    every = _search(graph, devices, batch, planner, V100.memory_bytes, math.inf)
    assert set(asked) == set(searched_sizes(batch, None))
    asked.clear()
    deferring = _search(
      graph, devices, batch, planner, V100.memory_bytes, engine._DEFER
    )
    assert _same(every, deferring), planner
    # The smallest sizes were never priced (their floors are several times
    # the best plan's estimate).
    assert not set(searched_sizes(batch, None)[:3]) & set(asked), asked
    asked.clear()
