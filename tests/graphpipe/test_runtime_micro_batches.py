"""The runtime with per-stage micro-batch sizes equals plain JAX.

A stage k times larger than its predecessor collects k of their forwards,
runs once and returns its input gradients in k pieces; replicas split
each stage's own micro-batch. Plans are made by hand (the planner picks
unequal sizes on paper-scale models only, `test_micro_batches.py`).
"""

import numpy as np
import optax
import pytest

from graphpipe import models
from graphpipe.core.stages import Plan, Stage, in_flight_counts
from graphpipe.runtime import Trainer
from graphpipe.runtime.layout import build_layout
from graphpipe.runtime.tables import build_tables, make_channels
from graphpipe.schedules import schedule_for
from graphpipe.schedules.grid import Action
from tests.graphpipe import runtime_cases as rc


def sized_plan(name, stages, sizes, batch_size) -> Plan:
  """Stages (nodes, replicas) on consecutive devices with sizes[s]."""
  graph = rc.tiny_graph(name)
  owner = {v: i for i, (block, _) in enumerate(stages) for v in block}
  edges = tuple(
    sorted(
      {
        (owner[e.src], owner[e.dst])
        for e in graph.edges
        if owner[e.src] != owner[e.dst]
      }
    )
  )
  counts = in_flight_counts(len(stages), edges, sizes)
  out, first = [], 0
  for i, ((block, k), b) in enumerate(zip(stages, sizes, strict=True)):
    out.append(
      Stage(i, tuple(block), tuple(range(first, first + k)), b, counts[i])
    )
    first += k
  return Plan("manual", tuple(out), edges, batch_size, first)


CASES = {
  # A join (and head) at twice the branches' size, on two devices, fed by
  # a data-parallel branch (a row per device): piece 0 of each join
  # micro-batch goes to one replica, piece 1 to the other; 1F1B,
  # forwards recomputed.
  "data_parallel_join_2x_1f1b": (
    "two_branch",
    [((0, 1, 2, 3), 2), ((4, 5, 6, 7), 1), ((8,), 2)],
    [2, 2, 4],
    16,
    "1f1b",
    True,
  ),
  # A chain growing 1x -> 2x -> 4x, all forwards first.
  "chain_1x_2x_4x_gpipe": (
    "transformer",
    [((0, 1), 1), ((2, 3), 1), ((4,), 1)],
    [2, 4, 8],
    16,
    "gpipe",
    False,
  ),
  # Rows that do not nest: micro-batches of 3 on one device feed 6 on
  # three devices (2 rows each), so the middle replica (device 2) gets
  # the last row of piece 0 and the first of piece 1.
  "rows_across_replicas": (
    "transformer",
    [((0, 1), 1), ((2, 3, 4), 3)],
    [3, 6],
    12,
    "1f1b",
    False,
  ),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_unequal_sizes_equal_plain_jax(case):
  name, stages, sizes, batch_size, schedule, recompute = CASES[case]
  plan = sized_plan(name, stages, sizes, batch_size)
  assert plan.per_stage_micro_batches
  graph = rc.tiny_graph(name)
  spec, cfg = models.get(name), models.config(name, "tiny")
  model = models.build(name, cfg, seed=1)
  batches = [spec.make_batch(cfg, batch_size, seed=s) for s in range(3)]
  optimizer = optax.sgd(0.1, momentum=0.9)
  trainer = Trainer(
    plan, optimizer, graph=graph, schedule=schedule, recompute=recompute
  )
  assert trainer.schedule.stage_microbatches == tuple(
    batch_size // b for b in sizes
  )
  rc.assert_trains_exactly(name, trainer, model, batches, optimizer)


def test_a_twice_larger_stage_collects_two_pieces_and_returns_two():
  name = "transformer"
  plan = sized_plan(name, [((0, 1), 1), ((2, 3, 4), 1)], [2, 4], 8)
  schedule = schedule_for(plan)
  layout = build_layout(rc.tiny_graph(name), plan, schedule)
  channels = make_channels(layout)
  tables = build_tables(layout, schedule, channels, recompute=False)
  (edge,) = layout.edges
  width = edge.width
  assert [
    (t.piece, t.src_row, t.dst_row, t.rows) for t in layout.transfers
  ] == [
    (0, 0, 0, 2),
    (1, 0, 2, 2),
  ]
  ticks = schedule.ticks()
  arrays = tables.arrays  # receive entries sit at the tick after the send
  for piece in (0, 1):
    # 0F{piece} lands in device 1's slot of 1F0, at the piece's rows.
    t = ticks[Action(0, "F", piece)] + 1
    (c,) = np.nonzero(arrays["recv_valid"][t, 1])[0]
    assert arrays["recv_grad"][t, 1, c] == 0
    assert arrays["recv_offset"][t, 1, c] == piece * 2 * width
    assert (
      arrays["recv_slot"][t, 1, c]
      == arrays["act_slot"][ticks[Action(1, "F", 0)], 1]
    )
  # 1B0 returns both pieces at once, on two channels, into the gradient
  # slots of 0B0 and 0B1.
  t = ticks[Action(1, "B", 0)] + 1
  got = np.nonzero(arrays["recv_valid"][t, 0])[0]
  assert len(got) == 2 and (arrays["recv_grad"][t, 0, got] == 1).all()
  slots = sorted(int(arrays["recv_slot"][t, 0, c]) for c in got)
  want = sorted(
    int(arrays["grad_slot"][ticks[Action(0, "B", i)], 0]) for i in (0, 1)
  )
  assert slots == want and len(set(slots)) == 2
