"""Layers split by output features: tensor parallelism as graph branches.

A layer whose weights are too large for one device, or whose time bounds
every plan (the layer after CANDLE-Uno's concatenation), can be cut into
t parts that run concurrently on t devices. Capture does it to the graph
(`capture(..., split_layers={'head': 4})`): a parameter W read by one

  matrix product  y = dot_general(x, W)   W's last axis a free axis
  convolution     y = conv(x, W)          W's output-feature axis

becomes t inputs W[..., part] (near-equal slices of that axis,
'head.kernel#0of4' ...), its product becomes t products, each its own
node, and a concatenation of their outputs along the output's feature
axis joins the rest of the layer (bias, activation):

      x ──> [W] ──> y              x ─┬─> [W#0of4] ──┐
                            =>        ├─> [W#1of4] ──┼─> concat ─> y
                                      └─>   ...    ──┘

Each column of y depends on its slice of W alone, so the parts compute
exactly the columns of the unsplit product (the same dot products, in the
same order). Every planner then sees ordinary branches: GraphPipe runs them
as concurrent stages; a chain planner may give them consecutive stages.
The input x goes to every part (the planner prices that fan-out) and the
parts' outputs to the concatenation (Megatron's column-parallel layer with
its all-gather as the concatenation's fan-in). `Splits.split` cuts the
user's W into the inputs and `Splits.join` concatenates them back, so
`update_model`, the trainer's parameters and checkpoints keep the
user's form.

An embedding table read by a lookup of rows is cut by rows instead, the
lookup into one lookup per part and their sum (`graphpipe.frontend.
split_rows`).

A parameter read anywhere else (a weight-decay penalty, a tied embedding)
is refused: the slices would have to be joined again where it is read.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.extend as jex
import numpy as np
from jax import lax
from jax._src import core as jcore

from graphpipe.errors import CaptureError
from graphpipe.frontend import split_rows


def part_sizes(size: int, parts: int) -> list[int]:
  """Near-equal sizes of `parts` slices of an axis of `size` (the larger
  ones first, as `np.array_split`)."""
  return [len(a) for a in np.array_split(np.arange(size), parts)]


def _reader(jaxpr, var):
  """The equations reading `var`, and whether an output is `var`."""
  readers = [
    e for e in jaxpr.eqns if any(v is var for v in e.invars if _is_var(v))
  ]
  return readers, any(v is var for v in jaxpr.outvars if _is_var(v))


def _axes(eqn, var):
  """(axis of `var` to split, axis of the output it becomes) where `eqn`
  reads `var` as a product's weights, else (None, why not)."""
  name = eqn.primitive.name
  if name == "dot_general":
    if eqn.invars[1] is not var or eqn.invars[0] is var:
      return None, "it is the left operand of its matrix product"
    (_, contract), (_, batch) = eqn.params["dimension_numbers"]
    last = var.aval.ndim - 1
    if last in contract or last in batch or var.aval.ndim < 2:
      return None, "its last axis is contracted or batched"
    return (last, eqn.outvars[0].aval.ndim - 1), ""
  if name == "conv_general_dilated":
    p = eqn.params
    if eqn.invars[1] is not var or eqn.invars[0] is var:
      return None, "it is the input of its convolution, not the kernel"
    if p["feature_group_count"] != 1 or p["batch_group_count"] != 1:
      return None, "its convolution is grouped (feature_group_count > 1)"
    numbers = p["dimension_numbers"]
    return (numbers.rhs_spec[0], numbers.out_spec[1]), ""
  if split_rows.is_lookup_reader(eqn):
    # A table looked up by rows: cut by rows (no output axis to cut).
    found, why = split_rows.lookup(eqn, var)
    return ((0, None), "") if found is not None else (None, why)
  return None, (
    f"it is read by {name}, not by a matrix product, convolution or row "
    "lookup as its weights"
  )


