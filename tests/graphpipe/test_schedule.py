"""Tests of graphpipe.schedule: 1F1B and GPipe schedules and the checker.

Also home of the stage-DAG builders and hypothesis strategies that
test_simulate.py reuses.
"""

import dataclasses

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from graphpipe.core.graph import Edge, Node, OpGraph
from graphpipe.core.stages import Plan, Stage, in_flight_counts
from graphpipe.errors import ScheduleError
from graphpipe.schedules.builders import gpipe, one_f_one_b, schedule_for
from graphpipe.schedules.checker import check_schedule
from graphpipe.schedules.grid import Action, Schedule, format_grid

FEW = settings(
  max_examples=25,
  deadline=None,
  suppress_health_check=[HealthCheck.too_slow],
)

# A stage DAG: (number of stages, edges with src < dst).
StageDag = tuple[int, tuple[tuple[int, int], ...]]


def make_plan(
  dag: StageDag,
  num_microbatches: int,
  devices_per_stage=None,
  micro_batch_size: int = 1,
  planner: str = "test",
  schedule: str = "1f1b",
) -> Plan:
  """A plan over `dag` with stage s on its own consecutive devices."""
  num_stages, edges = dag
  devices_per_stage = devices_per_stage or [1] * num_stages
  stages, first = [], 0
  counts = in_flight_counts(num_stages, edges)
  for s in range(num_stages):
    devices = tuple(range(first, first + devices_per_stage[s]))
    first += devices_per_stage[s]
    stages.append(Stage(s, (s,), devices, micro_batch_size, counts[s]))
  return Plan(
    planner,
    tuple(stages),
    tuple(edges),
    micro_batch_size * num_microbatches,
    first,
    schedule=schedule,
  )


def make_graph(dag: StageDag, fwd=None, edge_bytes: float = 8.0) -> OpGraph:
  """One node per stage (node s in stage s) with FLOPs = seconds/sample."""
  num_stages, edges = dag
  fwd = fwd or [1.0] * num_stages
  nodes = [
    Node(
      s,
      f"n{s}",
      param_bytes=64,
      fwd_flops=fwd[s],
      bwd_flops=2 * fwd[s],
      saved_bytes=100.0,
    )
    for s in range(num_stages)
  ]
  return OpGraph(nodes, [Edge(a, b, edge_bytes) for a, b in edges])


def chain(p: int) -> StageDag:
  return p, tuple((i, i + 1) for i in range(p - 1))


def _compose(args) -> StageDag:
  kind, (n1, e1), (n2, e2) = args
  shifted = tuple((a + n1, b + n1) for a, b in e2)
  edges = e1 + shifted
  if kind == "series":
    sinks = [v for v in range(n1) if not any(a == v for a, _ in e1)]
    sources = [v for v in range(n2) if not any(b == v for _, b in e2)]
    edges += tuple((a, b + n1) for a in sinks for b in sources)
  return n1 + n2, tuple(sorted(edges))


# Series-parallel stage DAGs: one stage, or series / parallel compositions.
sp_dags = st.recursive(
  st.just((1, ())),
  lambda inner: st.tuples(
    st.sampled_from(["series", "parallel"]), inner, inner
  ).map(_compose),
  max_leaves=6,
)


@st.composite
def any_dags(draw) -> StageDag:
  """A random DAG on 1..6 stages (mostly not series-parallel)."""
  n = draw(st.integers(1, 6))
  pairs = [(a, b) for a in range(n) for b in range(a + 1, n)]
  keep = draw(st.lists(st.booleans(), min_size=len(pairs), max_size=len(pairs)))
  return n, tuple(p for p, k in zip(pairs, keep, strict=True) if k)


@st.composite
def plans(draw, dags=None) -> Plan:
  """A plan on an SP or non-SP DAG, some stages data parallel."""
  dag = draw(dags or st.one_of(sp_dags, any_dags()))
  devices = draw(st.lists(st.integers(1, 2), min_size=dag[0], max_size=dag[0]))
  return make_plan(
    dag,
    num_microbatches=draw(st.integers(1, 5)),
    devices_per_stage=devices,
    micro_batch_size=2,
  )


