"""`Trainer`: trains a planned model with the pipelined SPMD step."""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from graphpipe.core import runnable
from graphpipe.core.graph import OpGraph
from graphpipe.core.stages import Plan
from graphpipe.errors import PipelineRuntimeError
from graphpipe.runtime import checkpoints, faults, feed, guards, slots
from graphpipe.runtime.layout import build_layout
from graphpipe.runtime.memory import trainer_report
from graphpipe.runtime.step import AXIS, StepBuilder
from graphpipe.runtime.zero import ZeroOne
from graphpipe.schedules.builders import schedule_for
from graphpipe.schedules.checker import built_for, check_schedule


class TrainState(NamedTuple):
  """Per-device training state: row d of each array lives on device d.

  Attributes:
    params: a tuple of [devices, slot size] float32 arrays: each device's
      stage parameters in its slots (`graphpipe.runtime.slots`).
    state: the same for the non-trainable variables.
    opt_state: the optax state of each device's slots ([devices, ...]
      leaves).
    step: number of optimizer steps taken.
  """

  params: jax.Array
  state: jax.Array
  opt_state: Any
  step: jax.Array


class Trainer:
  """Trains a captured graph with a pipeline plan, exactly.

  One jitted step runs the plan's schedule on a 1-D device mesh with
  `jax.shard_map`: every device executes its own stage (see
  `graphpipe.runtime.step` for the loop), activations and gradients move
  with `lax.ppermute`, data-parallel stages sum their gradients, and optax
  updates each device's flat parameter buffer. Loss and gradients equal
  `jax.value_and_grad` of the unpipelined loss.

  Example:
    >>> model = nnx.Sequential(nnx.Linear(4, 128, rngs=nnx.Rngs(0)),
    ...                        nnx.Linear(128, 128, rngs=nnx.Rngs(1)),
    ...                        nnx.Linear(128, 128, rngs=nnx.Rngs(2)),
    ...                        nnx.Linear(128, 1, rngs=nnx.Rngs(3)))
    >>> loss_fn = lambda m, b: jnp.mean((m(b["x"]) - b["y"]) ** 2)
    >>> batch = {"x": jnp.ones((16, 4)), "y": jnp.zeros((16, 1))}
    >>> graph = graphpipe.capture(loss_fn, model, batch)

    A model this small fits one device; under the tightest memory budget
    the planner cuts it into a real pipeline:

    >>> plan = graphpipe.tightest_plan(graph, num_devices=2, batch_size=16)
    >>> print(plan)
    Plan[graphpipe] 2 stages, depth 2, b=1 x 16 micro-batches, 2 devices,
    schedule 1f1b
      stage 0: nodes [0, 1] on devices [0], b=1, in flight 2
      stage 1: nodes [2, 3] on devices [1], b=1, in flight 1
      edges: [(0, 1)]
    >>> trainer = graphpipe.Trainer(plan, optax.sgd(1e-3), graph=graph)
    >>> state = trainer.init(model)
    >>> loss_before = float(loss_fn(model, batch))
    >>> state, metrics = trainer.step(state, batch)
    >>> abs(metrics["loss"] - loss_before) < 1e-5   # the unpipelined loss
    True
    >>> model = trainer.update_model(model, state)  # the trained weights
    >>> float(loss_fn(model, batch)) < loss_before
    True

  Args:
    plan: the stage DAG (from `graphpipe.plan` or a baseline planner).
      Stages may take different micro-batch sizes (`graphpipe.plan(...,
      per_stage_micro_batches=True)`): a stage k times larger than its
      predecessor collects k of their micro-batches, runs once and returns
      its gradients in k pieces (`graphpipe.runtime.layout`). A stage
      whose `sharding` is 'zero1' keeps a k-th of the optimizer state on
      each of its k devices (`graphpipe.runtime.zero`).
    optimizer: an optax transformation. It runs on each device's flat
      buffer, so it must treat parameters elementwise (sgd, adam, adamw,
      ...); transformations that reduce over all parameters (global-norm
      clipping) would see one stage only.
    mesh: a 1-D mesh of at least `plan.num_devices` devices; default the
      first `plan.num_devices` of `jax.devices()`.
    graph: the captured graph the plan was made for (default `plan.graph`).
    schedule: '1f1b' or 'gpipe' (default: the plan's), or a `Schedule`.
    recompute: recompute each stage's forward in its backward instead of
      stashing the forward's residuals (less memory, more compute).
    loss_reduction: no longer used: how the loss combines micro-batches
      is read from its program (`OpGraph.loss_form`); giving it raises.
    stop_on_nan: raise when the loss is not finite (else only flag it;
      either way the step is skipped, see `step`).
  """

  def __init__(
    self,
    plan: Plan,
    optimizer: optax.GradientTransformation,
    mesh: Mesh | None = None,
    *,
    graph: OpGraph | None = None,
    schedule=None,
    recompute: bool = False,
    loss_reduction: str | None = None,
    stop_on_nan: bool = False,
  ):
    if loss_reduction is not None:
      raise PipelineRuntimeError(
        "loss_reduction is no longer needed: the trainer reads how the "
        "loss combines micro-batches (sums over the batch, data statistics "
        "such as token counts, parameter-only terms) from its program "
        "(graph.loss_form); drop the argument"
      )
    graph, mesh = guards.trainer_inputs(plan, optimizer, graph, mesh, AXIS)
    self.plan, self.graph, self.optimizer = plan, graph, optimizer
    replicated = runnable.replication_refusal(graph, plan)
    if replicated:
      raise PipelineRuntimeError(replicated)
    self.stop_on_nan = stop_on_nan
    if schedule is None or isinstance(schedule, str):
      schedule = schedule_for(plan, schedule)
    check_schedule(schedule)
    if not built_for(schedule, plan):
      raise PipelineRuntimeError(
        "the schedule was built for another plan (stages, devices, edges "
        "or micro-batch counts differ): build it with schedule_for(plan)"
      )
    self.schedule, self.mesh = schedule, mesh
    self.layout = build_layout(graph, plan, schedule)
    self.builder = StepBuilder(
      self.layout,
      schedule,
      graph.program,
      recompute=recompute,
      batch_size=plan.batch_size,
      inputs=graph.inputs,
    )
    self.buffers = self.builder.buffers
    # ZeRO-1 stages: the optimizer runs on each device's owned elements.
    self.zero = ZeroOne(self.layout, self.buffers.params)
    self._rows = NamedSharding(self.mesh, P(AXIS))
    self._replicated = NamedSharding(self.mesh, P())
    self._packer = None  # packs batches already on the mesh (put_batch)
    # The loss's data statistics of a whole batch (put_batch).
    self._statistics = feed.statistics_of(self.builder.whole, self._replicated)
    # One compiled program serves training and verification: it returns
    # the reduced gradients beside the new state. It takes over the state
    # it is given, so that XLA updates parameters and optimizer state in
    # place.
    self._step = jax.jit(self._shard(self._train_step), donate_argnums=0)
    self._init_opt = jax.jit(
      jax.shard_map(
        lambda p: _rows(optimizer.init(self._owned_params(_local(p)))),
        mesh=self.mesh,
        in_specs=P(AXIS),
        out_specs=P(AXIS),
        check_vma=False,
      )
    )

  # The SPMD functions.

  def _shard(self, fn):
    state_spec = TrainState(P(AXIS), P(AXIS), P(AXIS), P())
    return jax.shard_map(
      fn,
      mesh=self.mesh,
      in_specs=(state_spec, P(AXIS), P()),
      out_specs=(state_spec, P(), P(AXIS)),
      check_vma=False,
    )

  def _owned_params(self, params):
    """What the optimizer updates on this device (inside shard_map): its
    parameter slots, or with ZeRO-1 stages its owned elements
    (`graphpipe.runtime.zero`)."""
    if not self.zero.active:
      return params
    return self.zero.own_params(params, jax.lax.axis_index(AXIS), AXIS)

  def _train_step(self, ts: TrainState, batch, statistics):
    slots_now = _local(ts.params)
    grads, loss, state = self.builder.gradients_and_loss(
      slots_now, _local(ts.state), batch[0], statistics
    )
    params = self._owned_params(slots_now)
    if self.zero.active:
      grads = self.zero.own_gradients(grads, jax.lax.axis_index(AXIS), AXIS)

    def update(params, opt_state):
      updates, opt_state = self.optimizer.update(grads, opt_state, params)
      return optax.apply_updates(params, updates), opt_state

    # A step whose loss is not finite is skipped: parameters, optimizer
    # state and step count stay as they were (the loss is psummed, so every
    # device decides alike). A cond, not a select of new and old: a select
    # reads the old values after the update has written the new ones over
    # them (the state is donated), so XLA copied the whole optimizer state
    # first: Adam over 24 MiB took 64 ms so, 11 ms as a cond, on one CPU
    # core (2026-12-07).
    finite = jnp.isfinite(loss)
    params, opt_state = jax.lax.cond(
      finite, update, lambda *kept: kept, params, _local(ts.opt_state)
    )
    keep = lambda new, old: jax.tree.map(
      lambda a, b: jnp.where(finite, a, b), new, old
    )
    if self.zero.active:
      params = self.zero.gather_params(
        params, slots_now, jax.lax.axis_index(AXIS), AXIS
      )
    # Variables the loss updates (running statistics) move on with the
    # parameters; the others are passed through untouched.
    state = (
      _rows(keep(state, _local(ts.state)))
      if self.graph.program.update_keys
      else ts.state
    )
    step = ts.step + finite.astype(ts.step.dtype)
    new = TrainState(_rows(params), state, _rows(opt_state), step)
    return new, {"loss": loss}, _rows(grads)

  # Public API.

  def init(self, model_or_variables) -> TrainState:
    """Initial state from an NNX model (or linen variables) of the graph.

    Refuses a model whose variables differ in structure or shape from the
    captured one's, and non-finite weights.
    """
    if not isinstance(model_or_variables, nnx.Module | Mapping):
      raise PipelineRuntimeError(
        "init takes the NNX model (or linen variables dict) the graph was "
        f"captured from, got {type(model_or_variables).__name__}"
      )
    return self.state_from_values(self._values_of(model_or_variables))

  def _values_of(self, model_or_variables) -> dict:
    """The variables of a model (or linen dict) of the captured structure
    and shapes, by key; PipelineRuntimeError otherwise."""
    try:
      values = self.graph.program.variable_values(model_or_variables)
    except (ValueError, KeyError, TypeError) as err:  # flax: no such path
      raise PipelineRuntimeError(
        f"this model is not the captured one (its variables differ: {err})"
      ) from None
    keys = self.graph.program.input_keys
    guards.check_values(values, self.layout.param_shapes, keys)
    return values

  def state_from_values(self, values: dict, step: int = 0) -> TrainState:
    """A state from parameter / state values by key ('param:a.b.kernel')."""
    keys = self.graph.program.input_keys
    guards.check_values(values, self.layout.param_shapes, keys)
    guards.check_step(step)
    params = self._to_rows(self._host_slots(self.buffers.params, values))
    state = self._to_rows(self._host_slots(self.buffers.state, values, True))
    # (device_put of a host scalar makes a malformed array across processes)
    step_array = jax.make_array_from_callback(
      (), self._replicated, lambda _: np.asarray(step, np.int32)
    )
    return TrainState(params, state, self._init_opt(params), step_array)

  def step(self, state: TrainState, batch, rng=None) -> tuple[TrainState, dict]:
    """One optimizer step on `batch` (the plan's batch size).

    `state` is consumed (its buffers are donated to the new state): use
    the returned state from then on. A step whose loss is not finite
    (NaN or inf) changes nothing but is reported: `metrics["finite"]` is
    False and the returned state equals the given one (parameters,
    optimizer state, step count); with `stop_on_nan` it raises
    `PipelineRuntimeError` instead, the unchanged state in its `.state`.
    """
    guards.check_state(state, self._expected_state, self.mesh)
    fed = self.put_batch(batch, rng)
    die_at = faults.armed("step")
    if die_at is not None and die_at == int(_first_shard(state.step)):
      self._step(state, fed.words, fed.statistics)
      faults.die()
    with guards.peers_checked():
      new, metrics, _ = self._step(state, fed.words, fed.statistics)
      loss = float(_first_shard(metrics["loss"]))
    metrics = {"loss": loss, "finite": bool(np.isfinite(loss))}
    if self.stop_on_nan and not metrics["finite"]:
      err = PipelineRuntimeError(
        f"the loss is {loss} at step {int(_first_shard(new.step))}; the "
        "step was skipped (its state is the error's .state)"
      )
      err.state = new
      raise err
    return new, metrics

  def loss_and_grads(
    self, state: TrainState, batch, rng=None
  ) -> tuple[float, dict]:
    """The pipelined loss and gradients by 'param:' key (no update)."""
    guards.check_state(state, self._expected_state, self.mesh)
    # The step consumes its state; it gets a copy, so `state` stays usable.
    state = jax.tree.map(jnp.copy, state)
    fed = self.put_batch(batch, rng)
    _, metrics, grads = self._step(state, fed.words, fed.statistics)
    loss = float(_first_shard(metrics["loss"]))
    if self.zero.active:
      host = np.asarray(_all_rows(grads))
      return loss, self.zero.assemble(host, self.layout.param_shapes)
    return loss, self._gather(grads)

  def params(self, state: TrainState) -> dict:
    """Current parameters by 'param:' key, gathered to the host."""
    guards.check_state(state, self._expected_state, self.mesh)
    return self._gather(state.params)

  def update_model(self, model, state: TrainState):
    """Writes the trained parameters into an NNX model (in place)."""
    if not isinstance(model, nnx.Module):
      raise PipelineRuntimeError(
        f"update_model takes the NNX model, got {type(model).__name__} (for "
        "linen: trainer.variables(state, variables))"
      )
    # A model of another config took the trained shapes silently.
    self._values_of(model)
    trained = self._trained(state, model)
    if self.graph.program.update_keys:
      # (the running statistics too, read before anything is written)
      updated = self.graph.program.unflatten_state(
        self.state_values(state), model
      )
      nnx.update(model, updated)
    nnx.update(model, trained)
    return model

  def variables(self, state: TrainState, variables=None) -> dict:
    """Linen variables with the trained parameters (and the variables the
    loss updates, running statistics)."""
    out = dict(variables or {})
    if self.graph.program.update_keys:
      out.update(
        self.graph.program.unflatten_state(self.state_values(state), variables)
      )
    out["params"] = self._trained(state, variables)
    return out

  def state_values(self, state: TrainState) -> dict:
    """The non-trainable variables by 'state:' key (running statistics as
    the steps left them), gathered to the host."""
    guards.check_state(state, self._expected_state, self.mesh)
    return self._gather(state.state, self.buffers.state, bits=True)

  def _trained(self, state: TrainState, base):
    """The trained parameters in the user's structure; parameters the loss
    never reads (no stage holds them) keep their values in `base`."""
    try:
      return self.graph.program.unflatten_params(self.params(state), base)
    except KeyError as err:
      raise PipelineRuntimeError(
        f"the loss never reads {err.args[0]}, so no stage holds it: pass "
        "the variables to take it from"
      ) from None

  # Checkpoints.

  def save(self, state: TrainState, directory: str) -> None:
    """Writes `state` to `directory` (orbax; every process calls it).

    The folder counts as a checkpoint only once the save has finished
    (`graphpipe.runtime.checkpoints`): a crash midway leaves a folder
    that `restore` refuses and `checkpoints.latest` skips.
    """
    guards.check_state(state, self._expected_state, self.mesh)
    checkpoints.save(self, state, directory)

  def restore(self, directory: str) -> TrainState:
    """Reads a state written by `save`, for this plan or another plan of
    the same graph (moved to this trainer's layout, one process:
    `graphpipe.runtime.relayout`)."""
    return checkpoints.restore(self, directory)

  def _signature(self) -> dict:
    from graphpipe.core.fingerprint import graph_fingerprint

    return {
      "graph": graph_fingerprint(self.graph),
      "stages": [list(s.nodes) for s in self.layout.stages],
      "devices": [list(s.devices) for s in self.layout.stages],
      "buffers": [
        list(self.buffers.params.sizes),
        list(self.buffers.state.sizes),
      ],
      # (only where a stage shards: older checkpoints' marks stay valid)
      **(
        {"sharding": [s.sharding for s in self.layout.stages]}
        if self.zero.active
        else {}
      ),
    }

  @functools.cached_property
  def _expected_state(self) -> TrainState:
    return self._abstract_state()

  def _abstract_state(self) -> TrainState:
    rows = lambda shape: jax.ShapeDtypeStruct(
      shape, jnp.float32, sharding=self._rows
    )
    num_devices = self.layout.num_devices
    params = tuple(rows((num_devices, n)) for n in self.buffers.params.sizes)
    opt_state = jax.eval_shape(self._init_opt, params)
    opt_state = jax.tree.map(
      lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=self._rows),
      opt_state,
    )
    return TrainState(
      params,
      tuple(rows((num_devices, n)) for n in self.buffers.state.sizes),
      opt_state,
      jax.ShapeDtypeStruct((), jnp.int32, sharding=self._replicated),
    )

  # Reports.

  def compiled(self, state: TrainState, batch, rng=None):
    """The compiled train step (for memory and cost analysis)."""
    fed = self.put_batch(batch, rng)
    return self._step.lower(state, fed.words, fed.statistics).compile()

  def memory_report(self, state: TrainState | None = None, batch=None) -> dict:
    """Per-device bytes by kind, predicted before anything is allocated.

    The prediction (`graphpipe.runtime.memory.runtime_report` of this
    trainer's own layout and buffers): 'memory_per_device' by kind,
    'total_bytes_per_device', own and held parameter and optimizer bytes,
    'padding_fraction'. Given a state and a batch, also the compiled
    step's figure ('compiled_bytes': arguments + outputs + temporaries -
    aliased, per device) and its compile time.
    """
    return trainer_report(self, state, batch)

  # Helpers.

  def _host_slots(self, layout, values, bits=False) -> list[np.ndarray]:
    """Per slot, [devices, slot size]: each device's stage in its row."""
    host = [
      np.zeros((self.layout.num_devices, n), np.float32) for n in layout.sizes
    ]
    for s in self.layout.stages:
      stage_slots = slots.host_slots(layout, s.id, values, bits)
      for d in s.devices:
        for slot, row in zip(host, stage_slots, strict=True):
          slot[d] = row
    return host

  def _to_rows(self, host: list[np.ndarray]) -> tuple:
    return tuple(
      jax.make_array_from_callback(x.shape, self._rows, lambda i, x=x: x[i])
      for x in host
    )

  def put_batch(self, batch, rng=None) -> feed.FedBatch:
    """`batch` as the step takes it: each device's own rows of the leaves
    its stage reads (`graphpipe.core.feed`), placed on its device, and for
    a model that draws in training its streams' keys from the step's key
    `rng` (`graphpipe.frontend.streams`).

    `step` and `loss_and_grads` do this to a batch they are given; a batch
    put once can be given to them again without moving any data.
    """
    if self._packer is None:
      self._packer = feed.device_packer(
        self.builder.feeds, self.buffers.feed, self._rows
      )
    fed = feed.put(
      batch,
      self.graph.inputs,
      self.plan.batch_size,
      self.builder.feeds,
      self.buffers.feed,
      self._rows,
      self._packer,
      self._statistics,
    )
    return feed.with_streams(fed, self.graph.program, rng, self._replicated)

  def _gather(self, rows: tuple, layout=None, bits=False) -> dict:
    """Each stage's slots (from its first device) -> values by key."""
    host = [_all_rows(x) for x in rows]
    out = {}
    for s in self.layout.stages:
      out.update(
        slots.host_values(
          layout or self.buffers.params,
          s.id,
          [x[s.devices[0]] for x in host],
          self.layout.param_shapes,
          bits,
        )
      )
    return out


def _all_rows(x) -> np.ndarray:
  """Every device's row of a [devices, ...] array, on the host."""
  from jax.experimental import multihost_utils

  if jax.process_count() > 1:
    return np.asarray(multihost_utils.process_allgather(x, tiled=True))
  return np.asarray(x)


def _local(tree):
  """Inside shard_map: this device's row of every leaf."""
  return jax.tree.map(lambda x: x[0], tree)


def _rows(tree):
  """Inverse of `_local`."""
  return jax.tree.map(lambda x: x[None], tree)


def _first_shard(x):
  return np.asarray(x.addressable_shards[0].data)
