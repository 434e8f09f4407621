"""Per-stage micro-batch sizes: plan rules, schedules, simulator, planner."""

import dataclasses

import pytest
from hypothesis import given
from hypothesis import strategies as st

from graphpipe import costs
from graphpipe.core.stages import Plan, in_flight_counts
from graphpipe.errors import PlanError, ScheduleError
from graphpipe.planning.search import plan
from graphpipe.planning.validate import check_plan
from graphpipe.schedules.builders import gpipe, one_f_one_b, schedule_for
from graphpipe.schedules.checker import check_schedule
from graphpipe.schedules.grid import Action, Schedule, overlapping
from graphpipe.simulator.engine import simulate
from tests.graphpipe.test_schedule import (
  FEW,
  chain,
  make_graph,
  make_plan,
  plans,
)
from tests.graphpipe.test_simulate import UnitCosts


def with_sizes(p: Plan, sizes) -> Plan:
  """`p` with stage s taking micro-batches of sizes[s] (1F1B counts)."""
  counts = in_flight_counts(p.num_stages, p.stage_edges, sizes)
  stages = tuple(
    dataclasses.replace(s, micro_batch_size=b, in_flight=n)
    for s, b, n in zip(p.stages, sizes, counts, strict=True)
  )
  return dataclasses.replace(p, stages=stages)


@st.composite
def sized_plans(draw) -> Plan:
  """A random stage DAG whose sizes double along some edges."""
  p = draw(plans())
  factors = draw(
    st.lists(
      st.sampled_from([1, 2]), min_size=p.num_stages, max_size=p.num_stages
    )
  )
  sizes = []
  for s in range(p.num_stages):
    base = max([2] + [sizes[a] for a in p.predecessors(s)])
    sizes.append(base * factors[s])
  batch = 2 * max(sizes) * len(set(sizes))  # every size divides it
  return with_sizes(dataclasses.replace(p, batch_size=batch), sizes)


def test_overlap_maps_micro_batches_both_ways():
  assert list(overlapping(1, 2, 8)) == [4, 5, 6, 7]
  assert list(overlapping(5, 8, 2)) == [1]
  assert list(overlapping(3, 4, 4)) == [3]


def test_in_flight_counts_are_in_samples():
  # A sink taking 2x: its predecessor stashes the sink's 2 + its own 1.
  assert in_flight_counts(2, [(0, 1)], [2, 4]) == [3, 1]
  assert in_flight_counts(3, [(0, 1), (1, 2)], [1, 2, 4]) == [7, 3, 1]
  with pytest.raises(PlanError, match="only grow"):
    in_flight_counts(2, [(0, 1)], [4, 2])


@FEW
@given(sized_plans())
def test_every_sized_schedule_passes_the_checker(p):
  for schedule in (one_f_one_b(p), gpipe(p)):
    check_schedule(schedule)
    for stage in p.stages:
      count = p.batch_size // stage.micro_batch_size
      assert schedule.microbatches(stage.id) == count
      for device in stage.devices:
        assert len(schedule.actions(device)) == 2 * count
    assert Schedule.from_dict(schedule.to_dict()) == schedule
  report = simulate(p, make_graph((p.num_stages, p.stage_edges)), UnitCosts())
  assert report.iteration_time_s > 0
  assert all(
    peak <= s.in_flight
    for peak, s in zip(report.peak_stash, p.stages, strict=True)
  )


