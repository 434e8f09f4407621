"""The executable side of a captured graph: one closed jaxpr per node.

A traced loss is a flat list of equations. Capture assigns every equation
to a node; `Program` cuts the jaxpr into one small jaxpr per node, whose
inputs and outputs are named by `value keys`:

  'param:<path>'  a trainable parameter     'batch:<name>'  a batch leaf
  'state:<path>'  a non-trainable variable  'const:<k>'     a traced constant
  'node<i>:<k>'   the k-th output of node i

Evaluating the node jaxprs in topological order, each reading the keys the
earlier ones wrote, reproduces the loss: the runtime cuts pipeline stages
out of the same pieces. Jaxprs have static shapes, so a program is made for
one batch size; `Program.at_batch_size` re-traces the loss at another size
and cuts it along the same equation groups.
"""

from __future__ import annotations

import dataclasses
import functools
import operator
from collections.abc import Callable, Sequence

import jax
import jax.extend as jex
import numpy as np

from graphpipe.errors import CaptureError


@dataclasses.dataclass(frozen=True)
class NodeProgram:
  """A node's computation: `outputs = jaxpr(*inputs)` over value keys."""

  jaxpr: jex.core.ClosedJaxpr
  inputs: tuple[str, ...]
  outputs: tuple[str, ...]

  def __call__(self, *args):
    return tuple(jex.core.jaxpr_as_fun(self.jaxpr)(*args))

  def input_avals(self):
    return [v.aval for v in self.jaxpr.jaxpr.invars]

  def output_avals(self):
    return [v.aval for v in self.jaxpr.jaxpr.outvars]


def _is_var(atom) -> bool:
  return not isinstance(atom, jex.core.Literal)


def primitive_signature(jaxpr) -> tuple[str, ...]:
  """The sequence of top-level primitive names: the shape of a trace."""
  return tuple(e.primitive.name for e in jaxpr.eqns)


def cut(
  closed: jex.core.ClosedJaxpr,
  input_keys: Sequence[str],
  groups: Sequence[Sequence[int]],
  loss_terms: Sequence[tuple[int, int]] | None = None,
  loss_constant: float = 0.0,
) -> tuple[list[NodeProgram], dict[str, object], list[str]]:
  """Cuts `closed` into one jaxpr per group of equation indices.

  Args:
    closed: the traced loss.
    input_keys: a value key for each of its invars.
    groups: equation indices of each node, nodes in topological order.
    loss_terms: (equation index, output index) of each value whose sum is
      the loss; None means the jaxpr's own output.
    loss_constant: added to the first loss term by its node (the constants
      the summing equations added, which leave with them).

  Returns:
    (node programs, constants by 'const:k' key, keys of the loss terms).
  """
  jaxpr = closed.jaxpr
  if loss_terms is None:
    loss_vars = list(jaxpr.outvars)
  else:
    loss_vars = [jaxpr.eqns[i].outvars[k] for i, k in loss_terms]
  key_of = {}
  for var, key in zip(jaxpr.invars, input_keys, strict=True):
    key_of[var] = key
  consts = {}
  for k, (var, value) in enumerate(
    zip(jaxpr.constvars, closed.consts, strict=True)
  ):
    key_of[var] = f"const:{k}"
    consts[f"const:{k}"] = value
  owner = {}
  for node, group in enumerate(groups):
    for i in group:
      for v in jaxpr.eqns[i].outvars:
        owner[v] = node
  # Which variables each node must export: read by another node or returned.
  exported = [dict() for _ in groups]
  for node, group in enumerate(groups):
    # Constants inlined into several nodes are defined in each reader.
    defined = {v for i in group for v in jaxpr.eqns[i].outvars}
    for i in group:
      for v in jaxpr.eqns[i].invars:
        if _is_var(v) and v in owner and owner[v] != node and v not in defined:
          exported[owner[v]].setdefault(v, None)
  extra = {}  # node -> equations appended to it
  if loss_constant and loss_terms is not None:
    first = loss_vars[0]
    shifted = jex.core.Var(first.aval)
    extra[owner[first]] = [
      jex.core.new_jaxpr_eqn(
        [
          first,
          jex.core.Literal(
            np.asarray(loss_constant, first.aval.dtype), first.aval
          ),
        ],
        [shifted],
        jax.lax.add_p,
        {},
        jex.core.no_effects,
      )
    ]
    owner[shifted] = owner[first]
    loss_vars[0] = shifted
  for v in loss_vars:
    if _is_var(v) and v in owner:
      exported[owner[v]].setdefault(v, None)
  for node, outs in enumerate(exported):
    for k, v in enumerate(outs):
      key_of[v] = f"node{node}:{k}"
  programs = []
  for node, group in enumerate(groups):
    eqns = [jaxpr.eqns[i] for i in sorted(group)] + extra.get(node, [])
    defined = {v for e in eqns for v in e.outvars}
    invars = {}
    for e in eqns:
      for v in e.invars:
        if _is_var(v) and v not in defined:
          if v not in key_of:
            raise CaptureError(
              f"node {node} reads {v} defined by no node (internal "
              "error: equations out of order)"
            )
          invars.setdefault(v, None)
    outvars = list(exported[node])
    effects = frozenset().union(*(e.effects for e in eqns))
    in_keys = tuple(key_of[v] for v in invars)
    out_keys = tuple(key_of[v] for v in outvars)
    debug = jex.core.DebugInfo(
      "graphpipe node", f"node{node}", in_keys, out_keys
    )
    sub = jex.core.Jaxpr([], list(invars), outvars, eqns, effects, debug)
    programs.append(
      NodeProgram(jex.core.ClosedJaxpr(sub, []), in_keys, out_keys)
    )
  loss_keys = []
  for v in loss_vars:
    if not _is_var(v) or v not in key_of:
      raise CaptureError(
        "the loss does not depend on any computation of the model: "
        "loss_fn must compute the loss from the model's outputs"
      )
    loss_keys.append(key_of[v])
  return programs, consts, loss_keys


