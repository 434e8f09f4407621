"""Schedule builders: 1F1B for stage DAGs and GPipe.

  schedule_for(plan)           # the plan's own kind
  one_f_one_b(plan), gpipe(plan)

Both run one greedy loop (`_greedy`), stages visited from the last to the
first at every tick (PAPERS.md, GraphPipe scheduler and baseline formulas),
and differ only in what a ready stage picks.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from graphpipe.core.stages import Plan, in_flight_counts
from graphpipe.errors import ScheduleError
from graphpipe.schedules.checker import check_schedule
from graphpipe.schedules.grid import (
  BACKWARD,
  FORWARD,
  KINDS,
  Action,
  Schedule,
  overlapping,
)


def schedule_for(plan: Plan, kind: str | None = None) -> Schedule:
  """The schedule of `kind` (default: the plan's own) for `plan`.

  Example:
    >>> plan = graphpipe.plan(capture_zoo("two_branch", "tiny"), 4, 8)
    >>> schedule_for(plan).kind                 # plan.schedule
    '1f1b'
    >>> schedule_for(plan, "gpipe").in_flight   # every micro-batch stashed
    (2, 2, 2)

  Args:
    plan: the stage DAG to schedule.
    kind: '1f1b' or 'gpipe'; None uses `plan.schedule`.
  """
  kind = kind or plan.schedule
  if kind == "1f1b":
    return one_f_one_b(plan)
  if kind == "gpipe":
    return gpipe(plan)
  raise ScheduleError(
    f"unknown schedule {kind!r}: use one of {', '.join(KINDS)}"
  )


def one_f_one_b(plan: Plan) -> Schedule:
  """The greedy 1F1B schedule of a stage DAG: backward as early as possible.

  Stage s keeps at most n(s) micro-batches stashed, n(sink) = 1 and
  n(s) = 1 + max over successors of n(t) b_t / b_s (`in_flight_counts` of
  `graphpipe.core.stages`, recomputed from the stage DAG and its sizes). On
  a chain of p stages with one size this is PipeDream-Flush: stage i (from
  1) holds p - i + 1, bubble (p - 1) / (m + p - 1) when balanced.

  Example:
    >>> plan = graphpipe.plan(capture_zoo("two_branch", "tiny"), 4, 8)
    >>> print(plan)                     # two branches joined by stage 2
    Plan[graphpipe] 3 stages, depth 2, b=4 x 2 micro-batches, 4 devices,
    schedule 1f1b
      stage 0: nodes [0, 1, 2] on devices [2], b=4, in flight 2
      stage 1: nodes [4, 5, 6] on devices [3], b=4, in flight 2
      stage 2: nodes [3, 7, 8] on devices [0, 1], b=4, in flight 1
      edges: [(0, 2), (1, 2)]
    >>> print(one_f_one_b(plan))        # stage 2 runs on devices 0 and 1
    1f1b schedule: 3 stages, 2 micro-batches, 6 steps, in flight 2,2,1
    step     0    1    2    3    4    5
    dev 0    .  2F0  2B0  2F1  2B1    .
    dev 1    .  2F0  2B0  2F1  2B1    .
    dev 2  0F0  0F1    .  0B0    .  0B1
    dev 3  1F0  1F1    .  1B0    .  1B1

  Args:
    plan: stages (ids in topological order, disjoint device sets, sizes
      that grow along edges by whole multiples) and stage edges.
  """
  num_stages, stage_edges, _ = _layout(plan)
  in_flight = tuple(
    in_flight_counts(num_stages, stage_edges, plan.micro_batch_sizes)
  )

  def pick(stage, forward_ready, backward_ready, forwards, backwards):
    if backward_ready:
      return BACKWARD
    if forward_ready and forwards - backwards < in_flight[stage]:
      return FORWARD
    return None

  return _greedy(plan, "1f1b", in_flight, pick)


def gpipe(plan: Plan) -> Schedule:
  """The GPipe schedule: every stage runs all forwards, then all backwards.

  Each stage stashes every micro-batch (in flight m); the bubble on a
  balanced chain is (p - 1) / (m + p - 1), as for 1F1B, at more memory.

  Example:
    >>> plan = graphpipe.plan(capture_zoo("two_branch", "tiny"), 4, 8)
    >>> print(gpipe(plan))              # all forwards, then all backwards
    gpipe schedule: 3 stages, 2 micro-batches, 6 steps, in flight 2,2,2
    step     0    1    2    3    4    5
    dev 0    .  2F0  2F1  2B0  2B1    .
    dev 1    .  2F0  2F1  2B0  2B1    .
    dev 2  0F0  0F1    .    .  0B0  0B1
    dev 3  1F0  1F1    .    .  1B0  1B1

  Args:
    plan: stages (ids in topological order, disjoint device sets, sizes
      that grow along edges by whole multiples) and stage edges.
  """
  _, _, counts = _layout(plan)
  in_flight = tuple(counts)

  def pick(stage, forward_ready, backward_ready, forwards, backwards):
    del backwards  # GPipe bounds nothing but the batch
    if forwards < counts[stage]:
      return FORWARD if forward_ready else None
    return BACKWARD if backward_ready else None

  return _greedy(plan, "gpipe", in_flight, pick)


def _layout(
  plan: Plan,
) -> tuple[int, tuple[tuple[int, int], ...], tuple[int, ...]]:
  """(num_stages, stage_edges, micro-batches per stage) of a schedulable
  plan."""
  if not plan.stages:
    raise ScheduleError("the plan has no stages: plan a non-empty graph")
  ids = [s.id for s in plan.stages]
  if ids != list(range(len(ids))):
    raise ScheduleError(
      f"stage ids must be 0..{len(ids) - 1} in order, got {ids}"
    )
  owner = {}
  for stage in plan.stages:
    if not stage.devices:
      raise ScheduleError(f"stage {stage.id} has no devices: give it one")
    for device in stage.devices:
      if not 0 <= device < plan.num_devices:
        raise ScheduleError(
          f"stage {stage.id} uses device {device}, outside the plan's "
          f"{plan.num_devices} devices"
        )
      if device in owner:
        raise ScheduleError(
          f"stages {owner[device]} and {stage.id} share device {device}: "
          "a device runs one stage, give each stage its own devices"
        )
      owner[device] = stage.id
  sizes = plan.micro_batch_sizes
  for stage, size in zip(plan.stages, sizes, strict=True):
    if size < 1 or plan.batch_size < 1 or plan.batch_size % size:
      raise ScheduleError(
        f"batch size {plan.batch_size} is not a positive multiple of stage "
        f"{stage.id}'s micro-batch size {size}: pick a micro-batch size "
        "that divides it"
      )
  edges = tuple(tuple(e) for e in plan.stage_edges)
  for src, dst in edges:
    if not 0 <= src < dst < len(ids):
      raise ScheduleError(
        f"stage edge {src}->{dst} must go forward between existing stages"
      )
    if sizes[dst] % sizes[src]:
      raise ScheduleError(
        f"stage {dst} takes micro-batches of {sizes[dst]}, not a multiple "
        f"of stage {src}'s {sizes[src]}: sizes may only grow along stage "
        "edges, by whole multiples"
      )
  return len(ids), edges, tuple(plan.batch_size // b for b in sizes)


# pick(stage, forward ready, backward ready, forwards run, backwards run)
# -> 'F', 'B' or None (idle).
PickFn = Callable[[int, bool, bool, int, int], str | None]


def _greedy(
  plan: Plan, kind: str, in_flight: Sequence[int], pick: PickFn
) -> Schedule:
  """Runs the stages tick by tick, each doing what `pick` chooses.

  The one loop of the scheduler, in pseudo-code:

    for tick = 0, 1, ...:                   # until every action has run
      for stage from the last to the first: # the paper's sink-to-source order
        F ready = its next forward's inputs (every predecessor micro-batch
                  it overlaps) left every predecessor before this tick
        B ready = its next backward's gradients (from the successor
                  micro-batch it is part of) came back from every successor
                  and its own forward ran, before this tick
        pick(stage, F ready, B ready, #F run, #B run) -> 'F', 'B', idle
        run it on every device of the stage at this tick

  Forwards and backwards each go in micro-batch order. Because readiness
  only looks at earlier ticks, a tick where no stage can act would repeat
  forever; that cannot happen for the two pickers here (n(s) b_s > n(t)
  b_t along every edge s -> t) and is reported as a bug if it does.
  """
  num_stages, edges, counts = _layout(plan)
  preds = [[a for a, b in edges if b == s] for s in range(num_stages)]
  succs = [[b for a, b in edges if a == s] for s in range(num_stages)]
  done: dict[Action, int] = {}
  next_forward = [0] * num_stages
  next_backward = [0] * num_stages
  total = 2 * sum(counts)

  def before(action, tick):
    return done.get(action, tick) < tick

  def all_before(stage, kind, microbatch, others, tick):
    return all(
      before(Action(o, kind, i), tick)
      for o in others
      for i in overlapping(microbatch, counts[stage], counts[o])
    )

  tick = 0
  while len(done) < total:
    ran = False
    for stage in reversed(range(num_stages)):
      f, b = next_forward[stage], next_backward[stage]
      forward_ready = f < counts[stage] and all_before(
        stage, FORWARD, f, preds[stage], tick
      )
      backward_ready = (
        b < f
        and before(Action(stage, FORWARD, b), tick)
        and all_before(stage, BACKWARD, b, succs[stage], tick)
      )
      choice = pick(stage, forward_ready, backward_ready, f, b)
      if choice == FORWARD:
        done[Action(stage, FORWARD, f)] = tick
        next_forward[stage] += 1
      elif choice == BACKWARD:
        done[Action(stage, BACKWARD, b)] = tick
        next_backward[stage] += 1
      ran = ran or choice is not None
    if not ran:
      raise ScheduleError(
        f"the {kind} scheduler is stuck at step {tick} with "
        f"{len(done)} of {total} actions "
        "placed: this is a bug in graphpipe.schedules, please report it "
        "with the plan"
      )
    tick += 1
  grid = [[None] * tick for _ in range(plan.num_devices)]
  for action, at in done.items():
    for device in plan.stages[action.stage].devices:
      grid[device][at] = action
  schedule = Schedule(
    kind=kind,
    num_microbatches=max(counts),
    stage_devices=tuple(tuple(s.devices) for s in plan.stages),
    stage_edges=edges,
    in_flight=tuple(in_flight),
    grid=tuple(tuple(row) for row in grid),
    stage_microbatches=counts if len(set(counts)) > 1 else (),
  )
  check_schedule(schedule)
  return schedule
