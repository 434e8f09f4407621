"""Capture of transforms and idioms inside models: nested jaxprs (scan,
jit, remat), nnx and linen transforms around blocks, dropout in inference
mode, constants built once and read by every layer. Each keeps its
modules' names and, where trained, equals jax.value_and_grad."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import graphpipe
from graphpipe.core.stages import Plan, Stage, in_flight_counts
from graphpipe.errors import CaptureError
from tests.graphpipe.test_capture import make_batch, xent


def test_nested_jaxprs_stay_in_their_node():
  class Inner(nnx.Module):
    def __init__(self, rngs):
      self.lin = nnx.Linear(6, 6, rngs=rngs)

    def __call__(self, x):
      step = lambda h, _: (jnp.tanh(h @ self.lin.kernel[...]), None)
      h, _ = jax.lax.scan(step, x, None, length=3)  # a scan
      return jax.checkpoint(jax.nn.relu)(h)  # remat of a custom_jvp

  class Outer(nnx.Module):
    def __init__(self, rngs):
      self.first = Inner(rngs)
      self.second = nnx.Linear(6, 6, rngs=rngs)

    def __call__(self, x):
      return self.second(jax.jit(self.first)(x))  # a jit

  model = Outer(nnx.Rngs(0))
  batch = make_batch()
  loss = lambda m, b: jnp.mean(m(b["x"]) ** 2)
  graph = graphpipe.capture(loss, model, batch)
  assert [n.name for n in graph.nodes] == ["first", "second"]
  assert graph.nodes[0].params == ("first.lin.kernel",)
  np.testing.assert_allclose(
    graph.evaluate(model, batch), loss(model, batch), rtol=1e-6
  )


def test_module_called_under_jit_inside_a_module():
  class Wrap(nnx.Module):
    def __init__(self, rngs):
      self.lin = nnx.Linear(6, 6, rngs=rngs)
      self.out = nnx.Linear(6, 6, rngs=rngs)

    def __call__(self, x):
      return self.out(jax.jit(self.lin)(x))

  class Outer(nnx.Module):
    def __init__(self, rngs):
      self.wrap = Wrap(rngs)
      self.head = nnx.Linear(6, 2, rngs=rngs)

    def __call__(self, x):
      return self.head(self.wrap(x))

  model = Outer(nnx.Rngs(0))
  loss = lambda m, b: jnp.mean(m(b["x"]) ** 2)
  graph = graphpipe.capture(loss, model, make_batch())
  assert [n.name for n in graph.nodes] == ["wrap.lin", "wrap.out", "head"]


def test_an_nnx_model_with_dropout_in_inference_mode_trains_exactly():
  # The capture error for training-mode dropout says to put it in inference
  # mode; then the Dropout's RngKey (a typed PRNG key, dtype key<fry>) was
  # a raw TypeError from numpy while sizing the model's variables.
  class Net(nnx.Module):
    def __init__(self, rngs):
      self.a = nnx.Linear(6, 8, rngs=rngs)
      self.drop = nnx.Dropout(0.5, rngs=rngs)
      self.b = nnx.Linear(8, 3, rngs=rngs)

    def __call__(self, x):
      return self.b(self.drop(jax.nn.relu(self.a(x))))

  model, batch = Net(nnx.Rngs(0)), make_batch()
  model.eval()
  graph = graphpipe.capture(xent, model, batch)
  plan = graphpipe.plan(graph, 2, len(batch["x"]))
  trainer = graphpipe.Trainer(plan, optax.sgd(0.1), graph=graph)
  assert sum(k.startswith("param:") for k in graph.program.input_keys) == 4
  assert_exact(trainer, graph, model, xent, batch, loss_rel=1e-6)
  trainer.step(trainer.init(model), batch)  # and a step runs


def test_linen_blocks_under_remat_keep_their_names():
  # Linen's scopes inside a lifted transform are relative to the
  # transformed module ('blk0/d'): every nn.remat block was one 'glue'
  # node, leaving a rematerialised stack nothing to pipeline.
  class Blk(nn.Module):
    @nn.compact
    def __call__(self, h):
      return h + nn.Dense(6, name="d2")(jnp.tanh(nn.Dense(6, name="d")(h)))

  class Enc(nn.Module):
    @nn.compact
    def __call__(self, h):
      for i in range(3):
        h = nn.remat(Blk)(name=f"blk{i}")(h)
      return h

  class Net(nn.Module):
    @nn.compact
    def __call__(self, x):
      h = Enc(name="enc")(nn.Dense(6, name="a")(x))
      return nn.Dense(3, name="head")(h)

  module, batch = Net(), make_batch()
  variables = module.init(jax.random.key(0), batch["x"])
  graph = graphpipe.capture(
    xent, module, batch, variables=variables, granularity=2
  )
  names = [n.name for n in graph.nodes]
  assert names == ["a", "enc.blk0", "enc.blk1", "enc.blk2", "head"]
  want = xent(module.bind(variables), batch)
  trainer = graphpipe.Trainer(
    graphpipe.plan(graph, 3, len(batch["x"])), optax.sgd(0.1), graph=graph
  )
  loss, _ = trainer.loss_and_grads(trainer.init(variables), batch)
  assert loss == pytest.approx(float(want), rel=1e-5)


def test_nnx_remat_and_jit_inside_a_model_are_not_taken_for_mutation():
  # nnx.remat and nnx.jit hand the variables they were given back as new
  # tracers: the identity check called that a change and refused the
  # model. A variable that does change under nnx.jit is refused: the call
  # both updates it and computes the loss's values.
  class Layer(nnx.Module):
    def __init__(self, rngs):
      self.lin = nnx.Linear(6, 6, rngs=rngs)
      self.calls = nnx.BatchStat(jnp.zeros(()))

    def __call__(self, x, count=False):
      if count:
        self.calls[...] = self.calls[...] + 1
      return jnp.tanh(self.lin(x))

  class Net(nnx.Module):
    def __init__(self, wrap, rngs):
      self.first, self.second = Layer(rngs), Layer(rngs)
      self.head, self.wrap = nnx.Linear(6, 3, rngs=rngs), wrap

    def __call__(self, x):
      return self.head(self.second(self.wrap(self.first, x)))

  batch = make_batch()
  for wrap in (
    lambda m, x: nnx.remat(lambda mm, v: mm(v))(m, x),
    lambda m, x: nnx.jit(lambda mm, v: mm(v))(m, x),
  ):
    model = Net(wrap, nnx.Rngs(0))
    graph = graphpipe.capture(xent, model, batch)
    trainer = graphpipe.Trainer(
      graphpipe.plan(graph, 2, len(batch["x"])), optax.sgd(0.1), graph=graph
    )
    loss, _ = trainer.loss_and_grads(trainer.init(model), batch)
    assert loss == pytest.approx(float(xent(model, batch)), rel=1e-5)
  counting = Net(
    lambda m, x: nnx.jit(lambda mm, v: mm(v, count=True))(m, x),
    nnx.Rngs(0),
  )
  with pytest.raises(CaptureError, match="reads a state variable it updates"):
    graphpipe.capture(xent, counting, batch)


def test_nnx_blocks_under_remat_and_jit_keep_their_names():
  # nnx.remat and nnx.jit split the modules they are given and merge new
  # objects inside, which the scopes (keyed by identity) did not know:
  # a stack of rematerialised blocks was one 'input' node, with nothing
  # to pipeline. The paths now travel in the graph definition.
  class Block(nnx.Module):
    def __init__(self, rngs):
      self.lin = nnx.Linear(6, 6, rngs=rngs)

    def __call__(self, x):
      return x + jnp.tanh(self.lin(x))

  class Net(nnx.Module):
    def __init__(self, wrap, rngs):
      self.blocks = nnx.List([Block(rngs) for _ in range(3)])
      self.head, self.wrap = nnx.Linear(6, 3, rngs=rngs), wrap

    def __call__(self, x):
      for block in self.blocks:
        x = self.wrap(block, x)
      return self.head(x)

  batch = make_batch()
  for wrap in (
    lambda m, x: nnx.remat(lambda mm, v: mm(v))(m, x),
    lambda m, x: nnx.jit(lambda mm, v: mm(v))(m, x),
    lambda m, x: nnx.remat(Block.__call__)(m, x),
  ):
    model = Net(wrap, nnx.Rngs(0))
    graph = graphpipe.capture(xent, model, batch)
    names = [n.name for n in graph.nodes]
    assert names == ["blocks.0", "blocks.1", "blocks.2", "head"]
    assert not hasattr(model.blocks[0], "_graphpipe_path")  # user's model
    stages = tuple(
      Stage(i, (i,), (i,), 4, flight)
      for i, flight in enumerate(in_flight_counts(4, CHAIN_4))
    )
    plan = Plan("manual", stages, CHAIN_4, len(batch["x"]), 4)
    trainer = graphpipe.Trainer(plan, optax.sgd(0.1), graph=graph)
    assert_exact(trainer, graph, model, xent, batch)


CHAIN_4 = ((0, 1), (1, 2), (2, 3))


def test_a_constant_built_once_and_read_by_every_layer_is_inlined():
  # A causal mask built in the root module and passed to every block (as
  # flax's lm1b decoder does) was an 'input' node with an edge to each
  # block and no batch axis: every cut crossed it and the trainer refused
  # every pipeline, the planner's own included. Each reader now builds it.
  width, seq, vocab = 8, 4, 7

  class Attention(nnx.Module):
    def __init__(self, rngs):
      self.qkv = nnx.Linear(width, 3 * width, rngs=rngs)
      self.out = nnx.Linear(width, width, rngs=rngs)

    def __call__(self, x, bias):
      q, k, v = jnp.split(self.qkv(x), 3, -1)
      logits = jnp.einsum("btd,bsd->bts", q, k) / np.sqrt(width) + bias
      mixed = jnp.einsum("bts,bsd->btd", jax.nn.softmax(logits, -1), v)
      return x + self.out(mixed)

  class CausalLM(nnx.Module):
    def __init__(self, rngs):
      self.embed = nnx.Embed(vocab, width, rngs=rngs)
      self.blocks = nnx.List([Attention(rngs) for _ in range(3)])
      self.head = nnx.Linear(width, vocab, rngs=rngs)

    def __call__(self, ids):
      t = ids.shape[1]
      bias = jnp.where(jnp.tril(jnp.ones((t, t), bool)), 0.0, -1e9)
      h = self.embed(ids)
      for block in self.blocks:
        h = block(h, bias)
      return self.head(h)

  rng = np.random.default_rng(0)
  batch = {
    "ids": rng.integers(0, vocab, (8, seq)).astype(np.int32),
    "target": rng.integers(0, vocab, (8, seq)).astype(np.int32),
  }

  def loss_fn(m, b):
    return optax.softmax_cross_entropy_with_integer_labels(
      m(b["ids"]), b["target"]
    ).mean()

  model = CausalLM(nnx.Rngs(0))
  graph = graphpipe.capture(loss_fn, model, batch, granularity=1)
  assert [n.name for n in graph.nodes] == [
    "embed",
    "blocks.0",
    "blocks.1",
    "blocks.2",
    "head",
  ]
  plan = graphpipe.tightest_plan(graph, 4, 8)
  assert plan.num_stages > 1
  trainer = graphpipe.Trainer(plan, optax.sgd(0.1), graph=graph)
  assert_exact(trainer, graph, model, loss_fn, batch)


def assert_exact(trainer, graph, model, loss_fn, batch, loss_rel=1e-5):
  """The trainer's loss and every gradient equal jax.value_and_grad's."""
  loss, grads = trainer.loss_and_grads(trainer.init(model), batch)
  graphdef, params, rest = nnx.split(model, nnx.Param, ...)
  want, want_grads = jax.value_and_grad(
    lambda p: loss_fn(nnx.merge(graphdef, p, rest), batch)
  )(params)
  assert loss == pytest.approx(float(want), rel=loss_rel)
  want_grads = graph.program.variable_values(
    nnx.merge(graphdef, want_grads, rest)
  )
  for name, value in want_grads.items():
    if name.startswith("param:"):
      np.testing.assert_allclose(grads[name], value, rtol=1e-5, atol=1e-7)
