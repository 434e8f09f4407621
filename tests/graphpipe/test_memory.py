"""One memory rule: planner's bound, runtime's report, compiled step.

The runtime's report (`graphpipe.memory_report`, from its own layout) must
never be below what the compiled step uses and within 10% (or 1 MiB) of
it; the planner's figure (`plan_memory`, from the graph) must never be
below the runtime's; a plan over budget is refused with a `PlanError` that
names the device, the bytes by kind and what to change.
"""

import dataclasses
import math
import re

import optax
import pytest

import graphpipe
from graphpipe import PlanError, Trainer, costs
from graphpipe.core.channels import plan_channels
from graphpipe.core.graph import Edge, Node, OpGraph
from graphpipe.core.memory import (
  KINDS,
  MODEL_KINDS,
  check_memory,
  memory_floor,
  plan_holdings,
  plan_memory,
)
from graphpipe.planning import engine
from tests.graphpipe import runtime_cases as rc
from tests.graphpipe.random_graphs import node_of

V100 = costs.AnalyticCostModel(costs.device_spec("v100"))

MIB = 2**20


@pytest.mark.parametrize(
  "name,num_devices,planner,recompute,room",
  [
    ("two_branch", 8, "graphpipe", False, 1),
    ("dlrm", 8, "graphpipe", True, 2),  # data-parallel stages
    ("mmt", 4, "sequential", False, 1),
  ],
)
def test_prediction_bounds_the_compiled_step(
  name, num_devices, planner, recompute, room
):
  plan = rc.pipeline_plan(name, num_devices, planner, room)
  graph = rc.tiny_graph(name)
  model, batch = rc.model_and_batch(name)
  trainer = Trainer(plan, optax.adam(1e-2), graph=graph, recompute=recompute)
  report = trainer.memory_report(trainer.init(model), batch)
  compiled = report["compiled_bytes"]
  for total in report["total_bytes_per_device"]:
    assert compiled <= total <= compiled + max(0.1 * compiled, MIB)
  # The same numbers without a trainer, before anything is allocated.
  alone = graphpipe.memory_report(
    plan, graph, optax.adam(1e-2), recompute=recompute
  )
  assert list(alone.totals) == report["total_bytes_per_device"]
  # The planner sizes the same slots, and never counts less.
  bound = plan_memory(graph, plan, recompute=recompute)
  for mine, theirs in zip(alone.per_device, bound.per_device, strict=True):
    assert set(mine) == set(KINDS)
    assert mine["parameters"] == theirs["parameters"]
    assert mine["channels"] <= theirs["channels"]
    # Residuals: the nodes' kept bytes bound what the runtime stashes.
    assert mine["stashes"] <= theirs["stashes"]
    # Each device's own rows of its stage's leaves, the same blocks.
    assert mine["batch"] == theirs["batch"]
    assert sum(mine.values()) <= sum(theirs.values())
  # The planner charges the runtime's own channel count; the blocks differ
  # only by the planner's bound on the largest transfer.
  channels = len(plan_channels(plan))
  assert max(1, channels) == trainer.buffers.channels
  per_channel = plan_holdings(graph, plan).channel_elements / max(1, channels)
  assert per_channel >= trainer.buffers.channel
  assert alone.padding_fraction == pytest.approx(
    bound.padding_fraction, rel=1e-4
  )


def test_padding_is_what_devices_hold_beyond_their_stage():
  plan = rc.pipeline_plan("dlrm", 8, "graphpipe")
  graph = rc.tiny_graph("dlrm")
  report = graphpipe.memory_report(plan, graph, optax.sgd(0.1))
  largest = max(
    sum(graph.nodes[n].param_bytes for n in s.nodes) for s in plan.stages
  )
  # SGD keeps no slots: held = the largest stage's parameters everywhere.
  assert set(report.held_bytes) == {largest}
  for s in plan.stages:
    own = sum(graph.nodes[n].param_bytes for n in s.nodes)
    for d in s.devices:
      assert report.own_bytes[d] == own
      assert report.padding_bytes[d] == largest - own
  assert report.padding_fraction == pytest.approx(
    sum(report.padding_bytes) / (largest * plan.num_devices)
  )