@dataclasses.dataclass(frozen=True)
class Splits:
  """Model variables split into parts by output features.

  Attributes:
    parts: input index (a parameter) -> (number of parts, its axis cut).
  """

  parts: dict[int, tuple[int, int]]

  @classmethod
  def find(cls, closed, names, requested: dict[str, int]) -> Splits:
    """The inputs of `closed` (the traced, unrolled loss) that `requested`
    asks to split: a key names a parameter ('head.kernel') or a module
    ('head': every parameter under it read as a product's weights);
    `names` are the names of the first inputs (the parameters)."""
    if not requested:
      return cls({})
    jaxpr = closed.jaxpr
    parts: dict[int, tuple[int, int]] = {}
    for key, count in requested.items():
      if not isinstance(count, int) or isinstance(count, bool) or count < 2:
        raise CaptureError(
          f"split_layers[{key!r}] must be a number of parts >= 2, got {count!r}"
        )
      exact = [k for k, n in enumerate(names) if n == key]
      under = [k for k, n in enumerate(names) if n.startswith(key + ".")]
      chosen = exact or under
      if not chosen:
        raise CaptureError(
          f"split_layers names {key!r}, which is neither a parameter nor "
          f"a module of the model; parameters: {_some(names)}"
        )
      found = []
      reasons = []
      for k in chosen:
        var = jaxpr.invars[k]
        readers, returned = _reader(jaxpr, var)
        if returned or len(readers) != 1:
          why = (
            "it is returned by the loss"
            if returned
            else f"it is read by {len(readers)} equations"
          )
          reasons.append((names[k], why + " (split needs one reader)"))
          continue
        axes, why = _axes(readers[0], var)
        if axes is None:
          reasons.append((names[k], why))
          continue
        size = var.aval.shape[axes[0]]
        if count > size:
          what = "output features" if axes[1] is not None else "rows"
          raise CaptureError(
            f"split_layers[{key!r}] = {count} parts, but {names[k]} has "
            f"only {size} {what}"
          )
        found.append((k, (count, axes[0])))
      if not found or (exact and reasons):
        detail = "; ".join(f"{n}: {why}" for n, why in reasons)
        raise CaptureError(
          f"split_layers cannot split {key!r}: {detail}. A split layer's "
          "weights must be read once, as the weights of a matrix product "
          "(last axis the output features), of an ungrouped convolution, "
          "or as a table whose rows a gather looks up"
        )
      for k, value in found:
        if k in parts and parts[k] != value:
          raise CaptureError(
            f"split_layers asks for {names[k]} in {parts[k][0]} and "
            f"{value[0]} parts"
          )
        parts[k] = value
    return cls(dict(sorted(parts.items())))

  def position(self, k: int) -> int:
    """The index input `k` (or its first part) has once split."""
    return sum(self.parts[i][0] if i in self.parts else 1 for i in range(k))

  def names(self, names):
    """Per input name, the names of its parts ('head.kernel#0of4', ...)."""
    out = []
    for k, name in enumerate(names):
      if k in self.parts:
        n = self.parts[k][0]
        out.extend(f"{name}#{i}of{n}" for i in range(n))
      else:
        out.append(name)
    return out

  def split(self, leaves) -> list:
    """Input leaves -> the split loss's (split ones cut into parts)."""
    out = []
    for k, leaf in enumerate(leaves):
      if k in self.parts:
        n, axis = self.parts[k]
        bounds = np.cumsum(part_sizes(np.shape(leaf)[axis], n))[:-1]
        out.extend(_cut(leaf, axis, bounds))
      else:
        out.append(leaf)
    return out

  def join(self, leaves, first: int, count: int) -> list:
    """Inverse of `split` for the `count` inputs from index `first` on."""
    out, at = [], 0
    for k in range(first, first + count):
      if k in self.parts:
        n, axis = self.parts[k]
        out.append(
          np.concatenate([np.asarray(x) for x in leaves[at : at + n]], axis)
        )
        at += n
      else:
        out.append(leaves[at])
        at += 1
    return out

  def apply(self, closed):
    """(`closed` with the split inputs and products, per equation of the
    result (the index of the equation it comes from, (its part, parts) or
    None))."""
    if not self.parts:
      return closed, [(i, None) for i in range(len(closed.jaxpr.eqns))]
    jaxpr = closed.jaxpr
    invars, pieces = [], {}
    for k, v in enumerate(jaxpr.invars):
      if k in self.parts:
        n, axis = self.parts[k]
        sizes = part_sizes(v.aval.shape[axis], n)
        new = [
          jcore.Var(v.aval.update(shape=_resized(v.aval.shape, axis, s)))
          for s in sizes
        ]
        pieces[v] = (new, axis)
        invars.extend(new)
      else:
        invars.append(v)
    eqns, origin = [], []
    constvars, consts = list(jaxpr.constvars), list(closed.consts)
    moved = set()  # sums of split lookups' rows, done in the parts
    for index, eqn in enumerate(jaxpr.eqns):
      if id(eqn) in moved:
        continue
      weights = [v for v in eqn.invars if _is_var(v) and v in pieces]
      if not weights:
        eqns.append(eqn)
        origin.append((index, None))
        continue
      (var,) = weights
      parts, _ = pieces[var]
      _, out_axis = _axes(eqn, var)[0]
      if out_axis is None:  # a row lookup: one per part, then their sum
        then = split_rows.summed_after(eqn, jaxpr)
        if then is not None:
          moved.add(id(then))
        made, part_of, (new_vars, values) = split_rows.split_lookup(
          eqn, var, parts, var.aval.shape[0], then
        )
        eqns += made
        origin += [(index, p) for p in part_of]
        constvars += new_vars
        consts += values
        continue
      out = eqn.outvars[0]
      ys = []
      for i, part in enumerate(parts):
        size = part.aval.shape[pieces[var][1]]
        y = jcore.Var(
          out.aval.update(shape=_resized(out.aval.shape, out_axis, size))
        )
        ys.append(y)
        eqns.append(
          eqn.replace(
            invars=[part if v is var else v for v in eqn.invars],
            outvars=[y],
          )
        )
        origin.append((index, (i, len(parts))))
      eqns.append(_concatenate(ys, out, out_axis, eqn.source_info))
      origin.append((index, None))
    effects = frozenset().union(*(e.effects for e in eqns))
    debug = jex.core.DebugInfo(
      "graphpipe split", "loss", None, tuple(str(i) for i in jaxpr.outvars)
    )
    new = jex.core.Jaxpr(constvars, invars, jaxpr.outvars, eqns, effects, debug)
    return jex.core.ClosedJaxpr(new, consts), origin


