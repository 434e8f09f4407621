"""Tick tables: fused actions, and the ticks where devices exchange."""

import numpy as np
import optax

from graphpipe.core.stages import Plan, Stage, in_flight_counts
from graphpipe.runtime import Trainer
from graphpipe.runtime.tables import FUSED, fuse_ticks, schedule_table
from graphpipe.schedules import schedule_for
from tests.graphpipe import runtime_cases as rc


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


def test_devices_exchange_exactly_at_ticks_where_something_is_sent():
  plan = rc.pipeline_plan("two_branch", 4, "sequential")
  trainer = Trainer(plan, optax.sgd(0.1), graph=rc.tiny_graph("two_branch"))
  tables = trainer.builder.tables
  exchange = tables["exchange"]
  assert (exchange == exchange[:, :1]).all()  # all devices alike
  # Rows received at the start of tick t + 1 were sent at the end of t.
  sent = tables["recv_valid"].any(axis=(1, 2))
  np.testing.assert_array_equal(exchange[:-1, 0], sent[1:])
  assert not exchange[-1].any()
  assert 0 < exchange[:, 0].sum() < len(exchange)
