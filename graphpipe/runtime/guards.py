"""Checks of what the trainer is given, and of what its peers did."""

from __future__ import annotations

import contextlib

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from graphpipe.core.graph import OpGraph
from graphpipe.core.stages import Plan, sharding_problem
from graphpipe.errors import PipelineRuntimeError, ProcessLostError


def check_step(step) -> None:
  """A step count the state's int32 holds."""
  if not (isinstance(step, int | np.integer) and 0 <= step < 2**31):
    raise PipelineRuntimeError(
      f"step must be an int in [0, 2^31), got {step!r}"
    )


def check_values(values: dict, shapes: dict, known=()) -> None:
  """Values by key of the captured model's shapes, numbers, and finite;
  no keys besides those and `known` (variables no stage reads)."""
  extra = sorted(set(values) - set(shapes) - set(known))
  if extra:
    raise PipelineRuntimeError(
      f"values for {extra[:3]}{' ...' if len(extra) > 3 else ''}, which the "
      "captured model does not have (keys like 'param:a.b.kernel')"
    )
  for key, (shape, _) in shapes.items():
    if key not in values:
      raise PipelineRuntimeError(f"no value for {key}: not the captured model")
    value = np.asarray(values[key])
    if not (jnp.issubdtype(value.dtype, jnp.number) or value.dtype == bool):
      raise PipelineRuntimeError(
        f"{key} holds {value.dtype} values, not numbers"
      )
    if value.shape != tuple(shape):
      raise PipelineRuntimeError(
        f"{key} has shape {list(value.shape)}, the captured model's has "
        f"{list(shape)}: pass the model the graph was captured from"
      )
    if not np.all(np.isfinite(value)):
      raise PipelineRuntimeError(
        f"{key} holds NaN or infinite values: training would only "
        "propagate them (fix the initialisation or the checkpoint)"
      )


@contextlib.contextmanager
def peers_checked():
  """Turns a collective that fails because a process died into an error
  that says so (multi-process runs only)."""
  try:
    yield
  except jax.errors.JaxRuntimeError as err:
    text = str(err)
    lost = ("Gloo", "collective", "Connection", "UNAVAILABLE", "heartbeat")
    if jax.process_count() == 1 or not any(w in text for w in lost):
      raise
    raise ProcessLostError(
      f"process {jax.process_index()} of {jax.process_count()}: the "
      "training step's collectives failed, so another process of the run "
      f"died or cannot be reached ({text.splitlines()[0][:200]}); restart "
      "the run from its last complete checkpoint "
      "(graphpipe.runtime.checkpoints.latest)"
    ) from None


def default_mesh(num_devices: int, axis: str) -> Mesh:
  """The first `num_devices` devices JAX sees, as a 1-D mesh."""
  devices = jax.devices()
  if len(devices) < num_devices:
    raise PipelineRuntimeError(
      f"the plan needs {num_devices} devices, JAX sees {len(devices)}: on "
      "CPU set XLA_FLAGS=--xla_force_host_platform_device_count=N before "
      "importing jax"
    )
  return Mesh(np.asarray(devices[:num_devices]), (axis,))


def trainer_inputs(plan, optimizer, graph, mesh, axis: str):
  """(graph, mesh) a Trainer runs `plan` with, after checking them: the
  plan's captured graph (a graph loaded from JSON has no program), an optax
  transformation, and a mesh of distinct devices (a 1-D mesh over the
  plan's devices; default the first devices JAX sees)."""
  if not isinstance(plan, Plan):
    raise PipelineRuntimeError(
      f"the trainer takes a Plan (graphpipe.plan), got {type(plan).__name__}"
    )
  if not all(hasattr(optimizer, a) for a in ("init", "update")):
    raise PipelineRuntimeError(
      f"optimizer must be an optax GradientTransformation (e.g. "
      f"optax.adam(1e-3)), got {optimizer!r}"
    )
  check_elementwise(optimizer)
  for stage in plan.stages:
    problem = sharding_problem(stage)
    if problem:
      raise PipelineRuntimeError(problem)
  graph = captured_graph(plan, graph, "the trainer", "Trainer(plan, optimizer")
  if mesh is None:
    mesh = default_mesh(plan.num_devices, axis)
  if not isinstance(mesh, Mesh):
    raise PipelineRuntimeError(
      f"mesh must be a jax.sharding.Mesh, got {type(mesh).__name__} (for a "
      "list of devices: Mesh(np.asarray(devices), ('pipe',)))"
    )
  devices = list(np.asarray(mesh.devices).reshape(-1))
  if len(set(devices)) != len(devices):
    raise PipelineRuntimeError(
      "the mesh names a device more than once: every device runs its own "
      "part of the plan"
    )
  if len(devices) < plan.num_devices:
    raise PipelineRuntimeError(
      f"the plan uses {plan.num_devices} devices but the mesh has "
      f"{len(devices)}"
    )
  if len(devices) != plan.num_devices or mesh.axis_names != (axis,):
    mesh = Mesh(np.asarray(devices[: plan.num_devices]), (axis,))
  return graph, mesh


# A generic parameter tree, named as flax names its parameters, and the
# same leaves packed into two flat slots (two stages' slots).
_TREE_SHAPES = {
  "dense": {"kernel": (3, 4), "bias": (4,)},
  "norm": {"scale": (4,), "bias": (4,)},
  "embed": {"embedding": (5, 3)},
  "conv": {"kernel": (2, 2, 3)},
}


