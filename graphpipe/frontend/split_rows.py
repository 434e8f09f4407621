"""Embedding tables split by rows (`capture(..., split_layers=...)`).

A table E read once by a row lookup (a gather of whole rows along its
first axis: `jnp.take(E, ids, axis=0)`, `E[ids]`, `nnx.Embed`), directly
or inside a `jit` whose output the lookup is, becomes t tables
E[lo_i:hi_i] (near-equal row ranges, `graphpipe.frontend.split`), and
the lookup becomes t lookups, each its own node, and their sum:

  y_i = gather(E_i, ids - lo_i)    (rows outside [lo_i, hi_i): zeros)
  y   = y_0 + ... + y_{t-1}

Every index lies in exactly one range, so each output row is one part's
row plus zeros: the same numbers as the unsplit lookup, and each part's
gradient is the scatter-add of the cotangents of the positions that read
its rows (the unsplit gradient's rows). Indices outside the table keep
the lookup's own rule: clamped into it first (XLA's rule for "clip" and
"promise_in_bounds" gathers; the gradient of the latter drops them, as
its scatter-add does), or, for a "fill" gather (`jnp.take`'s default),
the fill value (NaN) in the sum's place. This is the row-wise
(vocabulary-parallel) embedding of Megatron-LM and DLRM's table sharding
as graph branches: the parts' outputs meet in the sum (an all-reduce of
the lookups, as a fan-in the planner prices). A `reduce_sum` that alone
reads the lookup (an embedding bag's sum over its rows) is done in each
part before the parts meet (`summed_after`): a sum is linear, and a part
then sends one row per sample instead of the bag's rows.
"""

from __future__ import annotations

import jax
import jax.extend as jex
import jax.numpy as jnp
from jax import lax
from jax._src import core as jcore

from graphpipe.errors import CaptureError

_FILL = lax.GatherScatterMode.FILL_OR_DROP


def is_lookup_reader(eqn) -> bool:
  """Whether `eqn` could be a row lookup (a gather, or a jit holding one)."""
  return eqn.primitive.name in ("gather", "jit", "pjit")


def lookup(eqn, var) -> tuple[object | None, str]:
  """(the gather that reads `var` (or its twin inside `eqn`'s jit) as a
  table of rows, "") or (None, why not)."""
  if eqn.primitive.name == "gather":
    return _row_gather(eqn, var)
  if not is_lookup_reader(eqn):
    return None, f"it is read by {eqn.primitive.name}"
  positions = [i for i, v in enumerate(eqn.invars) if v is var]
  if len(positions) != 1:
    return None, "its jit reads it twice"
  inner = eqn.params["jaxpr"].jaxpr
  twin = inner.invars[positions[0]]
  readers = [e for e in inner.eqns if any(v is twin for v in e.invars)]
  if any(v is twin for v in inner.outvars) or len(readers) != 1:
    return None, "its jit reads it more than once"
  (reader,) = readers
  if reader.primitive.name != "gather":
    return None, f"its jit reads it with {reader.primitive.name}"
  gather, why = _row_gather(reader, twin)
  if gather is None:
    return None, why
  out = gather.outvars[0]
  if not any(v is out for v in inner.outvars) or any(
    v is out for e in inner.eqns for v in e.invars
  ):
    return None, "its jit computes on the rows it looks up"
  return gather, ""


def _row_gather(eqn, var) -> tuple[object | None, str]:
  """(`eqn`, "") where the gather `eqn` takes whole rows of `var` by one
  index each, else (None, why)."""
  if eqn.invars[0] is not var or eqn.invars[1] is var:
    return None, "it is the indices of its gather, not the table"
  numbers = eqn.params["dimension_numbers"]
  if (
    tuple(numbers.start_index_map) != (0,)
    or 0 not in numbers.collapsed_slice_dims
    or numbers.operand_batching_dims
    or eqn.params["slice_sizes"][0] != 1
  ):
    return None, "its gather does not take whole rows by one index each"
  if not jnp.issubdtype(var.aval.dtype, jnp.inexact):
    return None, "the table is not floating point"
  return eqn, ""


def summed_after(eqn, jaxpr):
  """The `reduce_sum` equation that alone reads the lookup `eqn`'s one
  output (an embedding bag's sum over its rows), else None."""
  if len(eqn.outvars) != 1 or any(v is eqn.outvars[0] for v in jaxpr.outvars):
    return None
  out = eqn.outvars[0]
  readers = [e for e in jaxpr.eqns if any(v is out for v in e.invars)]
  if len(readers) == 1 and readers[0].primitive.name == "reduce_sum":
    return readers[0]
  return None


