"""The GraphPipe paper's evaluation numbers and case-study plans.

From ../shared/PAPERS.md (Jeon et al., "GraphPipe", ASPLOS 2025): what
`experiments.reproduce` sets its figures beside.
"""

from __future__ import annotations

from graphpipe.core.graph import OpGraph
from graphpipe.core.stages import Plan, Stage, in_flight_counts

PAPER = {
  "throughput": {
    "max_speedup": 1.61,
    "claim": "GraphPipe up to 1.61x the best baseline, the gap growing "
    "with the GPU count (4 to 32 GPUs)",
  },
  "branch_sweep": {
    "speedup_at_16": 2.0,
    "claim": "more branches gain more: up to 2x at 16 branches",
  },
  "ablation": {
    "concurrency_only": [1.12, 1.40],
    "concurrency_and_micro_batch": [1.25, 1.61],
    "claim": "concurrency alone 1.12-1.40x at 32 GPUs, with larger "
    "micro-batches 1.25-1.61x",
  },
  "search_time": {
    "graphpipe_under_s": 60,
    "faster": [9, 21],
    "piper_no_plan": ["dlrm", "candle_uno"],
    "claim": "GraphPipe's search under a minute, 9-21x faster than "
    "PipeDream's and Piper's; Piper finds no plan for DLRM and CANDLE-Uno",
  },
  "case_study": {
    "num_stages": 8,
    "sequential_depth": 8,
    "sequential_micro_batch": 2,
    "graphpipe_depth": 4,
    "graphpipe_micro_batch": 4,
    "speedup": 1.20,
    "claim": "both planners choose 8 stages of one block; sequential depth "
    "8 at micro-batch 2, GraphPipe depth 4 at micro-batch 4; 20% faster",
  },
  "parity": {
    "speedup": 1.0,
    "claim": "on a purely sequential transformer GraphPipe matches the "
    "baselines",
  },
}


def case_study_plans(graph: OpGraph) -> dict[str, Plan]:
  """The paper's two case-study plans for the two-branch graph: one block
  per stage on 8 devices, the head with the second branch's last block;
  sequential (a chain, micro-batch 2) and graph (micro-batch 4)."""
  chains = []
  for source in [
    v for v in range(len(graph.nodes)) if not graph.predecessors(v)
  ]:
    chain = [source]
    while True:
      nxt = graph.successors(chain[-1])
      if len(nxt) != 1 or len(graph.predecessors(nxt[0])) != 1:
        break
      chain.append(nxt[0])
    chains.append(chain)
  stages = [[v] for chain in chains for v in chain]
  placed = {v for s in stages for v in s}
  stages[-1] += [v for v in range(len(graph.nodes)) if v not in placed]
  return {
    "sequential": _plan(graph, stages, 8, 2, chain=True),
    "graphpipe": _plan(graph, stages, 8, 4, chain=False),
  }


def _plan(graph, stages, batch, b, chain) -> Plan:
  owner = {v: i for i, s in enumerate(stages) for v in s}
  edges = {
    (owner[e.src], owner[e.dst])
    for e in graph.edges
    if owner[e.src] != owner[e.dst]
  }
  if chain:
    edges |= {(i, i + 1) for i in range(len(stages) - 1)}
  edges = tuple(sorted(edges))
  counts = in_flight_counts(len(stages), edges)
  return Plan(
    "paper",
    tuple(
      Stage(i, tuple(sorted(s)), (i,), b, counts[i])
      for i, s in enumerate(stages)
    ),
    edges,
    batch,
    len(stages),
  )
