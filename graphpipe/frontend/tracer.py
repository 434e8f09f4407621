"""`capture`: a Flax model and its loss become an `OpGraph`.

The loss is traced once with `jax.make_jaxpr` on abstract values (no weight
is materialised, so paper-scale models capture in seconds). Each top-level
equation is labelled with the module path active when it was traced, cut at
the requested depth, and `graphpipe.grouping` turns the labelled equations
into nodes; `graphpipe.node_costs` measures them.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from flax.core import unfreeze

from graphpipe.core.graph import Edge, InputSpec, Node, OpGraph
from graphpipe.errors import CaptureError, GraphCutError
from graphpipe.frontend import loss_form, node_costs
from graphpipe.frontend.grouping import (
  Grouping,
  labels_of,
  name_nodes,
  no_module_reason,
  runs,
)
from graphpipe.frontend.program import (
  Program,
  primitive_signature,
  source_input,
)
from graphpipe.frontend.scopes import nnx_module_scopes, path_to_str


def _key_name(key) -> str:
  for attr in ("key", "idx", "name"):
    if hasattr(key, attr):
      return str(getattr(key, attr))
  return str(key)


def _leaf_names(tree, drop_value=False) -> list[str]:
  names = []
  for path, _ in jax.tree_util.tree_flatten_with_path(tree)[0]:
    parts = [_key_name(k) for k in path]
    if drop_value and parts and parts[-1] == "value":
      parts = parts[:-1]
    names.append(path_to_str(parts))
  return names


def _abstract(tree):
  return jax.tree.map(
    lambda x: jax.ShapeDtypeStruct(np.shape(x), jnp.result_type(x)), tree
  )


def _with_batch_size(batch, size):
  return jax.tree.map(
    lambda x: jax.ShapeDtypeStruct((size,) + tuple(x.shape[1:]), x.dtype),
    batch,
  )


class _Bound:
  """How to call the user's loss on (params, state) for one framework."""

  def __init__(self, model, variables):
    if isinstance(model, nnx.Module):
      if variables is not None:
        raise CaptureError(
          "variables= is for linen modules; an NNX model carries its own"
        )
      self.framework = "nnx"
      self.graphdef, self.params, self.state = nnx.split(model, nnx.Param, ...)
      self.param_names = _leaf_names(self.params, drop_value=True)
      self.state_names = _leaf_names(self.state, drop_value=True)
      self.root = type(model).__name__
    elif isinstance(model, nn.Module):
      if variables is None:
        raise CaptureError(
          "a linen module needs its variables: capture(loss_fn, module, "
          "batch, variables=module.init(...))"
        )
      self.framework = "linen"
      self.module = model
      variables = unfreeze(variables)  # a FrozenDict as a dict
      self.params = variables.pop("params", {})
      self.state = variables
      self.param_names = _leaf_names(self.params)
      self.state_names = _leaf_names(self.state)
      self.root = type(model).__name__
    else:
      raise CaptureError(
        f"model must be a flax.nnx.Module or a flax.linen.Module, got "
        f"{type(model).__name__}"
      )
    if not jax.tree.leaves(self.params):
      raise CaptureError(
        f"the model {self.root} has no trainable parameters (nnx.Param / "
        "linen 'params'): there is nothing to train or to place on stages"
      )

  def call(self, loss_fn, params, state, batch):
    if self.framework == "nnx":
      model = nnx.merge(self.graphdef, params, state)
      before = jax.tree.leaves(nnx.state(model))
      with nnx_module_scopes(model):
        loss = loss_fn(model, batch)
      after = jax.tree.leaves(nnx.state(model))
      if len(before) != len(after) or (
        any(a is not b for a, b in zip(before, after, strict=True))
        and not self._writes_back_unchanged(loss_fn, params, state, batch)
      ):
        raise CaptureError(
          "loss_fn changed the model's variables while computing the loss "
          "(e.g. BatchNorm statistics, dropout RNG counters): graphpipe "
          "captures pure losses; put such layers in inference mode or "
          "make them deterministic"
        )
      return loss
    bound = self.module.bind({"params": params, **self.state})
    return loss_fn(bound, batch)

  def _writes_back_unchanged(self, loss_fn, params, state, batch) -> bool:
    """Whether every variable the loss left as a new value is its input,
    passed through nested calls: nnx.remat and nnx.jit return the
    variables they were given, as new tracers, even when nothing changed
    (identity said 'changed', and such models were refused)."""

    def before_and_after(params, state, batch):
      model = nnx.merge(self.graphdef, params, state)
      before = jax.tree.leaves(nnx.state(model))
      with nnx_module_scopes(model):
        loss_fn(model, batch)
      return before, jax.tree.leaves(nnx.state(model))

    shapes = jax.tree.map(
      lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), (params, state, batch)
    )
    jaxpr = jax.make_jaxpr(before_and_after)(*shapes).jaxpr
    half = len(jaxpr.outvars) // 2
    return all(
      a in jaxpr.invars and source_input(jaxpr, b) == jaxpr.invars.index(a)
      for a, b in zip(jaxpr.outvars[:half], jaxpr.outvars[half:], strict=True)
    )

  def split(self, variables):
    """User variables (an NNX state/model or linen dict) -> (params, state)."""
    if self.framework == "nnx":
      if isinstance(variables, nnx.Module):
        _, params, state = nnx.split(variables, nnx.Param, ...)
        return params, state
      _, params, state = nnx.split(
        nnx.merge(self.graphdef, variables), nnx.Param, ...
      )
      return params, state
    variables = unfreeze(variables)
    return variables.pop("params", {}), variables


