"""Layers split by output features (`capture(..., split_layers=...)`,
`graphpipe.frontend.split`): each part of a layer's product its own node,
planned as branches and trained like the unsplit model."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import graphpipe
from graphpipe.core import runnable
from graphpipe.core.memory import KINDS, plan_memory
from graphpipe.errors import CaptureError, PlanError
from graphpipe.frontend.split import part_sizes
from graphpipe.planning.no_plan import memory_floor

BATCH = 8


class Wide(nnx.Module):
  """An MLP whose middle layer holds most of the weights."""

  def __init__(self, rngs, wide=48):
    self.a = nnx.Linear(6, 16, rngs=rngs)
    self.b = nnx.Linear(16, wide, rngs=rngs)
    self.c = nnx.Linear(wide, 8, rngs=rngs)
    self.d = nnx.Linear(8, 1, rngs=rngs)

  def __call__(self, x):
    x = jax.nn.relu(self.a(x))
    x = jax.nn.tanh(self.b(x))
    return self.d(jax.nn.relu(self.c(x)))


class Conv(nnx.Module):
  def __init__(self, rngs):
    self.stem = nnx.Conv(3, 8, (3, 3), rngs=rngs)
    self.body = nnx.Conv(8, 12, (3, 3), rngs=rngs)
    self.head = nnx.Linear(12, 1, rngs=rngs)

  def __call__(self, x):
    x = jax.nn.relu(self.body(jax.nn.relu(self.stem(x))))
    return self.head(jnp.mean(x, axis=(1, 2)))


def mse(model, batch):
  return jnp.mean((model(batch["x"]) - batch["y"]) ** 2)


def mlp_batch(seed=0, batch=BATCH):
  rng = np.random.default_rng(seed)
  return {
    "x": rng.standard_normal((batch, 6)).astype(np.float32),
    "y": rng.standard_normal((batch, 1)).astype(np.float32),
  }


def image_batch(seed=0):
  rng = np.random.default_rng(seed)
  return {
    "x": rng.standard_normal((BATCH, 6, 6, 3)).astype(np.float32),
    "y": rng.standard_normal((BATCH, 1)).astype(np.float32),
  }


def reference(model, batch, optimizer, steps, loss=mse):
  model = nnx.clone(model)
  opt = nnx.Optimizer(model, optimizer, wrt=nnx.Param)
  losses = []
  for _ in range(steps):
    value, grads = nnx.value_and_grad(loss)(model, batch)
    opt.update(model, grads)
    losses.append(float(value))
  return losses, model


def check_training(model, batch, graph, plan, steps=2, loss=mse):
  assert runnable.refusal(graph, plan) is None
  optimizer = optax.sgd(0.1, momentum=0.9)
  trainer = graphpipe.Trainer(plan, optimizer, graph=graph)
  state = trainer.init(model)
  got = []
  for _ in range(steps):
    state, metrics = trainer.step(state, batch)
    got.append(metrics["loss"])
  want, trained = reference(model, batch, optimizer, steps, loss)
  np.testing.assert_allclose(got, want, rtol=1e-5)
  mine = trainer.update_model(nnx.clone(model), state)
  for (path, a), (_, b) in zip(
    jax.tree_util.tree_leaves_with_path(nnx.state(mine, nnx.Param)),
    jax.tree_util.tree_leaves_with_path(nnx.state(trained, nnx.Param)),
    strict=True,
  ):
    assert a.shape == b.shape  # the unsplit form, written back
    np.testing.assert_allclose(
      np.asarray(a), np.asarray(b), atol=1e-5, err_msg=str(path)
    )


def test_part_sizes_cover_the_axis():
  assert part_sizes(10, 3) == [4, 3, 3]
  assert part_sizes(8, 4) == [2, 2, 2, 2]


def test_a_split_layer_is_one_node_per_part_and_computes_the_same_loss():
  model, batch = Wide(nnx.Rngs(0)), mlp_batch()
  graph = graphpipe.capture(mse, model, batch, split_layers={"b": 3})
  names = [n.name for n in graph.nodes]
  assert names == ["a", "b#0of3", "b#1of3", "b#2of3", "b", "c", "d"]
  parts = [graph.nodes[names.index(f"b#{i}of3")] for i in range(3)]
  # Each part holds its slice of the kernel and reads the layer's input.
  assert [list(p.params) for p in parts] == [
    [f"b.kernel#{i}of3"] for i in range(3)
  ]
  values = graph.program.variable_values(model)
  assert [values[f"param:b.kernel#{i}of3"].shape for i in range(3)] == [
    (16, 16)
  ] * 3
  # The concatenation joins the rest of the layer (its bias, the tanh).
  assert sorted(graph.predecessors(names.index("b"))) == [1, 2, 3]
  assert graph.meta["split_layers"] == {"b.kernel": 3}
  np.testing.assert_allclose(
    float(graph.evaluate(model, batch)), float(mse(model, batch)), rtol=1e-6
  )
  # Parameters back in the user's form.
  joined = graph.program.unflatten_params(values)
  np.testing.assert_array_equal(
    np.asarray(joined["b"]["kernel"][...]), np.asarray(model.b.kernel[...])
  )


@pytest.mark.parametrize("planner", ["graphpipe", "sequential"])
def test_a_split_mlp_trains_exactly(planner):
  model, batch = Wide(nnx.Rngs(1), wide=50), mlp_batch(1)
  graph = graphpipe.capture(mse, model, batch, split_layers={"b": 4, "c": 2})
  plan = graphpipe.tightest_plan(graph, 8, BATCH, planner=planner)
  assert len(plan.stages) >= 3
  check_training(model, batch, graph, plan)


def test_a_split_convolution_trains_exactly():
  model, batch = Conv(nnx.Rngs(2)), image_batch(2)
  graph = graphpipe.capture(mse, model, batch, split_layers={"body": 3})
  names = [n.name for n in graph.nodes]
  assert names[1:4] == [f"body#{i}of3" for i in range(3)]
  np.testing.assert_allclose(
    float(graph.evaluate(model, batch)), float(mse(model, batch)), rtol=1e-5
  )
  plan = graphpipe.tightest_plan(graph, 4, BATCH)
  check_training(model, batch, graph, plan)


class Big(nnx.Module):
  """An MLP whose middle layer is 97% of its parameters."""

  def __init__(self, rngs):
    self.a = nnx.Linear(6, 32, rngs=rngs)
    self.b = nnx.Linear(32, 1024, rngs=rngs)
    self.c = nnx.Linear(1024, 1, rngs=rngs)

  def __call__(self, x):
    return self.c(jax.nn.tanh(self.b(jax.nn.relu(self.a(x)))))


def test_a_layer_larger_than_a_device_plans_once_split():
  """The middle layer alone needs twice the per-device budget (its
  parameters, gradients, optimizer state and working slots: the memory
  rule's floor): unsplit no plan fits; in 4 parts it plans, no device
  holding the whole layer, and trains like the unsplit model."""
  model, batch = Big(nnx.Rngs(3)), mlp_batch(3)
  whole = graphpipe.capture(mse, model, batch)
  floor, heaviest = memory_floor(whole)
  assert heaviest == "b"
  budget = floor / 2
  with pytest.raises(PlanError, match="node 'b' alone"):
    graphpipe.plan(whole, 8, BATCH, memory_bytes=budget)
  split = graphpipe.capture(mse, model, batch, split_layers={"b": 4})
  plan = graphpipe.plan(split, 8, BATCH, memory_bytes=budget)
  layer = [n for n in whole.nodes if n.name == "b"][0]
  assert plan_memory(split, plan).largest_of(KINDS) <= budget
  assert plan_memory(split, plan).largest_of(("parameters",)) < (
    layer.param_bytes / 2
  )
  check_training(model, batch, split, plan)


def test_a_linen_layer_splits_too():
  class Net(nn.Module):
    @nn.compact
    def __call__(self, x):
      x = nn.relu(nn.Dense(12, name="inp")(x))
      x = nn.relu(nn.Dense(20, name="mid")(x))
      return nn.Dense(1, name="out")(x)

  net, batch = Net(), mlp_batch(4)
  variables = net.init(jax.random.key(0), batch["x"])
  loss = lambda m, b: jnp.mean((m(b["x"]) - b["y"]) ** 2)
  graph = graphpipe.capture(
    loss, net, batch, variables=variables, split_layers={"mid.kernel": 2}
  )
  assert "mid#1of2" in [n.name for n in graph.nodes]
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


class Tied(nnx.Module):
  def __init__(self, rngs):
    self.embed = nnx.Embed(10, 8, rngs=rngs)
    self.mid = nnx.Linear(8, 8, rngs=rngs)

  def __call__(self, tokens):
    return self.embed.attend(jax.nn.relu(self.mid(self.embed(tokens))))


@pytest.mark.parametrize(
  "split, message",
  [
    ({"nope": 2}, "neither a parameter nor a module"),
    ({"mid": 1}, "number of parts >= 2"),
    ({"mid": 9}, "only 8 output features"),
    ({"embed": 2}, "split needs one reader"),
    ({"mid.bias": 2}, "not by a matrix product"),
  ],
)
def test_layers_that_cannot_split_are_refused_with_the_reason(split, message):
  batch = {"tokens": np.ones((BATCH, 3), np.int32)}
  loss = lambda m, b: jnp.mean(m(b["tokens"]) ** 2)
  with pytest.raises(CaptureError, match=message):
    graphpipe.capture(loss, Tied(nnx.Rngs(0)), batch, split_layers=split)


def test_a_split_model_checkpoint_restores_into_another_plan(tmp_path):
  model, batch = Wide(nnx.Rngs(5)), mlp_batch(5)
  graph = graphpipe.capture(mse, model, batch, split_layers={"b": 3})
  optimizer = optax.sgd(0.1, momentum=0.9)
  first = graphpipe.Trainer(
    graphpipe.tightest_plan(graph, 8, BATCH), optimizer, graph=graph
  )
  state = first.init(model)
  state, _ = first.step(state, batch)
  first.save(state, tmp_path / "ckpt")
  _, want = first.step(state, mlp_batch(6))
  second = graphpipe.Trainer(
    graphpipe.tightest_plan(graph, 4, BATCH, planner="sequential"),
    optimizer,
    graph=graph,
  )
  _, got = second.step(second.restore(tmp_path / "ckpt"), mlp_batch(6))
  np.testing.assert_allclose(got["loss"], want["loss"], rtol=1e-6)


def test_fastest_split_keeps_the_fastest_combination():
  """`graphpipe.fastest_split` captures each combination of part counts,
  plans each alike and keeps the fastest simulated plan (the same as
  planning each by hand)."""
  from graphpipe import simulate

  model, batch = Big(nnx.Rngs(6)), mlp_batch(6)

  def capture_with(split):
    return graphpipe.capture(mse, model, batch, split_layers=split)

  split, graph, plan, tried = graphpipe.fastest_split(
    capture_with, 8, BATCH, {"b": (1, 2, 4)}
  )
  by_hand = {}
  for parts in (1, 2, 4):
    layers = {"b": parts} if parts > 1 else {}
    g = capture_with(layers)
    by_hand[parts] = simulate(graphpipe.plan(g, 8, BATCH), g).iteration_time_s
  assert [t["iteration_time_s"] for t in tried] == [
    pytest.approx(by_hand[p]) for p in (1, 2, 4)
  ]
  fastest = min(by_hand, key=by_hand.get)
  assert split == ({"b": fastest} if fastest > 1 else {})
  assert simulate(plan, graph).iteration_time_s == pytest.approx(
    by_hand[fastest]
  )
  # Under a budget only split graphs meet, the whole layer has no plan.
  budget = memory_floor(capture_with({}))[0] / 2
  split, _, _, tried = graphpipe.fastest_split(
    capture_with, 8, BATCH, {"b": (1, 4)}, memory_bytes=budget
  )
  assert split == {"b": 4} and "error" in tried[0]
  with pytest.raises(PlanError, match="part counts >= 1"):
    graphpipe.fastest_split(capture_with, 8, BATCH, {"b": (0, 2)})