# The smallest non-SP DAG ("N"): 0->2, 0->3, 1->3.
N_DAG = (4, ((0, 2), (0, 3), (1, 3)))


@FEW
@given(plans())
@example(make_plan(N_DAG, 3))
def test_every_schedule_passes_the_checker(plan):
  m = plan.num_microbatches
  for schedule in (one_f_one_b(plan), gpipe(plan)):
    check_schedule(schedule)
    for stage in plan.stages:
      for device in stage.devices:
        assert len(schedule.actions(device)) == 2 * m
    assert len(schedule.ticks()) == 2 * m * plan.num_stages
    assert Schedule.from_dict(schedule.to_dict()) == schedule
  for stage in plan.stages:
    kinds = "".join(a.kind for _, a in gpipe(plan).stage_actions(stage.id))
    assert kinds == "F" * m + "B" * m


@FEW
@given(plans())
def test_in_flight_bounds_follow_the_stage_dag(plan):
  fast = one_f_one_b(plan)
  assert fast.in_flight == tuple(
    in_flight_counts(plan.num_stages, plan.stage_edges)
  )
  assert all(n <= plan.num_microbatches for n in gpipe(plan).in_flight)


@pytest.mark.parametrize("p", [1, 2, 4, 6])
def test_in_flight_on_a_chain_is_p_minus_i_plus_1(p):
  schedule = one_f_one_b(make_plan(chain(p), num_microbatches=8))
  # Stage i counted from 1 holds p - i + 1.
  assert schedule.in_flight == tuple(p - i + 1 for i in range(1, p + 1))


def test_1f1b_chain_is_pipedream_flush():
  schedule = one_f_one_b(make_plan(chain(3), num_microbatches=4))
  rows = [" ".join(map(str, schedule.actions(d))) for d in range(3)]
  assert rows == [
    "0F0 0F1 0F2 0B0 0F3 0B1 0B2 0B3",
    "1F0 1F1 1B0 1F2 1B1 1F3 1B2 1B3",
    "2F0 2B0 2F1 2B1 2F2 2B2 2F3 2B3",
  ]
  # Unit ticks: 2 (m + p - 1) steps.
  assert schedule.num_ticks == 2 * (4 + 3 - 1)


def test_gpipe_runs_all_forwards_then_all_backwards():
  schedule = gpipe(make_plan(chain(2), num_microbatches=3))
  assert [str(a) for a in schedule.actions(0)] == [
    "0F0",
    "0F1",
    "0F2",
    "0B0",
    "0B1",
    "0B2",
  ]
  assert schedule.in_flight == (3, 3)


def test_diamond_branches_run_concurrently():
  plan = make_plan((4, ((0, 1), (0, 2), (1, 3), (2, 3))), 4, [2, 1, 1, 1])
  schedule = one_f_one_b(plan)
  ticks = schedule.ticks()
  assert ticks[Action(1, "F", 0)] == ticks[Action(2, "F", 0)]
  assert schedule.in_flight == (3, 2, 2, 1)
  # Both devices of the data-parallel stage 0 run the same row.
  assert schedule.actions(0) == schedule.actions(1)


def test_schedule_for_follows_the_plan_and_refuses_unknown_kinds():
  plan = make_plan(chain(2), 2, schedule="gpipe")
  assert schedule_for(plan).kind == "gpipe"
  assert schedule_for(plan, "1f1b").kind == "1f1b"
  with pytest.raises(ScheduleError, match="unknown schedule 'zb'"):
    schedule_for(plan, "zb")


def test_unschedulable_plans_are_refused_clearly():
  plan = make_plan(chain(2), 2)
  shared = dataclasses.replace(
    plan,
    stages=(plan.stages[0], dataclasses.replace(plan.stages[1], devices=(0,))),
  )
  with pytest.raises(ScheduleError, match="share device 0"):
    one_f_one_b(shared)
  uneven = make_plan(chain(2), 2, micro_batch_size=2)
  uneven = dataclasses.replace(uneven, batch_size=5)
  with pytest.raises(ScheduleError, match="not a positive multiple"):
    gpipe(uneven)