# Linen errors of layers that change state or draw random numbers while
# training: the batch's shapes are not the cause (the hint said they were).
_STATEFUL_HINTS = {
  name: "graphpipe captures pure losses: run such layers in inference mode "
  "(BatchNorm use_running_average=True, Dropout deterministic=True)"
  for name in ("ModifyScopeVariableError", "InvalidRngError")
}


def capture(
  loss_fn: Callable,
  model,
  batch,
  *,
  variables=None,
  granularity: str | int = "layer",
  costs: bool = True,
  name: str = "",
  config: str = "",
) -> OpGraph:
  """Traces `loss_fn(model, batch)` into an operator graph with costs.

  Works on abstract values: `model` may come from `nnx.eval_shape` and
  `batch` may hold `jax.ShapeDtypeStruct`s, so nothing of paper size is
  allocated. Every batch leaf's leading axis is the batch axis.

  Example:
    >>> model = nnx.Sequential(nnx.Linear(4, 8, rngs=nnx.Rngs(0)),
    ...                        nnx.Linear(8, 1, rngs=nnx.Rngs(1)))
    >>> loss_fn = lambda m, b: jnp.mean((m(b["x"]) - b["y"]) ** 2)
    >>> batch = {"x": jnp.ones((8, 4)), "y": jnp.zeros((8, 1))}
    >>> graph = graphpipe.capture(loss_fn, model, batch)
    >>> print(graph)
    OpGraph Sequential: 2 nodes, 1 edges, loss at [1] (figures per sample)
      id name      fwd GFLOP  bwd GFLOP  params MB  act KB  saved KB  preds
    -------------------------------------------------------------------...
       0 layers.0     0.0000     0.0000      0.000    0.03      0.02  -
       1 layers.1     0.0000     0.0000      0.000    0.00      0.04  0
    -------------------------------------------------------------------...
         total        0.0000     0.0000      0.000    0.03      0.05
    >>> loss = graph.evaluate(model, batch)   # node by node
    >>> bool(jnp.allclose(loss, loss_fn(model, batch)))
    True

  Args:
    loss_fn: `loss_fn(model, batch) -> scalar`. For linen, `model` is the
      module bound to its variables, so the same loss code serves both.
    model: an `nnx.Module`, or a `flax.linen.Module` with `variables`.
    batch: a pytree of arrays (or ShapeDtypeStructs), batch axis first.
    variables: the linen module's variables (`module.init(...)`).
    granularity: where nodes are cut in the module tree: 'layer' (every
      innermost module call), or an int depth (1 = the root's children,
      2 = their children, ...; deeper calls belong to their ancestor at
      that depth). 'block' means depth 2.
    costs: measure FLOPs and bytes per node with XLA (a few seconds at
      paper scale); False leaves them zero.
    name, config: descriptive labels stored in the graph.

  Returns:
    An `OpGraph` whose `evaluate(variables, batch)` recomputes the loss.
  """
  start = time.perf_counter()
  if granularity == "layer":
    depth = 10**9
  elif granularity == "block":
    depth = 2
  elif (
    isinstance(granularity, int)
    and not isinstance(granularity, bool)  # True is no depth
    and granularity >= 1
  ):
    depth = granularity
  else:
    raise CaptureError(
      f"granularity must be 'layer', 'block' or a depth >= 1, got "
      f"{granularity!r}"
    )
  bound = _Bound(model, variables)
  leaves = jax.tree.leaves(batch)
  if not leaves:
    raise CaptureError("the batch has no arrays")
  if any(np.ndim(x) == 0 for x in leaves):
    raise CaptureError(
      "every batch leaf needs a leading batch axis; got a scalar leaf"
    )
  sizes = {np.shape(x)[0] for x in leaves}
  if len(sizes) != 1:
    raise CaptureError(
      f"batch leaves disagree on the batch size (leading axis): "
      f"{sorted(sizes)}; every leaf's first axis must be the batch axis"
    )
  batch_size = sizes.pop()
  if batch_size < 1:
    raise CaptureError(
      "the batch is empty (leading axis 0): capture needs at least one sample"
    )
  abstract_batch = _abstract(batch)
  params_abs = _abstract(bound.params)
  state_abs = _abstract(bound.state)
  batch_names = _leaf_names(batch)

  described_batch = jax.tree.map(
    lambda x: f"{x.dtype}{list(x.shape)}", abstract_batch
  )

  def trace(size: int):
    def fn(params, state, b):
      return bound.call(loss_fn, params, state, b)

    try:
      closed = jax.make_jaxpr(fn)(
        params_abs, state_abs, _with_batch_size(abstract_batch, size)
      )
    except CaptureError:
      raise
    except Exception as err:  # the user's code failed: say where to look
      hint = _STATEFUL_HINTS.get(type(err).__name__)
      raise CaptureError(
        f"tracing loss_fn(model, batch) failed with {type(err).__name__}: "
        f"{err}\n"
        + (
          hint
          or "Check that the batch's shapes and dtypes fit the model "
          f"(batch: {described_batch})"
        )
      ) from err
    outs = closed.out_avals
    if (
      len(outs) != 1
      or outs[0].shape != ()
      or not jnp.issubdtype(outs[0].dtype, jnp.floating)
    ):
      raise CaptureError(
        f"loss_fn must return one floating-point scalar; it returned "
        f"{[f'{a.dtype}{list(a.shape)}' for a in outs]}. Reduce the loss "
        "over the batch (e.g. jnp.mean) and return only the loss"
      )
    return closed

  closed = trace(batch_size)
  large = trace(2 * batch_size)
  if primitive_signature(large.jaxpr) != primitive_signature(closed.jaxpr):
    raise CaptureError(
      f"the loss traced at batch size {2 * batch_size} has a different "
      f"structure than at {batch_size}: the model's Python code depends on "
      "the batch size, so it cannot be cut into micro-batches"
    )
  jaxpr = closed.jaxpr
  input_keys = (
    [f"param:{n}" for n in bound.param_names]
    + [f"state:{n}" for n in bound.state_names]
    + [f"batch:{n}" for n in batch_names]
  )
  num_model_vars = len(bound.param_names) + len(bound.state_names)
  model_vars = set(jaxpr.invars[:num_model_vars])
  model_vars |= set(jaxpr.constvars)
  form = loss_form.find(jaxpr, large.jaxpr, num_model_vars)

  labels = labels_of(jaxpr, bound.framework, depth)
  module_eqns = [i for i in form.body if labels[i]]
  if not module_eqns:
    raise GraphCutError(
      f"no equation of the loss ran inside a submodule of {bound.root}: "
      "the graph would be a single node. "
      + no_module_reason(jaxpr, bound.framework)
    )
  grouping = Grouping(jaxpr, runs(labels, form.body), model_vars)
  grouping.inline_constants()
  grouping.topological()
  grouping.absorb_glue()
  grouping.topological()
  if len(grouping.groups) < 2:
    raise GraphCutError(
      f"the loss of {bound.root} forms a single node at granularity "
      f"{granularity!r}: only one module call was traced; a model of one "
      "layer has nothing to pipeline (build it from several submodules)"
    )
  grouping.name_by_variables(
    dict(
      zip(
        jaxpr.invars[:num_model_vars],
        bound.param_names + bound.state_names,
        strict=True,
      )
    )
  )
  groups = grouping.groups
  form = loss_form.assign_penalties(form, jaxpr, num_model_vars, groups)
  names = name_nodes(
    grouping.labels, groups, min(module_eqns), max(module_eqns)
  )
  flatten_inputs = _make_flatten(bound)
  program = Program(
    trace=trace,
    input_keys=input_keys,
    groups=groups,
    form=form,
    batch_size=batch_size,
    closed=closed,
    flatten=flatten_inputs,
    unflatten_params=_make_unflatten(bound),
  )
  loss_nodes = sorted(
    {int(k.split(":")[0][len("node") :]) for k in program.loss_keys}
  )
  graph = _build_graph(
    program,
    names,
    bound,
    batch_names,
    abstract_batch,
    loss_nodes,
    costs=costs,
  )
  graph.meta.update(
    framework=bound.framework,
    granularity=granularity,
    root=bound.root,
    num_params=int(sum(np.prod(x.shape) for x in jax.tree.leaves(params_abs))),
    capture_time_s=time.perf_counter() - start,
    loss_form=form.describe(),
    whole_batch_only=form.unsplittable,
    cut_rules=program.cut_rules(),
  )
  graph.model = name or bound.root
  graph.config = config
  return graph


