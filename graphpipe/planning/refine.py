"""Local search around the DPs' plans: the neighbours a DP cannot see.

  refined = refine(graph, partition, num_devices, estimate, busy)

The DPs minimise the bottleneck stage's time per sample. With few
micro-batches per iteration the iteration also pays for the pipeline's fill
and drain and for the all-reduce and optimizer step of whichever stage
finishes last, and plans that the bottleneck ranks equal (or worse) can be
much faster. `refine` searches on the estimated iteration time from a
partition, one move at a time: a beam of the few best neighbours walks on
(through worse plans if it must) until the best plan found has not
improved for a few rounds or the evaluation budget is spent. Moves:

  node     a node joins another stage (in a chain: a neighbouring one)
  split    a node leaves for a new stage of one spare device (without
           one: of a device its own replicated stage gives up)
  merge    two neighbouring stages become one
  devices  a stage's replica count moves to the next divisor of the
           micro-batch, up (spare devices, or devices another stage gives
           up) or down

Every neighbour is a valid partition: stages stay convex and the stage
graph acyclic; in a chain (a sequential plan) stages stay in order with
every operator edge going forward, and moves are between consecutive
stages only. Memory is checked by `evaluate`, or (`fits`) only for the
plans the walk keeps, best first (the plan's in-flight counts depend on
the stage graph).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from graphpipe.core.graph import OpGraph
from graphpipe.core.runnable import replica_counts
from graphpipe.planning.bitsets import bits, mask_of
from graphpipe.planning.candidates import Partition

# Plans evaluated per call at most: enough to walk a few dozen moves on
# the paper models in about a second.
DEFAULT_BUDGET = 400
# Beam search: the best few neighbours of the beam form the next beam, so
# the walk crosses a few worse plans to a better one; it stops when the
# best plan found has not improved for a few rounds.
_BEAM = 4
# With few micro-batches per iteration the bottleneck the DPs minimise says
# little (fill, drain and the last optimizer step are most of the
# iteration) and the local search does most of the work: it looks wider
# (a beam of 4 missed plans 3-21% faster on 2 of 2,100 random graphs of
# 3-8 nodes, one micro-batch each; 8 everywhere made planning small
# graphs 1.5x slower).
_WIDE_BEAM = 8
_FEW_MICRO_BATCHES = 2
_PATIENCE = 3


class _Reach:
  """Bit masks of each node's descendants and ancestors (itself excluded)."""

  def __init__(self, graph: OpGraph):
    n = len(graph.nodes)
    self.succ = [0] * n
    self.pred = [0] * n
    for e in graph.edges:
      self.succ[e.src] |= 1 << e.dst
      self.pred[e.dst] |= 1 << e.src
    self.desc = [0] * n
    for v in reversed(range(n)):
      mask = self.succ[v]
      for w in bits(self.succ[v]):
        mask |= self.desc[w]
      self.desc[v] = mask
    self.anc = [0] * n
    for v in range(n):
      mask = self.pred[v]
      for u in bits(self.pred[v]):
        mask |= self.anc[u]
      self.anc[v] = mask
    self._left: dict[int, int] = {}

  def _leaving(self, mask: int) -> int:
    """The nodes outside `mask` that its nodes feed (memoised: the walk
    asks about the same stages again and again)."""
    found = self._left.get(mask)
    if found is None:
      below = 0
      for v in bits(mask):
        below |= self.succ[v]
      found = self._left[mask] = below & ~mask
    return found

  def convex(self, mask: int) -> bool:
    """No path leaves the set and comes back."""
    below = above = 0
    for v in bits(mask):
      below |= self.desc[v]
      above |= self.anc[v]
    return not (below & above & ~mask)

  def acyclic(self, masks: list[int]) -> bool:
    """Whether the stage graph of these (convex) stages has no cycle."""
    reach = [self._leaving(mask) for mask in masks]
    succs = [
      [b for b, mask in enumerate(masks) if a != b and below & mask]
      for a, below in enumerate(reach)
    ]
    indegree = [0] * len(masks)
    for targets in succs:
      for b in targets:
        indegree[b] += 1
    ready = [s for s, d in enumerate(indegree) if d == 0]
    seen = 0
    while ready:
      a = ready.pop()
      seen += 1
      for b in succs[a]:
        indegree[b] -= 1
        if indegree[b] == 0:
          ready.append(b)
    return seen == len(masks)


@dataclasses.dataclass
class _State:
  masks: list[int]
  counts: list[int]

  def key(self) -> tuple:
    """What identifies the partition, without building it."""
    return tuple(self.masks), tuple(self.counts)

  def partition(self, like: Partition) -> Partition:
    stages = tuple(
      (tuple(bits(mask)), k)
      for mask, k in zip(self.masks, self.counts, strict=True)
    )
    return dataclasses.replace(like, stages=stages)


