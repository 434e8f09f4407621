"""Random streams in training: dropout, a VAE's noise, per plan the same.

Until 2026-12-03 a model drawing in training was refused unless the user
threaded per-sample keys through the batch (an nnx.Dropout's stream count
was a mutation, a linen module's missing rng an InvalidRngError blamed on
BatchNorm). Streams follow one rule now (`graphpipe.frontend.streams`):
sample j of the batch draws from fold_in(key, j), so every plan and every
micro-batch size trains as plain JAX does with the same keys.
"""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import graphpipe
from graphpipe.errors import GraphpipeError
from graphpipe.frontend import streams
from tests.graphpipe import runtime_cases as rc

BATCH = 8


class Block(nnx.Module):
  def __init__(self, rngs):
    self.lin = nnx.Linear(8, 8, rngs=rngs)
    self.drop = nnx.Dropout(0.3, rngs=rngs)

  def __call__(self, x):
    return self.drop(jnp.tanh(self.lin(x)))


class Dropped(nnx.Module):
  def __init__(self, rngs):
    self.inp = nnx.Linear(4, 8, rngs=rngs)
    self.blocks = nnx.List([Block(rngs) for _ in range(3)])
    self.out = nnx.Linear(8, 1, rngs=rngs)

  def __call__(self, x):
    x = self.inp(x)
    for block in self.blocks:
      x = block(x)
    return self.out(x)


class VAE(nnx.Module):
  """Encoder to a mean and log-variance, reparametrised noise, decoder."""

  def __init__(self, rngs):
    self.enc = nnx.Linear(4, 6, rngs=rngs)
    self.mean = nnx.Linear(6, 2, rngs=rngs)
    self.logvar = nnx.Linear(6, 2, rngs=rngs)
    self.dec = nnx.Linear(2, 4, rngs=rngs)
    self.rngs = rngs

  def __call__(self, x):
    h = jnp.tanh(self.enc(x))
    mean, logvar = self.mean(h), self.logvar(h)
    z = mean + jnp.exp(0.5 * logvar) * jax.random.normal(
      self.rngs.noise(), mean.shape
    )
    return self.dec(z), mean, logvar


def vae_loss(m, b):
  recon, mean, logvar = m(b["x"])
  kl = -0.5 * jnp.sum(1 + logvar - mean**2 - jnp.exp(logvar))
  return jnp.mean(jnp.sum((recon - b["x"]) ** 2, -1)) + kl / BATCH


def mse(m, b):
  return jnp.mean((m(b["x"])[:, 0] - b["y"]) ** 2)


def batch_of(seed=0):
  rng = np.random.default_rng(seed)
  return {
    "x": rng.standard_normal((BATCH, 4)).astype(np.float32),
    "y": rng.standard_normal((BATCH,)).astype(np.float32),
  }


def reference(model, loss, batch, key):
  """Plain NNX: the model's streams given the step's keys."""
  model = nnx.clone(model)
  keys = nnx.state(model, nnx.RngKey)
  count = len(jax.tree.leaves(keys))
  nnx.update(
    model,
    jax.tree.unflatten(
      jax.tree.structure(keys), streams.stream_keys(key, count)
    ),
  )
  value, grads = nnx.value_and_grad(loss)(model, batch)
  return float(value), grads


def plans(graph):
  n = len(graph.nodes)
  whole = rc.manual_plan(graph, [(list(range(n)), [0])], BATCH, BATCH)
  split = rc.manual_plan(
    graph,
    [([0, 1], [0]), ([2, 3], [1, 2]), (list(range(4, n)), [3])],
    4,
    BATCH,
  )
  each = rc.manual_plan(graph, [([i], [i]) for i in range(n)], 2, BATCH)
  return [whole, split, each]


def check(model, loss, graph, key):
  batch = batch_of()
  want, want_grads = reference(model, loss, batch, key)
  graphdef, _, rest = nnx.split(model, nnx.Param, ...)
  want_grads = graph.program.variable_values(
    nnx.merge(graphdef, want_grads, rest)
  )
  assert float(graph.evaluate(model, batch, key)) == pytest.approx(want)
  for plan in plans(graph):
    trainer = graphpipe.Trainer(plan, optax.sgd(0.1), graph=graph)
    got, grads = trainer.loss_and_grads(trainer.init(model), batch, key)
    assert got == pytest.approx(want, rel=1e-5)
    for k, value in grads.items():
      w = np.asarray(want_grads[k])
      assert np.max(np.abs(np.asarray(value) - w)) <= 1e-5 * (
        np.max(np.abs(w)) + 1e-6
      ), k


