"""Rules of the walk for structural, elementwise and reducing primitives.

Each rule takes (walk, the equation at both batch sizes, its operands'
states, the batch axes of its outputs) and returns its outputs' states.
"""

from __future__ import annotations

import dataclasses
import math

from graphpipe.frontend.samplewise.state import (
  GLOBAL,
  POSITION,
  ROWS,
  State,
  canonical,
  free,
  mixed,
  same_layout,
  shape_of,
)


def out_rows(axes, layout, params) -> State:
  return State(ROWS, params, axes[0], layout)


def combine(walk, ea, ins, out_axes, *, what="combines") -> State:
  """The one output of an equation whose batch-carrying operands must
  hold samples alike (same layout), and whose other operands must be
  the same for every sample."""
  params = any(s.params for s in ins)
  layout, seen_rows = None, False
  for s in ins:
    if s.kind == POSITION:
      return mixed(
        s.why
        or f"{walk.describe(ea)} reads each sample's position in the batch (an "
        "iota along the batch axis, as in x[jnp.arange(B), labels]: use "
        "jnp.take_along_axis): a micro-batch would count from its own start",
        params,
        out_axes[0][0] if out_axes[0] else None,
      )
    if s.kind == GLOBAL and (s.params or s.local) and out_axes[0]:
      return mixed(
        f"{walk.describe(ea)} {what} per-sample values with a statistic over "
        "the batch"
        + (
          " of values that depend on the parameters (normalisation by a "
          "batch statistic)"
          if s.params
          else " computed inside a nested call"
        ),
        params,
        out_axes[0][0],
      )
    if s.kind == ROWS:
      if seen_rows and not same_layout(layout, s.layout):
        return mixed(
          f"{walk.describe(ea)} {what} values whose samples are laid out "
          "differently along the batch axis",
          params,
          out_axes[0][0] if out_axes[0] else None,
        )
      layout = layout or s.layout
      seen_rows = True
  if not out_axes[0]:
    if any(s.kind == GLOBAL for s in ins):
      return State(GLOBAL, params, local=any(s.local for s in ins))
    return free(params, any(s.stream for s in ins))
  return out_rows(out_axes[0], layout, params)


def elementwise(walk, ea, eb, ins, out_axes):
  out = combine(walk, ea, ins, out_axes)
  return [out] * len(ea.outvars)


def unknown(walk, ea, eb, ins, out_axes):
  params = any(s.params for s in ins)
  if any(s.batched for s in ins) or any(out_axes):
    return [
      walk._mixed_out(
        f"{walk.describe(ea)} has no per-sample rule here (treated as mixing "
        "samples)",
        params,
        axes,
      )
      for axes in out_axes
    ]
  if any(s.kind == GLOBAL for s in ins):
    return [State(GLOBAL, params, local=any(s.local for s in ins))] * len(
      ea.outvars
    )
  return [free(params)] * len(ea.outvars)


def batched_operand(ins):
  for i, s in enumerate(ins):
    if s.batched:
      return i, s
  return None, None


def moved(s: State, axis: int) -> State:
  return dataclasses.replace(s, axis=axis)


def structural(walk, ea, eb, ins, out_axes, new_axis, keeps):
  """Outputs of a one-operand structural equation (transpose, slice,
  ...): the batch axis moves to `new_axis(axis)`; `keeps(axis)` says
  whether every sample's elements are kept in place."""
  i, s = batched_operand(ins)
  if s is None:
    return combine_all(walk, ea, ins, out_axes)
  if s.kind == POSITION or not keeps(s.axis):
    return [
      walk._mixed_out(
        f"{walk.describe(ea)} selects, moves or pads along the batch axis "
        "(samples by position)",
        s.params,
        axes,
      )
      for axes in out_axes
    ]
  axis = new_axis(s.axis)
  if out_axes[0] != [axis]:
    return [
      walk._mixed_out(f"{walk.describe(ea)}: batch axis lost", s.params, a)
      for a in out_axes
    ]
  return [moved(s, axis)] * len(ea.outvars)


def combine_all(walk, ea, ins, out_axes):
  out = combine(walk, ea, ins, out_axes)
  return [out] * len(ea.outvars)


def transpose(walk, ea, eb, ins, out_axes):
  perm = list(ea.params["permutation"])
  return structural(
    walk, ea, eb, ins, out_axes, lambda a: perm.index(a), lambda a: True
  )


def squeeze(walk, ea, eb, ins, out_axes):
  dims = ea.params["dimensions"]
  return structural(
    walk,
    ea,
    eb,
    ins,
    out_axes,
    lambda a: a - sum(d < a for d in dims),
    lambda a: a not in dims,
  )


