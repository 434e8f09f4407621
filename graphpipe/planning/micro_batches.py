"""Per-stage micro-batch sizes: a stage takes larger ones where it gains.

  grown = grow_micro_batches(graph, partition, batch_size, evaluate)

GraphPipe's optional extension (PAPERS.md): a stage's micro-batch may be a
whole multiple of its predecessors' (`graphpipe.core.stages` gives the
rules). A larger micro-batch runs a stage's kernels closer to the device's
peak (a join or a head reading several branches, a data-parallel stage
whose devices each get a slice) and halves its transfers' latencies, at
the price of a coarser pipeline after it and larger stashes before it (in
samples, n(s) b_s = b_s + max over successors of n(t) b_t).

Greedy, from a plan with one size: each round tries doubling the size of
each stage, lifting every later stage that would fall below it (a join
and the head after it grow together), and keeps the move that most
shortens the estimated iteration, while one does. Sizes only grow, so
device counts still divide them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from graphpipe.core.graph import OpGraph
from graphpipe.planning.assemble import stage_edges
from graphpipe.planning.candidates import Partition


def grow_micro_batches(
  graph: OpGraph,
  part: Partition,
  batch_size: int,
  evaluate: Callable[[Partition], float | None],
) -> Partition:
  """The partition with stage sizes grown where the estimate gains.

  Example:
    >>> from graphpipe.costs import AnalyticCostModel, device_spec
    >>> from graphpipe.planning.assemble import assemble
    >>> from graphpipe.planning.stage_costs import (StageCosts,
    ...                                             estimate_iteration_time)
    >>> graph = capture_zoo("two_branch", "paper")   # branches 0-3, 4-7; 8
    >>> v100 = AnalyticCostModel(device_spec("v100"))
    >>> costs = StageCosts(graph, v100, batch_size=256, num_devices=8,
    ...                    memory_bytes=16e9)
    >>> def estimate(part):
    ...   p = assemble(graph, part, costs, "graphpipe")
    ...   return estimate_iteration_time(p, graph, v100)
    >>> part = Partition((((0, 1, 2, 3), 1), ((4,), 1), ((5, 6, 7, 8), 1)),
    ...                  micro_batch_size=1)
    >>> grown = grow_micro_batches(graph, part, 256, estimate)
    >>> grown.sizes        # a whole branch and the join take 32 samples
    (32, 1, 32)
    >>> round(estimate(part), 2), round(estimate(grown), 2)   # seconds
    (2.37, 1.69)

  Args:
    graph: the operator graph.
    part: a partition (one size or several).
    batch_size: samples per iteration (sizes must divide it).
    evaluate: the estimated iteration time of a partition, or None when it
      is not valid (e.g. memory).
  """
  edges = stage_edges(graph, part)
  successors = {i: [] for i in range(len(part.stages))}
  for a, b in edges:
    successors[a].append(b)
  sizes = [part.size(i) for i in range(len(part.stages))]
  current = evaluate(part)
  if current is None:
    return part
  best_part = part
  while True:
    best = None
    for i in range(len(sizes)):
      trial_sizes = _doubled(sizes, i, successors)
      if any(batch_size % b for b in trial_sizes):
        continue
      trial = dataclasses.replace(part, sizes=tuple(trial_sizes))
      value = evaluate(trial)
      if value is not None and value < current * (1 - 1e-9):
        if best is None or value < best[0]:
          best = (value, trial_sizes, trial)
    if best is None:
      return best_part
    current, sizes, best_part = best


def _doubled(sizes: list[int], stage: int, successors) -> list[int]:
  """Sizes with `stage`'s doubled and every later stage lifted to it."""
  out = list(sizes)
  out[stage] *= 2
  frontier = [stage]
  while frontier:
    s = frontier.pop()
    for t in successors[s]:
      if out[t] < out[s]:
        out[t] = out[s]
        frontier.append(t)
  return out
