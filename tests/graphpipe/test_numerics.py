"""Numerics under stress: bf16, mixed precision, int32 on the wire, NaN.

bf16 is exact against plain JAX in bf16 computing the same micro-batches
(docs/guide/training.md, "Exactness"): the loss within 1e-6, mixed-precision
gradients (float32 weights, bf16 compute) equal, bf16-weight gradients within
one bf16 rounding (2^-8 of the largest element), since the runtime scales the
loss cotangent by chunk / batch before the bf16 backward where the reference
scales the finished gradient. Both need XLA to round every bf16 operation
(`--xla_allow_excess_precision=false`, set by the root conftest).
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import graphpipe
from graphpipe.core.stages import Plan, Stage, in_flight_counts
from graphpipe.errors import PipelineRuntimeError
from tests.graphpipe import random_models as rm
from tests.graphpipe import runtime_cases as rc

BATCH = 8
# A fan-out and a join, two loss heads: values of every kind cross stages.
SPEC = rm.Spec(
  reads=((), (0,), (0,), (1, 2), (3,)),
  kinds=("params", "activations", "params", "params", "params"),
  widths=(16, 16, 8, 8, 4),
  in_features=6,
)


def params_of(graph, tree):
  values = graph.program.variable_values(tree)
  return {
    k: np.asarray(v, np.float32)
    for k, v in values.items()
    if k.startswith("param:")
  }


def micro_batched_reference(model, batch, b):
  """Loss and gradients of plain JAX over micro-batches of b, summed in
  float32 with weights b / B (gradient accumulation)."""
  graphdef, params, rest = nnx.split(model, nnx.Param, ...)
  grad = jax.jit(
    jax.value_and_grad(
      lambda p, mb: rm.loss_fn(nnx.merge(graphdef, p, rest), mb)
    )
  )
  loss, acc = 0.0, None
  for j in range(BATCH // b):
    mb = {k: v[j * b : (j + 1) * b] for k, v in batch.items()}
    value, g = grad(params, mb)
    g = jax.tree.map(lambda x: np.asarray(x, np.float32) * (b / BATCH), g)
    acc = g if acc is None else jax.tree.map(np.add, acc, g)
    loss += float(value) * b / BATCH
  full_loss, full = grad(params, batch)
  return loss, acc, float(full_loss), full, (graphdef, rest)


@pytest.mark.parametrize(
  "param_dtype,grad_tol", [(jnp.float32, 1e-6), (jnp.bfloat16, 2.0**-8)]
)
def test_bf16_runs_exactly_as_plain_jax_in_bf16(param_dtype, grad_tol):
  model = rm.RandomModel(
    SPEC, rngs=nnx.Rngs(0), dtype=jnp.bfloat16, param_dtype=param_dtype
  )
  batch = rm.make_batch(SPEC, BATCH, dtype=jnp.bfloat16)
  graph = rm.with_shape_costs(
    graphpipe.capture(rm.loss_fn, model, batch, granularity=2, costs=False)
  )
  plan = graphpipe.tightest_plan(graph, 4, BATCH, "graphpipe", rc.SLOW)
  assert plan.num_stages > 1
  trainer = graphpipe.Trainer(plan, optax.sgd(0.1), graph=graph)
  # bf16 activations cross stages (widened to float32 on the wire).
  crossing = {v.dtype for e in trainer.layout.edges for v in e.values}
  assert "bfloat16" in crossing
  state = trainer.init(model)
  loss, grads = trainer.loss_and_grads(state, batch)
  assert {str(np.asarray(g).dtype) for g in grads.values()} == {
    jnp.dtype(param_dtype).name
  }
  want_loss, acc, full_loss, full, (graphdef, rest) = micro_batched_reference(
    model, batch, plan.micro_batch_size
  )
  assert loss == pytest.approx(want_loss, rel=1e-6)
  assert loss == pytest.approx(full_loss, rel=1e-6)
  got = {k: np.asarray(v, np.float32) for k, v in grads.items()}
  assert (
    rc.max_rel_error(got, params_of(graph, nnx.merge(graphdef, acc, rest)))
    <= grad_tol
  )
  # Against the whole batch at once: bf16 rounds the batch sum once, the
  # micro-batches once each (a few bf16 roundings apart).
  assert (
    rc.max_rel_error(got, params_of(graph, nnx.merge(graphdef, full, rest)))
    < 2.0**-5
  )
  state, metrics = trainer.step(state, batch)
  assert metrics["finite"]
  trained = trainer.params(state)
  assert {str(np.asarray(v).dtype) for v in trained.values()} == {
    jnp.dtype(param_dtype).name
  }


class Pick(nnx.Module):
  """Outputs an activation and integer indices: int32 above 2^24 (not
  exact in float32: only a bit-cast carries them across a stage
  boundary), or a narrow integer type near its range's end."""

  def __init__(self, rngs, dtype, offset):
    self.linear = nnx.Linear(6, 8, rngs=rngs)
    self.dtype, self.offset = dtype, offset

  def __call__(self, x):
    h = self.linear(x)
    idx = jnp.argmax(h, axis=-1).astype(jnp.int32) + self.offset
    return h, idx.astype(self.dtype)