def slice(walk, ea, eb, ins, out_axes):
  p = ea.params
  shape = shape_of(ea.invars[0])
  strides = p["strides"] or (1,) * len(shape)

  def keeps(a):
    return (
      p["start_indices"][a] == 0
      and p["limit_indices"][a] == shape[a]
      and strides[a] == 1
    )

  return structural(walk, ea, eb, ins, out_axes, lambda a: a, keeps)


def pad(walk, ea, eb, ins, out_axes):
  config = ea.params["padding_config"]
  if ins[1].batched or ins[1].kind == GLOBAL:
    return combine_all(walk, ea, ins, out_axes)
  return structural(
    walk,
    ea,
    eb,
    ins[:1],
    out_axes,
    lambda a: a,
    lambda a: tuple(config[a]) == (0, 0, 0),
  )


def rev(walk, ea, eb, ins, out_axes):
  dims = ea.params["dimensions"]
  return structural(
    walk, ea, eb, ins, out_axes, lambda a: a, lambda a: a not in dims
  )


def dynamic_slice(walk, ea, eb, ins, out_axes):
  i, s = batched_operand(ins[:1])
  if s is None or any(x.batched for x in ins[1:]):
    return combine_all(walk, ea, ins, out_axes)
  sizes = ea.params["slice_sizes"]
  full = shape_of(ea.invars[0])
  return structural(
    walk,
    ea,
    eb,
    ins[:1],
    out_axes,
    lambda a: a,
    lambda a: sizes[a] == full[a],
  )


def dynamic_update_slice(walk, ea, eb, ins, out_axes):
  update = ins[1]
  if any(x.batched for x in ins[2:]):
    return combine_all(walk, ea, ins, out_axes)
  if (
    update.batched
    and shape_of(ea.invars[1])[update.axis]
    != shape_of(ea.invars[0])[update.axis]
  ):
    return [
      walk._mixed_out(
        f"{walk.describe(ea)} writes some samples' rows only", True, axes
      )
      for axes in out_axes
    ]
  return combine_all(walk, ea, ins[:2], out_axes)


def broadcast_in_dim(walk, ea, eb, ins, out_axes):
  s = ins[0]
  dims = ea.params["broadcast_dimensions"]
  if s.batched:
    axis = dims[s.axis]
    if out_axes[0] != [axis]:
      return [
        walk._mixed_out(
          f"{walk.describe(ea)}: batch axis lost", s.params, out_axes[0]
        )
      ]
    return [moved(s, axis)]
  if not out_axes[0]:
    return [s]
  if s.kind == GLOBAL and (s.params or s.local):
    return [
      walk._mixed_out(
        f"{walk.describe(ea)} spreads a statistic over the batch"
        + (" of parameter-dependent values" if s.params else "")
        + " back onto the samples (normalisation by a batch statistic)",
        s.params,
        out_axes[0],
      )
    ]
  # Constant along the new batch axis: fits any layout.
  return [State(ROWS, s.params, out_axes[0][0], None)]


def iota(walk, ea, eb, ins, out_axes):
  if not out_axes[0]:
    return [free()]
  if ea.params["dimension"] == out_axes[0][0]:
    return [State(POSITION, False, out_axes[0][0])]
  return [State(ROWS, False, out_axes[0][0], None)]


def virtual(shape, axis, layout):
  """The value's dimensions as a row-major list of (size, is_samples)."""
  out = []
  for i, size in enumerate(shape):
    if i == axis:
      out.extend(layout if layout is not None else ((size, True),))
    else:
      out.append((size, False))
  return [(size, s) for size, s in out if size != 1 or s]