def refine(
  graph: OpGraph,
  part: Partition,
  num_devices: int,
  evaluate: Callable[[Partition], float | None],
  busy: Callable[[tuple[int, ...], int], float],
  budget: int = DEFAULT_BUDGET,
  micro_batches: int | None = None,
  fits: Callable[[Partition], bool] | None = None,
) -> Partition:
  """The best partition the beam search from `part` finds (module
  docstring); `part` itself when nothing better turns up.

  Example:
    >>> from graphpipe.costs import AnalyticCostModel, device_spec
    >>> from graphpipe.planning.assemble import assemble
    >>> from graphpipe.planning.stage_costs import (StageCosts,
    ...                                             estimate_iteration_time)
    >>> graph = capture_zoo("two_branch", "paper")   # branches 0-3, 4-7; 8
    >>> v100 = AnalyticCostModel(device_spec("v100"))
    >>> costs = StageCosts(graph, v100, batch_size=8, num_devices=8,
    ...                    memory_bytes=16e9)
    >>> def estimate(part):
    ...   p = assemble(graph, part, costs, "graphpipe")
    ...   return estimate_iteration_time(p, graph, v100)
    >>> busy = lambda nodes, k: costs.microbatch_time(nodes, 4, k)
    >>> part = Partition((((0, 1), 2), ((4, 5, 6, 7), 4), ((2, 3, 8), 2)),
    ...                  micro_batch_size=4)
    >>> better = refine(graph, part, 8, estimate, busy)
    >>> better.stages               # node 2 leaves the join for its branch
    (((0, 1, 2), 2), ((4, 5, 6, 7), 4), ((3, 8), 2))
    >>> round(estimate(part) * 1e3, 2), round(estimate(better) * 1e3, 2)  # ms
    (33.38, 28.45)

  Args:
    graph: the operator graph.
    part: the starting partition (one micro-batch size for all stages).
    num_devices: devices available.
    evaluate: the estimated iteration time of a partition, or None when it
      is not valid (e.g. memory); memoised here.
    busy: a stage's busy time per micro-batch from its nodes and replica
      count (devices move to the busiest stages).
    budget: evaluations at most.
    micro_batches: micro-batches per iteration (None: many): at most
      `_FEW_MICRO_BATCHES`, the walk keeps `_WIDE_BEAM` plans a round.
    fits: where `evaluate` leaves a check out (memory, the dearest), the
      check: asked only of the plans the walk would keep, best first, so
      the walk is the one it would be with the check inside `evaluate`.
  """
  if part.sizes:
    return part  # moves would have to carry sizes along: not searched
  reach = _Reach(graph)
  b = part.micro_batch_size

  def stage_busy(mask: int, k: int) -> float:
    return busy(tuple(bits(mask)), k)

  divisors = replica_counts(graph, b, num_devices)
  seen: dict[tuple, float | None] = {}  # by `_State.key`

  def score(state: _State) -> float | None:
    key = state.key()
    if key not in seen:
      seen[key] = evaluate(state.partition(part))
    return seen[key]

  checked: dict[tuple, bool] = {}  # by `_State.key`

  def kept(state: _State) -> bool:
    key = state.key()
    if key not in checked:
      checked[key] = fits is None or fits(state.partition(part))
    return checked[key]

  state = _State(
    [mask_of(nodes) for nodes, _ in part.stages], [k for _, k in part.stages]
  )
  current = score(state)
  if current is None or not kept(state):
    return part

  def neighbours(of: _State) -> list[tuple[float, _State]]:
    """Valid neighbours with their scores, best first."""
    out = []
    for move in _moves(
      of, reach, part.chain, divisors, num_devices, stage_busy
    ):
      if len(seen) >= budget:
        break
      value = score(move)
      if value is not None:
        out.append((value, move))
    out.sort(key=lambda x: x[0])
    return out

  best = (current, state)
  width = _BEAM
  if micro_batches is not None and micro_batches <= _FEW_MICRO_BATCHES:
    width = _WIDE_BEAM
  beam, expanded, stale = [state], set(), 0
  while beam and stale < _PATIENCE and len(seen) < budget:
    pool: dict[tuple, tuple[float, _State]] = {}
    for member in beam:
      expanded.add(member.key())
      for value, move in neighbours(member):
        key = move.key()
        if key not in expanded:
          pool[key] = (value, move)
    # The best `width` that pass `fits`, in order (a stable sort: among
    # equal scores, the order they were found in).
    beam, lead = [], None
    for value, move in sorted(pool.values(), key=lambda x: x[0]):
      if len(beam) == width:
        break
      if kept(move):
        beam.append(move)
        lead = lead or (value, move)
    if lead is not None and lead[0] < best[0] * (1 - 1e-9):
      best, stale = lead, 0
    else:
      stale += 1
  return best[1].partition(part)