def check_elementwise(optimizer) -> None:
  """Refuses an optimizer whose update of a parameter depends on other
  parameters or on the shapes and names of the arrays.

  The trainer runs optax on each stage's flat float32 slots, not on the
  model's tree: global-norm clipping saw one stage's norm, a weight decay
  masked by ndim or name decayed nothing (every slot is 1-D and unnamed),
  factored moments and per-layer trust ratios (adafactor, lamb) saw slots,
  not layers; silently (found by probing on 2026-12-03). Two steps on a
  generic tree and on the same numbers in flat slots must agree.
  """
  rng = np.random.default_rng(0)

  def draw():
    return jax.tree.map(
      lambda shape: jnp.asarray(rng.standard_normal(shape), jnp.float32),
      _TREE_SHAPES,
      is_leaf=lambda x: isinstance(x, tuple),
    )

  params, grads = draw(), [draw(), draw()]

  def slots(tree):  # two stages' slots: (stage 0's,), (stage 1's,)
    leaves = [x.reshape(-1) for x in jax.tree.leaves(tree)]
    half = len(leaves) // 2
    return (jnp.concatenate(leaves[:half]),), (jnp.concatenate(leaves[half:]),)

  def two_steps(p, gs):
    state = optimizer.init(p)
    for g in gs:
      updates, state = optimizer.update(g, state, p)
      p = jax.tree.map(lambda a, u: a + u, p, updates)
    return p

  try:
    want = slots(two_steps(params, grads))
    got = [  # each stage runs the optimizer on its own slots
      two_steps(slots(params)[k], [slots(g)[k] for g in grads])
      for k in range(2)
    ]
  except Exception as err:  # the user's optimizer: any failure
    raise PipelineRuntimeError(
      "the optimizer does not run on a generic parameter tree and on flat "
      f"arrays alike ({type(err).__name__}: {err}); the trainer runs it "
      "over each stage's flat parameter slots, so it must treat every "
      "parameter entry alike (e.g. optax.adam, optax.sgd, optax.adamw "
      "without a mask)"
    ) from None
  if not all(
    np.allclose(a[0], b[0], rtol=1e-5, atol=1e-7)
    for a, b in zip(want, got, strict=True)
  ):
    raise PipelineRuntimeError(
      "the optimizer's update of a parameter depends on other parameters "
      "or on the shapes or names of its arrays (global-norm clipping, a "
      "mask by ndim or name, factored moments as in adafactor, per-layer "
      "trust ratios as in lamb): the trainer runs it over each stage's "
      "flat parameter slots, where those would be one stage's or a slot's. "
      "Use elementwise transformations (optax.adam, optax.sgd, "
      "optax.adamw without a mask, optax.clip); clip by global norm "
      "outside the pipeline is not supported"
    )


def captured_graph(plan, graph, who: str, call: str) -> OpGraph:
  """`graph` (or the plan's own), checked: captured, not loaded from JSON
  (no program to run), and the one the plan was made for."""
  graph = graph if graph is not None else getattr(plan, "graph", None)
  if graph is not None and not isinstance(graph, OpGraph):
    raise PipelineRuntimeError(
      f"graph must be an OpGraph, got {type(graph).__name__}"
    )
  if graph is None or graph.program is None:
    loaded = graph is not None
    raise PipelineRuntimeError(
      f"{who} needs the captured graph the plan was made for"
      + (
        " (this one has no program: a graph loaded from JSON holds costs only)"
        if loaded
        else ""
      )
      + f": {call}, graph=graphpipe.capture(...))"
    )
  check_fingerprint(plan, graph)
  return graph


def check_fingerprint(plan: Plan, graph: OpGraph) -> None:
  """Refuses a plan made for another graph."""
  from graphpipe.core.fingerprint import made_for

  if not made_for(plan, graph):
    raise PipelineRuntimeError(
      "this plan was made for another graph (fingerprints differ): plan "
      "the captured graph you train"
    )


def check_state(state, expected, mesh: Mesh | None = None) -> None:
  """Refuses what is not a live state of this trainer: not a TrainState,
  a state whose buffers an earlier step consumed (stepping one crashed the
  process), or one of another plan or optimizer (its arrays differ from
  `expected`, the trainer's abstract state)."""
  if type(state) is not type(expected):
    raise PipelineRuntimeError(
      f"takes the TrainState of init/restore/step, got {type(state).__name__}"
    )
  leaves = jax.tree.leaves(state)
  if any(getattr(x, "is_deleted", lambda: False)() for x in leaves):
    raise PipelineRuntimeError(
      "this state was consumed by a step (its buffers were donated to the "
      "state that step returned): use the returned state"
    )
  got = jax.tree.structure(state), [(x.shape, x.dtype) for x in leaves]
  want = (
    jax.tree.structure(expected),
    [(x.shape, x.dtype) for x in jax.tree.leaves(expected)],
  )
  if got != want:
    raise PipelineRuntimeError(
      "this state is not one of this trainer's (its arrays differ from "
      "what this plan and optimizer hold): a state of another Trainer?"
    )
  placed = {d for x in leaves for d in x.sharding.device_set}
  if mesh is not None and not placed <= set(mesh.devices.flat):
    # It failed inside jit with "Received incompatible devices".
    raise PipelineRuntimeError(
      "this state lives on other devices than this trainer's mesh: a "
      "state of a trainer on another mesh? (trainer.params(state) and "
      "state_from_values move values between trainers)"
    )