def regroup(shape_in, axis, layout, shape_out):
  """(new axis, its layout) of a row-major reshape, or None where the
  reshape splits the samples' entry."""
  entries = virtual(shape_in, axis, layout)
  found = None
  for j, size in enumerate(shape_out):
    group, product = [], 1
    while product < size:
      if not entries or size % product:
        return None
      e_size, samples = entries[0]
      if size % (product * e_size) == 0:  # the whole entry fits
        group.append(entries.pop(0))
        product *= e_size
        continue
      need = size // product  # split a non-sample entry
      if samples or e_size % need:
        return None
      group.append((need, False))
      entries[0] = (e_size // need, False)
      product *= need
    if product != size:
      return None
    if any(samples for _, samples in group):
      found = (j, tuple(group))
  if entries or found is None:
    return None
  return found


def reshape(walk, ea, eb, ins, out_axes):
  s = ins[0]
  if any(x.batched or x.kind == GLOBAL for x in ins[1:]):
    return unknown(walk, ea, eb, ins, out_axes)
  if not s.batched:
    return combine_all(walk, ea, ins[:1], out_axes)
  if s.kind != ROWS:
    return [
      walk._mixed_out(
        f"{walk.describe(ea)} reshapes a value that reads samples' positions",
        s.params,
        out_axes[0],
      )
    ]
  shape_in = shape_of(eb.invars[0])
  shape_out = shape_of(eb.outvars[0])
  layout = s.layout
  if layout is None:  # constant along its axis: a block a sample
    layout = ((shape_in[s.axis], True),)
  got = regroup(shape_in, s.axis, large(layout, shape_in[s.axis]), shape_out)
  if got is None or out_axes[0] != [got[0]]:
    return [
      walk._mixed_out(
        f"{walk.describe(ea)} reshapes across samples (splits the batch axis)",
        s.params,
        out_axes[0],
      )
    ]
  axis, new = got
  if s.layout is None and len(canonical(new)) == 1:
    new = None  # still one entry: still constant along the axis
  return [State(ROWS, s.params, axis, new)]


def large(layout, size):
  """`layout` as at the large trace (its sample entry the axis' share)."""
  fixed = math.prod(n for n, samples in layout if not samples)
  return tuple(
    (size // fixed, True) if samples else (n, False) for n, samples in layout
  )


def concatenate(walk, ea, eb, ins, out_axes):
  dim = ea.params["dimension"]
  batched = [s for s in ins if s.batched]
  if not batched or all(s.axis != dim for s in batched):
    return combine_all(walk, ea, ins, out_axes)
  params = any(s.params for s in ins)
  first = batched[0]
  if (
    len(batched) == len(ins)
    and all(s.kind == ROWS for s in ins)
    and all(s.axis == dim for s in ins)
    and all(s.layout == first.layout for s in ins)
    and len({shape_of(v) for v in ea.invars}) == 1
  ):
    # k values stacked along the batch axis: each sample's elements sit
    # in k places, at stride of one value (two views of every sample).
    size = shape_of(eb.invars[0])[dim]
    layout = first.layout or ((size, True),)
    return [
      State(ROWS, params, dim, ((len(ins), False),) + large(layout, size))
    ]
  return [
    walk._mixed_out(
      f"{walk.describe(ea)} joins values of different samples along the batch "
      "axis",
      params,
      out_axes[0],
    )
  ]


def reduction(walk, ea, eb, ins, out_axes):
  s = ins[0]
  axes = ea.params["axes"]
  if not s.batched:
    return combine_all(walk, ea, ins, out_axes)
  if s.axis not in axes:
    return [moved(s, s.axis - sum(a < s.axis for a in axes))] * len(ea.outvars)
  if s.kind == POSITION:
    return [
      mixed(
        f"{walk.describe(ea)} reduces samples' positions in the batch", s.params
      )
    ] * len(ea.outvars)
  summed = ea.primitive.name == "reduce_sum" and s.kind == ROWS
  return [State(GLOBAL, s.params, summed=summed, local=walk.nested)] * len(
    ea.outvars
  )


def cumulative(walk, ea, eb, ins, out_axes):
  a = ea.params["axis"]
  return structural(walk, ea, eb, ins, out_axes, lambda x: x, lambda x: x != a)


def windowed(walk, ea, eb, ins, out_axes):
  p = ea.params
  n = len(shape_of(ea.invars[0]))

  def keeps(a):
    return (
      p["window_dimensions"][a] == 1
      and p["window_strides"][a] == 1
      and tuple(p["padding"][a]) == (0, 0)
      and (p.get("base_dilation") or (1,) * n)[a] == 1
      and (p.get("window_dilation") or (1,) * n)[a] == 1
    )

  if ea.primitive.name == "reduce_window":
    k = len(ea.outvars)
    if any(s.batched for s in ins[k:]):
      return unknown(walk, ea, eb, ins, out_axes)
    ins = ins[:k]
    first = next((s for s in ins if s.batched), None)
    if first is None:
      return combine_all(walk, ea, ins, out_axes)
    if not keeps(first.axis):
      return structural(walk, ea, eb, [first], out_axes, lambda a: a, keeps)
    return combine_all(walk, ea, ins, out_axes)
  return structural(walk, ea, eb, ins, out_axes, lambda a: a, keeps)


def sort(walk, ea, eb, ins, out_axes):
  dim = ea.params["dimension"]
  if any(s.batched and s.axis == dim for s in ins):
    return [
      walk._mixed_out(
        f"{walk.describe(ea)} sorts along the batch axis", True, axes
      )
      for axes in out_axes
    ]
  out = combine(walk, ea, ins, out_axes[:1])
  return [out] * len(ea.outvars)


def top_k(walk, ea, eb, ins, out_axes):
  last = len(shape_of(ea.invars[0])) - 1
  return structural(
    walk, ea, eb, ins, out_axes, lambda a: a, lambda a: a != last
  )


def split(walk, ea, eb, ins, out_axes):
  a = ea.params["axis"]
  return structural(walk, ea, eb, ins, out_axes, lambda x: x, lambda x: x != a)
