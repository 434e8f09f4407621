"""Deliberate process deaths, to test what survives them.

`GRAPHPIPE_FAULT=WHERE:PROCESS:STEP` makes the process whose
`jax.process_index()` is PROCESS kill itself with SIGKILL (as a crash or
the out-of-memory killer would: no Python clean-up runs) at:

- `step`: in `Trainer.step` on a state whose step counter is STEP, after
  the step is dispatched to the devices and before its result is read, so
  the other processes are inside that step's collectives;
- `save`: in `Trainer.save` of a state at step STEP, after the arrays'
  write has started and before the checkpoint is committed.

Unset (the normal case), each check is one environment lookup.
"""

from __future__ import annotations

import os
import signal

from graphpipe.errors import PipelineRuntimeError

ENV_FAULT = "GRAPHPIPE_FAULT"
WHERE = ("step", "save")


def armed(where: str) -> int | None:
  """The step at which this process dies at `where`, or None."""
  spec = os.environ.get(ENV_FAULT)
  if not spec:
    return None
  parts = spec.split(":")
  try:
    place, process, step = parts[0], int(parts[1]), int(parts[2])
  except (IndexError, ValueError):
    place = None
  if place not in WHERE or len(parts) != 3:
    raise PipelineRuntimeError(
      f"{ENV_FAULT}={spec!r}: expected WHERE:PROCESS:STEP with WHERE in "
      f"{WHERE}, e.g. 'step:1:2'"
    )
  import jax

  if place != where or process != jax.process_index():
    return None
  return step


def die() -> None:
  """Kills this process at once, as a crash would."""
  os.kill(os.getpid(), signal.SIGKILL)
