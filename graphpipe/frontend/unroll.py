"""Scanned layer stacks as one node per layer.

Deep JAX models write their layer stack as one `scan` over stacked
parameters (`nnx.scan` over an `nnx.vmap`-built stack, linen `nn.scan`),
so that compile time stays flat as the stack grows. Captured as it is,
the stack is one equation, hence one node: a 24-layer model had at most
the stages of its other modules. Capture unrolls such a scan instead:

  a top-level scan with no stacked outputs (ys) whose stacked operands
  (xs) are all model variables read by nothing else

becomes one copy of its body per layer, and each stacked variable of L
layers becomes L inputs, one per layer ('layers.lin.kernel[3]'), so a
stage holds only its layers' slices. `Stacks.split` cuts the user's
stacked arrays into those inputs and `Stacks.join` stacks them back, so
`update_model` and the trainer's parameters keep the stacked form.

The pipelined step then compiles like the same model written as a Python
loop (the unrolled graph is that model's graph): its compile time grows
with the depth, where plain JAX's scan keeps one body.
"""

from __future__ import annotations

import dataclasses

import jax.extend as jex
import numpy as np
from jax._src import core as jcore


@dataclasses.dataclass(frozen=True)
class Stacks:
  """Stacked model variables that capture splits into layers.

  Attributes:
    lengths: input index (a model variable) -> its number of layers.
  """

  lengths: dict[int, int]

  @classmethod
  def find(cls, closed, num_vars: int) -> Stacks:
    """The scans of `closed` (the traced loss) capture unrolls: their
    stacked operands are model variables (the first `num_vars` inputs)
    that nothing else reads."""
    jaxpr = closed.jaxpr
    uses: dict = {}
    for eqn in jaxpr.eqns:
      for v in eqn.invars:
        if _is_var(v):
          uses[v] = uses.get(v, 0) + 1
    for v in jaxpr.outvars:
      if _is_var(v):
        uses[v] = uses.get(v, 0) + 1
    variables = {v: k for k, v in enumerate(jaxpr.invars[:num_vars])}
    lengths = {}
    for eqn in jaxpr.eqns:
      xs = _scanned(eqn)
      if xs and all(v in variables and uses[v] == 1 for v in xs):
        lengths.update((variables[v], eqn.params["length"]) for v in xs)
    return cls(lengths)

  def position(self, k: int) -> int:
    """The index input `k` (or its first layer) has once split."""
    return sum(self.lengths.get(i, 1) for i in range(k))

  def names(self, names):
    """Per input name, the names of its layers ('a.kernel[0]', ...);
    `names` are those of the first inputs (variables)."""
    out = []
    for k, name in enumerate(names):
      if k in self.lengths:
        out.extend(f"{name}[{i}]" for i in range(self.lengths[k]))
      else:
        out.append(name)
    return out

  def split(self, leaves) -> list:
    """Input leaves -> the unrolled loss's (stacked ones cut per layer)."""
    out = []
    for k, leaf in enumerate(leaves):
      if k in self.lengths:
        out.extend(leaf[i] for i in range(self.lengths[k]))
      else:
        out.append(leaf)
    return out

  def join(self, leaves, first: int, count: int) -> list:
    """Inverse of `split` for the `count` inputs from index `first` on
    (parameters: 0; state: the number of parameters)."""
    out, at = [], 0
    for k in range(first, first + count):
      if k in self.lengths:
        n = self.lengths[k]
        out.append(np.stack([np.asarray(x) for x in leaves[at : at + n]]))
        at += n
      else:
        out.append(leaves[at])
        at += 1
    return out

  def unroll(self, closed):
    """(`closed` with those scans unrolled, per equation of the result the
    (index of the scan it copies, layer), or None)."""
    if not self.lengths:
      return closed, [None] * len(closed.jaxpr.eqns)
    jaxpr = closed.jaxpr
    invars, layers = [], {}
    for k, v in enumerate(jaxpr.invars):
      if k in self.lengths:
        parts = [jcore.Var(_layer_aval(v.aval)) for _ in range(self.lengths[k])]
        layers[v] = parts
        invars.extend(parts)
      else:
        invars.append(v)
    constvars, consts = list(jaxpr.constvars), list(closed.consts)
    subst: dict = {}

    def read(atom):
      return subst.get(atom, atom) if _is_var(atom) else atom

    eqns, origin = [], []
    for index, eqn in enumerate(jaxpr.eqns):
      xs = _scanned(eqn)
      if not xs or any(v not in layers for v in xs):
        eqns.append(eqn.replace(invars=[read(v) for v in eqn.invars]))
        origin.append(None)
        continue
      p = eqn.params
      body = p["jaxpr"]
      inner_consts = []
      for var, value in zip(body.jaxpr.constvars, body.consts, strict=True):
        fresh = jcore.Var(var.aval)
        constvars.append(fresh)
        consts.append(value)
        inner_consts.append(fresh)
      num_consts, num_carry = p["num_consts"], p["num_carry"]
      fixed = [read(v) for v in eqn.invars[:num_consts]]
      carry = [read(v) for v in eqn.invars[num_consts : num_consts + num_carry]]
      order = range(p["length"])
      for i in reversed(order) if p["reverse"] else order:
        env = dict(zip(body.jaxpr.constvars, inner_consts, strict=True))
        env.update(
          zip(
            body.jaxpr.invars,
            fixed + carry + [layers[v][i] for v in xs],
            strict=True,
          )
        )
        for inner in body.jaxpr.eqns:
          outs = [
            v if isinstance(v, jcore.DropVar) else jcore.Var(v.aval)
            for v in inner.outvars
          ]
          env.update(zip(inner.outvars, outs, strict=True))
          eqns.append(
            inner.replace(
              invars=[env.get(v, v) if _is_var(v) else v for v in inner.invars],
              outvars=outs,
            )
          )
          origin.append((index, i))
        carry = [env.get(v, v) if _is_var(v) else v for v in body.jaxpr.outvars]
      subst.update(zip(eqn.outvars, carry, strict=True))
    outvars = [read(v) for v in jaxpr.outvars]
    effects = frozenset().union(*(e.effects for e in eqns))
    debug = jex.core.DebugInfo(
      "graphpipe unrolled", "loss", None, tuple(str(i) for i in outvars)
    )
    new = jex.core.Jaxpr(constvars, invars, outvars, eqns, effects, debug)
    return jex.core.ClosedJaxpr(new, consts), origin


def layer_labels(labels, origin, scan_labels) -> list[str]:
  """Labels of an unrolled loss's equations: a layer's copies are named
  after the scan ('layers[3]'), each layer its own node."""
  out = []
  for label, where in zip(labels, origin, strict=True):
    if where is None:
      out.append(label)
    else:
      index, layer = where
      out.append(f"{scan_labels[index] or 'scan'}[{layer}]")
  return out


def _scanned(eqn):
  """The stacked operands of a scan with no stacked outputs, else None."""
  if eqn.primitive.name != "scan":
    return None
  p = eqn.params
  if len(eqn.outvars) != p["num_carry"]:
    return None
  return list(eqn.invars[p["num_consts"] + p["num_carry"] :]) or None


def _layer_aval(aval):
  return aval.update(shape=aval.shape[1:])


def _is_var(atom) -> bool:
  return not isinstance(atom, jex.core.Literal)
