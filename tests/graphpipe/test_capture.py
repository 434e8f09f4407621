"""Capture: grouping, exact node-by-node evaluation, costs, bad input
(transforms and idioms inside models: test_capture_transforms.py)."""

import flax
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import graphpipe
from graphpipe.core.graph import OpGraph
from graphpipe.errors import CaptureError, GraphCutError, GraphpipeError


class Block(nnx.Module):
  def __init__(self, d, rngs):
    self.a = nnx.Linear(d, 2 * d, rngs=rngs)
    self.b = nnx.Linear(2 * d, d, rngs=rngs)

  def __call__(self, x):
    return x + self.b(jax.nn.gelu(self.a(x)))


class TwoBranch(nnx.Module):
  def __init__(self, d, depth, rngs):
    self.left = nnx.List([Block(d, rngs) for _ in range(depth)])
    self.right = nnx.List([Block(d, rngs) for _ in range(depth)])
    self.head = nnx.Linear(2 * d, 3, rngs=rngs)

  def __call__(self, x):
    a, b = x, jnp.tanh(x)
    for blk in self.left:
      a = blk(a)
    for blk in self.right:
      b = blk(b)
    return self.head(jnp.concatenate([a, b], axis=-1))


class LBlock(nn.Module):
  d: int

  @nn.compact
  def __call__(self, x):
    return x + nn.Dense(self.d, name="b")(
      jax.nn.gelu(nn.Dense(2 * self.d, name="a")(x))
    )


class LTwoBranch(nn.Module):
  d: int
  depth: int

  @nn.compact
  def __call__(self, x):
    a, b = x, jnp.tanh(x)
    for i in range(self.depth):
      a = LBlock(self.d, name=f"left_{i}")(a)
    for i in range(self.depth):
      b = LBlock(self.d, name=f"right_{i}")(b)
    return nn.Dense(3, name="head")(jnp.concatenate([a, b], axis=-1))


def xent(model, batch):
  logits = model(batch["x"])
  logp = jax.nn.log_softmax(logits)
  return -jnp.mean(jnp.take_along_axis(logp, batch["y"][:, None], axis=1))


def make_batch(n=8, d=6):
  rng = np.random.default_rng(0)
  return {
    "x": rng.normal(size=(n, d)).astype(np.float32),
    "y": (np.arange(n) % 3).astype(np.int32),
  }


@pytest.fixture(scope="module")
def model():
  return TwoBranch(6, 3, nnx.Rngs(0))


def test_block_granularity_gives_two_chains_and_a_head(model):
  graph = graphpipe.capture(xent, model, make_batch(), granularity=1)
  # Depth 1: each list entry 'left.i' is a child module of the root.
  names = [n.name for n in graph.nodes]
  assert sorted(names) == sorted(
    [f"left.{i}" for i in range(3)]
    + [f"right.{i}" for i in range(3)]
    + ["head"]
  )
  head = graph.node_by_name("head")
  assert sorted(graph.predecessors(head.id)) == sorted(
    [graph.node_by_name("left.2").id, graph.node_by_name("right.2").id]
  )
  assert graph.loss_nodes == (head.id,)
  for i in range(2):
    for side in ("left", "right"):
      a, b = (graph.node_by_name(f"{side}.{k}").id for k in (i, i + 1))
      assert graph.successors(a) == [b]


@pytest.mark.parametrize("granularity", ["layer", 1])
def test_node_by_node_evaluation_equals_loss(model, granularity):
  batch = make_batch()
  graph = graphpipe.capture(xent, model, batch, granularity=granularity)
  np.testing.assert_allclose(
    graph.evaluate(model, batch), xent(model, batch), rtol=1e-6
  )
  # Another batch size re-traces along the same cut.
  other = make_batch(n=5)
  np.testing.assert_allclose(
    graph.evaluate(nnx.state(model), other), xent(model, other), rtol=1e-6
  )


