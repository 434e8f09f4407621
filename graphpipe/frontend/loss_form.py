"""How a loss combines micro-batches, proven from its program.

Walking back from the loss's output (`samplewise` says what every value
holds), a loss the pipeline can run is

    loss = head(S_1..S_m, D_1..D_k, Q_1..Q_r)

  S_i  sums over the batch of per-sample terms that depend on parameters
       (sum(ce * w), the sum inside a mean): each micro-batch adds its
       part; they are the graph's *loss outputs*;
  D_j  statistics of the batch's data alone (sum(w), a token count, a
       feature's max): computed once over the whole batch before the
       pipeline runs ('global:j'), readable anywhere;
  Q_k  terms of parameters alone (a weight penalty), each read from the
       parameters of one node: computed once per step by the stage that
       holds them ('penalty:k');
  head the few scalar operations that combine them (a division by the
       batch size or by a token count, a sum of two losses), run once per
       step after the last micro-batch.

The backward of each micro-batch needs d loss / d S_i before the sums are
complete. Where the head is affine in the S (every mean, masked mean,
mean plus summed term, penalty), that derivative does not depend on them
and is computed first ('affine'); a single scalar S may sit under any
function (log of a mean), its micro-batches then run with derivative 1
and the gradients are scaled at the end ('scaled'). Several sums under a
non-affine head are refused, naming the term.

Where a sum's terms are not per sample (a contrastive product across the
batch, normalisation by a batch statistic of parameter-dependent values,
a max over the batch), the form still holds for one micro-batch holding
the whole batch: `LossForm.unsplittable` says why any other plan would
train wrong, and the trainer and planners keep such plans out.
"""

from __future__ import annotations

import dataclasses
import math

import jax.extend as jex

from graphpipe.errors import CaptureError
from graphpipe.frontend import running
from graphpipe.frontend import samplewise as sw
from graphpipe.frontend.dataflow import operands, producers, slice_of

# A value of the traced loss, valid at any batch size: the k-th output of
# equation i ('eqn', i, k), input i ('in', i) or constant k ('const', k).
Ref = tuple


@dataclasses.dataclass(frozen=True)
class LossForm:
  """The structure of a loss (see the module docstring), by equation.

  Attributes:
    body: equations of the per-sample computation, including the sums.
    sums: the S values, in the order of the loss outputs.
    data: the D values (data statistics computed before the pipeline).
    prepass: equations that compute `data` from the batch.
    head: equations of the head (its constants included).
    penalty_roots: parameter-only values the head reads (before they are
      split by node, `assign_penalties`).
    penalties: (ref, owner node) of each Q value, once assigned.
    penalty_eqns: equations that compute the Q values.
    mode: 'affine' or 'scaled'.
    sum_sizes: elements of each S value.
    unsplittable: why the loss is exact only on the whole batch at once
      (None where any micro-batching is exact).
    apart: (ref, why) of body values whose samples' elements are not one
      block each along the batch axis (a time-major reshape, two views
      stacked): they cannot be cut into other chunk sizes between stages.
  """

  body: tuple[int, ...]
  sums: tuple[Ref, ...]
  data: tuple[Ref, ...]
  prepass: tuple[int, ...]
  head: tuple[int, ...]
  penalty_roots: tuple[Ref, ...]
  mode: str
  sum_sizes: tuple[int, ...]
  unsplittable: str | None
  penalties: tuple[tuple[Ref, int], ...] = ()
  penalty_eqns: tuple[int, ...] = ()
  apart: tuple[tuple[Ref, str], ...] = ()
  updates: tuple[Ref, ...] = ()
  statistics: tuple[Ref, ...] = ()

  def describe(self) -> str:
    """One line: the loss's terms and how micro-batches combine."""
    parts = [
      f"{len(self.sums)} sum{'s' * (len(self.sums) != 1)} over the batch"
    ]
    if self.data:
      parts.append(
        f"{len(self.data)} data statistic{'s' * (len(self.data) != 1)}"
      )
    if self.penalties or self.penalty_roots:
      n = len(self.penalties or self.penalty_roots)
      parts.append(f"{n} parameter term{'s' * (n != 1)}")
    split = (
      "micro-batches add their sums"
      if self.unsplittable is None
      else "exact only on the whole batch"
    )
    return f"loss = head({', '.join(parts)}), {self.mode}; {split}"


