"""The walk: every variable of a jaxpr at two batch sizes gets a `State`,
one rule per primitive (`shapes`, `operators`; calls, loops and branches
here, where they walk their bodies)."""

from __future__ import annotations

import dataclasses

import jax.extend as jex
import numpy as np

from graphpipe.frontend.samplewise import operators, shapes
from graphpipe.frontend.samplewise.state import (
  FREE,
  GLOBAL,
  MIXED,
  State,
  batch_axes,
  describe,
  free,
  is_var,
  join,
  mixed,
  shape_of,
)

_ELEMENTWISE = frozenset(
  """
  abs acos acosh add add_any and asin asinh atan atan2 atanh
  bessel_i0e bessel_i1e bitcast_convert_type cbrt ceil clamp clz complex
  conj convert_element_type copy copy_p cos cosh digamma div eq erf
  erf_inv erfc exp exp2 expm1 floor ge gt igamma igamma_grad_a igammac
  imag integer_pow is_finite le lgamma log log1p logistic lt max min mul
  ne neg nextafter not or polygamma population_count pow real
  reduce_precision rem round rsqrt select_n shift_left
  shift_right_arithmetic shift_right_logical sign sin sinh sqrt square
  stop_gradient sub tan tanh xor zeta random_wrap random_unwrap
  random_fold_in threefry2x32 random_seed optimization_barrier
  square erf_inv
  """.split()
)
CALLS = frozenset(
  {
    "jit",
    "pjit",
    "closed_call",
    "core_call",
    "remat2",
    "checkpoint",
    "custom_jvp_call",
    "custom_vjp_call",
    "custom_vjp_call_jaxpr",
  }
)
_REDUCTIONS = frozenset(
  {
    "reduce_sum",
    "reduce_max",
    "reduce_min",
    "reduce_prod",
    "reduce_and",
    "reduce_or",
    "reduce_xor",
    "argmax",
    "argmin",
  }
)
_CUMULATIVE = frozenset(
  {"cumsum", "cumprod", "cummax", "cummin", "cumlogsumexp"}
)
_WINDOWED = frozenset(
  {
    "reduce_window_sum",
    "reduce_window_max",
    "reduce_window_min",
    "reduce_window",
  }
)
_DRAWS = frozenset({"random_bits", "random_split", "rng_bit_generator"})


