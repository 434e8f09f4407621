"""Rules of the walk for products, convolutions, gathers, scatters and
random draws: the primitives that pair a value's axes with another's."""

from __future__ import annotations

from graphpipe.frontend.samplewise.shapes import (
  combine_all,
  unknown,
)
from graphpipe.frontend.samplewise.state import (
  GLOBAL,
  POSITION,
  ROWS,
  State,
  mixed,
  same_layout,
  shape_of,
)


def dot_general(walk, ea, eb, ins, out_axes):
  (lc, rc), (lb, rb) = ea.params["dimension_numbers"]
  lhs, rhs = ins[0], ins[1]
  params = lhs.params or rhs.params
  for s in (lhs, rhs):
    if s.kind == POSITION or (
      s.kind == GLOBAL
      and (s.params or s.local)
      and (lhs.batched or rhs.batched)
    ):
      return combine_all(walk, ea, ins, out_axes)
  nl, nr = len(shape_of(ea.invars[0])), len(shape_of(ea.invars[1]))
  lfree = [d for d in range(nl) if d not in lc and d not in lb]
  rfree = [d for d in range(nr) if d not in rc and d not in rb]
  if lhs.batched and rhs.batched:
    aligned = lhs.kind == rhs.kind == ROWS and same_layout(
      lhs.layout, rhs.layout
    )
    for pair, where in (((lb, rb), "batch"), ((lc, rc), "contract")):
      for p, (x, y) in enumerate(zip(*pair, strict=True)):
        if (x, y) == (lhs.axis, rhs.axis) and aligned:
          if where == "batch":
            return [State(ROWS, params, p, lhs.layout or rhs.layout)]
          return [State(GLOBAL, params, summed=True, local=walk.nested)]
    return [
      walk._mixed_out(
        f"{walk.describe(ea)} multiplies every sample with every other (a "
        "product across the batch, as in a contrastive loss)",
        params,
        out_axes[0],
      )
    ]
  s = lhs if lhs.batched else rhs if rhs.batched else None
  if s is None:
    return combine_all(walk, ea, ins, out_axes)
  if s.kind != ROWS:
    return [
      walk._mixed_out(
        f"{walk.describe(ea)} reads samples' positions", params, out_axes[0]
      )
    ]
  if s is lhs:
    if s.axis not in lfree:
      return unknown(walk, ea, eb, ins, out_axes)
    axis = len(lb) + lfree.index(s.axis)
  else:
    if s.axis not in rfree:
      return unknown(walk, ea, eb, ins, out_axes)
    axis = len(lb) + len(lfree) + rfree.index(s.axis)
  return [State(ROWS, params, axis, s.layout)]


def conv(walk, ea, eb, ins, out_axes):
  lhs, rhs = ins[0], ins[1]
  dn = ea.params["dimension_numbers"]
  params = lhs.params or rhs.params
  if not lhs.batched and not rhs.batched:
    return combine_all(walk, ea, ins, out_axes)
  if (
    lhs.kind == ROWS
    and not rhs.batched
    and not (rhs.kind == GLOBAL and (rhs.params or rhs.local))
    and lhs.axis == dn.lhs_spec[0]
    and ea.params["batch_group_count"] == 1
  ):
    return [State(ROWS, params, dn.out_spec[0], lhs.layout)]
  return [
    walk._mixed_out(
      f"{walk.describe(ea)} convolves across samples", params, out_axes[0]
    )
  ]