def test_every_parameter_owned_once(model):
  graph = graphpipe.capture(xent, model, make_batch(), granularity="layer")
  owned = [p for n in graph.nodes for p in n.params]
  assert len(owned) == len(set(owned))
  assert len(owned) == len(jax.tree.leaves(nnx.state(model, nnx.Param)))
  assert graph.totals()["param_bytes"] == 4 * sum(
    x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param))
  )


def test_layer_granularity_is_finer(model):
  coarse = graphpipe.capture(xent, model, make_batch(), granularity=1)
  fine = graphpipe.capture(xent, model, make_batch(), granularity="layer")
  assert len(fine) > len(coarse)
  assert any(n.name == "left.0.a" for n in fine.nodes)


def test_costs_are_per_sample_and_match_xla(model):
  batch = make_batch(n=8)
  graph = graphpipe.capture(xent, model, batch, granularity=1)
  _, state = nnx.split(model)
  graphdef = nnx.graphdef(model)
  whole = jax.jit(lambda s, b: xent(nnx.merge(graphdef, s), b)).lower(
    state, batch
  )
  xla_flops = whole.compile().cost_analysis()["flops"]
  ours = sum(n.cost("fwd_flops", 8) for n in graph.nodes)
  assert ours == pytest.approx(xla_flops, rel=0.02)
  block = graph.node_by_name("left.0")
  # Two dense layers 6 -> 12 -> 6: 2 * (6*12 + 12*6) multiply-adds.
  assert block.fwd_flops >= 2 * (6 * 12 + 12 * 6)
  assert block.bwd_flops >= block.fwd_flops
  assert block.activation_bytes == 6 * 4
  assert block.saved_bytes >= 6 * 4  # at least its input
  assert graph.edge(block.id, graph.node_by_name("left.1").id).bytes == 24


def test_a_model_captured_again_compiles_nothing(model, monkeypatch):
  from graphpipe.frontend import node_costs

  batch = make_batch(n=8)
  first = graphpipe.capture(xent, model, batch, granularity=1)

  def compiles(*_):
    raise AssertionError("measured again")

  monkeypatch.setattr(node_costs, "node_figures", compiles)
  again = graphpipe.capture(xent, model, batch, granularity=1)
  assert again.nodes == first.nodes and again.edges == first.edges
  # Another shape is another program: measured, not looked up.
  with pytest.raises(AssertionError, match="measured again"):
    graphpipe.capture(xent, model, make_batch(n=4), granularity=1)


def test_nnx_and_linen_graphs_have_the_same_shape():
  batch = make_batch()
  nnx_graph = graphpipe.capture(
    xent, TwoBranch(6, 2, nnx.Rngs(0)), batch, granularity=1
  )
  module = LTwoBranch(6, 2)
  variables = module.init(jax.random.key(0), batch["x"])
  linen_graph = graphpipe.capture(
    xent, module, batch, variables=variables, granularity=1
  )
  assert len(linen_graph) == len(nnx_graph)
  shape = lambda g: sorted(
    (len(g.predecessors(i)), len(g.successors(i)), g.nodes[i].param_bytes)
    for i in range(len(g))
  )
  assert shape(linen_graph) == shape(nnx_graph)
  assert linen_graph.totals()["fwd_flops"] == pytest.approx(
    nnx_graph.totals()["fwd_flops"], rel=1e-6
  )
  np.testing.assert_allclose(
    linen_graph.evaluate(variables, batch),
    xent(module.bind(variables), batch),
    rtol=1e-6,
  )
  assert {n.name for n in linen_graph.nodes} >= {"left_0", "right_1", "head"}
  # FrozenDict variables (older flax's init) and plain dicts are one model:
  # a graph captured from either evaluates and trains from both (the
  # frozen one was refused by init, the other by its structure).
  frozen = flax.core.freeze(variables)
  frozen_graph = graphpipe.capture(
    xent, module, batch, variables=frozen, granularity=1
  )
  want = xent(module.bind(variables), batch)
  trainer = graphpipe.Trainer(
    graphpipe.plan(frozen_graph, 1, len(batch["x"])),
    optax.sgd(0.1),
    graph=frozen_graph,
  )
  for given in (variables, frozen):
    np.testing.assert_allclose(frozen_graph.evaluate(given, batch), want, 1e-6)
    np.testing.assert_allclose(linen_graph.evaluate(given, batch), want, 1e-6)
    loss, _ = trainer.loss_and_grads(trainer.init(given), batch)
    assert loss == pytest.approx(float(want), rel=1e-5)