def _make_unflatten(bound: _Bound):
  treedef = jax.tree.structure(bound.params)

  def unflatten(leaves):
    return jax.tree.unflatten(treedef, leaves)

  return unflatten


def _make_flatten(bound: _Bound):
  reference = jax.tree.structure((bound.params, bound.state))

  def flatten(variables, batch):
    params, state = bound.split(variables)
    structure = jax.tree.structure((params, state))
    if structure != reference:
      raise CaptureError(
        "these variables do not have the structure of the captured "
        "model's: pass the variables (or model) the graph was captured from"
      )
    return jax.tree.leaves((params, state)) + jax.tree.leaves(batch)

  return flatten


def _build_graph(
  program, names, bound, batch_names, abstract_batch, loss_nodes, *, costs
):
  """Assembles nodes, edges and inputs; measures costs if asked."""
  small = program
  large = program.at_batch_size(2 * program.batch_size) if costs else None
  figures = [({}, {}) for _ in small.nodes]
  if costs:
    try:
      figures = node_costs.per_sample(small, large)
    except (ValueError, TypeError) as err:  # e.g. an undifferentiable loop
      raise CaptureError(
        "measuring the nodes' forward and backward costs failed with "
        f"{type(err).__name__}: {err}\nThe trainer differentiates the loss: "
        "jax.grad of loss_fn must work on this model"
      ) from err
  key_bytes = {}
  for key, aval in zip(
    program.input_keys, program.closed.jaxpr.invars, strict=True
  ):
    key_bytes[key] = node_costs.aval_bytes(aval.aval)
  nodes = []
  for i, (node_program, (slope, fixed)) in enumerate(
    zip(small.nodes, figures, strict=True)
  ):
    params = tuple(k[6:] for k in node_program.inputs if k.startswith("param:"))
    state = tuple(k[6:] for k in node_program.inputs if k.startswith("state:"))
    batch_inputs = tuple(
      k[6:] for k in node_program.inputs if k.startswith("batch:")
    )
    nodes.append(
      Node(
        id=i,
        name=names[i],
        params=params,
        param_bytes=sum(key_bytes[f"param:{p}"] for p in params),
        state=state,
        state_bytes=sum(key_bytes[f"state:{p}"] for p in state),
        batch_inputs=batch_inputs,
        fixed=fixed,
        **slope,
      )
    )
  edges = []
  small_edges = node_costs.edge_bytes(small)
  large_edges = node_costs.edge_bytes(large) if costs else small_edges
  for (src, dst), (size, count) in sorted(small_edges.items()):
    if costs:
      per = (large_edges[(src, dst)][0] - size) / small.batch_size
      fixed_bytes = size - per * small.batch_size
    else:
      per, fixed_bytes = size / small.batch_size, 0.0
    edges.append(Edge(src, dst, per, fixed_bytes, count))
  readers = {}
  for node in nodes:
    for name in node.params:
      readers.setdefault(f"param:{name}", []).append(node.id)
    for name in node.state:
      readers.setdefault(f"state:{name}", []).append(node.id)
  shared = {k: key_bytes[k] for k, ns in readers.items() if len(ns) > 1}
  inputs = [
    InputSpec(n, tuple(x.shape[1:]), str(x.dtype))
    for n, x in zip(batch_names, jax.tree.leaves(abstract_batch), strict=True)
  ]
  return OpGraph(
    nodes,
    edges,
    inputs=inputs,
    loss_nodes=loss_nodes,
    batch_size=program.batch_size,
    program=program,
    meta={"costs_measured": bool(costs)},
    shared=shared,
  )
