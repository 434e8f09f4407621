"""Pipeline schedules: which action each device runs at each step.

A schedule is data. An action is one stage's forward or backward pass of one
micro-batch and prints as `2F0` (stage 2, forward, micro-batch 0) or `2B0`.
The schedule is a grid of steps ("ticks") by devices: at each tick a device
runs at most one action, and every device of a data-parallel stage runs the
stage's action at the same tick on its share of the micro-batch. A device's
row read left to right is its ordered action list; an action's column is its
global step, which a runtime turns into the arrays its `lax.scan` reads.
What an action produces at tick t may be read from tick t + 1 on.

`one_f_one_b` and `gpipe` build schedules for a plan (PAPERS.md, GraphPipe
scheduler and baseline formulas); `check_schedule` refuses a wrong one with
the grid printed and the bad cell marked.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable, Sequence

from graphpipe.errors import GraphpipeError
from graphpipe.plan import Plan, in_flight_counts

FORWARD = "F"
BACKWARD = "B"
KINDS = ("1f1b", "gpipe")

_ACTION_RE = re.compile(r"^(\d+)([FB])(\d+)$")


class ScheduleError(GraphpipeError):
  """A plan cannot be scheduled, or a schedule breaks a pipeline rule."""


@dataclasses.dataclass(frozen=True, order=True)
class Action:
  """One stage's forward or backward pass of one micro-batch.

  Example:
    >>> str(Action(2, "F", 0))
    '2F0'
    >>> Action.parse("1B3")
    Action(stage=1, kind='B', microbatch=3)

  Args:
    stage: the stage id.
    kind: 'F' (forward) or 'B' (backward).
    microbatch: the micro-batch index, 0 .. num_microbatches - 1.
  """

  stage: int
  kind: str
  microbatch: int

  def __str__(self) -> str:
    return f"{self.stage}{self.kind}{self.microbatch}"

  @classmethod
  def parse(cls, text: str) -> Action:
    """The action that `str` prints as `text`, e.g. '2F0'."""
    match = _ACTION_RE.match(text.strip())
    if match is None:
      raise ScheduleError(
        f"{text!r} is not an action: write stage, F or B, micro-batch, "
        "e.g. '2F0'"
      )
    return cls(int(match[1]), match[2], int(match[3]))


Grid = tuple[tuple[Action | None, ...], ...]


@dataclasses.dataclass(frozen=True)
class Schedule:
  """Per device, the action it runs at each tick (None: idle).

  Example:
    >>> schedule = one_f_one_b(plan)
    >>> print(schedule)                 # the device x step grid
    >>> schedule.actions(0)             # device 0's ordered actions
    >>> schedule.ticks()[Action(1, "B", 0)]

  Args:
    kind: '1f1b' or 'gpipe' (or any name for a hand-made schedule).
    num_microbatches: micro-batches per iteration.
    stage_devices: per stage, the devices running it.
    stage_edges: (src stage, dst stage) pairs of the stage DAG.
    in_flight: per stage, the most micro-batches it may keep stashed.
    grid: grid[device][tick], the action or None; every row as long as
      the schedule.
  """

  kind: str
  num_microbatches: int
  stage_devices: tuple[tuple[int, ...], ...]
  stage_edges: tuple[tuple[int, int], ...]
  in_flight: tuple[int, ...]
  grid: Grid

  @property
  def num_stages(self) -> int:
    return len(self.stage_devices)

  @property
  def num_devices(self) -> int:
    return len(self.grid)

  @property
  def num_ticks(self) -> int:
    return len(self.grid[0]) if self.grid else 0

  def successors(self, stage: int) -> list[int]:
    """Stages that read `stage`'s forward outputs."""
    return [b for a, b in self.stage_edges if a == stage]

  def predecessors(self, stage: int) -> list[int]:
    """Stages whose forward outputs `stage` reads."""
    return [a for a, b in self.stage_edges if b == stage]

  def actions(self, device: int) -> tuple[Action, ...]:
    """The ordered actions of `device` (its row without idle ticks)."""
    return tuple(a for a in self.grid[device] if a is not None)

  def stage_actions(self, stage: int) -> tuple[tuple[int, Action], ...]:
    """(tick, action) of `stage` in order, read from its first device."""
    row = self.grid[self.stage_devices[stage][0]]
    return tuple(
      (tick, a) for tick, a in enumerate(row) if a and a.stage == stage
    )

  def ticks(self) -> dict[Action, int]:
    """The tick table: the global step of every action."""
    return {
      action: tick
      for stage in range(self.num_stages)
      for tick, action in self.stage_actions(stage)
    }

  def __str__(self) -> str:
    in_flight = ",".join(str(n) for n in self.in_flight)
    return (
      f"{self.kind} schedule: {self.num_stages} stages, "
      f"{self.num_microbatches} micro-batches, {self.num_ticks} steps, "
      f"in flight {in_flight}\n{format_grid(self, max_steps=32)}"
    )

  def to_dict(self) -> dict:
    """A JSON-ready dict: stages, and per device its actions and ticks."""
    devices = {}
    for device, row in enumerate(self.grid):
      cells = [(t, a) for t, a in enumerate(row) if a is not None]
      if cells:
        devices[str(device)] = {
          "actions": [str(a) for _, a in cells],
          "ticks": [t for t, _ in cells],
        }
    return {
      "kind": self.kind,
      "num_microbatches": self.num_microbatches,
      "num_ticks": self.num_ticks,
      "num_devices": self.num_devices,
      "stages": [
        {"id": s, "devices": list(d), "in_flight": n}
        for s, (d, n) in enumerate(
          zip(self.stage_devices, self.in_flight, strict=True)
        )
      ],
      "stage_edges": [list(e) for e in self.stage_edges],
      "devices": devices,
    }

  @classmethod
  def from_dict(cls, data: dict) -> Schedule:
    """Inverse of `to_dict`."""
    try:
      grid = [[None] * data["num_ticks"] for _ in range(data["num_devices"])]
      for device, cells in data["devices"].items():
        for text, tick in zip(cells["actions"], cells["ticks"], strict=True):
          grid[int(device)][tick] = Action.parse(text)
      return cls(
        kind=data["kind"],
        num_microbatches=data["num_microbatches"],
        stage_devices=tuple(tuple(s["devices"]) for s in data["stages"]),
        stage_edges=tuple(tuple(e) for e in data["stage_edges"]),
        in_flight=tuple(s["in_flight"] for s in data["stages"]),
        grid=tuple(tuple(row) for row in grid),
      )
    except (KeyError, IndexError, TypeError, ValueError) as err:
      raise ScheduleError(f"not a graphpipe schedule: {err!r}") from err