def test_planner_refuses_plans_whose_padded_figure_is_over_budget():
  graph = rc.tiny_graph("two_branch")
  plan = graphpipe.plan(graph, 4, 16)
  need = plan_memory(graph, plan).largest
  # Each stage's own rule fits the budget; the padded figure does not.
  with pytest.raises(PlanError) as info:
    check_memory(graph, plan, need - 1)
  message = str(info.value)
  assert "device" in message and "parameters" in message
  assert "more devices" in message and "recompute=True" in message
  # One byte over prints alike in GiB: the message says by how much.
  assert "(by 1 B)" in message
  with pytest.raises(PlanError, match=re.escape("(by 1 B)")):
    graphpipe.check_plan(plan, graph, need - 1)
  # The planner only returns plans that fit, by the same figure.
  for budget in (need, 1.01 * need):
    chosen = graphpipe.plan(graph, 4, 16, memory_bytes=budget)
    assert plan_memory(graph, chosen).largest <= budget
  with pytest.raises(PlanError, match="Without a limit, device .* holds"):
    graphpipe.plan(graph, 4, 16, memory_bytes=need / 50)
  # Above the floor the no-plan error offers remedies, but says itself
  # whether more devices fit (not "try more devices" whatever they do).
  floor = memory_floor(graph)[0]
  with pytest.raises(PlanError) as info:
    graphpipe.plan(graph, 4, 16, memory_bytes=1.001 * floor)
  assert "; try " in str(info.value)
  assert "try more devices" not in str(info.value)


def test_no_plan_error_says_when_more_devices_cannot_help():
  graph = rc.tiny_graph("dlrm")
  floor, heaviest = memory_floor(graph)
  # The floor is below every plan's figure (the random-graph test checks
  # it on hundreds of graphs): here on the planner's own plans.
  for devices in (1, 4, 8):
    chosen = graphpipe.plan(graph, devices, 16)
    assert floor <= plan_memory(graph, chosen).largest
  with pytest.raises(PlanError, match="more devices cannot help") as info:
    graphpipe.plan(graph, 4, 16, memory_bytes=0.9 * floor)
  assert repr(heaviest) in str(info.value)
  assert "use at least" not in str(info.value)
  # Under the floor nothing helps: no remedy is offered (it said "try more
  # devices; or recompute=True" after "more devices cannot help").
  assert "; try " not in str(info.value)
  # Just under the floor, the floor is printed as more than the budget.
  with pytest.raises(PlanError, match="more devices cannot help") as info:
    graphpipe.plan(graph, 4, 16, memory_bytes=0.9999 * floor)
  text = str(info.value)
  stated = float(text.split(" fits ")[1].split(" GiB")[0])
  named = float(text.split("hold at least ")[1].split(" GiB")[0])
  assert stated < named


def test_no_plan_error_counts_the_kinds_the_budget_bounds():
  # A budget on the model's kinds only (what tightest_plan squeezes): the
  # figure the error names is bisected on those kinds, so a plan exists
  # just over it and none a few percent under it.
  graph = rc.tiny_graph("dlrm")
  unlimited = plan_memory(graph, graphpipe.plan(graph, 4, 16))
  tightest = plan_memory(graph, graphpipe.tightest_plan(graph, 4, 16))
  budget = 0.9 * tightest.largest_of(MODEL_KINDS)
  with pytest.raises(PlanError, match="smallest per-device memory") as info:
    graphpipe.plan(graph, 4, 16, memory_bytes=budget, memory_kinds=MODEL_KINDS)
  text = str(info.value)
  assert "of parameters, gradients, optimizer, state per device" in text
  # Without a limit, the kinds the budget bounds are what is over it (it
  # set the device's whole total against the budget).
  unbounded = text.split("Without a limit, ")[1]
  assert "; of it parameters, gradients, optimizer, state take " in unbounded
  named = float(text.split("finds one is about ")[1].split(" GiB")[0]) * 2**30
  assert named < unlimited.largest  # all kinds would name more
  chosen = graphpipe.plan(
    graph, 4, 16, memory_bytes=1.01 * named, memory_kinds=MODEL_KINDS
  )
  assert plan_memory(graph, chosen).largest_of(MODEL_KINDS) <= 1.01 * named
  with pytest.raises(PlanError):
    graphpipe.plan(
      graph, 4, 16, memory_bytes=0.97 * named, memory_kinds=MODEL_KINDS
    )
  floor = memory_floor(graph, kinds=MODEL_KINDS)[0]
  assert floor <= plan_memory(graph, chosen).largest_of(MODEL_KINDS)
  assert floor < memory_floor(graph)[0]


def test_the_no_plan_searches_give_piper_the_callers_budget(monkeypatch):
  # Where nothing fits, plan searches again (without a limit, bisecting
  # the memory, more devices) to say what would fit: every one of those
  # searches gives Piper the budget the caller gave, not the default.
  from graphpipe.planning import piper

  budgets = []
  init = piper.PiperPartitioner.__init__

  def recording(self, graph, costs, budget):
    budgets.append(budget)
    init(self, graph, costs, budget)

  monkeypatch.setattr(piper.PiperPartitioner, "__init__", recording)
  graph = rc.tiny_graph("two_branch")
  fitting = plan_memory(graph, graphpipe.plan(graph, 4, 16, "piper")).largest
  with pytest.raises(PlanError, match="smallest per-device memory"):
    graphpipe.plan(
      graph, 4, 16, "piper", memory_bytes=0.2 * fitting, piper_budget=123_456
    )
  assert len(budgets) > 3  # the search, then the error's searches
  assert set(budgets[1:]) == {123_456}