def test_abstract_model_capture_allocates_nothing():
  model = nnx.eval_shape(lambda: TwoBranch(512, 2, nnx.Rngs(0)))
  batch = {
    "x": jax.ShapeDtypeStruct((4, 512), jnp.float32),
    "y": jax.ShapeDtypeStruct((4,), jnp.int32),
  }
  graph = graphpipe.capture(xent, model, batch, granularity=1)
  assert graph.node_by_name("left.0").param_bytes == 4 * (
    512 * 1024 + 1024 + 1024 * 512 + 512
  )


def test_json_round_trip_and_dot(model, tmp_path):
  graph = graphpipe.capture(xent, model, make_batch(), granularity=1)
  path = tmp_path / "g.json"
  graph.save(str(path))
  loaded = OpGraph.load(str(path))
  assert loaded.nodes == graph.nodes
  assert loaded.edges == graph.edges
  assert loaded.loss_nodes == graph.loss_nodes
  assert loaded.inputs == graph.inputs
  with pytest.raises(GraphpipeError, match="no executable program"):
    loaded.evaluate(model, make_batch())
  dot = graph.to_dot()
  assert dot.startswith("digraph") and dot.count("->") == len(graph.edges)
  assert "head" in str(graph)


def test_a_layer_called_twice_is_two_nodes_sharing_its_parameters():
  class Tied(nnx.Module):
    def __init__(self, rngs):
      self.a = nnx.Linear(4, 4, rngs=rngs)
      self.b = nnx.Linear(4, 4, rngs=rngs)
      self.c = nnx.Linear(4, 4, rngs=rngs)

    def __call__(self, x):
      return self.c(self.b(self.a(self.b(x))))

  model = Tied(nnx.Rngs(0))
  batch = {"x": np.ones((2, 4), np.float32)}
  loss = lambda m, b: jnp.mean(m(b["x"]) ** 2)
  graph = graphpipe.capture(loss, model, batch)
  # b is called first and third: two nodes holding it (until 2026-12-03
  # everything between them merged into one node).
  assert [n.name for n in graph.nodes] == ["b", "a", "b#1", "c"]
  assert graph.shared == {"param:b.kernel": 64, "param:b.bias": 16}
  assert graph.shared_readers()["param:b.kernel"] == (0, 2)
  assert graph.totals()["param_bytes"] == 3 * (64 + 16)
  np.testing.assert_allclose(
    graph.evaluate(model, batch), loss(model, batch), rtol=1e-6
  )


def test_summed_losses_become_loss_terms():
  class Tower(nnx.Module):
    def __init__(self, rngs):
      self.lin = nnx.Linear(4, 1, rngs=rngs)

    def __call__(self, x, y):
      return jnp.mean((self.lin(x)[:, 0] - y) ** 2)

  class TwoTower(nnx.Module):
    def __init__(self, rngs):
      self.t0, self.t1 = Tower(rngs), Tower(rngs)

    def __call__(self, b):
      return self.t0(b["x"], b["y0"]) + self.t1(b["x"], b["y1"])

  model = TwoTower(nnx.Rngs(0))
  batch = {
    "x": np.ones((3, 4), np.float32),
    "y0": np.zeros(3, np.float32),
    "y1": np.ones(3, np.float32),
  }
  graph = graphpipe.capture(lambda m, b: m(b), model, batch)
  assert len(graph) == 2 and not graph.edges
  assert graph.loss_nodes == (0, 1)
  np.testing.assert_allclose(
    graph.evaluate(model, batch), model(batch), rtol=1e-6
  )
  # A constant added to the terms was dropped with the summing node (the
  # loss came out 1.0 short; gradients were right).
  plus_one = lambda m, b: m(b) + 1.0
  graph = graphpipe.capture(plus_one, model, batch)
  assert graph.loss_nodes == (0, 1)
  np.testing.assert_allclose(
    graph.evaluate(model, batch), plus_one(model, batch), rtol=1e-6
  )
  trainer = graphpipe.Trainer(
    graphpipe.plan(graph, 2, 3), optax.sgd(0.1), graph=graph
  )
  loss, _ = trainer.loss_and_grads(trainer.init(model), batch)
  assert loss == pytest.approx(float(plus_one(model, batch)), rel=1e-6)


