"""The planners against brute force and PipeDream's own partitioner.

Piper's DP is checked against brute force on its own objective (the
smallest bottleneck over sequences of down-set differences).

On small random graphs every plan a planner could have chosen is built and
simulated (`tests.graphpipe.brute_force`); the planner's plan must be
within 2% of the fastest. The full PipeDream check on the paper models
runs in `experiments.reproduce` (and `python -m experiments.pipedream`);
here it runs on small graphs.
"""

import dataclasses
import itertools
import random

import pytest

from experiments import pipedream
from graphpipe import costs
from graphpipe.errors import PlanError
from graphpipe.planning import engine
from graphpipe.planning.piper import PiperPartitioner
from graphpipe.planning.search import plan
from graphpipe.planning.stage_costs import StageCosts
from graphpipe.planning.validate import check_plan
from graphpipe.simulator.engine import simulate
from tests.graphpipe import brute_force
from tests.graphpipe.test_planner import candle_like

V100 = costs.AnalyticCostModel(costs.device_spec("v100"))
TOLERANCE = 1.02


def config(seed: int) -> tuple:
  """(graph, devices, batch, memory) of one seeded random case."""
  rng = random.Random(1000 + seed)
  num_nodes = rng.randint(3, 8)
  devices = rng.choice([2, 3, 4])
  batch = rng.choice([4, 8, 16])
  memory = rng.choice([V100.memory_bytes, 0.4e9])
  graph = brute_force.random_graph(seed, num_nodes)
  return graph, devices, batch, memory


# The planners' own default, before the fixture below turns it off.
DEFAULT_PADDING_TOLERANCE = engine.PADDING_TOLERANCE


@pytest.fixture(autouse=True)
def fastest_plans(monkeypatch):
  """Time optimality is checked here: no time traded for less padding."""
  monkeypatch.setattr(engine, "PADDING_TOLERANCE", 0.0)


def within_brute_force(seed: int, planner: str, kind: str) -> None:
  graph, devices, batch, memory = config(seed)
  best = brute_force.best_plan(graph, devices, batch, V100, memory, kind)
  if best.plan is None:
    return  # nothing fits; the planner's refusal is tested elsewhere
  ours = plan(graph, devices, batch, planner=planner, memory_bytes=memory)
  check_plan(ours, graph, memory)
  seconds = simulate(ours, graph, V100).iteration_time_s
  assert seconds <= TOLERANCE * best.seconds, (
    f"{planner}: {seconds * 1e3:.4g} ms, brute force {best.seconds * 1e3:.4g}"
    f" ms ({best.tried} plans)\n{ours}\n{best.plan}"
  )


@pytest.mark.parametrize("seed", range(40))
def test_sequential_beats_every_chain_partition(seed):
  within_brute_force(seed, "sequential", "chain")


# Seeds past the first 30 where a sweep of 2,100 graphs found GraphPipe's
# plan 3-21% slower than brute force: a trunk whose last stage should take
# the head of one branch while the branches run apart (553, 1077: the DP
# grouped the branches on one device and the spare device became a
# replica), a replicated stage that should give a device to one of its
# own nodes (947), stage moves the local search's beam of 4 missed (1663,
# 2123: fewer parameters in the stage that steps its optimizer last).
HARD_SEEDS = [553, 947, 1077, 1663, 2123]


@pytest.mark.parametrize("seed", [*range(30), *HARD_SEEDS])
def test_graphpipe_beats_every_series_parallel_stage_graph(seed):
  within_brute_force(seed, "graphpipe", "sp")


# With the padding trade on (the default): the trade's own slowdown plus
# what the search misses must stay within the margin. 760: the faster plan
# (4 micro-batches) was estimated 4% over its simulated time, never
# simulated, and a 1.3% trade on top of the 1.1% miss made 2.4%; 309, 771:
# with a 2% trade, 1.99% and 1.93% over brute force: all of the margin.
@pytest.mark.parametrize(
  "seed, planner, kind",
  [
    (760, "sequential", "chain"),
    (309, "graphpipe", "sp"),
    (771, "graphpipe", "sp"),
  ],
)
def test_the_padding_trade_stays_within_the_margin(
  seed, planner, kind, monkeypatch
):
  monkeypatch.setattr(engine, "PADDING_TOLERANCE", DEFAULT_PADDING_TOLERANCE)
  within_brute_force(seed, planner, kind)