class Use(nnx.Module):
  def __init__(self, rngs, offset):
    self.linear = nnx.Linear(8, 8, rngs=rngs)
    self.offset = offset

  def __call__(self, h, idx):
    g = self.linear(h)
    index = idx.astype(jnp.int32) - self.offset
    picked = jnp.take_along_axis(g, index[:, None], axis=-1)
    return g * picked


class Indexed(nnx.Module):
  def __init__(self, rngs, dtype=jnp.int32, offset=2**24 + 1):
    self.pick, self.use = Pick(rngs, dtype, offset), Use(rngs, offset)
    self.head = nnx.Linear(8, 1, rngs=rngs)

  def __call__(self, x):
    return self.head(self.use(*self.pick(x)))


def indexed_loss(model, batch):
  return jnp.mean((model(batch["x"])[:, 0] - batch["y"]) ** 2)


@pytest.mark.parametrize(
  "dtype, offset",
  [
    (jnp.int32, 2**24 + 1),
    # Refused before 2026-12-03 ("dtype int8 crosses stages; supported:
    # ..."): narrow integers now travel widened, exact in float32.
    (jnp.int8, 120),
    (jnp.uint8, 248),
    (jnp.int16, -32768),
    (jnp.uint16, 65528),
  ],
)
def test_integer_values_cross_stages_bit_exact(dtype, offset):
  model = Indexed(nnx.Rngs(3), dtype, offset)
  rng = np.random.default_rng(0)
  batch = {
    "x": rng.standard_normal((BATCH, 6), np.float32),
    "y": rng.standard_normal((BATCH,), np.float32),
  }
  graph = graphpipe.capture(indexed_loss, model, batch, granularity=1)
  assert [v.name for v in graph.nodes][:2] == ["pick", "use"]
  # One node per stage, so the indices cross a stage boundary.
  n = len(graph.nodes)
  edges = tuple(sorted({(e.src, e.dst) for e in graph.edges}))
  flight = in_flight_counts(n, edges)
  stages = tuple(Stage(i, (i,), (i,), 2, flight[i]) for i in range(n))
  plan = Plan("manual", stages, edges, BATCH, n)
  trainer = graphpipe.Trainer(plan, optax.sgd(0.1), graph=graph)
  crossing = {v.dtype for e in trainer.layout.edges for v in e.values}
  assert jnp.dtype(dtype).name in crossing
  loss, grads = trainer.loss_and_grads(trainer.init(model), batch)
  graphdef, params, rest = nnx.split(model, nnx.Param, ...)
  want_loss, want = jax.value_and_grad(
    lambda p: indexed_loss(nnx.merge(graphdef, p, rest), batch)
  )(params)
  assert loss == pytest.approx(float(want_loss), rel=1e-6)
  want = params_of(graph, nnx.merge(graphdef, want, rest))
  assert rc.max_rel_error(grads, want) < 1e-5


def test_a_nan_loss_mid_run_skips_the_step_and_is_reported():
  plan = rc.pipeline_plan("two_branch", 4, "graphpipe")
  graph = rc.tiny_graph("two_branch")
  model, batch = rc.model_and_batch("two_branch")
  trainer = graphpipe.Trainer(plan, optax.adam(1e-2), graph=graph)
  state, metrics = trainer.step(trainer.init(model), batch)
  assert metrics["finite"]
  before = jax.tree.map(np.asarray, state)
  nan_batch = {k: np.array(v) for k, v in batch.items()}
  nan_batch["modality_0"][3, 2] = np.nan  # one element of one sample
  state, metrics = trainer.step(state, nan_batch)
  assert not metrics["finite"] and np.isnan(metrics["loss"])
  after = jax.tree.map(np.asarray, state)
  # Skipped: parameters, optimizer state and step count unchanged.
  for a, b in zip(jax.tree.leaves(before), jax.tree.leaves(after), strict=True):
    np.testing.assert_array_equal(a, b)
  # Training goes on from the unchanged state.
  state, metrics = trainer.step(state, rc.model_and_batch("two_branch", 1)[1])
  assert metrics["finite"] and int(np.asarray(state.step)) == 2
  good = jax.tree.map(np.asarray, state)
  # stop_on_nan is checked on the host after the step: the same compiled
  # step serves.
  trainer.stop_on_nan = True
  with pytest.raises(
    PipelineRuntimeError, match="loss is nan at step 2"
  ) as err:
    trainer.step(state, nan_batch)
  kept = jax.tree.map(np.asarray, err.value.state)
  assert int(kept.step) == 2
  for a, b in zip(jax.tree.leaves(kept), jax.tree.leaves(good), strict=True):
    np.testing.assert_array_equal(a, b)