def split_lookup(eqn, var, parts, rows: int, then=None):
  """The equations replacing the lookup `eqn` of table `var` by `parts`
  (the row-range tables' variables, in order): (equations, the part of
  each (index, parts) or None for the sum), constants (vars, values).

  `then`: the `reduce_sum` that alone reads the lookup (`summed_after`),
  replaced too: each part sums its own rows (a sum is linear), so a part
  sends the bag's sum, not its rows."""
  gather, _ = lookup(eqn, var)
  inputs = [a for a in eqn.invars if _is_var(a) and a is not var]
  place = eqn.invars.index(var)
  mode = gather.params["mode"]
  starts, lo = [], 0  # each part's first row
  for part in parts:
    starts.append(lo)
    lo += part.aval.shape[0]

  def arguments(table, values):
    """The reader's arguments: `values` for its variables, the table at
    its place, its literals."""
    it = iter(values)
    args = []
    for i, atom in enumerate(eqn.invars):
      if i == place:
        args.append(table)
      elif not _is_var(atom):
        args.append(atom.val)
      else:
        args.append(next(it))
    return args

  def clamped(indices):
    # A "clip" or "promise_in_bounds" gather clamps each index into the
    # table; a "fill" one leaves it to fall outside every part.
    return indices if mode == _FILL else jnp.clip(indices, 0, rows - 1)

  def outside(g, indices, shape):
    """Where an index falls outside the table, broadcast to the lookup's
    output `shape`."""
    flags = (indices[..., 0] < 0) | (indices[..., 0] > rows - 1)
    offset = g.params["dimension_numbers"].offset_dims
    kept = [d for d in range(len(shape)) if d not in offset]
    return lax.broadcast_in_dim(flags, shape, kept)

  def part_rule(lo):
    def rule(g, table, indices):
      y = lax.gather(
        table,
        clamped(indices) - jnp.asarray(lo, indices.dtype),
        g.params["dimension_numbers"],
        (1, *g.params["slice_sizes"][1:]),
        indices_are_sorted=g.params["indices_are_sorted"],
        unique_indices=g.params["unique_indices"],
        mode=_FILL,
        fill_value=0,
      )
      if mode == lax.GatherScatterMode.PROMISE_IN_BOUNDS:
        # Its forward clamps, but its gradient (a scatter-add) drops the
        # indices outside the table: so do the parts.
        y = jnp.where(outside(g, indices, y.shape), lax.stop_gradient(y), y)
      return y if then is None else summed(y)

    return rule

  def summed(y):
    return then.primitive.bind(y, **then.params)

  def join_rule(ys):
    def rule(g, _, indices):
      total = ys[0]
      for y in ys[1:]:
        total = total + y
      if mode != _FILL:
        return total
      fill = g.params["fill_value"]
      fill = jnp.asarray(jnp.nan if fill is None else fill, total.dtype)
      shape = g.outvars[0].aval.shape
      if then is not None:  # the fill wherever the bag reads one
        zero = jnp.zeros((), total.dtype)
        return total + summed(jnp.where(outside(g, indices, shape), fill, zero))
      return jnp.where(outside(g, indices, shape), fill, total)

    return rule

  new_eqns, origin, consts = [], [], ([], [])
  ys = []
  for i, (part, lo) in enumerate(zip(parts, starts, strict=True)):
    y = jcore.Var((then or gather).outvars[0].aval)
    ys.append(y)
    traced = jax.make_jaxpr(
      lambda table, *values, lo=lo: _run(
        eqn, gather, arguments(table, values), part_rule(lo), True
      )
    )(part.aval, *[a.aval for a in inputs])
    _inline(traced, [part, *inputs], [y], new_eqns, consts)
    origin += [(i, len(parts))] * (len(new_eqns) - len(origin))

  def join(*values):
    found, rest = values[: len(ys)], values[len(ys) :]
    return _run(eqn, gather, arguments(None, rest), join_rule(found), False)

  traced = jax.make_jaxpr(join)(
    *[y.aval for y in ys], *[a.aval for a in inputs]
  )
  outputs = list((then or eqn).outvars)
  _inline(traced, [*ys, *inputs], outputs, new_eqns, consts)
  origin += [None] * (len(new_eqns) - len(origin))
  return new_eqns, origin, consts


def _run(eqn, gather, args, rule, part_only: bool):
  """`eqn` evaluated on `args` with its table's gather replaced by
  `rule(gather, table, indices)`; `part_only`: the gather's result alone
  (the equations after it are the sum's)."""
  if eqn is gather:
    out = rule(gather, args[0], args[1])
    return out if part_only else [out]
  closed = eqn.params["jaxpr"]
  inner = closed.jaxpr
  env = {}

  def read(atom):
    return atom.val if not _is_var(atom) else env[atom]

  for v, x in zip(inner.constvars, closed.consts, strict=True):
    env[v] = x
  for v, x in zip(inner.invars, args, strict=True):
    env[v] = x
  for e in inner.eqns:
    if e is gather:
      outs = [rule(e, read(e.invars[0]), read(e.invars[1]))]
      if part_only:
        return outs[0]
    else:
      params = e.primitive.get_bind_params(e.params)
      outs = e.primitive.bind(*map(read, e.invars), **params)
      if not e.primitive.multiple_results:
        outs = [outs]
    for v, x in zip(e.outvars, outs, strict=True):
      env[v] = x
  return [read(v) for v in inner.outvars]


def _inline(traced, inputs, outputs, eqns, consts) -> None:
  """Appends `traced`'s equations to `eqns`, its inputs renamed to
  `inputs`, its outputs to `outputs`, its constants to `consts`."""
  jaxpr = traced.jaxpr
  rename = dict(zip(jaxpr.invars, inputs, strict=True))
  made = {v for e in jaxpr.eqns for v in e.outvars}
  if len(set(map(id, jaxpr.outvars))) != len(jaxpr.outvars) or not all(
    _is_var(v) and v in made for v in jaxpr.outvars
  ):
    raise CaptureError(
      "split_layers cannot split this lookup: its call returns an input or "
      "one value twice"
    )
  rename.update(zip(jaxpr.outvars, outputs, strict=True))
  consts[0].extend(jaxpr.constvars)
  consts[1].extend(traced.consts)
  for e in jaxpr.eqns:
    eqns.append(
      e.replace(
        invars=[rename.get(v, v) if _is_var(v) else v for v in e.invars],
        outvars=[rename.get(v, v) for v in e.outvars],
      )
    )


def _is_var(atom) -> bool:
  return not isinstance(atom, jex.core.Literal)