def gather(walk, ea, eb, ins, out_axes):
  operand, indices = ins[0], ins[1]
  dn = ea.params["dimension_numbers"]
  params = operand.params or indices.params
  if not operand.batched and not indices.batched:
    return combine_all(walk, ea, ins, out_axes)
  out_rank = len(shape_of(ea.outvars[0]))
  batch_positions = [d for d in range(out_rank) if d not in dn.offset_dims]
  n_idx = len(shape_of(ea.invars[1]))

  def bad(why):
    return [walk._mixed_out(f"{walk.describe(ea)} {why}", params, out_axes[0])]

  for s in (operand, indices):
    if s.batched and s.kind != ROWS:
      return bad(
        "indexes with samples' positions (x[arange(B), labels]): use "
        "jnp.take_along_axis"
      )
    if s.kind == GLOBAL and (s.params or s.local):
      return combine_all(walk, ea, ins, out_axes)
  if indices.batched and indices.axis == n_idx - 1:
    return bad("gathers along the batch axis of its indices")
  if operand.batched:
    ao = operand.axis
    if ao in dn.operand_batching_dims:
      p = list(dn.operand_batching_dims).index(ao)
      ok = (
        indices.batched
        and dn.start_indices_batching_dims[p] == indices.axis
        and same_layout(operand.layout, indices.layout)
      )
      if not ok:
        return bad("gathers across samples")
      return [
        State(
          ROWS,
          params,
          batch_positions[indices.axis],
          operand.layout or indices.layout,
        )
      ]
    sizes = ea.params["slice_sizes"]
    if (
      ao in dn.start_index_map
      or ao in dn.collapsed_slice_dims
      or sizes[ao] != shape_of(ea.invars[0])[ao]
      or indices.batched
    ):
      return bad("gathers across samples")
    kept = [
      d
      for d in range(len(shape_of(ea.invars[0])))
      if d not in dn.collapsed_slice_dims and d not in dn.operand_batching_dims
    ]
    return [State(ROWS, params, dn.offset_dims[kept.index(ao)], operand.layout)]
  return [State(ROWS, params, batch_positions[indices.axis], indices.layout)]


def scatter(walk, ea, eb, ins, out_axes):
  operand, indices, updates = ins[0], ins[1], ins[2]
  dn = ea.params["dimension_numbers"]
  params = any(s.params for s in ins)
  if not any(s.batched for s in ins[:3]):
    return combine_all(walk, ea, ins, out_axes)

  def bad():
    return [
      walk._mixed_out(f"{walk.describe(ea)} scatters across samples", params, a)
      for a in out_axes
    ]

  if any(s.batched and s.kind != ROWS for s in ins[:3]) or any(
    s.kind == GLOBAL and (s.params or s.local) for s in ins[:3]
  ):
    return bad()
  if not operand.batched:
    return bad()
  ao = operand.axis
  if ao in dn.operand_batching_dims:
    p = list(dn.operand_batching_dims).index(ao)
    if not (
      indices.batched and dn.scatter_indices_batching_dims[p] == indices.axis
    ):
      return bad()
  elif (
    indices.batched
    or ao in dn.scatter_dims_to_operand_dims
    or ao in dn.inserted_window_dims
  ):
    return bad()
  else:
    kept = [
      d
      for d in range(len(shape_of(ea.invars[0])))
      if d not in dn.inserted_window_dims and d not in dn.operand_batching_dims
    ]
    window = dn.update_window_dims[kept.index(ao)]
    if (
      not updates.batched
      or updates.axis != window
      or (shape_of(ea.invars[2])[window] != shape_of(ea.invars[0])[ao])
    ):
      return bad()
  for s in (indices, updates):
    if s.batched and not same_layout(s.layout, operand.layout):
      return bad()
  return [State(ROWS, params, ao, operand.layout)] * len(ea.outvars)


def draw(walk, ea, eb, ins, out_axes):
  key = ins[0]
  params = any(s.params for s in ins)
  if not out_axes[0]:
    drawn = shape_of(ea.outvars[0])
    if key.stream and ea.primitive.name != "random_split" and drawn:
      return [
        mixed(
          f"{walk.describe(ea)} draws {drawn} from a training stream, not "
          "in the batch's shape: the per-sample rule takes a draw's "
          "leading axis as samples, so each micro-batch would draw it anew",
          True,
        )
      ] * len(ea.outvars)
    return combine_all(walk, ea, ins, out_axes)
  if key.kind == ROWS and key.axis == out_axes[0][0]:
    return [State(ROWS, params, key.axis, key.layout)] * len(ea.outvars)
  if key.kind == ROWS and key.layout is None:
    return [State(ROWS, params, out_axes[0][0], None)] * len(ea.outvars)
  if key.stream and ea.primitive.name != "random_split":
    if out_axes[0] == [0]:  # sample j's part from fold_in(key, j)
      size = shape_of(eb.outvars[0])[0]
      return [State(ROWS, params, 0, ((size, True),))] * len(ea.outvars)
    return [
      State(
        POSITION,
        params,
        out_axes[0][0],
        why=f"{walk.describe(ea)} draws from a training stream with the "
        "batch on another axis than the first (the per-sample rule takes "
        "the leading axis as samples)",
      )
    ] * len(ea.outvars)
  return [
    State(
      POSITION,
      params,
      out_axes[0][0],
      why=f"{walk.describe(ea)} draws random numbers in the batch's shape from "
      "a key that is not per sample",
    )
  ] * len(ea.outvars)
