"""Pipeline schedules: the type, the builders and the checker.

  schedule = schedule_for(plan)        # 1F1B or GPipe, from the plan
  print(schedule)                      # the device x step grid, e.g. 2F0
  check_schedule(schedule)             # raises ScheduleError, cell marked

Modules: `grid` (`Action`, `Schedule`, `format_grid`), `builders`
(`schedule_for`, `one_f_one_b`, `gpipe`), `checker` (`check_schedule`).
"""

from graphpipe.schedules.builders import gpipe, one_f_one_b, schedule_for
from graphpipe.schedules.checker import check_schedule
from graphpipe.schedules.grid import (
  BACKWARD,
  FORWARD,
  KINDS,
  Action,
  Schedule,
  format_grid,
)

__all__ = [
  "BACKWARD",
  "FORWARD",
  "KINDS",
  "Action",
  "Schedule",
  "check_schedule",
  "format_grid",
  "gpipe",
  "one_f_one_b",
  "schedule_for",
]