def test_memory_report_of_an_abstract_paper_model():
  graph = graphpipe.models.capture_zoo("two_branch", "paper")
  plan = graphpipe.plan(graph, 8, 8)
  report = graphpipe.memory_report(plan, graph, optax.adam(1e-3))
  bound = plan_memory(graph, plan)
  assert report.largest <= bound.largest <= 16160 * MIB
  for mine, theirs in zip(report.per_device, bound.per_device, strict=True):
    assert mine["stashes"] <= theirs["stashes"] <= 2 * mine["stashes"]
  assert 0 <= report.padding_fraction < 0.5
  planned = dataclasses.replace(plan, graph=None)
  with pytest.raises(graphpipe.GraphpipeError, match="captured graph"):
    graphpipe.memory_report(planned)


def test_max_padding_is_a_hard_limit_or_a_plan_error():
  graph = rc.tiny_graph("dlrm")
  tightest = rc.pipeline_plan("dlrm", 8, "graphpipe")
  budget = 2 * plan_memory(graph, tightest).largest_of(MODEL_KINDS)
  options = {"device": rc.SLOW, "memory_bytes": budget}
  options["memory_kinds"] = MODEL_KINDS
  # The tight plan is over the limit below, so the limit must move it.
  assert plan_memory(graph, tightest).padding_fraction > 0.2
  chosen = graphpipe.plan(graph, 8, rc.BATCH, max_padding=0.1, **options)
  assert chosen.stages != tightest.stages
  memory = plan_memory(graph, chosen)
  assert memory.padding_fraction <= 0.1
  assert memory.largest_of(MODEL_KINDS) <= budget
  # No plan within memory is unpadded: the error says how close one gets.
  with pytest.raises(PlanError, match="padding fraction <= 0:") as info:
    graphpipe.plan(graph, 8, rc.BATCH, max_padding=0.0, **options)
  least = float(re.search(r"has ([0-9.]+) \(searched", str(info.value))[1])
  assert 0 < least <= 0.12


def test_the_padding_trade_costs_at_most_its_tolerance():
  # The case study's baseline: by time alone 8 stages of one block (0.12
  # padding) win; the default takes 2 stages on 4 devices each, 1.1%
  # slower, whose devices hold 0.02.
  graph = graphpipe.models.capture_zoo("two_branch", "paper")
  fastest = graphpipe.plan(
    graph, 8, 8, planner="sequential", padding_tolerance=0
  )
  traded = graphpipe.plan(graph, 8, 8, planner="sequential")
  seconds = [
    graphpipe.simulate(p, graph).iteration_time_s for p in (fastest, traded)
  ]
  padding = [plan_memory(graph, p).padding_fraction for p in (fastest, traded)]
  slower = seconds[1] / seconds[0] - 1
  assert 0 < slower <= engine.PADDING_TOLERANCE
  # Padding falls by more than the time grows.
  assert padding[0] - padding[1] > slower


def test_the_memory_the_error_names_is_over_the_budget_as_printed():
  # Found by the random-graph test (explore profile): a budget 0.2% under
  # the smallest memory that fits printed as "fits 0.123 GiB ... the
  # smallest per-device memory that fits is about 0.123 GiB". Both are now
  # printed with the digits it takes to tell them apart.
  widths = (256, 256, 1024, 256, 256, 1024, 64)
  nodes = [node_of(i, "params", w, 1.0) for i, w in enumerate(widths)]
  pairs = [(0, 1), (0, 2), (1, 2), (1, 3), (1, 4), (4, 5)]
  edges = [Edge(a, b, nodes[a].activation_bytes) for a, b in pairs]
  graph = OpGraph(nodes, edges, loss_nodes=[2, 3, 5, 6], model="random")
  budget = 132_359_806.0
  with pytest.raises(PlanError, match="smallest per-device memory") as info:
    graphpipe.plan(
      graph,
      2,
      4,
      micro_batch_sizes=[1],
      memory_bytes=budget,
      cost_model=V100,
    )
  text = str(info.value)
  stated = float(text.split(" fits ")[1].split(" GiB")[0]) * 2**30
  named = float(text.split("finds one is about ")[1].split(" GiB")[0]) * 2**30
  assert stated != named
  assert budget < named < 1.01 * budget
  chosen = graphpipe.plan(
    graph, 2, 4, micro_batch_sizes=[1], memory_bytes=named, cost_model=V100
  )
  assert plan_memory(graph, chosen).largest <= named


