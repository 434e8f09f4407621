"""Tick tables: which forwards and backwards the runtime fuses."""

import numpy as np

from graphpipe.plan import Plan, Stage, in_flight_counts
from graphpipe.runtime.tables import FUSED, fuse_ticks, schedule_table
from graphpipe.schedule import schedule_for


def chain(num_stages, microbatches, kind, edges=None):
  edges = (
    tuple((s, s + 1) for s in range(num_stages - 1)) if edges is None else edges
  )
  counts = in_flight_counts(num_stages, edges)
  stages = tuple(Stage(s, (s,), (s,), 1, counts[s]) for s in range(num_stages))
  plan = Plan("manual", stages, edges, microbatches, num_stages, schedule=kind)
  return schedule_table(schedule_for(plan))


def test_one_stage_1f1b_fuses_every_micro_batch():
  fused = fuse_ticks(chain(1, 4, "1f1b"))
  assert fused.shape[0] == 4
  assert (fused[:, 0, 1] == FUSED).all()
  np.testing.assert_array_equal(fused[:, 0, 2], np.arange(4))


def test_gpipe_and_busy_pipelines_keep_their_ticks():
  for table in (chain(1, 4, "gpipe"), chain(2, 4, "1f1b")):
    assert (fuse_ticks(table) == table).all()


def test_independent_sinks_fuse_together():
  # Two stages without an edge (the two-tower graphpipe plan).
  fused = fuse_ticks(chain(2, 3, "1f1b", edges=()))
  assert fused.shape[0] == 3
  assert (fused[:, :, 1] == FUSED).all()
