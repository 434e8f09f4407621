"""Plans and references shared by the runtime tests."""

import dataclasses
import functools

import jax
import numpy as np
import optax
import pytest
from flax import nnx

from graphpipe import models, plan, tightest_plan
from graphpipe.core.memory import SHAPE_KINDS, plan_memory
from graphpipe.core.stages import Plan, Stage, in_flight_counts
from graphpipe.costs import device_spec
from graphpipe.models import capture_zoo

BATCH = 16

# Compute-bound devices with free links: the planners then split and
# replicate stages as far as memory forces them to.
SLOW = dataclasses.replace(
  device_spec("v100"),
  name="slow-compute",
  peak_flops={"float32": 1e8},
  memory_bandwidth=1e13,
  intra_node_bandwidth=1e13,
  inter_node_bandwidth=1e13,
  intra_node_latency=0.0,
  inter_node_latency=0.0,
  half_efficiency_elements=1.0,
  devices_per_node=8,
)


@functools.cache
def tiny_graph(name):
  return capture_zoo(name, "tiny", batch_size=4)


def pipeline_plan(name, num_devices, planner, room=1):
  """The planner's plan for a tiny model under `room` times the tightest
  memory (`tightest_plan`: deep pipelines, one device a stage where the
  model's shape needs them all); room 2 leaves space for data-parallel
  stages. Memoised for the session (one key however `room` is passed)."""
  return _pipeline_plan(name, num_devices, planner, room)


@functools.cache
def _pipeline_plan(name, num_devices, planner, room):
  graph = tiny_graph(name)
  if room == 1:
    return tightest_plan(graph, num_devices, BATCH, planner, SLOW)
  tightest = pipeline_plan(name, num_devices, planner)  # memoised
  return plan(
    graph,
    num_devices,
    BATCH,
    planner=planner,
    device=SLOW,
    memory_bytes=room * plan_memory(graph, tightest).largest_of(SHAPE_KINDS),
    memory_kinds=SHAPE_KINDS,
  )


def model_and_batch(name, seed=0):
  spec = models.get(name)
  cfg = models.config(name, "tiny")
  return models.build(name, cfg, seed=1), spec.make_batch(cfg, BATCH, seed=seed)


def reference_loss_and_grads(name, model, batch):
  spec = models.get(name)
  graphdef, params, rest = nnx.split(model, nnx.Param, ...)
  loss, grads = jax.value_and_grad(
    lambda p: spec.loss_fn(nnx.merge(graphdef, p, rest), batch)
  )(params)
  values = tiny_graph(name).program.variable_values(
    nnx.merge(graphdef, grads, rest)
  )
  return float(loss), {
    k: v for k, v in values.items() if k.startswith("param:")
  }


def reference_training(name, model, batches, optimizer):
  """Parameters after plain single-device optax steps, by 'param:' key."""
  spec = models.get(name)
  graphdef, params, rest = nnx.split(model, nnx.Param, ...)
  opt_state = optimizer.init(params)
  losses = []

  @jax.jit
  def step(params, opt_state, batch):
    loss, grads = jax.value_and_grad(
      lambda p: spec.loss_fn(nnx.merge(graphdef, p, rest), batch)
    )(params)
    updates, opt_state = optimizer.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss

  for batch in batches:
    params, opt_state, loss = step(params, opt_state, batch)
    losses.append(float(loss))
  values = tiny_graph(name).program.variable_values(
    nnx.merge(graphdef, params, rest)
  )
  return losses, {k: v for k, v in values.items() if k.startswith("param:")}


def max_rel_error(got: dict, want: dict) -> float:
  assert sorted(got) == sorted(want)
  return max(
    float(np.max(np.abs(np.asarray(got[k]) - np.asarray(want[k]))))
    / (float(np.max(np.abs(np.asarray(want[k])))) + 1e-12)
    for k in want
  )


def assert_trains_exactly(name, trainer, model, batches, optimizer):
  """The pipelined loss and gradients on `batches[0]`, then one step per
  batch, equal plain JAX's (`reference_loss_and_grads`,
  `reference_training`) within 1e-5.

  Returns:
    (the trained state, plain JAX's parameters after the same steps).
  """
  state = trainer.init(model)
  loss, grads = trainer.loss_and_grads(state, batches[0])
  want_loss, want_grads = reference_loss_and_grads(name, model, batches[0])
  assert loss == pytest.approx(want_loss, rel=1e-5)
  assert max_rel_error(grads, want_grads) < 1e-5
  losses = []
  for b in batches:
    state, metrics = trainer.step(state, b)
    losses.append(metrics["loss"])
  want_losses, want_params = reference_training(name, model, batches, optimizer)
  np.testing.assert_allclose(losses, want_losses, rtol=1e-5)
  assert max_rel_error(trainer.params(state), want_params) < 1e-5
  return state, want_params


def assert_resumes_exactly(trainer, model, folder, name="two_branch"):
  """Four steps of `name`'s batches, saved to `folder` after the second;
  the state restored from it takes the last two with the same losses.

  Returns:
    the four losses.
  """
  state = trainer.init(model)
  losses = []
  for s in range(4):
    state, metrics = trainer.step(state, model_and_batch(name, s)[1])
    losses.append(metrics["loss"])
    if s == 1:
      trainer.save(state, folder)
  resumed = trainer.restore(folder)
  again = []
  for s in range(2, 4):
    resumed, metrics = trainer.step(resumed, model_and_batch(name, s)[1])
    again.append(metrics["loss"])
  assert again == losses[2:]
  return losses


def manual_plan(graph, groups, micro_batch, batch_size):
  """A 1F1B plan of stages given as (node list, device list) pairs, every
  stage taking micro-batches of `micro_batch`."""
  owner = {n: i for i, (nodes, _) in enumerate(groups) for n in nodes}
  edges = tuple(
    sorted(
      {
        (owner[e.src], owner[e.dst])
        for e in graph.edges
        if owner[e.src] != owner[e.dst]
      }
    )
  )
  flight = in_flight_counts(len(groups), edges)
  stages = tuple(
    Stage(i, tuple(nodes), tuple(devices), micro_batch, flight[i])
    for i, (nodes, devices) in enumerate(groups)
  )
  used = sum(len(d) for _, d in groups)
  return Plan("manual", stages, edges, batch_size, used)