@pytest.mark.parametrize("fail", [False, True])
def test_no_class_stays_patched(fail):
  model = TwoBranch(6, 1, nnx.Rngs(0))
  before = {
    cls: cls.__dict__["__call__"] for cls in (TwoBranch, Block, nnx.Linear)
  }
  batch = make_batch()
  if fail:
    batch = {"x": batch["x"][:, :5], "y": batch["y"]}
    with pytest.raises(CaptureError, match="shapes and dtypes"):
      graphpipe.capture(xent, model, batch)
  else:
    graphpipe.capture(xent, model, batch)
  for cls, call in before.items():
    assert cls.__dict__["__call__"] is call


def test_bad_inputs_raise_package_errors(model):
  batch = make_batch()
  with pytest.raises(CaptureError, match="one floating-point scalar"):
    graphpipe.capture(lambda m, b: m(b["x"]), model, batch)
  with pytest.raises(CaptureError, match="shapes and dtypes"):
    graphpipe.capture(xent, model, {"x": batch["x"][:, :4], "y": batch["y"]})
  with pytest.raises(CaptureError, match="disagree on the batch size"):
    graphpipe.capture(xent, model, {"x": batch["x"], "y": batch["y"][:3]})

  class NoParams(nnx.Module):
    def __call__(self, x):
      return x

  with pytest.raises(CaptureError, match="no trainable parameters"):
    graphpipe.capture(lambda m, b: jnp.mean(m(b["x"])), NoParams(), batch)

  class Flat(nnx.Module):
    def __init__(self):
      self.w = nnx.Param(jnp.ones((6,)))

    def __call__(self, x):
      return x * self.w

  with pytest.raises(GraphCutError, match="single node"):
    graphpipe.capture(lambda m, b: jnp.mean(m(b["x"])), Flat(), batch)
  with pytest.raises(CaptureError, match="granularity"):
    graphpipe.capture(xent, model, batch, granularity=0)
  with pytest.raises(CaptureError, match="linen module needs its variables"):
    graphpipe.capture(xent, LTwoBranch(6, 1), batch)
  assert issubclass(GraphCutError, GraphpipeError)


def test_mutating_loss_is_refused():
  class Counter(nnx.Module):
    def __init__(self, rngs):
      self.lin = nnx.Linear(6, 6, rngs=rngs)
      self.lin2 = nnx.Linear(6, 6, rngs=rngs)
      self.calls = nnx.BatchStat(jnp.zeros(()))

    def __call__(self, x):
      self.calls[...] = self.calls[...] + 1
      return self.lin2(self.lin(x))

  # A variable the loss updates is trained as running values are (one
  # update per micro-batch's forward: `graphpipe.runtime.running`).
  graph = graphpipe.capture(
    lambda m, b: jnp.mean(m(b["x"])), Counter(nnx.Rngs(0)), make_batch()
  )
  assert graph.program.update_keys == ("state:calls",)

  class Drifting(Counter):
    def __call__(self, x):
      self.lin.bias[...] = self.lin.bias[...] + 1
      return self.lin2(self.lin(x))

  with pytest.raises(CaptureError, match="changed the parameter lin.bias"):
    graphpipe.capture(
      lambda m, b: jnp.mean(m(b["x"])), Drifting(nnx.Rngs(0)), make_batch()
    )
