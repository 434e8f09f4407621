"""Capture: grouping, exact node-by-node evaluation, costs, bad input."""

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
from graphpipe.core.stages import Plan, Stage, in_flight_counts
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


def test_shared_parameter_merges_its_users():
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
  # b is called first and third: everything between them is one node.
  assert [sorted(n.params) for n in graph.nodes] == [
    ["a.bias", "a.kernel", "b.bias", "b.kernel"],
    ["c.bias", "c.kernel"],
  ]
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

  with pytest.raises(CaptureError, match="changed the model's variables"):
    graphpipe.capture(
      lambda m, b: jnp.mean(m(b["x"])), Counter(nnx.Rngs(0)), make_batch()
    )


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
  # model. A variable that does change under nnx.jit is still refused.
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
  with pytest.raises(CaptureError, match="changed the model's variables"):
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
