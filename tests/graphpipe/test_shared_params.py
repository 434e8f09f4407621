"""Parameters several stages read: tied embeddings, a bias every layer adds.

Until 2026-12-03 a parameter read by several modules merged every node
between its first and last reader: a language model with tied input and
output embeddings was one node, nothing to pipeline. Each reader is its
own node now, every stage that reads the parameter holds a copy, and the
copies' gradients are summed before the optimizer (`runtime.shared`).
"""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import graphpipe
from graphpipe.core.memory import plan_memory
from tests.graphpipe import runtime_cases as rc

VOCAB, WIDTH, LENGTH, BATCH = 11, 8, 6, 8


class Block(nnx.Module):
  def __init__(self, rngs):
    self.lin = nnx.Linear(WIDTH, WIDTH, rngs=rngs)

  def __call__(self, x, bias=0.0):
    return x + jnp.tanh(self.lin(x) + bias)


class TiedLM(nnx.Module):
  """Input embedding and output head share one table (`attend`)."""

  def __init__(self, rngs):
    self.embed = nnx.Embed(VOCAB, WIDTH, rngs=rngs)
    self.blocks = nnx.List([Block(rngs) for _ in range(3)])
    self.norm = nnx.LayerNorm(WIDTH, rngs=rngs)

  def __call__(self, tokens):
    x = self.embed(tokens)
    for block in self.blocks:
      x = block(x)
    return self.embed.attend(self.norm(x))


class SharedBias(nnx.Module):
  """One bias every layer adds."""

  def __init__(self, rngs):
    self.inp = nnx.Linear(4, WIDTH, rngs=rngs)
    self.bias = nnx.Param(jnp.full((WIDTH,), 0.1))
    self.blocks = nnx.List([Block(rngs) for _ in range(3)])
    self.out = nnx.Linear(WIDTH, 1, rngs=rngs)

  def __call__(self, x):
    x = self.inp(x)
    for block in self.blocks:
      x = block(x, self.bias[...])
    return self.out(x)


def lm_loss(model, batch):
  """The token-weighted loss of a decoder LM, padding weighted 0."""
  logits = model(batch["tokens"][:, :-1])
  ce = optax.softmax_cross_entropy_with_integer_labels(
    logits, batch["tokens"][:, 1:]
  )
  weights = batch["weights"][:, 1:]
  return jnp.sum(ce * weights) / jnp.sum(weights)


def lm_batch(seed=0):
  rng = np.random.default_rng(seed)
  weights = np.ones((BATCH, LENGTH), np.float32)
  weights[:, -2:] = 0  # padding
  return {
    "tokens": rng.integers(0, VOCAB, (BATCH, LENGTH)).astype(np.int32),
    "weights": weights,
  }


def plain_steps(model, loss, batch, optimizer, steps):
  """Parameters after `steps` optax steps of plain JAX."""
  graphdef, params, rest = nnx.split(model, nnx.Param, ...)
  state = optimizer.init(params)
  for _ in range(steps):
    grads = jax.grad(lambda p: loss(nnx.merge(graphdef, p, rest), batch))(
      params
    )
    updates, state = optimizer.update(grads, state, params)
    params = optax.apply_updates(params, updates)
  return nnx.merge(graphdef, params, rest)


def rel(got, want):
  got, want = np.asarray(got), np.asarray(want)
  return float(np.max(np.abs(got - want)) / (np.max(np.abs(want)) + 1e-12))


def check_trains_exactly(model, loss, batch, graph, plan, optimizer=None):
  optimizer = optimizer or optax.adam(1e-2)
  trainer = graphpipe.Trainer(plan, optimizer, graph=graph)
  state = trainer.init(model)
  got, grads = trainer.loss_and_grads(state, batch)
  graphdef, params, rest = nnx.split(model, nnx.Param, ...)
  want, want_grads = jax.value_and_grad(
    lambda p: loss(nnx.merge(graphdef, p, rest), batch)
  )(params)
  want_grads = graph.program.variable_values(
    nnx.merge(graphdef, want_grads, rest)
  )
  assert got == pytest.approx(float(want), rel=1e-5)
  for key, value in grads.items():
    assert rel(value, want_grads[key]) < 1e-5, key
  for _ in range(2):
    state, _ = trainer.step(state, batch)
  want = graph.program.variable_values(
    plain_steps(model, loss, batch, optimizer, 2)
  )
  trained = trainer.params(state)
  for key, value in trained.items():
    assert rel(value, want[key]) < 1e-5, key
  return trainer, state


def holders(plan, graph, key):
  readers = graph.shared_readers()[key]
  return [s for s in plan.stages if set(s.nodes) & set(readers)]


