"""The candidate search behind `graphpipe.plan`, and feasibility checks.

  run_search(graph, devices, batch, planner, cost_model, memory, sizes)
    -> the fastest candidate Plan, or None

`run_search` prices the partitioners' candidates for each micro-batch size
(memory rule, `estimate_iteration_time`), runs the local search from the
best few, and simulates the best estimates (see `graphpipe.planning.search`
for the whole procedure); `fits` and `unlimited_plan` are the questions the
no-plan errors and `tightest_plan` ask of it.
"""

from __future__ import annotations

import contextlib
import gc
import math
from collections.abc import Callable, Sequence

from graphpipe.core.cost_model import CostModel
from graphpipe.core.fingerprint import graph_fingerprint
from graphpipe.core.graph import OpGraph
from graphpipe.core.memory import KINDS, plan_memory
from graphpipe.core.runnable import refusal
from graphpipe.core.stages import Plan
from graphpipe.planning import baselines
from graphpipe.planning.assemble import (
  assemble,
  spend_spare_devices,
  split_branches,
)
from graphpipe.planning.candidates import Partition
from graphpipe.planning.graphpipe_dp import GraphPipePartitioner
from graphpipe.planning.micro_batches import grow_micro_batches
from graphpipe.planning.piper import PIPER_BUDGET, PiperPartitioner
from graphpipe.planning.refine import refine
from graphpipe.planning.stage_costs import (
  NodeTimes,
  StageCosts,
  estimate_iteration_time,
)
from graphpipe.simulator.engine import simulated_iteration_time

__all__ = [
  "PADDING_TOLERANCE",
  "fits",
  "least_padded",
  "run_search",
  "unlimited_plan",
]

# Simulation budget per search, in actions (~50 us each: about a second),
# and in plans.
_SIMULATED_ACTIONS = 20_000
_SIMULATED_PLANS = 32
# How far over the event simulation the estimate may be (see run_search).
_ESTIMATE_OVER = 0.05
# A micro-batch size waits while its work floor is over this many times
# the best estimate so far (run_search): priced only if its plans could
# start a local search or be simulated, so the search is the same.
_DEFER = 1.25
# A plan this much slower than the fastest may win with less padding
# (under the 2% by which no other partition may beat the planners': the
# trade must leave room for what the search misses) ...
PADDING_TOLERANCE = 0.015
# ... when its devices hold this much padding each on average (not tiny).
PADDING_MIN_BYTES = 2**20
# Local search starts from the best plan of this many micro-batch sizes.
_REFINED = 3
# Where no candidate fits memory (`repair`): the partitioners' offers under
# _REPAIR_BUDGETS x the budget (above it, of the _LOOSER_SIZES smallest
# micro-batch sizes: they need the least memory), then walks of at most
# _REPAIR_STEPS plans from the partitions nearest to fitting of the
# _REPAIR_WALKS nearest micro-batch sizes, if within _REPAIR_REACH x the
# budget; a plan over memory scores _OVER seconds per budget it holds.
_LOOSER_SIZES = 1
_REPAIR_WALKS = 1
_REPAIR_STEPS = 60
_REPAIR_REACH = 1.5
_REPAIR_BUDGETS = (0.7, 0.85, _REPAIR_REACH)
_OVER = 1e9


def _partitioner(
  graph: OpGraph, planner: str, costs: StageCosts, piper_budget: int
) -> Callable[[int], list[Partition]]:
  if planner == "graphpipe":
    return GraphPipePartitioner(graph, costs)
  if planner == "sequential":
    return baselines.SequentialPartitioner(graph, costs)
  if planner == "piper":
    return PiperPartitioner(graph, costs, piper_budget)
  return baselines.GPipePartitioner(graph, costs)


@contextlib.contextmanager
def _cyclic_gc_paused():
  """Python's cyclic garbage collector paused, and resumed as it was.

  A search allocates millions of short-lived objects, and every few
  hundred allocations the collector scans the young ones; its full scans
  walk the whole heap, so the more a process holds (a notebook, the
  reproduction with its captured graphs) the dearer they are: 15-25% of
  GraphPipe's 32-device dlrm search in a process holding four captured
  models (measured 2026-12-07). Reference counting still frees what the
  search drops; cycles it made are collected once the collector resumes.
  """
  was = gc.isenabled()
  gc.disable()
  try:
    yield
  finally:
    if was:
      gc.enable()