def ref_of(jaxpr, producer, var) -> Ref:
  if var in producer:
    i, k = producer[var]
    return ("eqn", i, k)
  if var in jaxpr.invars:
    return ("in", jaxpr.invars.index(var))
  return ("const", jaxpr.constvars.index(var))


def resolve(jaxpr, ref: Ref):
  """The variable `ref` names in `jaxpr` (the loss at some batch size)."""
  if ref[0] == "eqn":
    return jaxpr.eqns[ref[1]].outvars[ref[2]]
  if ref[0] == "in":
    return jaxpr.invars[ref[1]]
  return jaxpr.constvars[ref[1]]


def find(
  small, large, num_vars: int, num_streams: int = 0, updated=()
) -> LossForm:
  """The loss's form from its jaxpr at two batch sizes.

  Args:
    small, large: the loss jaxpr (open) at two batch sizes: the loss, then
      the new values of the state variables it updates.
    num_vars: how many leading inputs are model variables (parameters and
      state); `num_streams` random streams' keys follow them, then the
      batch leaves.
    updated: input indices of the state variables the loss updates.

  Raises:
    CaptureError: where the loss has no batch-dependent term that depends
      on the parameters, or combines several sums non-affinely.
  """
  first_leaf = num_vars + num_streams
  inputs = (
    [sw.free(True)] * num_vars
    + [sw.free(True, stream=True)] * num_streams
    + [
      sw.rows(0, large.invars[i].aval.shape[0])
      for i in range(first_leaf, len(small.invars))
    ]
  )
  producer = producers(small)
  shapes_large = {}
  for ea, eb in zip(small.eqns, large.eqns, strict=True):
    for va, vb in zip(ea.outvars, eb.outvars, strict=True):
      shapes_large[va] = vb.aval.shape
  for va, vb in zip(small.invars, large.invars, strict=True):
    shapes_large[va] = vb.aval.shape

  def batched(v) -> bool:
    return tuple(v.aval.shape) != tuple(shapes_large.get(v, v.aval.shape))

  updates = list(small.outvars[1:])
  if any(v not in producer for v in updates):
    raise CaptureError(
      "loss_fn sets a state variable to a constant or to another input: "
      "graphpipe trains state updated from the batch (running statistics)"
    )
  statistics = running.chunk_statistics(
    small, producer, sw.Walk(small, large, inputs).states, updates, batched
  )
  walk = sw.Walk(
    small, large, inputs, overrides=dict.fromkeys(statistics, sw.free(True))
  )
  states = walk.states

  def data_statistic(v) -> bool:
    """Computed from the batch's data alone, without a batch axis (its
    equation reads no variable: a nested call may return such a value
    beside parameter-dependent ones)."""
    s = states.get(v)
    if s is None or s.kind not in (sw.GLOBAL, sw.MIXED) or s.params:
      return False
    if batched(v) or v not in producer:
      return False
    eqn = small.eqns[producer[v][0]]
    return not any(states[u].params for u in operands(eqn) if u in states)

  loss = small.outvars[0]
  if isinstance(loss, jex.core.Literal) or loss not in states:
    raise CaptureError(
      "the loss does not depend on any computation of the model: loss_fn "
      "must compute the loss from the model's outputs"
    )
  head, sums, data, roots = set(), [], [], []
  seen, stack = set(), [loss]
  while stack:
    v = stack.pop()
    if v in seen:
      continue
    seen.add(v)
    if v in small.invars:
      if small.invars.index(v) < num_vars:
        roots.append(v)  # a parameter the head reads itself
      continue
    if v in small.constvars:
      continue
    if data_statistic(v):
      data.append(v)
      continue
    state = states[v]
    i, _ = producer[v]
    eqn = small.eqns[i]
    if state.kind == sw.FREE:
      if state.params:
        roots.append(v)
      else:
        head.add(i)
        stack.extend(operands(eqn))
      continue
    if any(batched(u) for u in operands(eqn)):
      sums.append(v)  # a reduction over the batch: a loss output
      continue
    head.add(i)
    stack.extend(operands(eqn))
  if not sums:
    raise CaptureError(
      "the loss does not depend on the parameters through the batch (no "
      "term of it sums model outputs over the samples): there is nothing "
      "to train by pipelining"
    )
  sums.sort(key=lambda v: producer[v])
  running.check_reads(small, producer, sums, roots, statistics, updated)
  body = slice_of(small, producer, sums + updates, data_statistic)
  for i in body:  # statistics the per-sample code reads (x - mean(x))
    for u in operands(small.eqns[i]):
      if u in producer and data_statistic(u) and u not in data:
        data.append(u)
  data.sort(key=lambda v: producer[v])
  prepass = slice_of(small, producer, data)
  sum_sizes = tuple(math.prod(v.aval.shape) for v in sums)
  affine = _affine(small, sorted(head), set(sums))
  if not affine and sum(sum_sizes) != 1:
    raise CaptureError(
      "the loss combines several sums over the batch non-linearly ("
      + ", ".join(sw.describe(small.eqns[producer[v][0]]) for v in sums[:4])
      + "): no micro-batch can start its backward before all of them are "
      "known. Write it as one sum, or as a sum of such terms each scaled "
      "by constants or data statistics (e.g. sum((ce + z) * w) / sum(w))"
    )
  unsplittable = None
  for v in sums:
    state = states[v]
    if state.kind == sw.MIXED:
      unsplittable = state.why
    elif not state.summed:
      unsplittable = (
        f"{sw.describe(small.eqns[producer[v][0]])} reduces values that "
        "depend on the parameters over the batch by other than a sum (a "
        "max, a product, a selection of samples)"
      )
    if unsplittable:
      break
  apart = []
  for i in body:
    for v in small.eqns[i].outvars:
      state = states[v]
      if not batched(v) or state.blocked:
        continue
      why = state.why or (
        f"{sw.describe(small.eqns[i])} lays each sample's elements apart "
        "along the batch axis"
        if state.kind == sw.ROWS
        else f"{sw.describe(small.eqns[i])} reads samples' positions"
      )
      apart.append((ref_of(small, producer, v), why))
  return LossForm(
    apart=tuple(apart),
    body=tuple(body),
    sums=tuple(ref_of(small, producer, v) for v in sums),
    data=tuple(ref_of(small, producer, v) for v in data),
    prepass=tuple(prepass),
    head=tuple(sorted(head)),
    penalty_roots=tuple(ref_of(small, producer, v) for v in roots),
    mode="affine" if affine else "scaled",
    sum_sizes=sum_sizes,
    unsplittable=unsplittable,
    updates=tuple(ref_of(small, producer, v) for v in updates),
    statistics=tuple(ref_of(small, producer, v) for v in statistics),
  )


