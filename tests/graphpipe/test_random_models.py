"""Random models, captured, pipelined on 8 devices and trained exactly.

Each model of `random_models` (DAGs of chains, fan-out, joins, skips, crossings,
several inputs and loss heads; layers heavy in parameters next to layers heavy
in activations) is captured, planned under the tightest memory that fits on 8
devices (`graphpipe.tightest_plan`, so it really pipelines), trained 2 steps by
`graphpipe.Trainer`, and its losses and weights are compared with plain
single-device optax training: equal within 1e-5 (relative, see
docs/guide/training.md "Exactness"). The planners take turns across the models
(each runs at least two); a few models are linen modules.

The NNX models carry quirks (`random_models`): code that refuses odd batch
sizes, values laid out time-major between layers, losses exact only on the
whole batch. The planners must return only plans the trainer runs
(`graphpipe.core.runnable`): every plan here is trained, none refused.

Every second round of the planners (NNX models 4-7, 12-15, ...) plans
with ZeRO-1 stages allowed, under twice the tightest memory (room for
data-parallel stages, which then shard their optimizer state), instead of
the tightest plan. Every third NNX model (1, 4, 7, ...) is captured with
its widest parameter-heavy layer split into parts by output features
(`capture`'s split_layers, `random_models.draw_split`).

GRAPHPIPE_RANDOM_MODELS=N runs N models (default 10), N // 5 of them linen.
"""

import os

import jax
import numpy as np
import optax
import pytest
from flax import nnx

import graphpipe
from graphpipe.core.memory import SHAPE_KINDS, plan_memory
from tests.graphpipe import random_models as rm
from tests.graphpipe import runtime_cases as rc

NUM_MODELS = int(os.environ.get("GRAPHPIPE_RANDOM_MODELS", "10"))
NUM_LINEN = max(1, NUM_MODELS // 5)
BATCH = 8
STEPS = 2
OPTIMIZER = optax.sgd(0.1, momentum=0.9)


def _plain_training(loss, params, batches):
  """Losses and parameters after plain optax steps of `loss(params, b)`."""
  opt_state = OPTIMIZER.init(params)

  @jax.jit
  def step(params, opt_state, batch):
    value, grads = jax.value_and_grad(loss)(params, batch)
    updates, opt_state = OPTIMIZER.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, value

  losses = []
  for batch in batches:
    params, opt_state, value = step(params, opt_state, batch)
    losses.append(float(value))
  return losses, params


def _pipelined(graph, planner, variables, batches, sharded=False):
  graph = rm.with_shape_costs(graph)
  plan = graphpipe.tightest_plan(graph, 8, BATCH, planner, rc.SLOW)
  if sharded:
    room = 2 * plan_memory(graph, plan).largest_of(SHAPE_KINDS)
    plan = graphpipe.plan(
      graph,
      8,
      BATCH,
      planner,
      rc.SLOW,
      memory_bytes=room,
      memory_kinds=SHAPE_KINDS,
      stage_shardings=("replicated", "zero1"),
    )
    assert all(
      s.sharding == ("zero1" if len(s.devices) > 1 else "replicated")
      for s in plan.stages
    )
  graphpipe.check_plan(plan, graph, float("inf"))
  trainer = graphpipe.Trainer(plan, OPTIMIZER, graph=graph)
  state = trainer.init(variables)
  losses = []
  for batch in batches:
    state, metrics = trainer.step(state, batch)
    losses.append(metrics["loss"])
  return plan, losses, trainer.params(state)


def _check(plan, graph, got, want, tightest=True):
  (got_losses, got_params), (want_losses, want_params) = got, want
  np.testing.assert_allclose(got_losses, want_losses, rtol=1e-5)
  assert rc.max_rel_error(got_params, want_params) < 1e-5
  # Tightest memory: more than one stage wherever two nodes hold weights.
  weighted = sum(1 for v in graph.nodes if v.param_bytes)
  assert not tightest or plan.num_stages > 1 or weighted < 2, plan


def _param_values(graph, variables):
  values = graph.program.variable_values(variables)
  return {k: v for k, v in values.items() if k.startswith("param:")}


@pytest.mark.parametrize("seed", range(NUM_MODELS - NUM_LINEN))
def test_random_nnx_model_trains_exactly(seed):
  planner = graphpipe.PLANNERS[seed % len(graphpipe.PLANNERS)]
  model = rm.build(seed, quirks=True)
  spec = model.spec
  batches = [rm.make_batch(spec, BATCH, seed=s) for s in range(STEPS)]
  split = rm.draw_split(spec, seed)
  graph = graphpipe.capture(
    rm.loss_fn,
    model,
    batches[0],
    granularity=2,
    costs=False,
    split_layers=split,
  )
  assert len(graph.nodes) >= len(spec.reads)  # a node per layer at least
  if split:  # one node per part, named after the layer
    ((layer, parts),) = split.items()
    names = [n.name for n in graph.nodes]
    for k in range(parts):
      assert any(
        n.startswith(layer.rsplit(".", 1)[0]) and n.endswith(f"#{k}of{parts}")
        for n in names
      ), names
  # Every planner in turn, then every planner again with ZeRO-1 stages.
  sharded = (seed // len(graphpipe.PLANNERS)) % 2 == 1
  plan, losses, params = _pipelined(graph, planner, model, batches, sharded)
  graphdef, start, rest = nnx.split(model, nnx.Param, ...)
  want_losses, trained = _plain_training(
    lambda p, b: rm.loss_fn(nnx.merge(graphdef, p, rest), b), start, batches
  )
  want = _param_values(graph, nnx.merge(graphdef, trained, rest))
  _check(plan, graph, (losses, params), (want_losses, want), not sharded)


@pytest.mark.parametrize("seed", range(100, 100 + NUM_LINEN))
def test_random_linen_model_trains_exactly(seed):
  planner = graphpipe.PLANNERS[seed % len(graphpipe.PLANNERS)]
  module, variables = rm.build_linen(seed)
  batches = [rm.make_batch(module.spec, BATCH, seed=s) for s in range(STEPS)]
  graph = graphpipe.capture(
    rm.loss_fn,
    module,
    batches[0],
    variables=variables,
    granularity=1,
    costs=False,
  )
  assert len(graph.nodes) >= len(module.spec.reads)
  plan, losses, params = _pipelined(graph, planner, variables, batches)
  want_losses, trained = _plain_training(
    lambda p, b: rm.loss_fn(module.bind({"params": p}), b),
    variables["params"],
    batches,
  )
  want = _param_values(graph, {"params": trained})
  _check(plan, graph, (losses, params), (want_losses, want))