class Program:
  """Executable node jaxprs of a captured graph, for any batch size.

  Args:
    trace: batch size -> closed jaxpr of the loss at that size.
    input_keys: value keys of the loss jaxpr's inputs (variables, batch).
    in_tree: the pytree structure of (params, state, batch) at capture.
    groups: equation indices of each node, nodes in topological order.
    loss_terms: positions (equation, output) of the values whose sum is
      the loss; None when the loss is the jaxpr's output.
    loss_constant: constants the loss adds to those terms (`cut`).
    batch_size: the batch size of `closed`.
    closed: the loss jaxpr at `batch_size`.
    flatten: (variables, batch) -> flat leaves in the order of input_keys.
    unflatten_params: parameter leaves in 'param:' key order -> the
      parameters as the user holds them (an nnx.State, a linen dict).
  """

  def __init__(
    self,
    *,
    trace: Callable[[int], jex.core.ClosedJaxpr],
    input_keys: Sequence[str],
    groups: Sequence[Sequence[int]],
    loss_terms: Sequence[tuple[int, int]] | None,
    batch_size: int,
    closed: jex.core.ClosedJaxpr,
    flatten: Callable,
    unflatten_params: Callable | None = None,
    loss_constant: float = 0.0,
  ):
    self._trace = trace
    self.input_keys = tuple(input_keys)
    self.groups = tuple(tuple(g) for g in groups)
    self.loss_terms = loss_terms
    self.loss_constant = loss_constant
    self.batch_size = batch_size
    self.closed = closed
    self._flatten = flatten
    self._unflatten_params = unflatten_params
    self._signature = primitive_signature(closed.jaxpr)
    self.nodes, self.consts, self.loss_keys = cut(
      closed, self.input_keys, self.groups, loss_terms, loss_constant
    )
    self._by_size = {batch_size: self}

  def at_batch_size(self, batch_size: int) -> Program:
    """The same program re-traced for batches of `batch_size` samples."""
    if batch_size in self._by_size:
      return self._by_size[batch_size]
    closed = self._trace(batch_size)
    if primitive_signature(closed.jaxpr) != self._signature:
      raise CaptureError(
        f"the loss traced at batch size {batch_size} has a different "
        f"structure than at {self.batch_size}: the model's Python code "
        "depends on the batch size, so one graph cannot serve both"
      )
    other = Program(
      trace=self._trace,
      input_keys=self.input_keys,
      groups=self.groups,
      loss_terms=self.loss_terms,
      loss_constant=self.loss_constant,
      batch_size=batch_size,
      closed=closed,
      flatten=self._flatten,
      unflatten_params=self._unflatten_params,
    )
    other._by_size = self._by_size
    self._by_size[batch_size] = other
    return other

  def flat_inputs(self, variables, batch) -> dict[str, object]:
    """Value keys -> arrays for the graph inputs and constants."""
    leaves = self._flatten(variables, batch)
    env = dict(zip(self.input_keys, leaves, strict=True))
    env.update(self.consts)
    return env

  def variable_values(self, variables) -> dict[str, object]:
    """'param:' and 'state:' keys -> arrays of `variables`."""
    leaves = self._flatten(variables, ())
    keys = [k for k in self.input_keys if k.startswith(("param:", "state:"))]
    return dict(zip(keys, leaves, strict=True))

  def unflatten_params(self, values: dict[str, object], fallback=None):
    """Parameters by 'param:' key -> the user's structure (nnx.State...);
    keys `values` lacks (parameters no node reads) are taken from the
    variables `fallback` (KeyError without)."""
    keys = [k for k in self.input_keys if k.startswith("param:")]
    if fallback is not None and any(k not in values for k in keys):
      values = {**self.variable_values(fallback), **values}
    return self._unflatten_params([values[k] for k in keys])

  def evaluate(self, variables, batch):
    """The loss, computed node by node (see OpGraph.evaluate)."""
    sizes = {np.shape(x)[0] for x in jax.tree.leaves(batch)}
    if len(sizes) != 1:
      raise CaptureError(
        f"batch leaves disagree on the batch size: {sorted(sizes)}"
      )
    program = self.at_batch_size(sizes.pop())
    env = program.run(program.flat_inputs(variables, batch))
    return functools.reduce(operator.add, [env[k] for k in program.loss_keys])

  def run(self, env: dict) -> dict:
    """`env` (value keys of the inputs and constants) with every node's
    outputs added, the nodes run in order."""
    env = dict(env)
    for node in self.nodes:
      outs = node(*[env[k] for k in node.inputs])
      env.update(zip(node.outputs, outs, strict=True))
    return env


def source_input(jaxpr, var) -> int | None:
  """The index of the input of `jaxpr` that `var` is, through equations
  that only pass it on (a nested jaxpr returning its own input); None if
  it is computed."""
  made = {v: (e, k) for e in jaxpr.eqns for k, v in enumerate(e.outvars)}
  while var not in jaxpr.invars:
    if isinstance(var, jex.core.Literal) or var not in made:
      return None
    eqn, k = made[var]
    subs = list(jex.core.jaxprs_in_params(eqn.params))
    if len(subs) != 1:
      return None
    sub = getattr(subs[0], "jaxpr", subs[0])
    if (len(sub.invars), len(sub.outvars)) != (
      len(eqn.invars),
      len(eqn.outvars),
    ):
      return None
    inner = source_input(sub, sub.outvars[k])
    if inner is None:
      return None
    var = eqn.invars[inner]
  return jaxpr.invars.index(var)