# Primitives through which a value stays affine in its operands.
_LINEAR = frozenset(
  """
  add add_any sub neg convert_element_type reduce_sum broadcast_in_dim
  reshape squeeze transpose slice concatenate copy copy_p rev
  expand_dims pad
  """.split()
)


def _affine(jaxpr, head, sums) -> bool:
  """Whether the loss (computed by the `head` equations) is affine in the
  `sums`: d loss / d S does not depend on the S."""
  # 0: does not depend on the sums, 1: affine in them, 2: otherwise.
  level = {v: 1 for v in sums}

  def of(atom):
    return 0 if isinstance(atom, jex.core.Literal) else level.get(atom, 0)

  for i in head:
    eqn = jaxpr.eqns[i]
    ins = [of(v) for v in eqn.invars]
    name = eqn.primitive.name
    if max(ins, default=0) == 0:
      out = 0
    elif name in _LINEAR:
      out = max(ins)
    elif name == "mul":
      out = max(ins) if sorted(ins)[0] == 0 and max(ins) == 1 else 2
    elif name == "div":
      out = ins[0] if ins[1] == 0 and ins[0] <= 1 else 2
    elif name == "dot_general":
      out = max(ins) if min(ins) == 0 and max(ins) == 1 else 2
    elif name == "select_n":
      out = max(ins[1:]) if ins[0] == 0 and max(ins[1:]) <= 1 else 2
    else:
      out = 2
    for v in eqn.outvars:
      level[v] = out
  return all(of(v) <= 1 for v in jaxpr.outvars)


