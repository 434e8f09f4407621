"""`check_schedule`: does a schedule obey the pipeline rules.

A wrong schedule is refused with the rule it breaks, the device x step grid
with the bad cell in brackets, and what to do.
"""

from __future__ import annotations

from graphpipe.errors import ScheduleError
from graphpipe.schedules.grid import (
  BACKWARD,
  FORWARD,
  Action,
  Schedule,
  format_grid,
)


def check_schedule(schedule: Schedule) -> None:
  """Raises `ScheduleError` unless `schedule` obeys the pipeline rules.

  The rules: each action runs on the devices of its stage, the same tick on
  all of them; every stage runs each of its micro-batches' forward and
  backward exactly once; a forward runs after the forwards of the
  micro-batches it reads on all predecessor stages; a backward runs after
  its own forward and after the backwards of the micro-batches it belongs
  to on all successor stages (with per-stage sizes, "the micro-batches it
  reads / belongs to" are those sharing samples with it,
  `graphpipe.schedules.grid.overlapping`); a stage never stashes more than
  its `in_flight` micro-batches (forwards run whose backward has not). The
  error names the rule, prints the device x step grid with the offending
  cell in brackets and says how to fix it.

  Example:
    >>> import dataclasses
    >>> from graphpipe.schedules import gpipe, one_f_one_b
    >>> plan = graphpipe.plan(capture_zoo("two_branch", "tiny"), 4, 8)
    >>> check_schedule(one_f_one_b(plan))      # passes silently

    GPipe's order with 1F1B's in-flight bounds (2, 2, 1) stashes too much:

    >>> bad = dataclasses.replace(gpipe(plan), in_flight=(2, 2, 1))
    >>> check_schedule(bad)
    Traceback (most recent call last):
    ...
    graphpipe.errors.ScheduleError: stage 2 stashes 2 micro-batches at step 2
    (2F1), more than its in-flight bound 1: run a backward before this forward
    step     0    1    2    3    4    5
    dev 0    .  2F0 [2F1] 2B0  2B1    .
    dev 1    .  2F0  2F1  2B0  2B1    .
    dev 2  0F0  0F1    .    .  0B0  0B1
    dev 3  1F0  1F1    .    .  1B0  1B1
    Build schedules with graphpipe.schedules.one_f_one_b(plan) or
    gpipe(plan), or move the marked action.

  Args:
    schedule: the schedule to check.
  """
  num_stages = schedule.num_stages
  fix = (
    "Build schedules with graphpipe.schedules.one_f_one_b(plan) or "
    "gpipe(plan), or move the marked action."
  )

  def fail(problem, device, tick):
    grid = format_grid(schedule, mark=(device, tick), max_steps=40)
    raise ScheduleError(f"{problem}\n{grid}\n{fix}")

  if (
    len(schedule.in_flight) != num_stages
    or any(len(row) != schedule.num_ticks for row in schedule.grid)
    or schedule.stage_microbatches
    and len(schedule.stage_microbatches) != num_stages
  ):
    raise ScheduleError(
      "malformed schedule: one in-flight bound (and one micro-batch count, "
      "if any) per stage and equally long device rows are required"
    )
  for device, row in enumerate(schedule.grid):
    for tick, action in enumerate(row):
      if action is None:
        continue
      if not (
        0 <= action.stage < num_stages
        and action.kind in (FORWARD, BACKWARD)
        and 0 <= action.microbatch < schedule.microbatches(action.stage)
      ):
        count = (
          schedule.microbatches(action.stage)
          if 0 <= action.stage < num_stages
          else schedule.num_microbatches
        )
        fail(
          f"{action} at step {tick} on device {device} is not an action of "
          f"this schedule ({num_stages} stages, {count} micro-batches)",
          device,
          tick,
        )
      if device not in schedule.stage_devices[action.stage]:
        fail(
          f"{action} runs on device {device}, which is not a device of "
          f"stage {action.stage} "
          f"({list(schedule.stage_devices[action.stage])})",
          device,
          tick,
        )
  at: dict[Action, int] = {}
  for stage, devices in enumerate(schedule.stage_devices):
    expected = schedule.stage_actions(stage)
    for device in devices[1:]:
      row = schedule.grid[device]
      got = tuple((t, a) for t, a in enumerate(row) if a and a.stage == stage)
      if got != expected:
        # The first step where the two rows differ.
        tick = min(t for t, a in set(got) ^ set(expected))
        fail(
          f"device {device} does not run stage {stage}'s actions at the "
          f"same steps as device {devices[0]}: every device of a "
          "data-parallel stage runs the stage's action at the same tick",
          device,
          tick,
        )
    for tick, action in expected:
      if action in at:
        fail(
          f"{action} runs twice (steps {at[action]} and {tick}): each "
          "micro-batch runs forward and backward once per stage",
          devices[0],
          tick,
        )
      at[action] = tick
    for kind in (FORWARD, BACKWARD):
      for microbatch in range(schedule.microbatches(stage)):
        if Action(stage, kind, microbatch) not in at:
          tick = next(
            (
              t
              for t, a in expected
              if a.kind == kind and a.microbatch > microbatch
            ),
            expected[-1][0] + 1 if expected else 0,
          )
          name = "forward" if kind == FORWARD else "backward"
          fail(
            f"stage {stage} never runs {Action(stage, kind, microbatch)} "
            f"({name} of micro-batch {microbatch}); the mark is where it "
            "is missing",
            devices[0],
            tick,
          )
  for stage, devices in enumerate(schedule.stage_devices):
    for tick, action in schedule.stage_actions(stage):
      k = action.microbatch
      if action.kind == FORWARD:
        needs = [
          Action(p, FORWARD, i)
          for p in schedule.predecessors(stage)
          for i in schedule.inputs(stage, k, p)
        ]
        rule = "a forward runs after its predecessors' forwards"
      else:
        needs = [Action(stage, FORWARD, k)] + [
          Action(s, BACKWARD, i)
          for s in schedule.successors(stage)
          for i in schedule.inputs(stage, k, s)
        ]
        rule = (
          "a backward runs after its own forward and its successors' backwards"
        )
      for need in needs:
        if at[need] >= tick:
          fail(
            f"{action} at step {tick} on device {devices[0]} runs before "
            f"{need} (step {at[need]}) finished: {rule} of the same "
            "samples, at a later step",
            devices[0],
            tick,
          )
    stashed = 0
    for tick, action in schedule.stage_actions(stage):
      stashed += 1 if action.kind == FORWARD else -1
      if stashed > schedule.in_flight[stage]:
        fail(
          f"stage {stage} stashes {stashed} micro-batches at step {tick} "
          f"({action}), more than its in-flight bound "
          f"{schedule.in_flight[stage]}: run a backward before this forward",
          devices[0],
          tick,
        )


def built_for(schedule: Schedule, plan) -> bool:
  """Whether `schedule` was built for `plan`: the same stages on the same
  devices, the same stage edges and micro-batch counts."""
  return (
    schedule.stage_devices == tuple(tuple(s.devices) for s in plan.stages)
    and set(schedule.stage_edges) == set(map(tuple, plan.stage_edges))
    and tuple(schedule.microbatches(s) for s in range(plan.num_stages))
    == plan.stage_microbatches
  )