@_cyclic_gc_paused()
def run_search(
  graph,
  num_devices,
  batch_size,
  planner,
  cost_model,
  memory_bytes,
  sizes,
  per_stage: bool = False,
  piper_budget: int = PIPER_BUDGET,
  memory_kinds: Sequence[str] = KINDS,
  padding_tolerance: float | None = None,
  feasible_only: bool = False,
  max_padding: float | None = None,
  any_feasible: bool = False,
  shardings: Sequence[str] = ("replicated",),
  lockstep: bool = False,
) -> Plan | None:
  """The fastest candidate plan (see the module docstring), or None.

  With `feasible_only`, the best-estimated candidate as soon as the
  partitioners' candidates are priced (no local search, no simulation):
  None exactly when the full search gives None, for feasibility checks.
  With `any_feasible`, the first candidate that fits, whatever its time:
  the same candidates are priced in the same order up to it, so None
  exactly when the full search gives None (what `fits` asks).
  With `max_padding`, candidates whose padding fraction is over it do not
  count, and data-parallel copies of the whole model are candidates too.
  `padding_tolerance` None: `PADDING_TOLERANCE` as it is at call time.
  `shardings`: the stage layouts plans may use (`StageCosts`).
  `lockstep`: the candidates are simulated as `graphpipe.runtime` steps
  them (`simulate(..., lockstep=True)`) instead of as the paper's
  asynchronous pipeline.
  """
  if padding_tolerance is None:
    padding_tolerance = PADDING_TOLERANCE
  costs = StageCosts(
    graph,
    cost_model,
    batch_size,
    num_devices,
    memory_bytes,
    memory_kinds,
    shardings,
  )
  partitioners = [_partitioner(graph, planner, costs, piper_budget)]
  if max_padding is not None and planner == "graphpipe":
    # A chain is a graph pipeline too: under a padding limit the even
    # chains of the sequential DP are often the only plans that meet it.
    partitioners.append(baselines.SequentialPartitioner(graph, costs))
  fingerprint = graph_fingerprint(graph)
  timing = NodeTimes(cost_model)
  candidates: dict[Partition, tuple | None] = {}
  split: set[Partition] = set()  # candidates of `split_branches`
  first: list[Plan] = []  # with `any_feasible`: the first that fits

  def fits(p: Plan):
    """(whether `p` fits the budget and the padding limit, its memory).
    Every device holds what the largest stage needs (SPMD): the
    runtime's per-device figure, not each stage's own, must fit."""
    memory = plan_memory(graph, p)
    ok = memory.largest_of(memory_kinds) <= costs.memory_bytes
    if max_padding is not None:
      ok = ok and memory.padding_fraction <= max_padding
    return ok, memory

  def evaluate(part: Partition, lazy: bool = False) -> tuple | None:
    """(estimate, in flight at the source, -b, plan, its memory), None if
    over memory. `lazy`: the memory is checked later (`checked`), and
    None stands for it until then."""
    if part not in candidates:
      p = assemble(graph, part, costs, planner, fingerprint)
      # Only what the trainer runs (a chunk the code traces at, no split
      # of a whole-batch loss, cut rules: `graphpipe.core.runnable`).
      ok = refusal(graph, p) is None and all(
        costs.in_flight_capacity(s.nodes, s.micro_batch_size, len(s.devices))
        >= s.in_flight
        for s in p.stages
      )
      candidates[part] = None
      memory = None
      if ok and not (lazy and not any_feasible):
        ok, memory = fits(p)
      if ok and any_feasible:
        first.append(p)  # not priced: the search stops here
        candidates[part] = (0.0, 0, 0, p, memory)
        return candidates[part]
      if ok:
        estimate = estimate_iteration_time(p, graph, timing)
        candidates[part] = (
          estimate,
          p.stages[0].in_flight,
          -p.micro_batch_size,
          p,
          memory,
        )
    return candidates[part] if lazy else checked(part)

  def checked(part: Partition) -> tuple | None:
    """`part`'s candidate, its memory checked (None if over)."""
    found = candidates.get(part)
    if found is not None and found[4] is None:
      ok, memory = fits(found[3])
      candidates[part] = (*found[:4], memory) if ok else None
    return candidates.get(part)

  def offer(b: int) -> None:
    """Prices the partitioners' partitions of micro-batch size `b`."""
    for partition in partitioners:
      for part in partition(b):
        if first:
          return
        apart = (
          split_branches(graph, part, costs) if planner == "graphpipe" else part
        )
        if apart != part:
          # Grouped branches run apart on spare devices: a candidate beside
          # the one whose spare devices become replicas.
          spent = spend_spare_devices(graph, apart, costs)
          split.update((spent, apart))
          if evaluate(spent) is None:
            evaluate(apart)
        if part.schedule == "1f1b":
          spent = spend_spare_devices(graph, part, costs)
          # Replicas hold their gradient sums: the partition as the DP gave
          # it (spare devices idle) may fit where the spent one does not.
          if evaluate(spent) is not None:
            continue
        evaluate(part)

  # Sizes in order of their work floor (`StageCosts.work_floor`): a size
  # whose floor is over `_DEFER` x the best estimate so far waits, and is
  # priced only where it could change the search (`restore_order`).
  floors = {}
  # (With at most `_REFINED` sizes every size would start a local search:
  # none could wait.)
  if (
    max_padding is None
    and not (feasible_only or any_feasible)
    and len(sizes) > _REFINED
  ):
    floors = {b: costs.work_floor(b) for b in sizes}
  runs: dict[int, list[Partition]] = {}  # the candidates each size added
  deferred: list[int] = []
  fastest = math.inf

  def price(b: int) -> None:
    nonlocal fastest
    before = len(candidates)
    offer(b)
    runs[b] = list(candidates)[before:]
    for part in runs[b]:
      found = candidates[part]
      if found is not None and found[0] < fastest:
        fastest = found[0]

  def restore_order() -> None:
    """`candidates` in the order pricing the sizes as given would have
    added them (ties in the rankings below keep that order)."""
    first_ones = [part for b in sizes if b in runs for part in runs[b]]
    known = set(first_ones)
    order = first_ones + [part for part in candidates if part not in known]
    again = [(part, candidates[part]) for part in order]
    candidates.clear()
    candidates.update(again)

  def price_deferred() -> None:
    for b in deferred:
      price(b)
    deferred.clear()
    restore_order()

  for b in sorted(sizes, key=floors.get) if floors else sizes:
    if floors and floors[b] > _DEFER * fastest:
      deferred.append(b)
      continue
    price(b)
    if first:
      return first[0]
  restore_order()
  # Every plan of a deferred size estimates at least this (less float
  # rounding: the floor and the estimates sum the same times apart).
  waiting = min((floors[b] for b in deferred), default=math.inf) * (1 - 1e-9)
  offered = bool(candidates)  # the partitioners offered some partition
  everything = tuple(range(len(graph.nodes)))
  if max_padding is not None:
    # No padding at all: the whole model on k devices, data parallel.
    for b in sizes:
      for k in range(1, num_devices + 1):
        if num_devices % k == 0 and k in costs.replica_counts(b):
          evaluate(Partition(((everything, k),), b))
  if not any(c is not None for c in candidates.values()):
    # Every device holds what the largest stage needs, and replicas hold
    # their gradient sums: where no pipeline fits, the whole model on one
    # device (the others idle) still may, and every planner can make it.
    schedule = "gpipe" if planner == "gpipe" else "1f1b"
    for b in sizes:
      evaluate(Partition(((everything, 1),), b, schedule=schedule))
  if not any(c is not None for c in candidates.values()):

    def offers(factor: float) -> list[Partition]:
      """The partitioners' partitions under `factor` x the budget (over
      it: of the smallest micro-batch sizes only, which need the least
      memory)."""
      other = StageCosts(
        graph,
        cost_model,
        batch_size,
        num_devices,
        memory_bytes * factor,
        memory_kinds,
        shardings,
      )
      offer = _partitioner(graph, planner, other, piper_budget)
      some = sorted(sizes)[:_LOOSER_SIZES] if factor > 1 else sizes
      return [part for b in some for part in offer(b)]

    # Piper's search is exponential: it is not run again.
    again = None if planner == "piper" else offers
    repair(
      graph,
      list(candidates),
      again,
      offered,
      evaluate,
      costs,
      planner,
    )
  if first:
    return first[0]

  def ranking() -> list:
    return sorted(
      ((c[:3], part) for part, c in candidates.items() if c is not None),
      key=lambda x: x[0],
    )

  ranked = ranking()
  if deferred and (
    len({part.micro_batch_size for key, part in ranked if key[0] < waiting})
    < _REFINED
  ):
    # A deferred size could be among the local search's starts.
    price_deferred()
    ranked = ranking()
  if not ranked:
    return None
  if feasible_only:
    return candidates[ranked[0][1]][3]
  # The DPs rank by the bottleneck; with few micro-batches, fill, drain and
  # the last optimizer step matter too: local search from the best plan of
  # each of the best few micro-batch sizes (near-copies of one plan would
  # all lead to the same place).
  by_size: dict[int, Partition] = {}
  for _, part in ranked:
    by_size.setdefault(part.micro_batch_size, part)
  starts = list(by_size.values())[:_REFINED]
  # A split candidate's walk need not reach what the DP's own plan of the
  # same size leads to: where one starts, the best unsplit plan does too.
  for b in [p.micro_batch_size for p in starts if p in split]:
    unsplit = next(
      (p for _, p in ranked if p.micro_batch_size == b and p not in split),
      None,
    )
    if unsplit is not None:
      starts.append(unsplit)
  # Fewer sizes than starts (e.g. one size asked for): the next best plans
  # (of other estimates) start too.
  seen = {round(candidates[p][0], 12) for p in starts}
  for key, part in ranked:
    if len(starts) >= _REFINED:
      break
    if round(key[0], 12) not in seen:
      seen.add(round(key[0], 12))
      starts.append(part)

  def estimated(part: Partition, lazy: bool = False) -> float | None:
    found = evaluate(part, lazy)
    return None if found is None else found[0]

  for part in starts:
    if part.schedule != "1f1b":
      continue
    # The local search prices thousands of neighbours and keeps a few:
    # their memory is checked only where one would be kept.
    refined = refine(
      graph,
      part,
      num_devices,
      lambda part: estimated(part, lazy=True),
      lambda nodes, k, b=part.micro_batch_size: costs.microbatch_time(
        nodes, b, k
      ),
      micro_batches=batch_size // part.micro_batch_size,
      fits=lambda part: checked(part) is not None,
    )
    if per_stage:
      # Per-stage sizes (GraphPipe's extension): grow them from the
      # uniform plans found so far.
      for uniform in dict.fromkeys([part, refined]):
        grow_micro_batches(graph, uniform, batch_size, estimated)

  def choose() -> tuple[Plan, float]:
    """(the plan, the estimate at which the simulations stopped)."""
    ranked = sorted(
      ((part, c) for part, c in candidates.items() if c is not None),
      key=lambda pc: pc[1][:3],
    )
    # The estimate is mostly a few percent under the event simulation, but
    # may be over it by up to `_ESTIMATE_OVER` (several micro-batches whose
    # fill the estimate charges in full): simulate the schedule each plan
    # will run, best estimate first, until the next estimate is that much
    # over the fastest simulated plan (or the simulation budget is spent).
    # Plans within `padding_tolerance` of the fastest are simulated too: of
    # those, a less padded one wins where its padding falls by more than its
    # time grows (`least_padded`; every device holds slots the size of the
    # largest stage's parameters).
    best, budget, timed, close = None, _SIMULATED_ACTIONS, set(), []
    stop = math.inf  # the estimate the simulations stopped at
    slack = 1.0  # 1 + padding_tolerance once the fastest plan pads much
    for part, c in ranked:
      # Only plans within memory count (the local search's neighbours were
      # not all checked). A plan skipped whether or not it fits (a twin,
      # over the simulation budget) is not checked: memory is the costly
      # part of the choice.
      ends = best is not None and (
        c[0] >= best[0] * max(slack, 1 + _ESTIMATE_OVER)
        or len(timed) == _SIMULATED_PLANS
      )
      # Plans the estimate cannot tell apart (mirror images: the same stages
      # on other branches or devices) are simulated once.
      twin = round(c[0], 12)
      actions = 2 * c[3].num_microbatches * c[3].num_stages
      if not ends and (
        best is not None and (actions > budget or twin in timed)
      ):
        continue
      c = checked(part)
      if c is None:
        continue
      if ends:
        stop = c[0]
        break
      timed.add(twin)
      budget -= actions
      seconds = simulated_iteration_time(c[3], graph, cost_model, lockstep)
      close.append((seconds, *c[1:]))
      if best is None or (seconds, *c[1:3]) < best[:3]:
        best = (seconds, *c[1:])
        padding = sum(c[4].padding_bytes)
        heavy = padding >= PADDING_MIN_BYTES * c[3].num_devices
        slack = 1 + padding_tolerance if heavy else 1.0
    if slack == 1.0:
      return best[3], stop
    return least_padded(
      [(c[0], c[4].padding_fraction, c) for c in close],
      padding_tolerance,
    )[3], stop

  chosen, stop = choose()
  if deferred and stop >= waiting:
    # The simulations went on past where a deferred size's plans begin.
    price_deferred()
    chosen, _ = choose()
  return chosen