def format_grid(
  schedule: Schedule,
  mark: tuple[int, int] | None = None,
  max_steps: int | None = None,
) -> str:
  """The device x step grid as text, one row per device that runs a stage.

  Example:
    >>> print(format_grid(schedule, mark=(1, 3)))
    step     0    1    2    3    4    5    6    7
    dev 0  0F0  0F1    .  0B0  0F2  0B1    .  0B2
    dev 1    .  1F0  1B0 [1F1] 1B1  1F2  1B2    .

  Args:
    schedule: the schedule to print.
    mark: (device, tick) of a cell to bracket; the tick may be one past the
      end (a missing action at the end of a row).
    max_steps: show at most this many steps, around the mark if any.
  """
  num_ticks = schedule.num_ticks
  if mark is not None and mark[1] >= num_ticks:
    num_ticks = mark[1] + 1
  first, last = 0, num_ticks
  if max_steps is not None and num_ticks > max_steps:
    center = mark[1] if mark is not None else max_steps // 2
    first = max(0, min(center - max_steps // 2, num_ticks - max_steps))
    last = first + max_steps
  used = sorted({d for devices in schedule.stage_devices for d in devices})
  used += [
    d
    for d in range(schedule.num_devices)
    if d not in used and any(schedule.grid[d])
  ]

  def cell(device, tick):
    row = schedule.grid[device]
    action = row[tick] if tick < len(row) else None
    return str(action) if action is not None else "."

  width = max(
    [len(str(t)) for t in range(first, last)]
    + [len(cell(d, t)) for d in used for t in range(first, last)]
  )
  label = 1 + max([len("step")] + [len(f"dev {d}") for d in used])
  head = f"{'step':<{label}}" + "".join(
    f" {t:>{width}} " for t in range(first, last)
  )
  lines = [(head + (" ..." if last < num_ticks else "")).rstrip()]
  for device in used:
    cells = []
    for tick in range(first, last):
      text = f"{cell(device, tick):>{width}}"
      cells.append(f"[{text}]" if (device, tick) == mark else f" {text} ")
    more = " ..." if last < num_ticks else ""
    line = f"{f'dev {device}':<{label}}" + "".join(cells) + more
    lines.append(line.rstrip())
  if first > 0:
    lines.insert(0, f"(steps {first}..{last - 1} of {num_ticks})")
  return "\n".join(lines)


def schedule_for(plan: Plan, kind: str | None = None) -> Schedule:
  """The schedule of `kind` (default: the plan's own) for `plan`.

  Example:
    >>> schedule = schedule_for(plan)           # plan.schedule, e.g. '1f1b'
    >>> schedule = schedule_for(plan, "gpipe")

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
  n(s) = 1 + max over successors (`plan.in_flight_counts`, recomputed from
  the stage DAG). On a chain of p stages this is PipeDream-Flush: stage i
  (from 1) holds p - i + 1, bubble (p - 1) / (m + p - 1) when balanced.

  Example:
    >>> print(one_f_one_b(plan))        # 2 stages, 3 micro-batches
    1f1b schedule: 2 stages, 3 micro-batches, 8 steps, in flight 2,1
    step     0    1    2    3    4    5    6    7
    dev 0  0F0  0F1    .  0B0  0F2  0B1    .  0B2
    dev 1    .  1F0  1B0  1F1  1B1  1F2  1B2    .

  Args:
    plan: stages (ids in topological order, disjoint device sets, one
      micro-batch size) and stage edges.
  """
  num_stages, stage_edges, _ = _layout(plan)
  in_flight = tuple(in_flight_counts(num_stages, stage_edges))

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
    >>> [str(a) for a in gpipe(plan).actions(0)]    # 2 micro-batches
    ['0F0', '0F1', '0B0', '0B1']

  Args:
    plan: stages (ids in topological order, disjoint device sets, one
      micro-batch size) and stage edges.
  """
  num_stages, _, num_microbatches = _layout(plan)
  in_flight = (num_microbatches,) * num_stages

  def pick(stage, forward_ready, backward_ready, forwards, backwards):
    del stage, backwards  # GPipe bounds nothing but the batch
    if forwards < num_microbatches:
      return FORWARD if forward_ready else None
    return BACKWARD if backward_ready else None

  return _greedy(plan, "gpipe", in_flight, pick)


def _layout(plan: Plan) -> tuple[int, tuple[tuple[int, int], ...], int]:
  """(num_stages, stage_edges, num_microbatches) of a schedulable plan."""
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
  sizes = {s.micro_batch_size for s in plan.stages}
  if len(sizes) > 1:
    raise ScheduleError(
      f"stages use different micro-batch sizes {sorted(sizes)}: the "
      "scheduler needs one micro-batch size for all stages"
    )
  (size,) = sizes
  if size < 1 or plan.batch_size % size:
    raise ScheduleError(
      f"batch size {plan.batch_size} is not a positive multiple of the "
      f"micro-batch size {size}: pick a micro-batch size that divides it"
    )
  edges = tuple(tuple(e) for e in plan.stage_edges)
  for src, dst in edges:
    if not 0 <= src < dst < len(ids):
      raise ScheduleError(
        f"stage edge {src}->{dst} must go forward between existing stages"
      )
  return len(ids), edges, plan.batch_size // size


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
        F ready = its next forward's micro-batch left every predecessor
                  before this tick
        B ready = its next backward's micro-batch came back from every
                  successor and its own forward ran, before this tick
        pick(stage, F ready, B ready, #F run, #B run) -> 'F', 'B', idle
        run it on every device of the stage at this tick

  Forwards and backwards each go in micro-batch order. Because readiness
  only looks at earlier ticks, a tick where no stage can act would repeat
  forever; that cannot happen for the two pickers here (n(s) > n(t) along
  every edge s -> t) and is reported as a bug if it does.
  """
  num_stages, edges, num_microbatches = _layout(plan)
  preds = [[a for a, b in edges if b == s] for s in range(num_stages)]
  succs = [[b for a, b in edges if a == s] for s in range(num_stages)]
  done: dict[Action, int] = {}
  next_forward = [0] * num_stages
  next_backward = [0] * num_stages

  def before(action, tick):
    return done.get(action, tick) < tick

  tick = 0
  while len(done) < 2 * num_stages * num_microbatches:
    ran = False
    for stage in reversed(range(num_stages)):
      f, b = next_forward[stage], next_backward[stage]
      forward_ready = f < num_microbatches and all(
        before(Action(p, FORWARD, f), tick) for p in preds[stage]
      )
      backward_ready = (
        b < f
        and before(Action(stage, FORWARD, b), tick)
        and all(before(Action(s, BACKWARD, b), tick) for s in succs[stage])
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
        f"{len(done)} of {2 * num_stages * num_microbatches} actions "
        "placed: this is a bug in graphpipe.schedule, please report it "
        "with the plan"
      )
    tick += 1
  grid = [[None] * tick for _ in range(plan.num_devices)]
  for action, at in done.items():
    for device in plan.stages[action.stage].devices:
      grid[device][at] = action
  schedule = Schedule(
    kind=kind,
    num_microbatches=num_microbatches,
    stage_devices=tuple(tuple(s.devices) for s in plan.stages),
    stage_edges=edges,
    in_flight=tuple(in_flight),
    grid=tuple(tuple(row) for row in grid),
  )
  check_schedule(schedule)
  return schedule


def check_schedule(schedule: Schedule) -> None:
  """Raises `ScheduleError` unless `schedule` obeys the pipeline rules.

  The rules: each action runs on the devices of its stage, the same tick on
  all of them; every stage runs each micro-batch's forward and backward
  exactly once; a forward runs after the forwards of that micro-batch on all
  predecessor stages; a backward runs after its own forward and after the
  backwards of that micro-batch on all successor stages; a stage never
  stashes more than its `in_flight` micro-batches (forwards run whose
  backward has not). The error names the rule, prints the device x step
  grid with the offending cell in brackets and says how to fix it.

  Example:
    >>> check_schedule(one_f_one_b(plan))      # passes silently
    >>> check_schedule(bad)
    ScheduleError: stage 0 stashes 2 micro-batches at step 1 (0F1), more
    than its in-flight bound 1: run a backward before this forward
    step     0    1    2    3    4    5    6    7    8    9
    dev 0  0F0 [0F1]   .  0B0  0F2  0B1  0F3  0B2    .  0B3
    dev 1    .  1F0  1B0  1F1  1B1  1F2  1B2  1F3  1B3    .
    Build schedules with graphpipe.schedule.one_f_one_b(plan) or ...

  Args:
    schedule: the schedule to check.
  """
  num_stages = schedule.num_stages
  m = schedule.num_microbatches
  fix = (
    "Build schedules with graphpipe.schedule.one_f_one_b(plan) or "
    "gpipe(plan), or move the marked action."
  )

  def fail(problem, device, tick):
    grid = format_grid(schedule, mark=(device, tick), max_steps=40)
    raise ScheduleError(f"{problem}\n{grid}\n{fix}")

  if len(schedule.in_flight) != num_stages or any(
    len(row) != schedule.num_ticks for row in schedule.grid
  ):
    raise ScheduleError(
      "malformed schedule: one in-flight bound per stage and equally long "
      "device rows are required"
    )
  for device, row in enumerate(schedule.grid):
    for tick, action in enumerate(row):
      if action is None:
        continue
      if not (
        0 <= action.stage < num_stages
        and action.kind in (FORWARD, BACKWARD)
        and 0 <= action.microbatch < m
      ):
        fail(
          f"{action} at step {tick} on device {device} is not an action of "
          f"this schedule ({num_stages} stages, {m} micro-batches)",
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
      for microbatch in range(m):
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
        needs = [Action(p, FORWARD, k) for p in schedule.predecessors(stage)]
        rule = "a forward runs after its predecessors' forwards"
      else:
        needs = [Action(stage, FORWARD, k)] + [
          Action(s, BACKWARD, k) for s in schedule.successors(stage)
        ]
        rule = (
          "a backward runs after its own forward and its successors' backwards"
        )
      for need in needs:
        if at[need] >= tick:
          fail(
            f"{action} at step {tick} on device {devices[0]} runs before "
            f"{need} (step {at[need]}) finished: {rule} of the same "
            "micro-batch, at a later step",
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
