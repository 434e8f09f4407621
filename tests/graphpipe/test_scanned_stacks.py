"""Scanned layer stacks split across stages (`graphpipe.frontend.unroll`).

Until 2026-12-04 a stack written as one scan over stacked parameters
(`nnx.vmap` + `nnx.scan`, linen `nn.scan`) captured as one node: a
24-layer model had at most the stages of its other modules. Capture now
unrolls such a scan into one node per layer, each stacked parameter into
one input per layer, and gives the user back the stacked form.
"""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import graphpipe
from graphpipe.core import runnable
from graphpipe.errors import GraphCutError
from tests.graphpipe import runtime_cases as rc

VOCAB, DIM, HEADS, KV_HEADS, SEQ, BATCH = 32, 16, 4, 2, 6, 8


class Attention(nnx.Module):
  """Grouped-query attention: HEADS query heads share KV_HEADS keys and
  values, causal."""

  def __init__(self, rngs):
    head = DIM // HEADS
    self.q = nnx.Linear(DIM, HEADS * head, use_bias=False, rngs=rngs)
    self.kv = nnx.Linear(DIM, 2 * KV_HEADS * head, use_bias=False, rngs=rngs)
    self.o = nnx.Linear(HEADS * head, DIM, use_bias=False, rngs=rngs)

  def __call__(self, x):
    b, t, _ = x.shape
    head = DIM // HEADS
    q = self.q(x).reshape(b, t, HEADS, head)
    k, v = jnp.split(self.kv(x).reshape(b, t, 2 * KV_HEADS, head), 2, axis=2)
    k = jnp.repeat(k, HEADS // KV_HEADS, axis=2)
    v = jnp.repeat(v, HEADS // KV_HEADS, axis=2)
    scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) / jnp.sqrt(head)
    causal = jnp.tril(jnp.ones((t, t), bool))
    scores = jnp.where(causal, scores, -1e9)
    out = jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(scores, -1), v)
    return self.o(out.reshape(b, t, DIM))


class Layer(nnx.Module):
  def __init__(self, rngs):
    self.norm1 = nnx.RMSNorm(DIM, rngs=rngs)
    self.attn = Attention(rngs)
    self.norm2 = nnx.RMSNorm(DIM, rngs=rngs)
    self.up = nnx.Linear(DIM, 2 * DIM, rngs=rngs)
    self.down = nnx.Linear(2 * DIM, DIM, rngs=rngs)

  def __call__(self, x):
    x = x + self.attn(self.norm1(x))
    return x + self.down(jax.nn.gelu(self.up(self.norm2(x))))


class LLM(nnx.Module):
  """A decoder LM as published NNX LLMs write it: tied embeddings, GQA, a
  stack of layers built by nnx.vmap and run by nnx.scan."""

  def __init__(self, layers, rngs):
    self.embed = nnx.Embed(VOCAB, DIM, rngs=rngs)

    @nnx.split_rngs(splits=layers)
    @nnx.vmap(in_axes=(0,), out_axes=0)
    def make(rngs):
      return Layer(rngs)

    self.layers = make(rngs)
    self.norm = nnx.RMSNorm(DIM, rngs=rngs)

  def __call__(self, tokens):
    x = self.embed(tokens)

    @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)
    def run(x, layer):
      return layer(x)

    return self.embed.attend(self.norm(run(x, self.layers)))


def lm_loss(model, batch):
  """Next-token cross-entropy weighted by the targets' mask (padding 0)."""
  logits = model(batch["tokens"][:, :-1])
  targets = batch["tokens"][:, 1:]
  weights = batch["mask"][:, 1:]
  ce = optax.softmax_cross_entropy_with_integer_labels(logits, targets)
  return jnp.sum(ce * weights) / jnp.sum(weights)


def lm_batch():
  rng = np.random.default_rng(0)
  tokens = rng.integers(1, VOCAB, (BATCH, SEQ + 1)).astype(np.int32)
  lengths = rng.integers(2, SEQ + 2, BATCH)
  lengths[:2] = 0  # the first micro-batch of 2 is all padding
  mask = (np.arange(SEQ + 1)[None] < lengths[:, None]).astype(np.float32)
  return {"tokens": np.where(mask > 0, tokens, 0), "mask": mask}


def nnx_reference(model, loss, batch, steps, optimizer):
  model = nnx.clone(model)
  opt = nnx.Optimizer(model, optimizer, wrt=nnx.Param)
  losses = []
  for _ in range(steps):
    value, grads = nnx.value_and_grad(loss)(model, batch)
    opt.update(model, grads)
    losses.append(float(value))
  return losses, model


def check(model, loss, batch, graph, plan, steps=2):
  assert runnable.refusal(graph, plan) is None
  # (Not adam: it divides a near-zero gradient by its own size, and turns
  # float reassociation across micro-batches into 1e-4 differences.)
  optimizer = optax.sgd(0.1, momentum=0.9)
  trainer = graphpipe.Trainer(plan, optimizer, graph=graph)
  state = trainer.init(model)
  got = []
  for _ in range(steps):
    state, metrics = trainer.step(state, batch)
    got.append(metrics["loss"])
  want, trained = nnx_reference(model, loss, batch, steps, optimizer)
  np.testing.assert_allclose(got, want, rtol=1e-5)
  mine = trainer.update_model(nnx.clone(model), state)
  for (path, a), (_, b) in zip(
    jax.tree_util.tree_leaves_with_path(nnx.state(mine, nnx.Param)),
    jax.tree_util.tree_leaves_with_path(nnx.state(trained, nnx.Param)),
    strict=True,
  ):
    assert a.shape == b.shape  # the stacked form, written back
    np.testing.assert_allclose(
      np.asarray(a), np.asarray(b), atol=1e-5, err_msg=str(path)
    )