def test_a_larger_sink_runs_once_every_k_and_returns_k_pieces():
  p = with_sizes(make_plan(chain(2), 4, micro_batch_size=2), [2, 4])
  schedule = one_f_one_b(p)
  assert schedule.stage_microbatches == (4, 2)
  assert [str(a) for a in schedule.actions(1)] == ["1F0", "1B0", "1F1", "1B1"]
  ticks = schedule.ticks()
  # 1F0 reads 0F0 and 0F1; 0B0 and 0B1 wait for the piece of 1B0.
  assert ticks[Action(1, "F", 0)] > ticks[Action(0, "F", 1)]
  assert ticks[Action(0, "B", 1)] > ticks[Action(1, "B", 0)]
  # Forward 1 s per sample on both stages, backward 2 s, no links: the
  # sink starts after two forwards of stage 0 (4 s); each stage is busy
  # 8 x 3 = 24 s.
  report = simulate(p, make_graph(chain(2)), UnitCosts())
  events = {e.name: e for e in report.events if e.device == 1}
  assert events["1F0"].start_s == pytest.approx(4.0)
  transfers = [e for e in report.events if e.category == "transfer"]
  assert not transfers  # free links carry nothing here
  assert report.iteration_time_s >= 24.0


def test_gradient_pieces_travel_separately():
  p = with_sizes(make_plan(chain(2), 4, micro_batch_size=2), [2, 4])
  graph = make_graph(chain(2), edge_bytes=1.0)
  report = simulate(p, graph, UnitCosts(transfer_s_per_byte=0.25))
  grads = [e for e in report.events if e.name.startswith("grad 1B0")]
  # Two pieces of 2 samples, 1 byte each per sample: 0.5 s each, in turn.
  assert [e.duration_s for e in grads] == pytest.approx([0.5, 0.5])
  assert grads[1].start_s == pytest.approx(grads[0].start_s + 0.5)


def test_the_checker_refuses_a_backward_before_its_piece():
  p = with_sizes(make_plan(chain(2), 2, micro_batch_size=2), [2, 4])
  good = one_f_one_b(p)
  grid = [list(row) for row in good.grid]
  # Move 0B0 to before 1B0 ran.
  ticks = good.ticks()
  early = ticks[Action(1, "B", 0)]
  late = ticks[Action(0, "B", 0)]
  grid[0][late], grid[0][early] = grid[0][early], grid[0][late]
  bad = dataclasses.replace(good, grid=tuple(tuple(r) for r in grid))
  with pytest.raises(ScheduleError, match="successors' backwards"):
    check_schedule(bad)


def test_plans_with_shrinking_sizes_are_refused():
  p = make_plan(chain(2), 2, micro_batch_size=4)
  shrinking = dataclasses.replace(
    p,
    stages=(
      p.stages[0],
      dataclasses.replace(p.stages[1], micro_batch_size=2),
    ),
  )
  with pytest.raises(ScheduleError, match="only grow"):
    schedule_for(shrinking)
  with pytest.raises(PlanError, match="not a multiple"):
    check_plan(shrinking, make_graph(chain(2)), 1e12)


@pytest.fixture(scope="module")
def dlrm():
  from graphpipe.models import capture_zoo

  return capture_zoo("dlrm", "paper")


def test_the_planner_picks_unequal_sizes_where_they_pay(dlrm):
  # DLRM on 16 devices with a quarter of a V100's memory: a pipeline's
  # first stages hold the most micro-batches in flight, so one size must be
  # small enough for them; per-stage sizes let later stages take larger
  # ones (8 to 64 samples: 11% faster than the best uniform plan, with the
  # padding trade and by time alone; experiments.reproduce's per_stage).
  # With the whole memory one size is as fast: the uniform search finds
  # plans as good (until its branches could run apart on spare devices,
  # sizes 128 and 256 won 7% here).
  v100 = costs.AnalyticCostModel(costs.device_spec("v100"))
  memory = v100.memory_bytes / 4
  uniform = plan(dlrm, 16, 512, memory_bytes=memory)
  sized = plan(dlrm, 16, 512, per_stage_micro_batches=True, memory_bytes=memory)
  check_plan(sized, dlrm, memory)
  assert sized.per_stage_micro_batches and not uniform.per_stage_micro_batches
  assert (
    simulate(sized, dlrm, v100).iteration_time_s
    < simulate(uniform, dlrm, v100).iteration_time_s
  )
  # (`uniform` shows the default: off, the paper's optional extension;
  # the runtime runs such plans, `test_runtime_micro_batches.py`.)