def _small_two_tower() -> OpGraph:
  """The quickstart notebook's linen two-tower MLP, as captured."""

  def node(i, name, params, flops, saved, kept, activation):
    return Node(
      i,
      name,
      param_bytes=params,
      fwd_flops=flops,
      bwd_flops=2 * flops,
      fwd_bytes=1000.0,
      bwd_bytes=2000.0,
      activation_bytes=activation,
      saved_bytes=saved,
      kept_bytes=kept,
      fixed={"fwd_bytes": float(params), "bwd_bytes": 2.0 * params},
    )

  nodes = [
    node(0, "left", 12544, 6272.0, 704.0, 512.0, 128.0),
    node(1, "right", 5888, 2968.0, 496.0, 304.0, 128.0),
    node(2, "head", 2600, 1341.0, 305.0, 300.0, 0.0),
  ]
  return OpGraph(nodes, [Edge(0, 2, 128.0), Edge(1, 2, 128.0)])


@pytest.mark.parametrize(
  "kinds", [KINDS, MODEL_KINDS, MODEL_KINDS + ("stashes", "work")]
)
@pytest.mark.parametrize("planner", ["sequential", "graphpipe"])
def test_the_chains_that_fit_are_found(kinds, planner):
  # The sequential DP priced its ranges' memory without the work term and
  # one gradient copy, so the one-stage chain (which does not fit) won its
  # search and hid [left | right, head], which does: "no sequential plan
  # fits" where GraphPipe found that very plan. And `memory_kinds` bounded
  # every kind of a stage's memory, not only the kinds asked for.
  graph = _small_two_tower()
  whole = plan_memory(graph, graphpipe.plan(graph, 1, 16)).largest_of(kinds)
  budget = 0.75 * whole  # the halves fit (0.6-0.65), the whole does not
  found = graphpipe.plan(
    graph, 2, 16, planner=planner, memory_bytes=budget, memory_kinds=kinds
  )
  assert found.num_stages == 2
  assert plan_memory(graph, found).largest_of(kinds) <= budget


def test_a_stage_holds_no_more_micro_batches_than_it_runs():
  # One micro-batch through a depth-2 pipeline: its first stages were
  # counted 2 in flight, so the planner's memory was over the simulator's
  # (7.9 against 6.5 MB) and a budget the plan fits chose one 39% slower.
  graph = graphpipe.models.capture_zoo("mmt", "tiny")
  fast = graphpipe.plan(graph, 3, 64)
  assert fast.num_microbatches == 1 and fast.depth == 2
  assert all(s.in_flight <= 1 for s in fast.stages)
  simulated = graphpipe.simulate(fast, graph).max_peak_memory_bytes
  assert plan_memory(graph, fast).largest == simulated
  bounded = graphpipe.plan(graph, 3, 64, memory_bytes=1.05 * simulated)
  assert bounded.stages == fast.stages
  graphpipe.check_plan(fast, graph, 1.05 * simulated)


def test_a_larger_budget_never_loses_a_plan():
  # Every device holds what the largest stage needs of each kind, which
  # the partitioners' per-stage bounds do not see: tiny two_branch on 4
  # devices planned under 250,000 bytes (a plan of 223,933) and failed
  # under 263,678 and 280,000. On 3 devices the case study's plan of
  # 1.32e9 bytes (a join stage holding both branches' last blocks, which
  # the DP never offers) was found only from 1.76e9 up: 1.4e9 failed and
  # the error named "about 1.63 GiB" and 6 devices.
  tiny = graphpipe.models.capture_zoo("two_branch", "tiny")
  v100 = costs.AnalyticCostModel(costs.device_spec("v100"))
  sizes = [1, 2, 4, 8]
  for devices, low, high in ((4, 150_000, 400_000), (8, 150_000, 400_000)):
    answers = [
      engine.fits(tiny, devices, 8, "graphpipe", v100, low * 1.04**i, sizes)
      for i in range(int(math.log(high / low) / math.log(1.04)) + 1)
    ]
    first = answers.index(True)
    assert all(answers[first:]), (devices, answers)
  for budget in (250_000, 263_678, 280_000):
    chosen = graphpipe.plan(tiny, 4, 8, memory_bytes=budget)
    assert plan_memory(tiny, chosen).largest <= budget
  paper = graphpipe.models.capture_zoo("two_branch", "paper")
  chosen = graphpipe.plan(paper, 3, 8, memory_bytes=1.4e9)
  assert plan_memory(paper, chosen).largest <= 1.33e9
  with pytest.raises(
    PlanError,
    match="smallest per-device memory under which it finds one is about 1.2",
  ):
    graphpipe.plan(paper, 3, 8, memory_bytes=1.3e9)
