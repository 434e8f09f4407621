"""Runtime options no zoo model exercises: recompute, summed losses,
non-trainable variables, the schedule= and mesh= arguments, and a
data-parallel stage whose replicas stay bit-identical."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import Mesh

import graphpipe
from graphpipe.errors import GraphpipeError
from tests.graphpipe import runtime_cases as rc

BATCH = 8


class Shifted(nnx.Module):
  """A Linear plus a fixed random offset (a non-trainable variable)."""

  def __init__(self, fan_in, width, rngs):
    self.linear = nnx.Linear(fan_in, width, rngs=rngs)
    self.offset = nnx.Variable(jax.random.normal(rngs.params(), (width,)))

  def __call__(self, x):
    return jnp.tanh(self.linear(x) + self.offset[...])


class Branchy(nnx.Module):
  """x -> two branches -> join -> head."""

  def __init__(self, rngs):
    self.left, self.right = Shifted(6, 8, rngs), Shifted(6, 4, rngs)
    self.join = Shifted(12, 4, rngs)
    self.head = nnx.Linear(4, 1, rngs=rngs)

  def __call__(self, x):
    return self.head(
      self.join(jnp.concatenate([self.left(x), self.right(x)], -1))
    )


def mean_loss(model, batch):
  return jnp.mean((model(batch["x"])[:, 0] - batch["y"]) ** 2)


def sum_loss(model, batch):
  return jnp.sum((model(batch["x"])[:, 0] - batch["y"]) ** 2)


def batch_of(seed):
  rng = np.random.default_rng(seed)
  return {
    "x": rng.standard_normal((BATCH, 6), np.float32),
    "y": rng.standard_normal((BATCH,), np.float32),
  }


def manual_plan(graph, groups, micro_batch=2):
  """Stages of `groups` (node lists, device lists), 1F1B."""
  return rc.manual_plan(graph, groups, micro_batch, BATCH)


def reference(model, loss_fn, batch, graph):
  graphdef, params, rest = nnx.split(model, nnx.Param, ...)
  loss, grads = jax.value_and_grad(
    lambda p: loss_fn(nnx.merge(graphdef, p, rest), batch)
  )(params)
  values = graph.program.variable_values(nnx.merge(graphdef, grads, rest))
  return float(loss), {
    k: v for k, v in values.items() if k.startswith("param:")
  }


def max_rel(got, want):
  assert sorted(got) == sorted(want)
  return max(
    float(np.max(np.abs(np.asarray(got[k]) - np.asarray(want[k]))))
    / (float(np.max(np.abs(np.asarray(want[k])))) + 1e-12)
    for k in want
  )


@pytest.fixture(scope="module")
def setup():
  model = Branchy(nnx.Rngs(0))
  graph = graphpipe.capture(mean_loss, model, batch_of(0), granularity=1)
  names = [v.name for v in graph.nodes]
  assert names[:3] == ["left", "right", "join"], names
  assert sum(v.state_bytes for v in graph.nodes) > 0  # the offsets
  # left | right | join + head: the branches side by side.
  plan = manual_plan(graph, [([0], [0]), ([1], [1]), ([2, 3], [2])])
  return model, graph, plan


def check_exact(trainer, model, loss_fn, graph, seed=0):
  batch = batch_of(seed)
  loss, grads = trainer.loss_and_grads(trainer.init(model), batch)
  want_loss, want = reference(model, loss_fn, batch, graph)
  assert loss == pytest.approx(want_loss, rel=1e-5)
  assert max_rel(grads, want) < 1e-5


def test_recompute_is_exact_and_stashes_less(setup):
  model, graph, plan = setup
  sgd = optax.sgd(0.1)
  recompute = graphpipe.Trainer(plan, sgd, graph=graph, recompute=True)
  stash = graphpipe.Trainer(plan, sgd, graph=graph).buffers.stash_bytes()
  assert recompute.buffers.stash_bytes() < stash
  check_exact(recompute, model, mean_loss, graph)


def test_summed_losses_and_penalties_train_exactly(setup):
  """A sum over samples, and a weight penalty beside it, need nothing
  declared: until 2026-12-03 a summed loss needed loss_reduction='sum',
  with which a penalty counted once per micro-batch (refused then);
  `graphpipe.frontend.loss_form` reads both from the program."""
  model, _, _ = setup
  penalised = lambda m, b: (
    sum_loss(m, b) + 0.1 * jnp.sum(m.head.kernel[...] ** 2)
  )
  for loss in (sum_loss, penalised):
    graph = graphpipe.capture(loss, model, batch_of(0), granularity=1)
    plan = manual_plan(graph, [([0], [0]), ([1], [1]), ([2, 3], [2])])
    check_exact(
      graphpipe.Trainer(plan, optax.sgd(0.1), graph=graph), model, loss, graph
    )

  # A bfloat16 model's per-sample sum trains too.
  class Low(nnx.Module):
    def __init__(self, rngs):
      kw = dict(dtype=jnp.bfloat16, param_dtype=jnp.bfloat16, rngs=rngs)
      self.a, self.b = nnx.Linear(6, 8, **kw), nnx.Linear(8, 8, **kw)
      self.c = nnx.Linear(8, 1, **kw)

    def __call__(self, x):
      return self.c(jnp.tanh(self.b(jnp.tanh(self.a(x)))))

  low = Low(nnx.Rngs(0))
  low_batch = jax.tree.map(lambda x: x.astype(jnp.bfloat16), batch_of(0))
  graph = graphpipe.capture(sum_loss, low, low_batch)
  trainer = graphpipe.Trainer(
    manual_plan(graph, [([0], [0]), ([1], [1]), ([2], [2])]),
    optax.sgd(0.1),
    graph=graph,
  )
  loss, _ = trainer.loss_and_grads(trainer.init(low), low_batch)
  assert loss == pytest.approx(float(sum_loss(low, low_batch)), rel=2e-2)


def test_optimizers_that_are_not_elementwise_are_refused(setup):
  """optax runs on each stage's flat slots: global-norm clipping saw one
  stage's norm (2 steps: half of the update off), a weight decay masked by
  ndim decayed nothing, lamb's trust ratios were per slot, silently
  (found by probing on 2026-12-03). Refused; elementwise ones train."""
  model, graph, plan = setup
  refused = (
    optax.chain(optax.clip_by_global_norm(0.05), optax.sgd(0.1)),
    optax.adamw(
      1e-2,
      weight_decay=0.1,
      mask=lambda p: jax.tree.map(lambda x: x.ndim > 1, p),
    ),
    optax.lamb(1e-3),
  )
  for optimizer in refused:
    with pytest.raises(GraphpipeError, match="flat parameter slots"):
      graphpipe.Trainer(plan, optimizer, graph=graph)
  for optimizer in (
    optax.chain(optax.clip(0.05), optax.adamw(1e-2, weight_decay=0.1)),
    optax.MultiSteps(optax.lion(1e-4), 2),
  ):
    graphpipe.Trainer(plan, optimizer, graph=graph)


def test_non_trainable_variables_are_read_and_kept(setup):
  model, graph, plan = setup
  trainer = graphpipe.Trainer(plan, optax.sgd(0.1), graph=graph)
  state = trainer.init(model)
  before = [np.asarray(x) for x in state.state]
  assert sum(x.size for x in before) >= 8 + 4 + 4  # every offset is held
  state, _ = trainer.step(state, batch_of(0))
  for a, b in zip(before, state.state, strict=True):
    np.testing.assert_array_equal(a, np.asarray(b))
  # The offsets enter the loss: a zero offset would give another loss.
  check_exact(trainer, model, mean_loss, graph, seed=1)


def test_schedule_and_mesh_arguments(setup):
  model, graph, plan = setup
  gpipe = graphpipe.schedule_for(plan, "gpipe")
  given = graphpipe.Trainer(plan, optax.sgd(0.1), graph=graph, schedule=gpipe)
  assert given.schedule is gpipe
  by_name = graphpipe.Trainer(
    plan, optax.sgd(0.1), graph=graph, schedule="gpipe"
  )
  assert by_name.schedule.kind == "gpipe" and by_name.schedule == gpipe
  assert (
    by_name.buffers.stash_bytes()
    > graphpipe.Trainer(plan, optax.sgd(0.1), graph=graph).buffers.stash_bytes()
  )
  # The last three devices, backwards: stage 0 runs on device 7.
  devices = jax.devices()[::-1][:3]
  trainer = graphpipe.Trainer(
    plan,
    optax.sgd(0.1),
    Mesh(np.asarray(devices), ("pipe",)),
    graph=graph,
    schedule="gpipe",
  )
  state = trainer.init(model)
  assert list(state.params[0].sharding.mesh.devices) == devices
  check_exact(trainer, model, mean_loss, graph)


def test_data_parallel_stage_replicas_stay_bit_identical(setup):
  model, graph, _ = setup
  # The branches on two devices each, the join and head on two more.
  plan = manual_plan(
    graph, [([0], [0, 1]), ([1], [2, 3]), ([2, 3], [4, 5])], micro_batch=4
  )
  assert all(len(s.devices) == 2 for s in plan.stages)
  trainer = graphpipe.Trainer(plan, optax.adam(1e-2), graph=graph)
  check_exact(trainer, model, mean_loss, graph)
  state = trainer.init(model)
  for step in range(3):
    state, _ = trainer.step(state, batch_of(step))
  rows = [
    np.asarray(x) for x in jax.tree.leaves((state.params, state.opt_state))
  ]
  for s in plan.stages:
    first, second = s.devices
    for x in rows:
      if x.ndim and x.shape[0] == plan.num_devices:
        np.testing.assert_array_equal(x[first], x[second])


class WithSpareHead(nnx.Module):
  """Two layers the loss reads and one it never does (a spare head)."""

  def __init__(self):
    self.a = nnx.Linear(4, 8, rngs=nnx.Rngs(0))
    self.b = nnx.Linear(8, 1, rngs=nnx.Rngs(1))
    self.spare = nnx.Linear(3, 3, rngs=nnx.Rngs(2))

  def __call__(self, x):
    return self.b(nnx.relu(self.a(x)))


def test_parameters_the_loss_never_reads_keep_their_values():
  # update_model raised a KeyError for them ('param:spare.bias').
  batch = {"x": np.ones((BATCH, 4), np.float32)}
  batch["y"] = np.zeros((BATCH, 1), np.float32)
  model = WithSpareHead()

  def loss(m, b):
    return jnp.mean((m(b["x"]) - b["y"]) ** 2)

  graph = graphpipe.capture(loss, model, batch)
  plan = graphpipe.tightest_plan(graph, 2, BATCH)
  trainer = graphpipe.Trainer(plan, optax.sgd(0.1), graph=graph)
  spare = np.asarray(model.spare.kernel[...])
  before = np.asarray(model.a.kernel[...])
  state, _ = trainer.step(trainer.init(model), batch)
  trainer.update_model(model, state)
  assert not np.array_equal(np.asarray(model.a.kernel[...]), before)
  np.testing.assert_array_equal(np.asarray(model.spare.kernel[...]), spare)
  with pytest.raises(graphpipe.PipelineRuntimeError, match="never reads"):
    trainer.variables(state)
  with pytest.raises(graphpipe.PipelineRuntimeError, match="takes the NNX"):
    trainer.update_model({"params": {}}, state)


class Offsets(nnx.Variable):
  """A non-trainable integer table (e.g. hashed ids)."""


class IndexedByState(nnx.Module):
  """Reads a feature chosen by integer arithmetic on a large int32 state."""

  def __init__(self, offset):
    self.a = nnx.Linear(4, 8, rngs=nnx.Rngs(0))
    self.b = nnx.Linear(8, 1, rngs=nnx.Rngs(1))
    self.offset = Offsets(jnp.array([offset], jnp.int32))

  def __call__(self, x, i):
    h = nnx.relu(self.a(x))
    pick = (i + self.offset[...][0]) % 7
    return self.b(h) + jnp.take_along_axis(h, pick[:, None], 1)


@pytest.mark.parametrize("offset", [3, 2**24 + 1, 2**30 + 3])
def test_integer_state_beyond_float32_is_exact(offset):
  # Non-trainable int32 variables sat in float32 slots by value: above
  # 2^24 they were rounded (loss 2.91 against 1.95, no error).
  rng = np.random.RandomState(0)
  batch = {
    "x": rng.randn(BATCH, 4).astype(np.float32),
    "i": rng.randint(0, 3, (BATCH,)).astype(np.int32),
    "y": np.ones((BATCH, 1), np.float32),
  }

  def loss(m, b):
    return jnp.mean((m(b["x"], b["i"]) - b["y"]) ** 2)

  model = IndexedByState(offset)
  graph = graphpipe.capture(loss, model, batch)
  plan = graphpipe.tightest_plan(graph, 2, BATCH)
  trainer = graphpipe.Trainer(plan, optax.sgd(0.1), graph=graph)
  got, _ = trainer.loss_and_grads(trainer.init(model), batch)
  assert got == pytest.approx(float(loss(model, batch)), rel=1e-6)


def test_an_auxiliary_loss_a_layer_returns_trains_exactly():
  # An auxiliary loss a layer returns as a scalar (a mixture-of-experts
  # balance term) was a scalar crossing stages, refused until 2026-12-03:
  # it is a sum over the batch of the layer's node now, its mean taken by
  # the loss's head.
  class Gate(nnx.Module):
    def __init__(self, rngs):
      self.lin = nnx.Linear(6, 6, rngs=rngs)

    def __call__(self, x):
      h = jnp.tanh(self.lin(x))
      return h, jnp.mean(h**2)

  class Net(nnx.Module):
    def __init__(self, rngs):
      self.gate = Gate(rngs)
      self.mid = nnx.Linear(6, 6, rngs=rngs)
      self.head = nnx.Linear(6, 1, rngs=rngs)

    def __call__(self, x):
      h, aux = self.gate(x)
      return self.head(jnp.tanh(self.mid(h))), aux

  def loss(m, b):
    y, aux = m(b["x"])
    return jnp.mean((y[:, 0] - b["y"]) ** 2) + 0.01 * aux

  model = Net(nnx.Rngs(0))
  graph = graphpipe.capture(loss, model, batch_of(0))
  assert len(graph.loss_nodes) == 2  # the gate adds its part of a sum
  plan = manual_plan(
    graph, [([0], [0]), (list(range(1, len(graph.nodes))), [1])]
  )
  check_exact(
    graphpipe.Trainer(plan, optax.sgd(0.1), graph=graph), model, loss, graph
  )