def test_brute_force_enumerates_what_it_claims():
  graph = brute_force.random_graph(3, 4)
  chains = list(brute_force.chain_partitions(range(4), 2, 2))
  # Cuts of 4 nodes into 1 or 2 stages, replicas (1), (2), (1, 1).
  assert len(chains) == 2 + 3
  sp_plans = list(brute_force.sp_partitions(graph, 4, 1))
  assert all(sum(k for _, k in s) <= 4 for s in sp_plans)
  assert {tuple(sorted(nodes for nodes, _ in s)) for s in sp_plans} >= {
    ((0, 1, 2, 3),)
  }


@pytest.mark.parametrize("seed", range(0, 40, 4))
def test_pipedream_partitions_do_not_beat_sequential_on_random_graphs(seed):
  graph, devices, batch, memory = config(seed)
  spec = dataclasses.replace(costs.device_spec("v100"), memory_bytes=memory)
  cost_model = costs.AnalyticCostModel(spec)
  try:
    ours = plan(
      graph, devices, batch, planner="sequential", memory_bytes=memory
    )
  except PlanError:
    return  # nothing fits: nothing to compare
  found = pipedream.check(graph, devices, batch, cost_model, ours)
  assert found.pipedream_speedup <= TOLERANCE, found


@pytest.mark.parametrize("devices", [4, 8])
def test_pipedream_partitions_do_not_beat_sequential_on_candle_like(devices):
  graph = candle_like()
  ours = plan(graph, devices, 128, planner="sequential")
  found = pipedream.check(graph, devices, 128, V100, ours)
  assert found.pipedream_speedup <= TOLERANCE, found
  assert found.pipedream_s < float("inf")


@pytest.mark.parametrize("seed", [1, 2, 5])
def test_pipedream_reference_minimises_its_own_recurrence(seed):
  # Every chain partition on exactly m machines, scored with the
  # recurrence's own terms: the DP's partition attains the minimum.
  graph, devices, batch, _ = config(seed)
  n = len(graph.nodes)
  for b in brute_force.micro_batch_sizes(batch)[:3]:
    terms = pipedream.Recurrence(graph, V100, devices, batch, b, range(n))
    best = float("inf")
    for cuts in range(min(n, devices)):
      for positions in itertools.combinations(range(1, n), cuts):
        bounds = [0, *positions, n]
        for counts in itertools.product(range(1, devices + 1), repeat=cuts + 1):
          if sum(counts) != devices:
            continue
          stages = [
            (a, z - 1, k)
            for (a, z), k in zip(
              itertools.pairwise(bounds), counts, strict=True
            )
          ]
          best = min(best, terms.bottleneck(stages))
    found = pipedream.partition(graph, V100, devices, batch, b)
    if best == float("inf"):
      assert found is None or sum(k for _, k in found) < devices
      continue
    position = 0
    scored = []
    for nodes, k in found:
      scored.append((position, position + len(nodes) - 1, k))
      position += len(nodes)
    assert terms.bottleneck(scored) == pytest.approx(best)


@pytest.mark.parametrize("seed", [0, 3, 6, 9, 12, 15])
def test_piper_finds_the_smallest_bottleneck_over_down_set_sequences(seed):
  graph, devices, batch, memory = config(seed)
  if len(graph.nodes) > 6:
    graph = brute_force.random_graph(seed, 6)
  b = brute_force.micro_batch_sizes(batch)[-1]
  table = StageCosts(graph, V100, batch, devices, memory)
  # The smallest bottleneck of any down-set sequence on exactly k devices.
  best = {}
  for stages in brute_force.down_set_sequences(graph, devices, b):
    p = len(stages)
    if all(
      table.in_flight_capacity(nodes, b, k) >= p - i
      for i, (nodes, k) in enumerate(stages)
    ):
      used = sum(k for _, k in stages)
      best[used] = min(
        best.get(used, float("inf")),
        max(table.time_per_sample(nodes, b, k) for nodes, k in stages),
      )
  found = PiperPartitioner(graph, table, budget=10**6)(b)
  if not best:
    assert not found
    return

  def bottleneck(part):
    return max(table.time_per_sample(nodes, b, k) for nodes, k in part.stages)

  # First Piper's answer on all devices, then the best on fewer devices
  # (each optimal for at most its own device count), all distinct.
  assert bottleneck(found[0]) == pytest.approx(min(best.values()), rel=1e-9)
  assert len({part.stages for part in found}) == len(found)
  for part in found:
    used = sum(k for _, k in part.stages)
    within = min(v for k, v in best.items() if k <= used)
    assert bottleneck(part) == pytest.approx(within, rel=1e-9)


def test_piper_gives_up_when_its_budget_runs_out():
  graph = candle_like(4)
  with pytest.raises(PlanError, match="search budget"):
    plan(graph, 8, 64, planner="piper", piper_budget=2_000)
