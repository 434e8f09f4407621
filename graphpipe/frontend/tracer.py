"""`capture`: a Flax model and its loss become an `OpGraph`.

The loss is traced once with `jax.make_jaxpr` on abstract values (no weight is
materialised, so paper-scale models capture in seconds). Each top-level equation
is labelled with the module path active when it was traced, cut at the requested
depth, and `graphpipe.frontend.grouping` turns the labelled equations into
nodes; `graphpipe.frontend.node_costs` measures them.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from graphpipe.core.graph import Edge, InputSpec, Node, OpGraph
from graphpipe.errors import CaptureError, GraphCutError
from graphpipe.frontend import loss_form, node_costs
from graphpipe.frontend.bound import (
  STATEFUL_HINTS,
  Bound,
  leaf_names,
  make_flatten,
  make_unflatten,
)
from graphpipe.frontend.grouping import (
  SCAN_REASON,
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
from graphpipe.frontend.split import Splits, part_labels
from graphpipe.frontend.unroll import Stacks, layer_labels


def _abstract(tree):
  return jax.tree.map(
    lambda x: jax.ShapeDtypeStruct(np.shape(x), jnp.result_type(x)), tree
  )


def _with_batch_size(batch, size):
  return jax.tree.map(
    lambda x: jax.ShapeDtypeStruct((size,) + tuple(x.shape[1:]), x.dtype),
    batch,
  )


def capture(
  loss_fn: Callable,
  model,
  batch,
  *,
  variables=None,
  rngs: Sequence[str] = (),
  granularity: str | int = "layer",
  costs: bool = True,
  split_layers: dict[str, int] | None = None,
  name: str = "",
  config: str = "",
) -> OpGraph:
  """Traces `loss_fn(model, batch)` into an operator graph with costs.

  Works on abstract values: `model` may come from `nnx.eval_shape` and
  `batch` may hold `jax.ShapeDtypeStruct` leaves, so nothing of paper size is
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
    rngs: the names of a linen module's random streams in training
      (`make_rng` names: ('dropout',)). An NNX model's streams are its
      `nnx.Rngs`. Streams draw by the per-sample rule of
      `graphpipe.frontend.streams`: the trainer takes a key per step.
    granularity: where nodes are cut in the module tree: 'layer' (every
      innermost module call), or an int depth (1 = the root's children,
      2 = their children, ...; deeper calls belong to their ancestor at
      that depth). 'block' means depth 2.
    costs: measure FLOPs and bytes per node with XLA (a few seconds at
      paper scale); False leaves them zero.
    split_layers: parameter or module name -> number of parts: each such
      weight (of a matrix product or convolution) is cut by output
      features into that many parameters, each product part its own node
      (tensor parallelism as graph branches, `graphpipe.frontend.split`),
      and each embedding table (read by a lookup of rows) by rows, each
      part's lookup its own node (`graphpipe.frontend.split_rows`):
      {'head': 4, 'embed': 2}. The trainer's parameters keep the unsplit
      form.
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
  bound = Bound(model, variables, rngs)
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
  streams_abs = bound.abstract_streams()
  batch_names = leaf_names(batch)

  described_batch = jax.tree.map(
    lambda x: f"{x.dtype}{list(x.shape)}", abstract_batch
  )

  # Which state variables the loss updates (BatchNorm's running
  # statistics): known after the first trace, which returns them all.
  updated: list[int] | None = None
  # Scanned layer stacks unrolled, one node per layer: known after it.
  stacks: Stacks | None = None
  # Layers split by output features or rows (split_layers): known after it.
  splits: Splits | None = None

  # Collective axes the model's code names (BatchNorm(axis_name=...)):
  # the data-parallel replicas of a micro-batch. graphpipe runs a stage of
  # such a model on one device holding the whole micro-batch, so each
  # axis is bound with size 1 (a collective over it is the identity on
  # that one replica) and `graphpipe.core.runnable` keeps every stage
  # unreplicated: statistics over the axis are the micro-batch's.
  axes: list[str] = []

  def trace(size: int):
    def fn(params, state, streams, b):
      loss, params_after, state_after = bound.call(
        loss_fn, params, state, streams, b
      )
      if updated is None:
        return loss, params_after, state_after
      return loss, [state_after[j] for j in updated]

    for name in axes:
      fn = jax.vmap(
        fn, in_axes=None, out_axes=None, axis_size=1, axis_name=name
      )
    try:
      closed = jax.make_jaxpr(fn)(
        params_abs,
        state_abs,
        streams_abs,
        _with_batch_size(abstract_batch, size),
      )
    except CaptureError:
      raise
    except Exception as err:  # the user's code failed: say where to look
      hint = STATEFUL_HINTS.get(type(err).__name__)
      unbound = _UNBOUND_AXIS.search(str(err))
      if unbound and unbound.group(1) not in axes and len(axes) < 8:
        axes.append(unbound.group(1))
        return trace(size)
      if unbound:
        hint = (
          f"The model names a collective axis ({unbound.group(1)}) that "
          "graphpipe could not bind: name it with a string "
          "(BatchNorm(axis_name='batch'))"
        )
      if axes and "out_axes" in str(err):
        hint = (
          f"The model names the collective axis {axes!r} (e.g. "
          "BatchNorm(axis_name=...)): graphpipe binds it to the replicas "
          "of a micro-batch, one device holding them all, so a value "
          "that differs along it (lax.axis_index) cannot be run"
        )
      raise CaptureError(
        f"tracing loss_fn(model, batch) failed with {type(err).__name__}: "
        f"{err}\n"
        + (
          hint
          or "Check that the batch's shapes and dtypes fit the model "
          f"(batch: {described_batch})"
        )
      ) from err
    num_loss = len(closed.out_avals) - (
      len(bound.param_names) + len(bound.state_names)
      if updated is None
      else len(updated)
    )
    outs = closed.out_avals[:num_loss]
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
    if stacks is None:
      return closed
    closed = stacks.unroll(closed)[0]
    return closed if splits is None else splits.apply(closed)[0]

  updated = _updated_state(trace(batch_size), bound)
  raw = trace(batch_size)
  stacks = Stacks.find(raw, len(bound.param_names) + len(bound.state_names))
  unrolled, origin = stacks.unroll(raw)
  # (Split layers: 'head.kernel#0of4' ..., each part of the product its
  # own node.)
  splits = Splits.find(
    unrolled, stacks.names(bound.param_names), dict(split_layers or {})
  )
  closed, parts = splits.apply(unrolled)
  large = trace(2 * batch_size)
  if primitive_signature(large.jaxpr) != primitive_signature(closed.jaxpr):
    raise CaptureError(
      f"the loss traced at batch size {2 * batch_size} has a different "
      f"structure than at {batch_size}: the model's Python code depends on "
      "the batch size, so it cannot be cut into micro-batches"
    )
  jaxpr = closed.jaxpr
  update_keys = [f"state:{bound.state_names[j]}" for j in updated]
  # (Stacked variables as one input per layer: 'layers.lin.kernel[3]'.)
  var_names = splits.names(stacks.names(bound.param_names + bound.state_names))
  num_params = splits.position(stacks.position(len(bound.param_names)))
  num_model_vars = len(var_names)
  input_keys = (
    [f"param:{n}" for n in var_names[:num_params]]
    + [f"state:{n}" for n in var_names[num_params:]]
    + [f"rng:{n}" for n in bound.stream_names]
    + [f"batch:{n}" for n in batch_names]
  )
  model_vars = set(jaxpr.invars[:num_model_vars])
  model_vars |= set(jaxpr.constvars)
  form = loss_form.find(
    jaxpr,
    large.jaxpr,
    num_model_vars,
    len(bound.stream_names),
    [
      splits.position(stacks.position(len(bound.param_names) + j))
      for j in updated
    ],
  )

  labels = part_labels(
    layer_labels(
      labels_of(unrolled.jaxpr, bound.framework, depth),
      origin,
      labels_of(raw.jaxpr, bound.framework, depth),
    ),
    parts,
  )
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
    scans = [e for e in jaxpr.eqns if e.primitive.name == "scan"]
    raise GraphCutError(
      f"the loss of {bound.root} forms a single node at granularity "
      f"{granularity!r}: "
      + (
        SCAN_REASON
        if scans
        else "only one module call was traced; a model of one layer has "
        "nothing to pipeline (build it from several submodules)"
      )
    )
  grouping.name_by_variables(
    dict(
      zip(
        jaxpr.invars[:num_model_vars],
        var_names,
        strict=True,
      )
    )
  )
  groups = grouping.groups
  form = loss_form.assign_penalties(form, jaxpr, num_model_vars, groups)
  names = name_nodes(
    grouping.labels, groups, min(module_eqns), max(module_eqns)
  )
  flatten, unflatten = make_flatten(bound), make_unflatten(bound)
  first = {"param": 0, "state": len(bound.param_names)}
  count = {"param": len(bound.param_names), "state": len(bound.state_names)}
  program = Program(
    trace=trace,
    input_keys=input_keys,
    groups=groups,
    form=form,
    batch_size=batch_size,
    closed=closed,
    flatten=lambda *args: splits.split(stacks.split(flatten(*args))),
    unflatten_params=lambda leaves, kind="param": unflatten(
      stacks.join(
        splits.join(
          leaves,
          stacks.position(first[kind]),
          stacks.position(first[kind] + count[kind])
          - stacks.position(first[kind]),
        ),
        first[kind],
        count[kind],
      ),
      kind,
    ),
    update_keys=update_keys,
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
    collective_axes=list(axes),
    cut_rules=program.cut_rules(),
    split_layers={
      stacks.names(bound.param_names)[k]: n
      for k, (n, _) in splits.parts.items()
    },
  )
  graph.model = name or bound.root
  graph.config = config
  return graph


_UNBOUND_AXIS = re.compile(r"unbound axis name: ([^\s.,;]+)")


def _updated_state(closed, bound) -> list[int]:
  """Indices of the state variables the traced loss (returning the loss,
  then every parameter and state leaf after the call) changes; a
  parameter it changes is refused."""
  jaxpr = closed.jaxpr
  num_params = len(bound.param_names)
  outs = jaxpr.outvars[1:]
  for k, v in enumerate(outs[:num_params]):
    if source_input(jaxpr, v) != k:
      raise CaptureError(
        f"loss_fn changed the parameter {bound.param_names[k]} while "
        "computing the loss: graphpipe trains parameters with the "
        "optimizer only"
      )
  updated = []
  for j, v in enumerate(outs[num_params:]):
    if bound.state_names[j] in bound.counts:
      continue
    if source_input(jaxpr, v) != num_params + j:
      aval = v.aval
      if not jnp.issubdtype(aval.dtype, jnp.floating):
        raise CaptureError(
          f"loss_fn updates {bound.state_names[j]} ({aval.dtype}) while "
          "computing the loss: graphpipe trains state updates of floating "
          "point values only (running statistics; a replicated stage "
          "averages its replicas' values)"
        )
      updated.append(j)
  return updated


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
