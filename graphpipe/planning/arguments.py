"""Argument checks and micro-batch sizes shared by the planning entry points
(`graphpipe.plan`, `tightest_plan`)."""

from __future__ import annotations

import numbers
from collections.abc import Sequence

import numpy as np

from graphpipe.core.graph import OpGraph
from graphpipe.core.memory import KINDS
from graphpipe.core.runnable import micro_batch_sizes
from graphpipe.errors import PlanError

PLANNERS = ("graphpipe", "sequential", "gpipe", "piper")


def check_arguments(
  graph,
  num_devices,
  batch_size,
  planner,
  padding_tolerance=0.0,
  max_padding=None,
  memory_kinds=KINDS,
  piper_budget=1,
) -> None:
  if not isinstance(graph, OpGraph):
    raise PlanError(
      f"plan takes an OpGraph (graphpipe.capture or OpGraph.load), got "
      f"{type(graph).__name__}"
    )
  if planner not in PLANNERS:
    raise PlanError(
      f"unknown planner {planner!r}; choose one of {', '.join(PLANNERS)}"
    )
  if not _count(num_devices):
    raise PlanError(f"num_devices must be a positive int, got {num_devices!r}")
  if not _count(batch_size):
    raise PlanError(f"batch_size must be a positive int, got {batch_size!r}")
  if not graph.nodes:
    raise PlanError("the graph has no nodes: capture a model first")
  if not isinstance(padding_tolerance, int | float) or not (
    padding_tolerance >= 0
  ):
    raise PlanError(
      f"padding_tolerance must be a number >= 0, got {padding_tolerance!r}"
    )
  if max_padding is not None and (
    not isinstance(max_padding, int | float) or not 0 <= max_padding <= 1
  ):
    raise PlanError(
      "max_padding must be None or a number in [0, 1] (a share of the "
      f"parameter and optimizer bytes held), got {max_padding!r}"
    )
  unknown = [k for k in memory_kinds if k not in KINDS]
  if isinstance(memory_kinds, str) or unknown or not memory_kinds:
    raise PlanError(
      "memory_kinds must be a non-empty list of kinds of "
      f"graphpipe.core.memory.KINDS ({', '.join(KINDS)}), got "
      f"{memory_kinds!r}"
    )
  if not _count(piper_budget):
    raise PlanError(f"piper_budget must be an int >= 1, got {piper_budget!r}")


def check_memory_bytes(memory_bytes) -> None:
  """A per-device budget: a number > 0 (NaN is not)."""
  real = isinstance(memory_bytes, int | float) and not isinstance(
    memory_bytes, bool
  )
  if not (real and memory_bytes > 0):
    raise PlanError(
      f"memory_bytes must be a number > 0 (per device), got {memory_bytes!r}"
    )


def _count(value) -> bool:
  """A positive integer, Python's or numpy's (True is not a count of 1)."""
  return (
    isinstance(value, numbers.Integral)
    and not isinstance(value, bool | np.bool_)
    and value >= 1
  )


def searched_sizes(
  batch_size: int, requested: Sequence[int] | None, graph=None
) -> list[int]:
  """The micro-batch sizes to search: powers of two dividing the batch,
  or those requested; of them, those the model runs at (`graph`)."""
  sizes = _sizes(batch_size, requested)
  if graph is None:
    return sizes
  runs = micro_batch_sizes(graph, batch_size, sizes)
  if not runs:
    why = (
      f"the loss needs the whole batch of {batch_size} at once "
      f"({graph.whole_batch_only})"
      if graph.whole_batch_only
      else "the model's code traces at none of them"
    )
    raise PlanError(f"no micro-batch size among {sizes} can run: {why}")
  return runs


def _sizes(batch_size: int, requested: Sequence[int] | None) -> list[int]:
  if requested is None:
    return [b for b in (2**i for i in range(31)) if batch_size % b == 0]
  if isinstance(requested, str) or not isinstance(requested, Sequence):
    raise PlanError(
      f"micro_batch_sizes takes a list of sizes, got {requested!r}"
    )
  # Entries that could not be used were dropped silently ([3, 4] for a
  # batch of 8 searched 4 alone; [True] searched 1; [2.5, 4] searched 4).
  wrong = [b for b in requested if not _count(b) or batch_size % b]
  if wrong or not requested:
    divisors = [b for b in range(1, batch_size + 1) if batch_size % b == 0]
    raise PlanError(
      f"batch size {batch_size} is not divisible by the micro-batch sizes "
      f"{wrong or list(requested)} of {list(requested)}: use positive ints "
      f"among its divisors {divisors[:12]}"
      + ("..." if len(divisors) > 12 else "")
    )
  return sorted({int(b) for b in requested})


def check_shardings(shardings) -> tuple[str, ...]:
  """`plan`'s `stage_shardings` as a tuple, or PlanError."""
  from graphpipe.core.stages import SHARDINGS

  if isinstance(shardings, str):
    shardings = (shardings,)
  try:
    shardings = tuple(shardings)
  except TypeError:
    shardings = None
  if (
    not shardings
    or "replicated" not in shardings
    or not set(shardings) <= set(SHARDINGS)
  ):
    raise PlanError(
      f"stage_shardings must list 'replicated' and any of {SHARDINGS[1:]} "
      f"(the layouts stages may take), got {shardings!r}"
    )
  return shardings
