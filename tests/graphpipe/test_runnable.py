"""Planners return only plans the trainer runs (`graphpipe.core.runnable`).

Until 2026-12-03 capture recorded nothing of where a model cannot be cut:
a model whose code refuses odd batch sizes got micro-batch 1 from
`tightest_plan` and was refused at Trainer construction; so were plans
that split the batch of a loss with a max over it, and data-parallel
stages between which values lie time-major. `random_models` draws such
quirks for the property test in `test_random_models`.
"""

import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import graphpipe
from graphpipe.core.runnable import refusal
from graphpipe.errors import PlanError
from tests.graphpipe import runtime_cases as rc

BATCH = 8


class Layer(nnx.Module):
  """A Linear and a tanh; `time_major` lays its input and output out as 16
  runs of B (each sample's elements apart along the batch axis)."""

  def __init__(self, fan_in, width, rngs, reads=False, writes=False):
    self.lin = nnx.Linear(fan_in, width, rngs=rngs)
    self.reads, self.writes = reads, writes

  def __call__(self, x):
    if self.reads:
      x = x.reshape(16, -1).T
    h = jnp.tanh(self.lin(x))
    return h.T.reshape(-1) if self.writes else h


class Net(nnx.Module):
  def __init__(self, rngs, pairs=False, time_major=False):
    self.a = Layer(6, 16, rngs)
    self.b = Layer(16, 16, rngs, writes=time_major)
    self.c = Layer(16, 16, rngs, reads=time_major)
    self.d = nnx.Linear(16, 1, rngs=rngs)
    self.pairs = pairs

  def __call__(self, x):
    if self.pairs and x.shape[0] % 2:
      raise ValueError("this model takes pairs of samples")
    return self.d(self.c(self.b(self.a(x))))


def batch_of(seed=0):
  rng = np.random.default_rng(seed)
  return {
    "x": rng.standard_normal((BATCH, 6)).astype(np.float32),
    "y": rng.standard_normal((BATCH,)).astype(np.float32),
  }


def mse(m, b):
  return jnp.mean((m(b["x"])[:, 0] - b["y"]) ** 2)


def check_runs(model, loss, graph, plan):
  assert refusal(graph, plan) is None, plan
  trainer = graphpipe.Trainer(plan, optax.sgd(0.1), graph=graph)
  got, _ = trainer.loss_and_grads(trainer.init(model), batch_of())
  assert got == pytest.approx(float(loss(model, batch_of())), rel=1e-5)


def test_a_loss_of_the_whole_batch_gets_plans_that_do_not_split_it():
  def loss(m, b):
    errors = (m(b["x"])[:, 0] - b["y"]) ** 2
    return jnp.mean(errors) + 0.1 * jnp.max(errors)

  model = Net(nnx.Rngs(0))
  graph = graphpipe.capture(loss, model, batch_of())
  assert "reduce_max" in graph.whole_batch_only
  for plan in (
    graphpipe.plan(graph, 4, BATCH, device=rc.SLOW),
    graphpipe.tightest_plan(graph, 4, BATCH, device=rc.SLOW),
  ):
    assert all(
      s.micro_batch_size == BATCH and len(s.devices) == 1 for s in plan.stages
    )
    check_runs(model, loss, graph, plan)
  with pytest.raises(PlanError, match="whole batch"):
    graphpipe.plan(graph, 4, BATCH, micro_batch_sizes=[2])


def test_a_model_that_takes_pairs_of_samples_never_gets_chunks_of_one():
  model = Net(nnx.Rngs(0), pairs=True)
  graph = graphpipe.capture(mse, model, batch_of())
  assert not graph.traces_at(1) and graph.traces_at(2)
  for planner in ("graphpipe", "sequential"):
    plan = graphpipe.tightest_plan(graph, 8, BATCH, planner, rc.SLOW)
    assert plan.num_stages > 1
    assert all(s.micro_batch_size // len(s.devices) >= 2 for s in plan.stages)
    check_runs(model, mse, graph, plan)


def test_values_laid_out_time_major_keep_one_chunk_size_across_a_cut():
  model = Net(nnx.Rngs(0), time_major=True)
  graph = graphpipe.capture(mse, model, batch_of(), granularity=1)
  apart = graph.meta["cut_rules"]["apart"]
  assert apart, graph.meta["cut_rules"]
  a, b = apart[0]
  # A cut there into a data-parallel stage is refused, as the trainer
  # would; the planners offer only plans that keep the chunk.
  groups = [(list(range(b)), [0]), (list(range(b, len(graph.nodes))), [1, 2])]
  replicated = rc.manual_plan(graph, groups, 4, BATCH)
  assert "apart" in refusal(graph, replicated)
  with pytest.raises(graphpipe.GraphpipeError, match="rows together"):
    graphpipe.Trainer(replicated, optax.sgd(0.1), graph=graph)
  for planner in graphpipe.PLANNERS:
    plan = graphpipe.plan(graph, 8, BATCH, planner, device=rc.SLOW)
    check_runs(model, mse, graph, plan)


def test_planners_trace_only_the_sizes_they_choose_and_retry_on_a_refusal():
  # `graphpipe.planning.search.search_tracing_chosen`: the search assumes
  # every size traces, then traces the chosen plan's chunks; chunks of one
  # fail here, so it searches again without them. On this model the plans
  # equal those of a graph traced at every size beforehand (in general
  # they need not: the first search's candidates held the failing size).
  model = Net(nnx.Rngs(0), pairs=True)
  for planner in ("graphpipe", "sequential", "gpipe"):
    lazy = graphpipe.capture(mse, model, batch_of())
    eager = graphpipe.capture(mse, model, batch_of())
    for size in (1, 2, 4, 8):
      eager.traces_at(size)
    got = graphpipe.plan(lazy, 8, BATCH, planner, rc.SLOW)
    want = graphpipe.plan(eager, 8, BATCH, planner, rc.SLOW)
    assert got.to_dict()["stages"] == want.to_dict()["stages"], planner
    assert lazy.program.known_refused(1)  # tried, failed, searched again
    chunks = {s.micro_batch_size // len(s.devices) for s in got.stages}
    assert 1 not in chunks
    check_runs(model, mse, lazy, got)
  model = Net(nnx.Rngs(0))  # traces everywhere: only the chosen sizes
  graph = graphpipe.capture(mse, model, batch_of())
  plan = graphpipe.plan(graph, 2, BATCH, "graphpipe", rc.SLOW)
  used = {s.micro_batch_size // len(s.devices) for s in plan.stages}
  used |= {s.micro_batch_size for s in plan.stages}
  assert set(graph.program._by_size) <= used | {BATCH, 2 * BATCH}