def assign_penalties(form: LossForm, jaxpr, num_vars: int, groups) -> LossForm:
  """Splits the head's parameter-only values into terms that each read
  the variables of one node (`groups`: the nodes' equations).

  A value read from several nodes' parameters moves into the head when
  its equation combines them (`sum(p1**2) + sum(p2**2)`: the two sums
  become the terms); variables no node reads go to the node of the first
  sum.
  """
  where = {v: k for k, v in enumerate(jaxpr.invars[:num_vars])}
  node_of_var, node_of_out = {}, {}
  for node, group in enumerate(groups):
    for i in group:
      for v in operands(jaxpr.eqns[i]):
        if v in where:
          node_of_var.setdefault(where[v], node)
      for v in jaxpr.eqns[i].outvars:
        node_of_out[v] = node
  loss_node = node_of_out[resolve(jaxpr, form.sums[0])]
  num_params_and_state = num_vars
  producer = producers(jaxpr)
  eqns = jaxpr.eqns
  memo = {}

  def owners(v) -> frozenset:
    if isinstance(v, jex.core.Literal):
      return frozenset()
    if v in memo:
      return memo[v]
    if v in jaxpr.invars:
      k = jaxpr.invars.index(v)
      out = (
        frozenset({node_of_var.get(k, loss_node)})
        if (k < num_params_and_state)
        else frozenset()
      )
    elif v in producer:
      out = frozenset().union(*(owners(u) for u in eqns[producer[v][0]].invars))
    else:
      out = frozenset()
    memo[v] = out
    return out

  head = set(form.head)
  terms, stack = [], [resolve(jaxpr, r) for r in form.penalty_roots]
  seen = set()
  while stack:
    v = stack.pop()
    if v in seen:
      continue
    seen.add(v)
    who = owners(v)
    if not who:  # built from constants alone: the head computes it
      if v in producer:
        head.add(producer[v][0])
        stack.extend(operands(eqns[producer[v][0]]))
      continue
    if len(who) == 1:
      terms.append((v, next(iter(who))))
      continue
    if v not in producer or eqns[producer[v][0]].primitive.name in sw.CALLS:
      raise CaptureError(
        "a term of the loss reads the parameters of several layers at once "
        f"({_where(jaxpr, producer, v)}) in a way that cannot be split "
        "per layer: write it as a sum of per-layer terms (e.g. "
        "sum(jnp.sum(p ** 2) for p in leaves))"
      )
    i = producer[v][0]
    head.add(i)
    stack.extend(operands(eqns[i]))
  elements = sum(math.prod(v.aval.shape) for v, _ in terms)
  if elements > 1 << 16:
    raise CaptureError(
      f"the loss's parameter-only terms hold {elements} values read across "
      "layers (e.g. all parameters concatenated before a norm): write the "
      "term as a sum of per-parameter sums (sum(jnp.sum(p ** 2) for p in "
      "leaves)) so that each layer's stage computes its own part"
    )
  terms.sort(key=lambda t: ref_of(jaxpr, producer, t[0]))
  needed = slice_of(jaxpr, producer, [v for v, _ in terms])
  return dataclasses.replace(
    form,
    head=tuple(sorted(head)),
    penalties=tuple((ref_of(jaxpr, producer, v), n) for v, n in terms),
    penalty_eqns=tuple(needed),
  )


def _where(jaxpr, producer, v) -> str:
  if v in producer:
    return sw.describe(jaxpr.eqns[producer[v][0]])
  return "a parameter read directly"
