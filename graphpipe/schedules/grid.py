"""The schedule type: which action each device runs at each step.

A schedule is data. An action is one stage's forward or backward pass of one
micro-batch and prints as `2F0` (stage 2, forward, micro-batch 0) or `2B0`.
The schedule is a grid of steps ("ticks") by devices: at each tick a device
runs at most one action, and every device of a data-parallel stage runs the
stage's action at the same tick on its share of the micro-batch. A device's
row read left to right is its ordered action list; an action's column is its
global step, which a runtime turns into the arrays its `lax.scan` reads.
What an action produces at tick t may be read from tick t + 1 on.

Per-stage micro-batch sizes. A stage's actions count its own micro-batches:
stage s runs `microbatches(s)` = M_s of them, and its micro-batch j is the
j-th slice of M_s equal slices of the mini-batch. Across a stage edge the
two ends' micro-batches map by overlap (`overlapping`): when a stage runs k
times fewer micro-batches than its predecessor (k times larger), its
forward j reads the predecessor's micro-batches jk .. jk + k - 1, and its
backward j returns their gradients in k pieces, one per predecessor
micro-batch; the predecessor's backward i then waits for the piece of the
successor's backward i // k. This is all a runtime needs to execute such a
schedule: the counts, the edges and each device's ordered actions.

`graphpipe.schedules.builders` makes schedules for a plan (1F1B, GPipe);
`graphpipe.schedules.checker` refuses a wrong one with the grid printed and
the bad cell marked.
"""

from __future__ import annotations

import dataclasses
import re

from graphpipe.errors import ScheduleError

FORWARD = "F"
BACKWARD = "B"
KINDS = ("1f1b", "gpipe")

_ACTION_RE = re.compile(r"^(\d+)([FB])(\d+)$")


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
    microbatch: the micro-batch index, 0 .. M - 1 for a stage running M.
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


def overlapping(microbatch: int, count: int, other: int) -> range:
  """The micro-batches of a stage running `other` per iteration that share
  samples with micro-batch `microbatch` of a stage running `count`.

  Example:
    >>> list(overlapping(1, 2, 8))     # a 4x larger micro-batch ...
    [4, 5, 6, 7]
    >>> list(overlapping(5, 8, 2))     # ... and the one a small one is in
    [1]

  Args:
    microbatch: the micro-batch index, 0 .. count - 1.
    count: micro-batches of its stage per iteration.
    other: micro-batches of the other stage per iteration.
  """
  first = microbatch * other // count
  last = ((microbatch + 1) * other - 1) // count
  return range(first, last + 1)


@dataclasses.dataclass(frozen=True)
class Schedule:
  """Per device, the action it runs at each tick (None: idle).

  Example:
    >>> plan = graphpipe.plan(capture_zoo("two_branch", "tiny"), 4, 8)
    >>> schedule = graphpipe.schedule_for(plan)   # two branches, a join
    >>> print(schedule)                 # the device x step grid
    1f1b schedule: 3 stages, 2 micro-batches, 6 steps, in flight 2,2,1
    step     0    1    2    3    4    5
    dev 0    .  2F0  2B0  2F1  2B1    .
    dev 1    .  2F0  2B0  2F1  2B1    .
    dev 2  0F0  0F1    .  0B0    .  0B1
    dev 3  1F0  1F1    .  1B0    .  1B1
    >>> [str(a) for a in schedule.actions(0)]   # device 0's ordered actions
    ['2F0', '2B0', '2F1', '2B1']
    >>> schedule.ticks()[Action(2, "B", 0)]     # the step it runs at
    2

  Args:
    kind: '1f1b' or 'gpipe' (or any name for a hand-made schedule).
    num_microbatches: micro-batches per iteration (of the stage that runs
      the most, when they differ).
    stage_devices: per stage, the devices running it.
    stage_edges: (src stage, dst stage) pairs of the stage DAG.
    in_flight: per stage, the most micro-batches it may keep stashed.
    grid: grid[device][tick], the action or None; every row as long as
      the schedule.
    stage_microbatches: per stage, the micro-batches it runs when stages
      use different micro-batch sizes (module docstring); empty: every
      stage runs `num_microbatches`.
  """

  kind: str
  num_microbatches: int
  stage_devices: tuple[tuple[int, ...], ...]
  stage_edges: tuple[tuple[int, int], ...]
  in_flight: tuple[int, ...]
  grid: Grid
  stage_microbatches: tuple[int, ...] = ()

  @property
  def num_stages(self) -> int:
    return len(self.stage_devices)

  def microbatches(self, stage: int) -> int:
    """Micro-batches `stage` runs per iteration."""
    if self.stage_microbatches:
      return self.stage_microbatches[stage]
    return self.num_microbatches

  def inputs(self, stage: int, microbatch: int, neighbour: int) -> range:
    """Micro-batches of `neighbour` sharing samples with `microbatch` of
    `stage` (its inputs for a predecessor, the gradients it waits for
    from a successor)."""
    return overlapping(
      microbatch, self.microbatches(stage), self.microbatches(neighbour)
    )

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
    counts = f"{self.num_microbatches}"
    if self.stage_microbatches:
      counts = ",".join(str(m) for m in self.stage_microbatches)
    return (
      f"{self.kind} schedule: {self.num_stages} stages, "
      f"{counts} micro-batches, {self.num_ticks} steps, "
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
        {
          "id": s,
          "devices": list(d),
          "in_flight": n,
          "microbatches": self.microbatches(s),
        }
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
        stage_microbatches=_stage_counts(data),
      )
    except (KeyError, IndexError, TypeError, ValueError) as err:
      raise ScheduleError(f"not a graphpipe schedule: {err!r}") from err


def _stage_counts(data: dict) -> tuple[int, ...]:
  """Per-stage micro-batch counts of a schedule dict, () when uniform."""
  counts = tuple(
    s.get("microbatches", data["num_microbatches"]) for s in data["stages"]
  )
  return counts if len(set(counts)) > 1 else ()


def format_grid(
  schedule: Schedule,
  mark: tuple[int, int] | None = None,
  max_steps: int | None = None,
) -> str:
  """The device x step grid as text, one row per device that runs a stage.

  Example:
    >>> plan = graphpipe.plan(capture_zoo("two_branch", "tiny"), 4, 8)
    >>> schedule = graphpipe.schedule_for(plan)
    >>> print(format_grid(schedule, mark=(0, 3)))
    step     0    1    2    3    4    5
    dev 0    .  2F0  2B0 [2F1] 2B1    .
    dev 1    .  2F0  2B0  2F1  2B1    .
    dev 2  0F0  0F1    .  0B0    .  0B1
    dev 3  1F0  1F1    .  1B0    .  1B1

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