class Walk:
  """Walks a jaxpr at two batch sizes, giving every variable a `State`.

  Args:
    small, large: the same jaxpr traced at two batch sizes (equal
      equations, shapes differing along batch axes).
    inputs: the states of its inputs.
    overrides: variable -> the state it is given whatever its equation
      makes (a layer's batch statistics, per chunk by declaration).
    nested: a jaxpr inside an equation (its GLOBAL values are `local`).
  """

  def __init__(
    self, small, large, inputs, *, nested=False, where="", overrides=None
  ):
    self.small, self.large, self.nested = small, large, nested
    self.where = where
    self.states: dict = {}
    for v, s in zip(small.invars, inputs, strict=True):
      self.states[v] = s
    for v in small.constvars:
      self.states[v] = free()
    self.eqn_of: dict = {}
    for ea, eb in zip(small.eqns, large.eqns, strict=True):
      outs = self._eqn(ea, eb)
      for v, s in zip(ea.outvars, outs, strict=True):
        self.states[v] = (overrides or {}).get(v, s)
        self.eqn_of[v] = ea

  def describe(self, eqn) -> str:
    """The equation and where it was written; inside a nested jaxpr, the
    top-level call's place (the inner lines are JAX's own code)."""
    if self.where:
      return f"{eqn.primitive.name} in {self.where}"
    return describe(eqn)

  def of(self, atom) -> State:
    if not is_var(atom):
      return free()
    return self.states.get(atom, free())

  def outputs(self) -> list[State]:
    return [self.of(v) for v in self.small.outvars]

  # One equation.

  def _eqn(self, ea, eb) -> list[State]:
    ins = [self.of(v) for v in ea.invars]
    params = any(s.params for s in ins)
    out_axes = [
      batch_axes(shape_of(va), shape_of(vb))
      for va, vb in zip(ea.outvars, eb.outvars, strict=True)
    ]
    for s in ins:
      if s.kind == MIXED:
        return [
          self._statistic(self._mixed_out(s.why, params, axes), axes)
          for axes in out_axes
        ]
    if any(len(axes) > 1 or -1 in axes for axes in out_axes):
      return [
        self._mixed_out(
          f"{self.describe(ea)} makes a value with several batch axes "
          "(every sample against every other)",
          params,
          axes,
        )
        for axes in out_axes
      ]
    if not any(s.batched or s.kind == GLOBAL for s in ins) and not any(
      out_axes
    ):
      stream = any(s.stream for s in ins)
      # A stream's key into a draw or a call (that may draw): walked.
      if not stream or (
        ea.primitive.name not in _DRAWS
        and not jex.core.jaxprs_in_params(ea.params)
      ):
        return [free(params, stream)] * len(ea.outvars)
    # A literal that changes with the batch size (x / x.shape[0]) makes
    # a chunk's values differ from its part of the batch's.
    differs = any(
      not is_var(va) and not np.array_equal(va.val, vb.val)
      for va, vb in zip(ea.invars, eb.invars, strict=True)
    )
    if differs and any(out_axes):
      return [
        self._mixed_out(
          f"{self.describe(ea)} uses the batch size in a per-sample value "
          "(divide by it after summing over the batch)",
          params,
          axes,
        )
        for axes in out_axes
      ]
    name = ea.primitive.name
    rule = _RULES.get(name)
    if rule is None:
      if name in _ELEMENTWISE:
        rule = shapes.elementwise
      elif name in CALLS:
        rule = _call
      elif name in _REDUCTIONS:
        rule = shapes.reduction
      elif name in _CUMULATIVE:
        rule = shapes.cumulative
      elif name in _WINDOWED:
        rule = shapes.windowed
      elif name in _DRAWS:
        rule = operators.draw
      elif name.startswith("scatter"):
        rule = operators.scatter
      else:
        rule = shapes.unknown
    outs = rule(self, ea, eb, ins, out_axes)
    return [
      self._statistic(s, axes) for s, axes in zip(outs, out_axes, strict=True)
    ]

  def _statistic(self, s: State, axes) -> State:
    """A statistic made by an equation of a nested jaxpr is computed at
    each chunk's size; one a top-level equation makes (a call returning
    it included) can be computed once over the whole batch. Of the batch's
    data alone, any value without a batch axis is such a statistic, also
    one computed from values that mix samples (a variance)."""
    if s.kind == MIXED and not axes and not s.params:
      s = State(GLOBAL)
    if s.kind == GLOBAL:
      return dataclasses.replace(s, local=self.nested)
    return s

  @staticmethod
  def _mixed_out(why, params, axes) -> State:
    return mixed(why, params, axes[0] if len(axes) == 1 else None)


def _sub_walk(walk, ea, eb, sub_a, sub_b, ins):
  where = walk.where or describe(ea)
  return Walk(
    _open(sub_a), _open(sub_b), ins, nested=True, where=where
  ).outputs()


def _open(jaxpr):
  return getattr(jaxpr, "jaxpr", jaxpr)


def _subs(eqn):
  return [_open(j) for j in jex.core.jaxprs_in_params(eqn.params)]


def _call(walk, ea, eb, ins, out_axes):
  subs_a, subs_b = _subs(ea), _subs(eb)
  if len(subs_a) != 1 or len(subs_a[0].invars) != len(ins):
    return shapes.unknown(walk, ea, eb, ins, out_axes)
  outs = _sub_walk(walk, ea, eb, subs_a[0], subs_b[0], ins)
  if len(outs) != len(ea.outvars):
    return shapes.unknown(walk, ea, eb, ins, out_axes)
  return outs