def test_dropout_in_training_is_the_same_on_every_plan():
  model = Dropped(nnx.Rngs(0, dropout=1))
  graph = graphpipe.capture(mse, model, batch_of())
  assert len(graph.program.streams) == 3  # each Dropout's key
  assert graph.whole_batch_only is None
  key = jax.random.key(7)
  check(model, mse, graph, key)
  # Each step's key draws other masks; the trainer asks for it.
  trainer = graphpipe.Trainer(plans(graph)[1], optax.sgd(0.1), graph=graph)
  state = trainer.init(model)
  first, _ = trainer.loss_and_grads(state, batch_of(), jax.random.key(1))
  second, _ = trainer.loss_and_grads(state, batch_of(), jax.random.key(2))
  assert first != second
  with pytest.raises(GraphpipeError, match="pass the step's key"):
    trainer.step(state, batch_of())


def test_a_vae_draws_its_noise_per_sample():
  model = VAE(nnx.Rngs(0, noise=3))
  graph = graphpipe.capture(vae_loss, model, batch_of())
  assert "rng:rngs.noise.key" in graph.program.streams
  check(model, vae_loss, graph, jax.random.key(5))


def test_a_model_without_streams_refuses_a_key():
  model = nnx.Sequential(
    nnx.Linear(4, 8, rngs=nnx.Rngs(0)), nnx.Linear(8, 1, rngs=nnx.Rngs(1))
  )
  graph = graphpipe.capture(mse, model, batch_of())
  trainer = graphpipe.Trainer(
    rc.manual_plan(graph, [([0], [0]), ([1], [1])], 4, BATCH),
    optax.sgd(0.1),
    graph=graph,
  )
  with pytest.raises(GraphpipeError, match="draws none"):
    trainer.loss_and_grads(trainer.init(model), batch_of(), jax.random.key(0))


def test_a_draw_not_in_the_batch_shape_needs_the_whole_batch():
  class Noisy(nnx.Module):
    def __init__(self, rngs):
      self.a = nnx.Linear(4, 8, rngs=rngs)
      self.b = nnx.Linear(8, 1, rngs=rngs)
      self.rngs = rngs

    def __call__(self, x):  # one noise vector for every sample
      h = self.a(x) + jax.random.normal(self.rngs.noise(), (8,))
      return self.b(jnp.tanh(h))

  graph = graphpipe.capture(mse, Noisy(nnx.Rngs(0, noise=1)), batch_of())
  assert "not in the batch's shape" in graph.whole_batch_only


def test_linen_dropout_with_named_streams():
  class Net(nn.Module):
    @nn.compact
    def __call__(self, x):
      for i in range(3):
        x = nn.Dropout(0.3, deterministic=False)(
          jnp.tanh(nn.Dense(8, name=f"layer{i}")(x))
        )
      return nn.Dense(1, name="head")(x)

  module, batch = Net(), batch_of()
  variables = module.init(jax.random.key(0), batch["x"])
  loss = lambda m, b: jnp.mean((m(b["x"])[:, 0] - b["y"]) ** 2)
  with pytest.raises(GraphpipeError, match="rngs=\\('dropout',\\)"):
    graphpipe.capture(loss, module, batch, variables=variables)
  graph = graphpipe.capture(
    loss, module, batch, variables=variables, rngs=("dropout",)
  )
  key = jax.random.key(3)
  (stream,) = streams.stream_keys(key, 1)
  want, want_grads = jax.value_and_grad(
    lambda p: loss(module.bind({"params": p}, rngs={"dropout": stream}), batch)
  )(variables["params"])
  plan = rc.manual_plan(
    graph, [([n], [n]) for n in range(len(graph.nodes))], 2, BATCH
  )
  trainer = graphpipe.Trainer(plan, optax.sgd(0.1), graph=graph)
  got, grads = trainer.loss_and_grads(trainer.init(variables), batch, key)
  assert got == pytest.approx(float(want), rel=1e-5)
  flat = graph.program.variable_values({"params": want_grads})
  for k, value in grads.items():
    assert rc.max_rel_error({k: value}, {k: flat[k]}) < 1e-5, k
