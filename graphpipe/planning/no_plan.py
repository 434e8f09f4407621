"""The `PlanError`s of `graphpipe.plan` when no plan fits: the smallest
memory and device count that would (bisected with `fits`), or the least
padding a plan within memory reaches."""

from __future__ import annotations

import math

from graphpipe.core.graph import OpGraph
from graphpipe.core.memory import (
  KINDS,
  memory_floor,
  over_budget_message,
  plan_memory,
)
from graphpipe.core.stages import Plan
from graphpipe.errors import PlanError
from graphpipe.planning.engine import fits, run_search, unlimited_plan
from graphpipe.planning.piper import PIPER_BUDGET


def padding_error(
  graph,
  devices,
  batch,
  planner,
  model,
  memory,
  sizes,
  max_padding,
  kinds,
  piper_budget=PIPER_BUDGET,
  shardings=("replicated",),
) -> PlanError:
  """Says the least padding a plan that fits can have (bisected to 0.02)."""
  low, high, least = max_padding, 1.0, None
  while high - low > 0.02:
    middle = (low + high) / 2
    found = run_search(
      graph,
      devices,
      batch,
      planner,
      model,
      memory,
      sizes,
      memory_kinds=kinds,
      feasible_only=True,
      max_padding=middle,
      piper_budget=piper_budget,
      shardings=shardings,
    )
    if found is None:
      low = middle
    else:
      high, least = middle, plan_memory(graph, found).padding_fraction
  reach = f"{least:.3f}" if least is not None else f"over {low:.2f}"
  return PlanError(
    f"no {planner} plan for {graph.model or 'the graph'} on {devices} "
    f"devices (batch {batch}) has a padding fraction <= {max_padding:g}: "
    f"the least padded of its candidates within memory has {reach} "
    "(searched to 0.02). "
    "Every device holds slots the size of the largest stage's parameters "
    "and optimizer state; raise max_padding, use fewer or more devices "
    "(stages of more even size), or a budget that fits the whole model "
    "data parallel."
  )


def _unbounded_fit(
  graph,
  devices,
  batch,
  planner,
  model,
  memory,
  sizes,
  kinds=KINDS,
  piper_budget=PIPER_BUDGET,
  shardings=("replicated",),
):
  """The plan searched without a memory limit, if it fits `memory`."""
  found = unlimited_plan(
    graph, devices, batch, planner, model, sizes, piper_budget, shardings
  )
  ok = found is not None and _peak_memory(found, graph, kinds) <= memory
  return found if ok else None


def no_plan_error(
  graph,
  devices,
  batch,
  planner,
  model,
  memory,
  sizes,
  unlimited,
  kinds=KINDS,
  piper_budget=PIPER_BUDGET,
  shardings=("replicated",),
):
  """Says what memory (or how many devices) would have allowed a plan;
  `unlimited` is the plan searched without a memory limit (or None); the
  budget bounds the memory `kinds` (`graphpipe.core.memory.KINDS`); the
  searches it runs give Piper `piper_budget`, as the search that failed."""
  if unlimited is None:
    return PlanError(
      f"no {planner} plan exists for {devices} devices even without a "
      "memory limit (internal: every stage time was infinite)"
    )
  # No plan on any number of devices holds less than the floor: the
  # bisection starts there, and more devices are no remedy below it.
  floor, heaviest = memory_floor(graph, kinds=kinds, shardings=shardings)
  # Bisect the per-device memory to 1% (a budget over the unlimited plan's
  # peak fits: `plan` falls back to that plan).
  low = max(float(memory), float(floor))
  high = _peak_memory(unlimited, graph, kinds)
  while high > low * 1.01:
    middle = math.sqrt(low * high)
    found = fits(
      graph,
      devices,
      batch,
      planner,
      model,
      middle,
      sizes,
      kinds,
      piper_budget,
      shardings,
    )
    low, high = (low, middle) if found else (middle, high)
  more, more_devices = None, devices
  while (
    floor <= memory and more is None and more_devices < min(4 * devices, 64)
  ):
    more_devices = min(2 * more_devices, 64)
    args = (graph, more_devices, batch, planner, model, memory, sizes)
    feasible = fits(*args, kinds, piper_budget, shardings)
    if (
      feasible
      or _unbounded_fit(*args, kinds, piper_budget, shardings) is not None
    ):
      more = more_devices
  hint = f", or use at least {more} devices" if more else ""
  counted = "" if set(kinds) == set(KINDS) else f" of {', '.join(kinds)}"
  over = [floor] if floor > memory else []
  budget_text, high_text, *floor_text = _distinct_gib(memory, high, *over)
  if floor > memory:
    slots = (
      "parameter, gradient, optimizer and working-gradient slots of its size"
      if not counted
      else f"slots of its size{counted}"
    )
    hint = (
      f" (more devices cannot help: node {heaviest!r} alone makes every "
      f"device of any plan hold at least {floor_text[0]} GiB, {slots})"
    )
  return PlanError(
    f"no {planner} plan for {graph.model or 'the graph'} fits "
    f"{budget_text} GiB{counted} per device on {devices} devices "
    f"(batch {batch}, micro-batches {sizes}): the smallest per-device "
    f"memory under which it finds one is about {high_text} GiB; raise "
    "memory_bytes "
    f"or pick a device with more memory{hint}. Without a limit, "
    + over_budget_message(
      graph,
      unlimited,
      plan_memory(graph, unlimited),
      memory,
      devices_hint=False,
      kinds=kinds,
    )
  )


def _distinct_gib(budget: float, *amounts: float) -> list[str]:
  """The budget and `amounts` (each over it) in GiB to 3 significant
  digits, or as many more as it takes to tell each from the budget (a
  memory just over a budget that does not fit: "fits 0.123 GiB ... the
  smallest that fits is about 0.123 GiB" would name the budget itself)."""
  for digits in range(3, 10):
    texts = [f"{x / 2**30:.{digits}g}" for x in (budget, *amounts)]
    if texts[0] not in texts[1:]:
      break
  return texts


def _peak_memory(p: Plan, graph: OpGraph, kinds=KINDS) -> float:
  return plan_memory(graph, p).largest_of(kinds)