def _scan(walk, ea, eb, ins, out_axes):
  p = ea.params
  nc, nk = p["num_consts"], p["num_carry"]
  body_a, body_b = _subs(ea)[0], _subs(eb)[0]
  consts, carry, xs = ins[:nc], ins[nc : nc + nk], ins[nc + nk :]
  sliced = []
  for s in xs:
    if s.batched and s.axis == 0:
      return [
        walk._mixed_out(
          f"{walk.describe(ea)} loops over the batch axis", True, axes
        )
        for axes in out_axes
      ]
    sliced.append(shapes.moved(s, s.axis - 1) if s.batched else s)
  for _ in range(3):  # a carry holds what the body puts into it
    outs = _sub_walk(walk, ea, eb, body_a, body_b, consts + carry + sliced)
    new = [join(c, o) for c, o in zip(carry, outs[:nk], strict=True)]
    if new == carry:
      break
    carry = new
  outs = _sub_walk(walk, ea, eb, body_a, body_b, consts + carry + sliced)
  ys = [shapes.moved(s, s.axis + 1) if s.batched else s for s in outs[nk:]]
  return carry + ys


def _while(walk, ea, eb, ins, out_axes):
  p = ea.params
  cn, bn = p["cond_nconsts"], p["body_nconsts"]
  cond_consts, body_consts = ins[:cn], ins[cn : cn + bn]
  carry = ins[cn + bn :]
  body_a, body_b = _open(p["body_jaxpr"]), _open(eb.params["body_jaxpr"])
  cond_a, cond_b = _open(p["cond_jaxpr"]), _open(eb.params["cond_jaxpr"])
  for _ in range(3):
    outs = _sub_walk(walk, ea, eb, body_a, body_b, body_consts + carry)
    new = [join(c, o) for c, o in zip(carry, outs, strict=True)]
    if new == carry:
      break
    carry = new
  (pred,) = _sub_walk(walk, ea, eb, cond_a, cond_b, cond_consts + carry)
  if pred.kind != FREE and not (
    pred.kind == GLOBAL and not pred.params and not pred.local
  ):
    return [
      walk._mixed_out(
        f"{walk.describe(ea)} loops as long as the batch's values decide",
        True,
        axes,
      )
      for axes in out_axes
    ]
  return carry


def _cond(walk, ea, eb, ins, out_axes):
  index, operands = ins[0], ins[1:]
  if index.kind != FREE and not (
    index.kind == GLOBAL and not index.params and not index.local
  ):
    return [
      walk._mixed_out(
        f"{walk.describe(ea)} picks code by the batch's values", True, axes
      )
      for axes in out_axes
    ]
  outs = None
  for sa, sb in zip(_subs(ea), _subs(eb), strict=True):
    got = _sub_walk(walk, ea, eb, sa, sb, operands)
    outs = (
      got
      if outs is None
      else [join(x, y) for x, y in zip(outs, got, strict=True)]
    )
  return outs


_RULES = {
  "transpose": shapes.transpose,
  "squeeze": shapes.squeeze,
  "slice": shapes.slice,
  "pad": shapes.pad,
  "rev": shapes.rev,
  "dynamic_slice": shapes.dynamic_slice,
  "dynamic_update_slice": shapes.dynamic_update_slice,
  "broadcast_in_dim": shapes.broadcast_in_dim,
  "iota": shapes.iota,
  "reshape": shapes.reshape,
  "concatenate": shapes.concatenate,
  "sort": shapes.sort,
  "top_k": shapes.top_k,
  "split": shapes.split,
  "dot_general": operators.dot_general,
  "conv_general_dilated": operators.conv,
  "gather": operators.gather,
  "scan": _scan,
  "while": _while,
  "cond": _cond,
}