def test_actions_print_and_parse_compactly():
  assert str(Action(2, "F", 0)) == "2F0"
  assert Action.parse("12B3") == Action(12, "B", 3)
  with pytest.raises(ScheduleError, match="e.g. '2F0'"):
    Action.parse("2X0")


def test_schedule_prints_as_a_grid():
  text = str(one_f_one_b(make_plan(chain(2), 2)))
  assert text.splitlines()[0].startswith("1f1b schedule: 2 stages")
  assert "dev 0  0F0  0F1" in text
  assert "dev 1    .  1F0  1B0" in text


def _with_cell_moves(schedule, moves):
  """The schedule with each (device, from tick, to tick) cell moved."""
  grid = [list(row) for row in schedule.grid]
  for device, src, dst in moves:
    grid[device][dst], grid[device][src] = grid[device][src], None
  return dataclasses.replace(schedule, grid=tuple(map(tuple, grid)))


def _cell(schedule, text):
  return schedule.ticks()[Action.parse(text)]


def test_checker_refuses_a_dependency_violation():
  good = one_f_one_b(make_plan(chain(3), 4))
  # Swap 1F1 and 1F0 of device 1: 1F1 now runs with 0F1 on device 0.
  a, b = _cell(good, "1F0"), _cell(good, "1F1")
  grid = [list(row) for row in good.grid]
  grid[1][a], grid[1][b] = grid[1][b], grid[1][a]
  bad = dataclasses.replace(good, grid=tuple(map(tuple, grid)))
  with pytest.raises(ScheduleError) as err:
    check_schedule(bad)
  text = str(err.value)
  assert "1F1 at step 1 on device 1 runs before 0F1" in text
  assert "[1F1]" in text and "step" in text
  assert "dev 1    . [1F1]" in text


def test_checker_refuses_an_over_full_stash():
  good = one_f_one_b(make_plan(chain(2), 4))
  # Stage 0 (in flight 2) runs 0F2 in the idle step before 0B0.
  idle = good.grid[0].index(None)
  bad = _with_cell_moves(good, [(0, _cell(good, "0F2"), idle)])
  with pytest.raises(ScheduleError) as err:
    check_schedule(bad)
  text = str(err.value)
  assert "stage 0 stashes 3 micro-batches" in text
  assert "in-flight bound 2" in text
  assert "[0F2]" in text


def test_checker_refuses_a_missing_microbatch():
  good = one_f_one_b(make_plan(chain(2), 4))
  grid = [list(row) for row in good.grid]
  grid[1][_cell(good, "1B2")] = None
  bad = dataclasses.replace(good, grid=tuple(map(tuple, grid)))
  with pytest.raises(ScheduleError) as err:
    check_schedule(bad)
  text = str(err.value)
  assert "stage 1 never runs 1B2 (backward of micro-batch 2)" in text
  # The mark sits where the order skips: on 1B3.
  assert "[1B3]" in text


def test_checker_refuses_duplicates_wrong_devices_and_split_replicas():
  good = one_f_one_b(make_plan(chain(2), 2, [2, 1]))
  idle = good.grid[2].index(None, _cell(good, "1B1"))
  grid = [list(row) for row in good.grid]
  grid[2][idle] = Action(1, "B", 1)
  with pytest.raises(ScheduleError, match="1B1 runs twice"):
    check_schedule(dataclasses.replace(good, grid=tuple(map(tuple, grid))))
  grid = [list(row) for row in good.grid]
  grid[2][idle] = Action(0, "F", 0)
  with pytest.raises(ScheduleError, match="not a device of stage 0"):
    check_schedule(dataclasses.replace(good, grid=tuple(map(tuple, grid))))
  grid = [list(row) for row in good.grid]
  grid[1][_cell(good, "0F1")] = None
  with pytest.raises(ScheduleError, match="same steps as device 0"):
    check_schedule(dataclasses.replace(good, grid=tuple(map(tuple, grid))))


def test_long_grids_print_a_window_around_the_mark():
  schedule = gpipe(make_plan(chain(2), 40))
  text = format_grid(schedule, mark=(1, 60), max_steps=10)
  assert text.splitlines()[0] == f"(steps 55..64 of {schedule.num_ticks})"
  assert "[" in text and text.count("\n") == 3