def test_tied_embeddings_are_read_by_two_nodes_and_train_exactly():
  model, batch = TiedLM(nnx.Rngs(0)), lm_batch()
  graph = graphpipe.capture(lm_loss, model, batch)
  key = "param:embed.embedding"
  first, last = graph.shared_readers()[key]
  assert (first, last) == (0, len(graph.nodes) - 1)
  assert graph.nodes[last].name == "embed#1"  # attend(), named by module
  table = VOCAB * WIDTH * 4
  assert graph.shared == {key: table}
  assert graph.variable_bytes([first, last]) == graph.variable_bytes([first])
  n = len(graph.nodes)
  # The readers in the first and last of three stages, the middle one
  # data-parallel: micro-batches, replicas and two copies at once.
  plan = rc.manual_plan(
    graph,
    [([0, 1, 2], [0]), (list(range(3, n - 2)), [1, 2]), ([n - 2, n - 1], [3])],
    4,
    BATCH,
  )
  assert len(holders(plan, graph, key)) == 2
  trainer, state = check_trains_exactly(model, lm_loss, batch, graph, plan)
  # The copies stay bit-identical: every holder's first device.
  rows = [np.asarray(x) for x in state.params]
  copies = []
  for s in holders(plan, graph, key):
    slot, offset = trainer.buffers.params.places[s.id][key]
    copies.append(rows[slot][s.devices[0], offset : offset + VOCAB * WIDTH])
  np.testing.assert_array_equal(copies[0], copies[1])
  # The memory rule counts each copy, as the runtime allocates them.
  runtime = graphpipe.memory_report(plan, graph, optax.adam(1e-2))
  rule = plan_memory(graph, plan)
  for mine, theirs in zip(runtime.per_device, rule.per_device, strict=True):
    assert mine["parameters"] == theirs["parameters"]
  own = trainer.memory_report()["param_bytes_own"]
  assert own[0] >= table and own[3] >= table
  # update_model writes one parameter back.
  model = trainer.update_model(model, state)
  np.testing.assert_allclose(
    np.asarray(model.embed.embedding[...]).reshape(-1),
    copies[0],
    rtol=0,
  )


def test_planners_cut_between_the_readers_of_a_tied_embedding():
  model, batch = TiedLM(nnx.Rngs(0)), lm_batch()
  graph = graphpipe.capture(lm_loss, model, batch)
  key = "param:embed.embedding"
  for planner in ("graphpipe", "sequential"):
    plan = graphpipe.tightest_plan(
      graph, num_devices=4, batch_size=BATCH, planner=planner
    )
    assert plan.num_stages >= 3, plan
    assert len(holders(plan, graph, key)) == 2
    check_trains_exactly(model, lm_loss, batch, graph, plan)
  # The simulator prices the exchange of the copies' gradients.
  report = graphpipe.simulate(plan, graph)
  assert any(e.category == "exchange" for e in report.events)


def test_a_bias_every_layer_adds_trains_exactly():
  model = SharedBias(nnx.Rngs(0))
  rng = np.random.default_rng(0)
  batch = {
    "x": rng.standard_normal((BATCH, 4)).astype(np.float32),
    "y": rng.standard_normal((BATCH,)).astype(np.float32),
  }

  def loss(m, b):
    return jnp.mean((m(b["x"])[:, 0] - b["y"]) ** 2)

  graph = graphpipe.capture(loss, model, batch)
  readers = graph.shared_readers()["param:bias"]
  assert len(readers) == 3
  groups = [([n], [n]) for n in range(len(graph.nodes))]
  plan = rc.manual_plan(graph, groups, 2, BATCH)
  check_trains_exactly(model, loss, batch, graph, plan)


def test_linen_tied_embeddings_train_exactly():
  class LinenLM(nn.Module):
    @nn.compact
    def __call__(self, tokens):
      embed = nn.Embed(VOCAB, WIDTH, name="embed")
      x = embed(tokens)
      for i in range(2):
        x = x + jnp.tanh(nn.Dense(WIDTH, name=f"block{i}")(x))
      return embed.attend(x)

  module = LinenLM()
  batch = lm_batch()
  variables = module.init(jax.random.key(0), batch["tokens"])
  graph = graphpipe.capture(lm_loss, module, batch, variables=variables)
  assert len(graph.shared_readers()["param:embed.embedding"]) == 2
  groups = [([n], [n]) for n in range(len(graph.nodes))]
  plan = rc.manual_plan(graph, groups, 4, BATCH)
  trainer = graphpipe.Trainer(plan, optax.sgd(0.1), graph=graph)
  got, grads = trainer.loss_and_grads(trainer.init(variables), batch)
  want, want_grads = jax.value_and_grad(
    lambda p: lm_loss(module.bind({"params": p}), batch)
  )(variables["params"])
  assert got == pytest.approx(float(want), rel=1e-5)
  flat = graph.program.variable_values({"params": want_grads})
  for key, value in grads.items():
    assert rel(value, flat[key]) < 1e-5, key