def part_labels(labels, origin) -> list[str]:
  """Labels of a split loss's equations (`labels` those of the equations
  they come from): each part of a product its own node ('head#0of4'); the
  concatenation stays in the layer's node."""
  out = []
  for index, part in origin:
    label = labels[index]
    if part is None:
      out.append(label)
    else:
      out.append(f"{label or 'split'}#{part[0]}of{part[1]}")
  return out


def _concatenate(ys, out, axis, source_info):
  """The equation `out = concatenate(ys, axis)`."""
  traced = jax.make_jaxpr(lambda *a: lax.concatenate(a, axis))(
    *[jax.ShapeDtypeStruct(y.aval.shape, y.aval.dtype) for y in ys]
  )
  (eqn,) = traced.jaxpr.eqns
  return eqn.replace(invars=list(ys), outvars=[out], source_info=source_info)


def _cut(leaf, axis, bounds):
  if isinstance(leaf, jax.ShapeDtypeStruct):
    sizes = np.diff([0, *bounds, leaf.shape[axis]])
    return [
      jax.ShapeDtypeStruct(_resized(leaf.shape, axis, int(s)), leaf.dtype)
      for s in sizes
    ]
  starts = [0, *bounds]
  stops = [*bounds, np.shape(leaf)[axis]]
  return [
    leaf[(slice(None),) * axis + (slice(int(a), int(b)),)]
    for a, b in zip(starts, stops, strict=True)
  ]


def _resized(shape, axis, size):
  return tuple(size if i == axis else d for i, d in enumerate(shape))


def _some(names, limit=12):
  shown = ", ".join(names[:limit])
  return shown + (f", ... ({len(names)} in all)" if len(names) > limit else "")


def _is_var(atom) -> bool:
  return not isinstance(atom, jex.core.Literal)
