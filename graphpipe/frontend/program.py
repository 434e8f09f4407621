"""The executable side of a captured graph: one closed jaxpr per piece.

A traced loss is a flat list of equations. Its form (`loss_form`) sorts
them into the per-sample body, the data statistics computed before the
pipeline, the parameter-only terms and the head that combines them;
capture assigns every body equation to a node. `Program` cuts the jaxpr
into one small jaxpr per piece, whose inputs and outputs are named by
`value keys`:

  'param:<path>'  a trainable parameter     'batch:<name>'  a batch leaf
  'state:<path>'  a non-trainable variable  'const:<k>'     a traced constant
  'node<i>:<k>'   the k-th output of node i 'global:<k>'    a data statistic
  'penalty:<k>'   a parameter-only term     'loss'          the head's output

Running the pre-pass, the node jaxprs in topological order (each reading
the keys the earlier ones wrote), the penalties and the head reproduces
the loss: the runtime cuts pipeline stages out of the same pieces, each
micro-batch adding to the sums ('loss_keys') the head reads. Jaxprs have
static shapes, so a program is made for one batch size;
`Program.at_batch_size` re-traces the loss at another size and cuts it
along the same equation groups.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

import jax
import jax.extend as jex
import numpy as np

from graphpipe.errors import CaptureError
from graphpipe.frontend.loss_form import LossForm, producers, ref_of, resolve
from graphpipe.frontend.streams import stream_keys


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


def sub_program(eqns, key_of: dict, outvars, name: str) -> NodeProgram:
  """The equations `eqns` as one closed jaxpr over value keys: its inputs
  are what they read and do not define (each must have a key in
  `key_of`), its outputs `outvars` (keyed by `key_of`)."""
  defined = {v for e in eqns for v in e.outvars}
  invars = {}
  # (An output no equation defines passes an input through: a loss that is
  # one sum has an empty head.)
  for v in [v for e in eqns for v in e.invars] + list(outvars):
    if _is_var(v) and v not in defined:
      if v not in key_of:
        raise CaptureError(
          f"{name} reads {v} defined by no other piece (internal error: "
          "equations out of order)"
        )
      invars.setdefault(v, None)
  effects = frozenset().union(*(e.effects for e in eqns))
  in_keys = tuple(key_of[v] for v in invars)
  out_keys = tuple(key_of[v] for v in outvars)
  debug = jex.core.DebugInfo("graphpipe node", name, in_keys, out_keys)
  sub = jex.core.Jaxpr([], list(invars), list(outvars), eqns, effects, debug)
  return NodeProgram(jex.core.ClosedJaxpr(sub, []), in_keys, out_keys)


@dataclasses.dataclass(frozen=True)
class Pieces:
  """A loss cut into its pieces at one batch size (see `cut`)."""

  nodes: list[NodeProgram]  # per node, its outputs ('node<i>:<k>')
  refs: dict[str, tuple]  # 'node<i>:<k>' -> the value it is (a form Ref)
  consts: dict[str, object]  # 'const:<k>' -> value
  loss_keys: list[str]  # the sums over the batch, in the form's order
  prepass: NodeProgram  # batch -> 'global:<k>' (data statistics)
  penalties: dict[int, NodeProgram]  # node -> its 'penalty:<k>' terms
  head: NodeProgram  # sums, statistics, penalties -> the loss
  updates: dict[str, str]  # 'state:<path>' -> the node output of its update
  statistic_nodes: tuple[int, ...]  # nodes computing chunk statistics


def cut(
  closed: jex.core.ClosedJaxpr,
  input_keys: Sequence[str],
  groups: Sequence[Sequence[int]],
  form: LossForm,
  update_keys: Sequence[str] = (),
) -> Pieces:
  """Cuts `closed` into one jaxpr per group of equation indices, and
  the pre-pass, penalty and head programs of its loss form.

  Args:
    closed: the traced loss.
    input_keys: a value key for each of its invars.
    groups: equation indices of each node (the form's body), nodes in
      topological order.
    form: the loss's form (`graphpipe.frontend.loss_form`).
    update_keys: the state variables the loss updates, in the order of
      `form.updates` (the jaxpr's outputs after the loss).
  """
  jaxpr = closed.jaxpr
  key_of = {}
  for var, key in zip(jaxpr.invars, input_keys, strict=True):
    key_of[var] = key
  consts = {}
  for k, (var, value) in enumerate(
    zip(jaxpr.constvars, closed.consts, strict=True)
  ):
    key_of[var] = f"const:{k}"
    consts[f"const:{k}"] = value
  data = [resolve(jaxpr, r) for r in form.data]
  for k, v in enumerate(data):
    key_of[v] = f"global:{k}"
  sums = [resolve(jaxpr, r) for r in form.sums]
  owner = {}
  for node, group in enumerate(groups):
    for i in group:
      for v in jaxpr.eqns[i].outvars:
        owner[v] = node
  # Which variables each node must export: read by another node or a sum.
  exported = [dict() for _ in groups]
  for node, group in enumerate(groups):
    # Constants inlined into several nodes are defined in each reader.
    defined = {v for i in group for v in jaxpr.eqns[i].outvars}
    for i in group:
      for v in jaxpr.eqns[i].invars:
        if _is_var(v) and v in owner and owner[v] != node and v not in defined:
          exported[owner[v]].setdefault(v, None)
  updates = [resolve(jaxpr, r) for r in form.updates]
  for v in sums + updates:
    exported[owner[v]].setdefault(v, None)
  for node, outs in enumerate(exported):
    for k, v in enumerate(outs):
      key_of[v] = f"node{node}:{k}"
  nodes = [
    sub_program(
      [jaxpr.eqns[i] for i in sorted(group)],
      key_of,
      list(exported[node]),
      f"node{node}",
    )
    for node, group in enumerate(groups)
  ]
  terms = [(resolve(jaxpr, r), n) for r, n in form.penalties]
  for k, (v, _) in enumerate(terms):
    key_of.setdefault(v, f"penalty:{k}")
  penalty_keys = {v: f"penalty:{k}" for k, (v, _) in enumerate(terms)}
  penalties = {}
  for node in sorted({n for _, n in terms}):
    mine = [v for v, n in terms if n == node]
    needed = _needed(jaxpr, form.penalty_eqns, mine)
    keyed = {**key_of, **penalty_keys}
    penalties[node] = sub_program(
      [jaxpr.eqns[i] for i in needed], keyed, mine, f"penalties{node}"
    )
  prepass = sub_program(
    [jaxpr.eqns[i] for i in form.prepass], key_of, data, "prepass"
  )
  head_keys = {**key_of, **penalty_keys}
  head_keys.setdefault(jaxpr.outvars[0], "loss")
  head = sub_program(
    [jaxpr.eqns[i] for i in form.head], head_keys, [jaxpr.outvars[0]], "head"
  )
  producer = producers(jaxpr)
  refs = {
    key_of[v]: ref_of(jaxpr, producer, v) for outs in exported for v in outs
  }
  statistics = {resolve(jaxpr, r) for r in form.statistics}
  return Pieces(
    nodes,
    refs,
    consts,
    [key_of[v] for v in sums],
    prepass,
    penalties,
    head,
    {k: key_of[v] for k, v in zip(update_keys, updates, strict=True)},
    tuple(sorted({owner[v] for v in statistics if v in owner})),
  )


def _needed(jaxpr, eqns, outvars) -> list[int]:
  """The equations among `eqns` that `outvars` depend on."""
  wanted = set(outvars)
  picked = []
  for i in sorted(eqns, reverse=True):
    e = jaxpr.eqns[i]
    if any(v in wanted for v in e.outvars):
      picked.append(i)
      wanted.update(v for v in e.invars if _is_var(v))
  return sorted(picked)


class Program:
  """Executable pieces of a captured loss, for any batch size.

  Args:
    trace: batch size -> closed jaxpr of the loss at that size.
    input_keys: value keys of the loss jaxpr's inputs (variables, batch).
    groups: equation indices of each node, nodes in topological order.
    form: the loss's form (`graphpipe.frontend.loss_form.LossForm`).
    batch_size: the batch size of `closed`.
    closed: the loss jaxpr at `batch_size`.
    flatten: (variables, batch) -> flat leaves in the order of input_keys.
    unflatten_params: parameter leaves in 'param:' key order -> the
      parameters as the user holds them (an nnx.State, a linen dict).

  Attributes (at this batch size, `cut`): `nodes`, `consts`, `loss_keys`
  (the sums over the batch each micro-batch adds to), `prepass` (the
  batch's data statistics), `penalties` (per node, its parameter-only
  terms), `head` (the loss from those), `updates` ('state:' key -> the
  node output holding the variable's new value after a chunk: BatchNorm's
  running statistics) and `statistic_nodes` (nodes normalising by their
  chunk's statistics).
  """

  def __init__(
    self,
    *,
    trace: Callable[[int], jex.core.ClosedJaxpr],
    input_keys: Sequence[str],
    groups: Sequence[Sequence[int]],
    form: LossForm,
    batch_size: int,
    closed: jex.core.ClosedJaxpr,
    flatten: Callable,
    unflatten_params: Callable | None = None,
    update_keys: Sequence[str] = (),
  ):
    self._trace = trace
    self.input_keys = tuple(input_keys)
    self.groups = tuple(tuple(g) for g in groups)
    self.form = form
    self.batch_size = batch_size
    self.closed = closed
    self._flatten = flatten
    self._unflatten_params = unflatten_params
    self._signature = primitive_signature(closed.jaxpr)
    self.update_keys = tuple(update_keys)
    pieces = cut(closed, self.input_keys, self.groups, form, update_keys)
    self.nodes, self.consts = pieces.nodes, pieces.consts
    self.updates = pieces.updates
    self.statistic_nodes = pieces.statistic_nodes
    self.refs = pieces.refs
    self.loss_keys = pieces.loss_keys
    self.prepass, self.penalties = pieces.prepass, pieces.penalties
    self.head = pieces.head
    self._by_size = {batch_size: self}
    self._refused: set[int] = set()

  def traces_at(self, batch_size: int) -> bool:
    """Whether the model's code traces at `batch_size` samples (a reshape
    into pairs of samples does not at 1)."""
    if batch_size in self._by_size:
      return True
    if batch_size not in self._refused:
      try:
        self.at_batch_size(batch_size)
      except Exception:  # the user's code: any error means no
        self._refused.add(batch_size)
    return batch_size not in self._refused

  def known_refused(self, batch_size: int) -> bool:
    """Whether a trace at `batch_size` failed (without tracing)."""
    return batch_size in self._refused

  def cut_rules(self) -> dict[str, list[tuple[int, int]]]:
    """Node pairs the planners must respect (`graphpipe.core.runnable`):
    'apart', an edge whose values hold samples apart along the batch axis
    (a time-major reshape): both ends take chunks of one size; 'joined',
    an edge carrying a value without a batch axis (a statistic over the
    batch, a transform of parameters): both ends in one stage;
    'statistics', layers normalising by their chunk's statistics
    (BatchNorm in training): chunks of one size."""
    apart = {ref for ref, _ in self.form.apart}
    large = self.at_batch_size(2 * self.batch_size)
    shapes = {}
    for node in large.nodes:
      shapes.update(zip(node.outputs, node.output_avals(), strict=True))
    producer = {k: n for n, node in enumerate(self.nodes) for k in node.outputs}
    rules = {"apart": set(), "joined": set(), "statistics": set()}
    # Layers normalising by their chunk's statistics (BatchNorm in
    # training) all see chunks of one size: the plan's micro-batch.
    first, *rest = self.statistic_nodes or (None,)
    rules["statistics"].update((first, n) for n in rest)
    for dst, node in enumerate(self.nodes):
      for key, aval in zip(node.inputs, node.input_avals(), strict=True):
        if key not in producer:
          continue
        pair = (producer[key], dst)
        if tuple(aval.shape) == tuple(shapes[key].shape):
          rules["joined"].add(pair)
        elif self.refs.get(key) in apart:
          rules["apart"].add(pair)
    return {k: sorted(v) for k, v in rules.items()}

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
      form=self.form,
      batch_size=batch_size,
      closed=closed,
      flatten=self._flatten,
      unflatten_params=self._unflatten_params,
      update_keys=self.update_keys,
    )
    other._by_size, other._refused = self._by_size, self._refused
    self._by_size[batch_size] = other
    return other

  @property
  def streams(self) -> tuple[str, ...]:
    """Value keys of the random streams the model draws from ('rng:<path>';
    a Dropout in inference mode keeps a stream it never reads)."""
    read = {k for node in self.nodes for k in node.inputs}
    return tuple(k for k in self.stream_keys(None) if k in read)

  def stream_keys(self, rng) -> dict:
    """'rng:' key -> its key for the step's key `rng` (k-th stream:
    `graphpipe.frontend.streams.stream_keys`); None values for None."""
    keys = [k for k in self.input_keys if k.startswith("rng:")]
    if rng is None:
      return dict.fromkeys(keys)
    return dict(zip(keys, stream_keys(rng, len(keys)), strict=True))

  def flat_inputs(self, variables, batch, rng=None) -> dict[str, object]:
    """Value keys -> arrays for the graph inputs and constants; the
    streams' keys from `rng` (`stream_keys`), else an NNX model's own."""
    keys = None if rng is None else list(self.stream_keys(rng).values())
    leaves = self._flatten(variables, batch, keys)
    env = dict(zip(self.input_keys, leaves, strict=True))
    env.update(self.consts)
    return env

  def variable_values(self, variables) -> dict[str, object]:
    """'param:' and 'state:' keys -> arrays of `variables`."""
    keys = [k for k in self.input_keys if k.startswith(("param:", "state:"))]
    leaves = self._flatten(variables, (), list(self.stream_keys(None).values()))
    return dict(zip(keys, leaves[: len(keys)], strict=True))

  def unflatten_params(self, values: dict[str, object], fallback=None):
    """Parameters by 'param:' key -> the user's structure (nnx.State...);
    keys `values` lacks (parameters no node reads) are taken from the
    variables `fallback` (KeyError without)."""
    return self._unflatten("param", values, fallback)

  def unflatten_state(self, values: dict[str, object], fallback=None):
    """`unflatten_params` for the other variables ('state:' keys)."""
    return self._unflatten("state", values, fallback)

  def _unflatten(self, kind, values, fallback):
    keys = [k for k in self.input_keys if k.startswith(f"{kind}:")]
    if fallback is not None and any(k not in values for k in keys):
      values = {**self.variable_values(fallback), **values}
    return self._unflatten_params([values[k] for k in keys], kind)

  def evaluate(self, variables, batch, rng=None):
    """The loss, computed piece by piece (see OpGraph.evaluate)."""
    sizes = {np.shape(x)[0] for x in jax.tree.leaves(batch)}
    if len(sizes) != 1:
      raise CaptureError(
        f"batch leaves disagree on the batch size: {sorted(sizes)}"
      )
    program = self.at_batch_size(sizes.pop())
    return program.loss(program.run(program.flat_inputs(variables, batch, rng)))

  def run(self, env: dict) -> dict:
    """`env` (value keys of the inputs and constants) with the batch's
    data statistics (unless `env` holds them) and every node's outputs
    added, the nodes run in order."""
    env = dict(env)
    if self.prepass.outputs and self.prepass.outputs[0] not in env:
      env.update(
        zip(
          self.prepass.outputs,
          self.prepass(*[env[k] for k in self.prepass.inputs]),
          strict=True,
        )
      )
    for node in self.nodes:
      outs = node(*[env[k] for k in node.inputs])
      env.update(zip(node.outputs, outs, strict=True))
    return env

  def loss(self, env: dict):
    """The loss from a run's `env`: penalties, then the head."""
    env = dict(env)
    for pieces in self.penalties.values():
      outs = pieces(*[env[k] for k in pieces.inputs])
      env.update(zip(pieces.outputs, outs, strict=True))
    return self.head(*[env[k] for k in self.head.inputs])[0]


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
