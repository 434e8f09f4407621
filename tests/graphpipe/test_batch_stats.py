"""BatchNorm in training: statistics per micro-batch, running values on.

Semantics as in GPipe and torch pipelines: a layer in training normalises
by the statistics of the chunk a device runs (a micro-batch, or a
replica's rows of it), and its running values are updated by each chunk in
micro-batch order; a data-parallel stage's replicas each fold their own
rows and the step averages them. The reference is plain NNX / linen
running the same chunks in the same order with gradient accumulation.
Until 2026-12-04 such losses were refused at capture ("graphpipe captures
pure losses") and `mutable=['batch_stats']` had no way back.
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
from graphpipe.errors import CaptureError, PipelineRuntimeError
from tests.graphpipe import runtime_cases as rc

BATCH = 16
WEIGHT_DECAY = 1e-3


class ConvBN(nnx.Module):
  def __init__(self, cin, cout, rngs):
    self.conv = nnx.Conv(cin, cout, (3, 3), use_bias=False, rngs=rngs)
    self.bn = nnx.BatchNorm(
      cout, use_running_average=False, momentum=0.9, rngs=rngs
    )

  def __call__(self, x):
    return self.bn(self.conv(x))


class Residual(nnx.Module):
  def __init__(self, width, rngs):
    self.a = ConvBN(width, width, rngs)
    self.b = ConvBN(width, width, rngs)

  def __call__(self, x):
    return jax.nn.relu(x + self.b(jax.nn.relu(self.a(x))))


class ResNet(nnx.Module):
  """A small ResNet in the style of published Flax examples: convolutions
  without bias, each followed by BatchNorm; global pooling; dense head."""

  def __init__(self, rngs, width=4, classes=3):
    self.stem = ConvBN(3, width, rngs)
    self.blocks = nnx.List([Residual(width, rngs) for _ in range(2)])
    self.head = nnx.Linear(width, classes, rngs=rngs)

  def __call__(self, x):
    x = jax.nn.relu(self.stem(x))
    for block in self.blocks:
      x = block(x)
    return self.head(x.mean(axis=(1, 2)))


def resnet_loss(model, batch):
  """Cross-entropy plus an L2 penalty over every parameter, as the
  published ResNet training losses add weight decay."""
  logits = model(batch["image"])
  ce = optax.softmax_cross_entropy_with_integer_labels(logits, batch["label"])
  l2 = sum(jnp.sum(p**2) for p in jax.tree.leaves(nnx.state(model, nnx.Param)))
  return ce.mean() + WEIGHT_DECAY * l2


def images(seed=0):
  rng = np.random.default_rng(seed)
  return {
    "image": rng.standard_normal((BATCH, 6, 6, 3)).astype(np.float32),
    "label": rng.integers(0, 3, BATCH).astype(np.int32),
  }


def nnx_reference(model, loss, batch, micro, replicas, steps, optimizer):
  """Plain NNX: each step runs the chunks of `micro // replicas` samples
  (micro-batch m, replica r: rows m * micro + r * chunk on), gradients
  accumulated with the chunk's share of the batch; each replica folds
  the running values of its chunks in micro-batch order and the step
  averages the replicas'. Returns the losses and the final model."""
  graphdef, params, rest = nnx.split(nnx.clone(model), nnx.Param, ...)
  opt_state = optimizer.init(params)
  chunk = micro // replicas
  fresh = lambda tree: jax.tree.map(jnp.array, tree)
  losses = []
  for _ in range(steps):
    total, grads, folded = 0.0, jax.tree.map(jnp.zeros_like, params), []
    for r in range(replicas):
      mine = rest
      for m in range(BATCH // micro):
        lo = m * micro + r * chunk
        part = jax.tree.map(lambda x, lo=lo: x[lo : lo + chunk], batch)
        net = nnx.merge(graphdef, fresh(params), fresh(mine))
        value, g = nnx.value_and_grad(lambda n, part=part: loss(n, part))(net)
        mine = fresh(nnx.state(net, nnx.Not(nnx.Param)))
        share = chunk / BATCH
        total += share * float(value)
        grads = jax.tree.map(lambda a, b, s=share: a + s * b, grads, g)
      folded.append(mine)
    rest = jax.tree.map(lambda *xs: sum(xs[1:], xs[0]) / len(xs), *folded)
    losses.append(total)
    updates, opt_state = optimizer.update(grads, opt_state, params)
    params = optax.apply_updates(params, updates)
  return losses, nnx.merge(graphdef, params, rest)


def statistics_stages(graph, plan):
  """(micro-batch size, replicas) of the stages holding running values."""
  owner = plan.stage_of_node()
  stages = {owner[n] for n in graph.program.statistic_nodes}
  return {
    (plan.stages[s].micro_batch_size, len(plan.stages[s].devices))
    for s in stages
  }


def check_nnx(model, loss, batch, graph, plan, steps=2):
  optimizer = optax.adam(0.01)
  assert runnable.refusal(graph, plan) is None
  (micro, replicas), *others = sorted(statistics_stages(graph, plan))
  trainer = graphpipe.Trainer(plan, optimizer, graph=graph)
  state = trainer.init(model)
  got_losses = []
  for _ in range(steps):
    state, metrics = trainer.step(state, batch)
    got_losses.append(metrics["loss"])
  want_losses, want_model = nnx_reference(
    model, loss, batch, micro, replicas, steps, optimizer
  )
  np.testing.assert_allclose(got_losses, want_losses, rtol=1e-5)
  trained = trainer.update_model(nnx.clone(model), state)
  got = graph.program.variable_values(trained)
  want = graph.program.variable_values(want_model)
  # Running values of stages of another (micro-batch, replicas) fold: each
  # against the reference of its own stage's.
  owner = plan.stage_of_node()
  by_stage = {}
  for n in graph.program.statistic_nodes:
    s = plan.stages[owner[n]]
    by_stage[graph.nodes[n].state] = (s.micro_batch_size, len(s.devices))
  for keys, shape in by_stage.items():
    if shape != (micro, replicas):
      _, other = nnx_reference(model, loss, batch, *shape, steps, optimizer)
      values = graph.program.variable_values(other)
      want.update({f"state:{k}": values[f"state:{k}"] for k in keys})
  assert set(got) == set(want)
  for k in got:
    np.testing.assert_allclose(
      np.asarray(got[k]), np.asarray(want[k]), atol=1e-5, rtol=1e-5, err_msg=k
    )
  # The running values moved (the model itself was not trained in place).
  before = graph.program.variable_values(model)
  moved = [k for k in graph.program.update_keys if k in got]
  assert moved and all(
    not np.allclose(got[k], before[k]) for k in moved if k.endswith("mean")
  )


@pytest.fixture(scope="module")
def resnet():
  model = ResNet(nnx.Rngs(0))
  graph = graphpipe.capture(resnet_loss, model, images())
  return model, graph


def test_capture_records_the_updates_and_the_statistics(resnet):
  _, graph = resnet
  program = graph.program
  # Every BatchNorm's mean and var, each from the node of its layer.
  assert len(program.update_keys) == 2 * 5
  assert all(k.endswith((".mean", ".var")) for k in program.update_keys)
  assert len(program.statistic_nodes) == 5
  # Normalising by the chunk's statistics keeps the samples apart: the
  # loss is not whole-batch-only, and the L2 penalty is per layer.
  assert graph.whole_batch_only is None
  assert "parameter term" in graph.meta["loss_form"]
  assert len(graph.meta["cut_rules"]["statistics"]) == 4


@pytest.mark.parametrize(
  "split",
  ["whole", "pipeline", "replicated"],
)
def test_resnet_trains_as_plain_nnx_on_the_same_micro_batches(resnet, split):
  model, graph = resnet
  n = len(graph.nodes)
  third = n // 3
  groups = {
    "whole": ([(list(range(n)), [0])], BATCH),
    "pipeline": (
      [
        (list(range(third)), [0]),
        (list(range(third, 2 * third)), [1]),
        (list(range(2 * third, n)), [2]),
      ],
      4,
    ),
    # Chunks of 4 on every stage: the middle one two replicas of 8.
    "replicated": (
      [
        (list(range(third)), [0, 1]),
        (list(range(third, 2 * third)), [2, 3]),
        (list(range(2 * third, n)), [4, 5]),
      ],
      8,
    ),
  }[split]
  plan = rc.manual_plan(graph, groups[0], groups[1], BATCH)
  check_nnx(model, resnet_loss, images(), graph, plan)


@pytest.mark.parametrize("planner", ["graphpipe", "tightest"])
def test_planned_plans_train_exactly(resnet, planner):
  model, graph = resnet
  if planner == "graphpipe":
    plan = graphpipe.plan(graph, num_devices=4, batch_size=BATCH)
  else:
    plan = graphpipe.tightest_plan(graph, num_devices=4, batch_size=BATCH)
    assert len(plan.stages) >= 3
  check_nnx(model, resnet_loss, images(), graph, plan)


def test_stages_of_different_chunk_sizes_are_refused(resnet):
  model, graph = resnet
  n = len(graph.nodes)
  half = n // 2
  # 8 samples a device on one stage, 4 on the other.
  plan = rc.manual_plan(
    graph, [(list(range(half)), [0]), (list(range(half, n)), [1, 2])], 8, BATCH
  )
  assert "batch statistics" in runnable.refusal(graph, plan)
  with pytest.raises(PipelineRuntimeError, match="chunks of different sizes"):
    graphpipe.Trainer(plan, optax.sgd(0.1), graph=graph)


class RunningNorm(nnx.Module):
  """Normalises by the running mean it updates: not trainable by chunks."""

  def __init__(self, rngs):
    self.lin = nnx.Linear(4, 4, rngs=rngs)
    self.out = nnx.Linear(4, 1, rngs=rngs)
    self.mean = nnx.BatchStat(jnp.zeros(4))

  def __call__(self, x):
    h = self.lin(x)
    self.mean.value = 0.9 * self.mean.value + 0.1 * h.mean(0)
    return self.out(h - self.mean.value)


def test_a_loss_reading_the_value_it_updates_is_refused():
  batch = {"x": np.ones((8, 4), np.float32)}
  with pytest.raises(CaptureError, match="reads a state variable it updates"):
    graphpipe.capture(
      lambda m, b: jnp.mean(m(b["x"]) ** 2), RunningNorm(nnx.Rngs(0)), batch
    )


class LinenNet(nn.Module):
  """linen: BatchNorm with `use_running_average=not train`, called with
  `mutable=['batch_stats']` in the published training loops; with
  `axis_name='batch'` syncing statistics across data-parallel replicas,
  as published data-parallel code (ImageNet examples) writes it."""

  widths: tuple[int, ...] = (8, 8)
  axis_name: str | None = None

  @nn.compact
  def __call__(self, x, train: bool):
    for width in self.widths:
      x = nn.Dense(width, use_bias=False)(x)
      x = nn.BatchNorm(
        use_running_average=not train, momentum=0.9, axis_name=self.axis_name
      )(x)
      x = nn.relu(x)
    return nn.Dense(3)(x)


def linen_case(module, seed):
  """(batch, variables, loss) of a LinenNet: 5 features, 3 classes."""
  rng = np.random.default_rng(seed)
  batch = {
    "x": rng.standard_normal((BATCH, 5)).astype(np.float32),
    "y": rng.integers(0, 3, BATCH).astype(np.int32),
  }
  variables = module.init(jax.random.key(0), batch["x"][:2], train=False)

  def loss(bound, b):
    logits = bound(b["x"], train=True)
    return optax.softmax_cross_entropy_with_integer_labels(
      logits, b["y"]
    ).mean()

  return batch, variables, loss


def assert_variables_close(got, want):
  """Every leaf of the variables dict `want` within 1e-5 in `got`."""
  for path, value in jax.tree_util.tree_leaves_with_path(want):
    have = got
    for key in path:
      have = have[key.key]
    np.testing.assert_allclose(
      np.asarray(have), np.asarray(value), atol=1e-5, err_msg=str(path)
    )


def test_linen_batch_stats_train_and_come_back():
  module = LinenNet()
  batch, variables, loss = linen_case(module, 1)
  graph = graphpipe.capture(loss, module, batch, variables=variables)
  assert len(graph.program.update_keys) == 4
  n = len(graph.nodes)
  plan = rc.manual_plan(
    graph, [(list(range(n // 2)), [0]), (list(range(n // 2, n)), [1])], 4, BATCH
  )
  optimizer = optax.sgd(0.1)
  trainer = graphpipe.Trainer(plan, optimizer, graph=graph)
  state = trainer.init(variables)
  for _ in range(2):
    state, _ = trainer.step(state, batch)
  got = trainer.variables(state, variables)

  # The published linen loop, over the same micro-batches in order.
  params, stats = variables["params"], variables["batch_stats"]
  opt_state = optimizer.init(params)
  for _ in range(2):
    grads = jax.tree.map(jnp.zeros_like, params)
    for m in range(BATCH // 4):
      part = jax.tree.map(lambda x, m=m: x[4 * m : 4 * m + 4], batch)

      def f(p, stats=stats, part=part):
        logits, new = module.apply(
          {"params": p, "batch_stats": stats},
          part["x"],
          train=True,
          mutable=["batch_stats"],
        )
        ce = optax.softmax_cross_entropy_with_integer_labels(logits, part["y"])
        return ce.mean(), new["batch_stats"]

      (_, stats), g = jax.value_and_grad(f, has_aux=True)(params)
      grads = jax.tree.map(lambda a, b: a + b / 4, grads, g)
    updates, opt_state = optimizer.update(grads, opt_state, params)
    params = optax.apply_updates(params, updates)
  assert_variables_close(got, {"params": params, "batch_stats": stats})


def test_linen_running_values_are_inputs_not_constants():
  """Until 2026-12-04 capture read a linen module's non-parameter
  variables from the `variables` it was given, as constants: a trainer
  initialised from other batch statistics used the captured ones,
  silently."""
  module = LinenNet()
  x = np.random.default_rng(2).standard_normal((BATCH, 5)).astype(np.float32)
  variables = module.init(jax.random.key(0), x[:2], train=False)

  def loss(bound, b):
    return jnp.mean(bound(b["x"], train=False) ** 2)

  graph = graphpipe.capture(loss, module, {"x": x}, variables=variables)
  assert graph.program.update_keys == ()
  other = jax.tree.map(lambda v: v + 0.5, variables["batch_stats"])
  variables2 = {"params": variables["params"], "batch_stats": other}
  want = float(loss(module.bind(variables2), {"x": x}))
  assert float(graph.evaluate(variables2, {"x": x})) == pytest.approx(want)
  n = len(graph.nodes)
  plan = rc.manual_plan(
    graph, [(list(range(n // 2)), [0]), (list(range(n // 2, n)), [1])], 4, BATCH
  )
  trainer = graphpipe.Trainer(plan, optax.sgd(0.1), graph=graph)
  got, _ = trainer.loss_and_grads(trainer.init(variables2), {"x": x})
  assert got == pytest.approx(want, rel=1e-5)


@pytest.fixture(scope="module")
def synced():
  module = LinenNet(widths=(8, 8, 8), axis_name="batch")
  batch, variables, loss = linen_case(module, 3)
  graph = graphpipe.capture(loss, module, batch, variables=variables)
  return module, batch, variables, graph


def synced_reference(module, batch, variables, micro, steps, optimizer):
  """Plain JAX data parallelism as the model means it: each micro-batch
  split over 2 replicas (shard_map, axis 'batch'), BatchNorm syncing its
  statistics across them (one replica for a micro-batch of 1); gradients
  accumulated in micro-batch order."""
  from jax.sharding import Mesh
  from jax.sharding import PartitionSpec as P

  mesh = Mesh(np.array(jax.devices()[: 2 - micro % 2]), ("batch",))

  def replicas(params, stats, part):
    logits, new = module.apply(
      {"params": params, "batch_stats": stats},
      part["x"],
      train=True,
      mutable=["batch_stats"],
    )
    ce = optax.softmax_cross_entropy_with_integer_labels(logits, part["y"])
    return jax.lax.pmean(ce.mean(), "batch"), new["batch_stats"]

  run = jax.jit(
    jax.value_and_grad(
      jax.shard_map(
        replicas,
        mesh=mesh,
        in_specs=(P(), P(), P("batch")),
        out_specs=(P(), P()),
      ),
      has_aux=True,
    )
  )
  params, stats = variables["params"], variables["batch_stats"]
  opt_state = optimizer.init(params)
  losses = []
  for _ in range(steps):
    grads = jax.tree.map(jnp.zeros_like, params)
    total = 0.0
    for m in range(BATCH // micro):
      part = jax.tree.map(lambda x, m=m: x[m * micro : (m + 1) * micro], batch)
      (value, stats), g = run(params, stats, part)
      share = micro / BATCH
      total += share * float(value)
      grads = jax.tree.map(lambda a, b, s=share: a + s * b, grads, g)
    losses.append(total)
    updates, opt_state = optimizer.update(grads, opt_state, params)
    params = optax.apply_updates(params, updates)
  return losses, {"params": params, "batch_stats": stats}


def _check_synced(module, batch, variables, graph, plan, steps=2):
  assert runnable.refusal(graph, plan) is None
  assert all(len(s.devices) == 1 for s in plan.stages)
  (micro,) = {s.micro_batch_size for s in plan.stages}
  optimizer = optax.adam(0.01)
  trainer = graphpipe.Trainer(plan, optimizer, graph=graph)
  state = trainer.init(variables)
  got_losses = []
  for _ in range(steps):
    state, metrics = trainer.step(state, batch)
    got_losses.append(metrics["loss"])
  got = trainer.variables(state, variables)
  want_losses, want = synced_reference(
    module, batch, variables, micro, steps, optimizer
  )
  np.testing.assert_allclose(got_losses, want_losses, rtol=1e-5)
  assert_variables_close(got, want)


def test_synced_batch_norm_captures_with_its_axis(synced):
  """Until 2026-12-05 BatchNorm(axis_name='batch') was refused at capture
  ("drop axis_name")."""
  _, _, _, graph = synced
  assert graph.collective_axes == ("batch",)
  assert len(graph.program.statistic_nodes) == 3
  # The replicas of a micro-batch are one device: no data-parallel stage.
  assert runnable.replica_counts(graph, 8, 8) == [1]


def test_synced_batch_norm_trains_as_replicas_syncing_statistics(synced):
  module, batch, variables, graph = synced
  n = len(graph.nodes)
  plan = rc.manual_plan(
    graph,
    [(list(range(n // 2)), [0]), (list(range(n // 2, n)), [1])],
    4,
    BATCH,
  )
  _check_synced(module, batch, variables, graph, plan)


@pytest.mark.parametrize("planner", ["graphpipe", "tightest"])
def test_synced_batch_norm_planned_plans_train_exactly(synced, planner):
  module, batch, variables, graph = synced
  if planner == "graphpipe":
    plan = graphpipe.plan(graph, num_devices=4, batch_size=BATCH)
  else:
    plan = graphpipe.tightest_plan(graph, num_devices=4, batch_size=BATCH)
    assert len(plan.stages) >= 3
  _check_synced(module, batch, variables, graph, plan)


def test_synced_batch_norm_refuses_a_data_parallel_stage(synced):
  _, _, _, graph = synced
  n = len(graph.nodes)
  plan = rc.manual_plan(
    graph,
    [(list(range(n // 2)), [0, 1]), (list(range(n // 2, n)), [2, 3])],
    8,
    BATCH,
  )
  assert "collective axis batch" in runnable.refusal(graph, plan)
  with pytest.raises(PipelineRuntimeError, match="collective axis batch"):
    graphpipe.Trainer(plan, optax.sgd(0.1), graph=graph)