@pytest.fixture(scope="module")
def llm():
  model = LLM(24, nnx.Rngs(0))
  return model, graphpipe.capture(lm_loss, model, lm_batch())


def test_a_scanned_stack_is_one_node_per_layer(llm):
  _, graph = llm
  names = [n.name for n in graph.nodes]
  assert [f"layers[{i}]" for i in range(24)] == [
    n for n in names if n.startswith("layers[")
  ]
  # Each layer's node holds its own slice of every stacked parameter.
  node = graph.nodes[names.index("layers[5]")]
  assert node.params and all(p.endswith("[5]") for p in node.params)
  kernel = graph.program.variable_values(llm[0])["param:layers.up.kernel[5]"]
  assert kernel.shape == (DIM, 2 * DIM)
  # The tied embedding: read by the input and the output head.
  assert "param:embed.embedding" in graph.shared


def test_llm_in_eight_stages_trains_exactly(llm):
  model, graph = llm
  names = [n.name for n in graph.nodes]
  layer = lambda i: names.index(f"layers[{i}]")
  stages = []
  for s in range(8):
    nodes = [layer(i) for i in range(3 * s, 3 * s + 3)]
    if s == 0:
      nodes = [i for i in range(layer(0))] + nodes
    if s == 7:
      nodes += list(range(layer(23) + 1, len(names)))
    stages.append((nodes, [s]))
  plan = rc.manual_plan(graph, stages, 2, BATCH)
  check(model, lm_loss, lm_batch(), graph, plan)


@pytest.mark.parametrize("planner", ["graphpipe", "sequential"])
def test_tightest_plans_of_the_llm_train_exactly(llm, planner):
  model, graph = llm
  plan = graphpipe.tightest_plan(graph, 8, BATCH, planner=planner)
  assert len(plan.stages) >= 4
  check(model, lm_loss, lm_batch(), graph, plan)


def test_linen_nn_scan_stack():
  class Block(nn.Module):
    @nn.compact
    def __call__(self, x, _):
      return x + nn.tanh(nn.Dense(8)(x)), None

  class Net(nn.Module):
    @nn.compact
    def __call__(self, x):
      x = nn.Dense(8)(x)
      stack = nn.scan(
        Block,
        variable_axes={"params": 0},
        split_rngs={"params": True},
        length=5,
      )
      x, _ = stack(name="stack")(x, None)
      return nn.Dense(1)(x)

  rng = np.random.default_rng(0)
  batch = {
    "x": rng.standard_normal((BATCH, 4)).astype(np.float32),
    "y": rng.standard_normal((BATCH, 1)).astype(np.float32),
  }
  net = Net()
  variables = net.init(jax.random.key(0), batch["x"])
  loss = lambda m, b: jnp.mean((m(b["x"]) - b["y"]) ** 2)
  graph = graphpipe.capture(loss, net, batch, variables=variables)
  assert [n.name for n in graph.nodes][1:6] == [f"stack[{i}]" for i in range(5)]
  plan = graphpipe.tightest_plan(graph, 4, BATCH)
  trainer = graphpipe.Trainer(plan, optax.sgd(0.1), graph=graph)
  state, _ = trainer.step(trainer.init(variables), batch)
  grads = jax.grad(lambda p: loss(net.bind({"params": p}), batch))(
    variables["params"]
  )
  want = jax.tree.map(lambda p, g: p - 0.1 * g, variables["params"], grads)
  got = trainer.variables(state, variables)["params"]
  jax.tree.map(
    lambda a, b: np.testing.assert_allclose(np.asarray(a), b, atol=1e-6),
    got,
    want,
  )


def test_a_scan_over_time_stays_one_node():
  """A scan whose stacked operands are not model variables (an RNN over
  the sequence) is not a layer stack: it is left as it is."""

  class RNN(nnx.Module):
    def __init__(self, rngs):
      self.inp = nnx.Linear(3, 8, rngs=rngs)
      self.cell = nnx.Linear(8, 8, rngs=rngs)
      self.out = nnx.Linear(8, 1, rngs=rngs)

    def __call__(self, x):
      xs = jnp.swapaxes(self.inp(x), 0, 1)
      step = lambda h, x_t: (jnp.tanh(self.cell(h) + x_t), None)
      h, _ = jax.lax.scan(step, jnp.zeros_like(xs[0]), xs)
      return self.out(h)

  batch = {"x": np.ones((BATCH, 5, 3), np.float32)}
  graph = graphpipe.capture(
    lambda m, b: jnp.mean(m(b["x"]) ** 2), RNN(nnx.Rngs(0)), batch
  )
  assert not any("[" in n.name for n in graph.nodes)


def test_a_stack_left_as_a_scan_is_named_in_the_message():
  """A scan capture cannot unroll (here it returns each layer's output):
  the message said "a model of one layer" before."""

  class Stack(nnx.Module):
    def __init__(self, rngs):
      @nnx.split_rngs(splits=4)
      @nnx.vmap(in_axes=(0,), out_axes=0)
      def make(rngs):
        return nnx.Linear(4, 4, rngs=rngs)

      self.layers = make(rngs)

    def __call__(self, x):
      @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=(nnx.Carry, 0))
      def run(x, layer):
        y = jnp.tanh(layer(x))
        return y, y

      x, every = run(x, self.layers)
      return x + every.sum(0)

  with pytest.raises(GraphCutError, match="inside one scan capture does not"):
    graphpipe.capture(
      lambda m, b: jnp.mean(m(b["x"]) ** 2),
      Stack(nnx.Rngs(0)),
      {"x": np.ones((BATCH, 4), np.float32)},
    )