def _moves(state: _State, reach: _Reach, chain: bool, divisors, devices, busy):
  """Every neighbour of `state` (module docstring)."""
  masks, counts = state.masks, state.counts
  spare = devices - sum(counts)
  stages = range(len(masks))
  if chain:
    pairs = [(i, i + 1) for i in range(len(masks) - 1)]
    movable = pairs
  else:
    pairs = []
    for i in stages:
      below = 0
      for v in bits(masks[i]):
        below |= reach.succ[v]
      pairs += [(i, j) for j in stages if j != i and below & masks[j]]
    # A node may join any stage that stays convex (and the stage graph
    # acyclic), not only one holding a neighbour: stages of a graph
    # pipeline may group nodes of different branches.
    movable = [(i, j) for i in stages for j in stages if i < j]
  for i, j in movable:
    # Nodes of i that may join j, and nodes of j that may join i.
    yield from _node_moves(state, reach, chain, i, j)
    yield from _node_moves(state, reach, chain, j, i)
  if spare >= 1:
    for i in stages:
      yield from _splits(state, reach, chain, i)
  else:
    # No spare device: a replicated stage gives up replicas so that one of
    # its own nodes takes a stage of its own (concurrent where it can be).
    for i in stages:
      down = [d for d in divisors if d < counts[i]]
      if down:
        yield from _splits(_with_count(state, i, down[-1]), reach, chain, i)
  for i, j in pairs:
    merged = masks[i] | masks[j]
    if chain or (
      reach.convex(merged)
      and reach.acyclic(
        [m for s, m in enumerate(masks) if s not in (i, j)] + [merged]
      )
    ):
      k = max(d for d in divisors if d <= counts[i] + counts[j])
      keep = [s for s in stages if s != j]
      new_masks = [merged if s == i else masks[s] for s in keep]
      new_counts = [k if s == i else counts[s] for s in keep]
      yield _State(new_masks, new_counts)
  busiest = sorted(stages, key=lambda s: -busy(masks[s], counts[s]))
  for s in stages:
    up = [d for d in divisors if d > counts[s]]
    down = [d for d in divisors if d < counts[s]]
    if up and up[0] - counts[s] <= spare:
      yield _with_count(state, s, up[0])
    if down:
      yield _with_count(state, s, down[-1])
      freed = counts[s] - down[-1] + spare
      for t in busiest[:3]:
        more = [d for d in divisors if d > counts[t]]
        if t != s and more and more[0] - counts[t] <= freed:
          trial = _with_count(state, s, down[-1])
          yield _with_count(trial, t, more[0])


def _node_moves(state, reach, chain, src, dst):
  """Nodes of stage src moving to stage dst."""
  masks = state.masks
  for v in bits(masks[src]):
    if chain:
      # Stages stay in order: a node moves later only if none of its
      # successors stays behind, earlier only if none of its predecessors
      # is in its stage.
      if dst > src and reach.succ[v] & masks[src]:
        continue
      if dst < src and reach.pred[v] & masks[src]:
        continue
    rest = masks[src] & ~(1 << v)
    yield from _moved(state, reach, chain, src, dst, v, rest)


def _moved(state, reach, chain, src, dst, v, rest):
  joined = state.masks[dst] | 1 << v
  if not chain and not (
    reach.convex(joined) and (not rest or reach.convex(rest))
  ):
    return
  masks, counts = list(state.masks), list(state.counts)
  masks[dst], masks[src] = joined, rest
  if not rest:
    del masks[src]
    del counts[src]
  if chain or reach.acyclic(masks):
    yield _State(masks, counts)


def _splits(state, reach, chain, src):
  """A node of stage src leaving for a new stage on one spare device."""
  masks = state.masks
  if not masks[src] & (masks[src] - 1):
    return  # a single node
  for v in bits(masks[src]):
    rest = masks[src] & ~(1 << v)
    if chain:
      # Before its stage when none of its predecessors is in it, after
      # when none of its successors is.
      places = []
      if not reach.pred[v] & masks[src]:
        places.append(src)
      if not reach.succ[v] & masks[src]:
        places.append(src + 1)
    elif reach.convex(rest):
      places = [len(masks)]
    else:
      places = []
    for at in places:
      new_masks, counts = list(masks), list(state.counts)
      new_masks[src] = rest
      new_masks.insert(at, 1 << v)
      counts.insert(at, 1)
      if chain or reach.acyclic(new_masks):
        yield _State(new_masks, counts)


def _with_count(state: _State, stage: int, k: int) -> _State:
  counts = list(state.counts)
  counts[stage] = k
  return _State(list(state.masks), counts)