def repair(
  graph: OpGraph,
  starts: list[Partition],
  offers: Callable[[float], list[Partition]] | None,
  offered: bool,
  evaluate: Callable[[Partition], tuple | None],
  costs: StageCosts,
  planner: str,
) -> None:
  """Where no candidate fits memory: the partitioners' offers under other
  budgets, then local search from the partitions nearest to fitting, first
  towards less memory, then, within the budget, towards less time (what
  fits, `evaluate` records as a candidate).

  The partitioners bound each stage's memory, but every device holds what
  the largest stage needs of each kind (`plan_memory`), which no stage
  sees: a budget may pass stages whose plan is over it while a tighter
  budget, or a move the DP cannot make (a join stage taking the tails of
  two branches), gives a plan that fits. Without this a larger budget
  could lose a plan a smaller one found.

  Args:
    starts: the partitions priced so far (none fits).
    offers: the partitioners' partitions under a factor x the budget; None:
      not to be searched again (Piper).
    offered: whether the partitioners offered any partition under the
      budget (if not, they offer none under a tighter one either).
  """
  kinds, budget = costs.memory_kinds, costs.memory_bytes
  memory: dict[Partition, float] = {}

  def ratio(part: Partition) -> float:
    if part not in memory:
      p = assemble(graph, part, costs, planner)
      memory[part] = plan_memory(graph, p).largest_of(kinds) / budget
    return memory[part]

  def relaxed(part: Partition) -> float:
    found = evaluate(part)
    return found[0] if found is not None else _OVER * ratio(part)

  pool = dict.fromkeys(starts)
  for factor in _REPAIR_BUDGETS if offers is not None else ():
    if factor < 1 and not offered:
      continue
    fresh = dict.fromkeys(offers(factor))
    if any(evaluate(part) is not None for part in fresh):
      return  # one fits: the search goes on from it
    pool.update(fresh)
  near: dict[int, tuple[float, Partition]] = {}  # nearest of each size
  for part in pool:
    if part.schedule == "1f1b" and not part.sizes:
      over = ratio(part)
      b = part.micro_batch_size
      if b not in near or over < near[b][0]:
        near[b] = (over, part)
  nearest = sorted(near.values(), key=lambda x: x[0])[:_REPAIR_WALKS]
  for over, part in nearest:
    if over > _REPAIR_REACH:
      break
    b = part.micro_batch_size
    found = refine(
      graph,
      part,
      costs.num_devices,
      relaxed,
      lambda nodes, k, b=b: costs.microbatch_time(nodes, b, k),
      budget=_REPAIR_STEPS,
      micro_batches=costs.batch_size // b,
    )
    if relaxed(found) < _OVER:
      return  # within memory: the search's own local search goes on


def least_padded(timed, tolerance: float):
  """Of (seconds, padding fraction, item) within `tolerance` of the fastest,
  the item whose padding plus relative slowdown is least (ties: faster):
  padding must fall by more than the time it costs, share for share.

  Example:
    >>> least_padded([(1.00, 0.30, "a"), (1.01, 0.29, "b")], 0.02)
    'a'
    >>> least_padded([(1.00, 0.30, "a"), (1.01, 0.10, "b")], 0.02)
    'b'
    >>> least_padded([(1.00, 0.30, "a"), (1.03, 0.00, "c")], 0.02)
    'a'
  """
  fastest = min(t for t, _, _ in timed)
  close = [x for x in timed if x[0] <= fastest * (1 + tolerance)]
  return min(close, key=lambda x: (x[0] / fastest - 1 + x[1], x[0]))[2]


def fits(
  graph: OpGraph,
  num_devices: int,
  batch_size: int,
  planner: str,
  cost_model: CostModel,
  memory_bytes: float,
  sizes: Sequence[int],
  memory_kinds: Sequence[str] = KINDS,
  piper_budget: int = PIPER_BUDGET,
  shardings: Sequence[str] = ("replicated",),
) -> bool:
  """Whether `plan`'s search has a candidate within `memory_bytes` (the
  partitioners' candidates priced; no local search or simulation): false
  exactly when the full search finds none. For bisections over memory."""
  found = run_search(
    graph,
    num_devices,
    batch_size,
    planner,
    cost_model,
    memory_bytes,
    sizes,
    memory_kinds=memory_kinds,
    any_feasible=True,
    piper_budget=piper_budget,
    shardings=shardings,
  )
  return found is not None


def unlimited_plan(
  graph: OpGraph,
  num_devices: int,
  batch_size: int,
  planner: str,
  cost_model: CostModel,
  sizes: Sequence[int],
  piper_budget: int = PIPER_BUDGET,
  shardings: Sequence[str] = ("replicated",),
) -> Plan | None:
  """`plan`'s search without a memory limit (None: no plan at all)."""
  return run_search(
    graph,
    num_devices,
    batch_size,
    planner,
    cost_model,
    math.inf,
    sizes,
    piper_budget=piper_budget,
    shardings=shardings,
  )
