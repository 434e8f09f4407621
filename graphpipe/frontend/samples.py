"""Whether values keep each sample's rows together along their batch axis.

The runtime slices a value that crosses stages by rows of its batch axis,
`per` rows a sample, sample j in rows [j * per, (j + 1) * per): where a
stage's chunk of samples differs from its predecessor's, it cuts or joins
those blocks. A model may lay a value out otherwise, e.g. time-major
(`(T, B, D) -> (T * B, D)`: sample j's rows are j, B + j, ...) or two views
stacked along the batch axis (`concatenate([x1, x2])`: rows j and B + j);
slicing such a value hands a replica or a micro-batch other samples' rows,
and the loss and gradients come out wrong without any error.

`mixed_values` finds such values by running the program at batch size 2
on made-up inputs and changing one sample's inputs at a time: the rows of
a value that change must be that sample's block.

`batch_shaped_draws` finds random numbers drawn in the shape of the batch
from a key that is not: `bernoulli(key(0), p, h.shape)` in a loss, or
dropout given `nnx.Rngs(0)` inside it. Each micro-batch then draws its own
mask from the same key, which is not its rows of the whole batch's mask.
"""

from __future__ import annotations

import weakref

import jax
import jax.extend as jex
import jax.numpy as jnp
import numpy as np

from graphpipe.frontend.streams import per_sample_key

PROBE_BATCH = 2


def _batch_axis(small, large) -> int | None:
  axes = [
    i for i, (a, b) in enumerate(zip(small, large, strict=True)) if a != b
  ]
  return axes[0] if len(axes) == 1 else None


# Arrays larger than this many elements repeat a block of this many draws
# (a prime, so that no row or column of a matrix lines up with the block):
# drawing a paper-size embedding table element by element took 16 s of a
# 24 s memory report (dlrm at 16 devices, 2026-12-06), and a repeated
# block changes nothing the probe looks at (which rows move).
_BLOCK = 1_048_573


def _made_up(aval, rng, centred=False):
  """A value of `aval`: floats in [0.5, 1.5] (logs and square roots stay
  finite) or, `centred`, normal with a layer's scale (a matrix's entries
  1 / sqrt(fan-in), others 1: positive weights saturated a tanh after 32
  features, and a change to one sample then moved no row at all);
  integers 0, booleans False; None for key types."""
  dtype = aval.dtype
  if jax.dtypes.issubdtype(dtype, jax.dtypes.extended):
    return None
  if not jnp.issubdtype(dtype, jnp.floating):
    return jnp.zeros(aval.shape, dtype)
  shape = tuple(aval.shape)
  size = int(np.prod(shape))
  drawn = (min(size, _BLOCK),)
  if not centred:
    values = rng.uniform(0.5, 1.5, drawn)
  else:
    fan_in = int(np.prod(shape[:-1])) if len(shape) > 1 else 1
    values = rng.normal(0.0, 1 / np.sqrt(max(fan_in, 1)), drawn)
  values = values.astype(np.float32)
  if size > _BLOCK:
    values = np.resize(values, size)
  return jnp.asarray(values.reshape(shape), dtype)


def _changed(value, sample, axis):
  """`value` with sample `sample`'s rows along `axis` changed."""
  index = [slice(None)] * value.ndim
  index[axis] = sample
  index = tuple(index)
  if jnp.issubdtype(value.dtype, jnp.floating):
    return value.at[index].add(1.0)
  if value.dtype == jnp.bool_:
    return value.at[index].set(True)
  return value.at[index].set(1)


# program -> {keys: result}: a trainer built again for the same graph (a
# sweep, a test) probes nothing new.
_PROBED = weakref.WeakKeyDictionary()


def mixed_values(program, keys) -> dict[str, tuple[int, list[int], int]]:
  """Values among `keys` whose samples' rows are not consecutive blocks.

  Returns:
    key -> (sample, rows of the value that sample's inputs change, rows per
    sample, the probe's batch size), for each key that fails; empty where
    the probe cannot run (an input of a key type) or every value keeps its
    samples together.
  """
  keys = sorted(keys)
  if not keys:
    return {}
  done = _PROBED.setdefault(program, {})
  if tuple(keys) not in done:
    done[tuple(keys)] = _probe(program, keys)
  return done[tuple(keys)]


def _at_two_sizes(program, size: int):
  """(program at `size`, at 2 `size`, size); at the capture's batch size
  where the model's code does not trace at `size` (a reshape that needs
  more samples)."""
  try:
    return program.at_batch_size(size), program.at_batch_size(2 * size), size
  except Exception:  # the user's code: its own batch size traces
    size = program.batch_size
    return program, program.at_batch_size(2 * size), size


def _avals(small, large):
  """Value key -> (aval at `small`'s batch size, shape at `large`'s), for
  every node input and output."""
  found = {}
  for node_s, node_l in zip(small.nodes, large.nodes, strict=True):
    for keys, side_s, side_l in (
      (node_s.inputs, node_s.input_avals(), node_l.input_avals()),
      (node_s.outputs, node_s.output_avals(), node_l.output_avals()),
    ):
      for key, a, b in zip(keys, side_s, side_l, strict=True):
        found[key] = (a, b.shape)
  return found


def _probe(program, keys):
  small, large, size = _at_two_sizes(program, PROBE_BATCH)
  both = _avals(small, large)
  avals = {key: a for key, (a, _) in both.items()}
  large_shapes = {key: shape for key, (_, shape) in both.items()}
  rng = np.random.default_rng(0)
  inputs = {}
  for key, aval in avals.items():
    if key.startswith(("param:", "state:", "batch:")):
      # State (a BatchNorm's variance) stays positive.
      inputs[key] = _made_up(aval, rng, centred=not key.startswith("state:"))
      if inputs[key] is None:
        return {}
    elif key.startswith("rng:"):
      inputs[key] = per_sample_key(0)
  inputs.update(small.consts)
  # The batch's data statistics are the same for every micro-batch (the
  # runtime computes them once over the whole batch): held fixed here.
  inputs.update(
    zip(
      small.prepass.outputs,
      small.prepass(*[inputs[k] for k in small.prepass.inputs]),
      strict=True,
    )
  )

  @jax.jit
  def run(env):  # one compilation: op by op, each op compiled on its own
    env = small.run(env)
    return {key: env[key] for key in keys}

  base = run(inputs)
  found = {}
  for sample in sorted({0, size - 1}):
    env = dict(inputs)
    for key in inputs:
      if key.startswith("batch:"):
        axis = _batch_axis(avals[key].shape, large_shapes[key])
        if axis is not None:
          env[key] = _changed(env[key], sample, axis)
    probe = run(env)
    for key in keys:
      if key in found:
        continue
      axis = _batch_axis(avals[key].shape, large_shapes[key])
      if axis is None:
        continue
      tolerance = _tolerance(base[key].dtype, 1e-5)
      a, b = _numbers(base[key]), _numbers(probe[key])
      rows = a.shape[axis]
      per = rows // size
      differs = _differs(a, b, tolerance)
      moved = np.moveaxis(differs, axis, 0).reshape(rows, -1).any(axis=1)
      changed = [int(r) for r in np.flatnonzero(moved)]
      if any(r // per != sample for r in changed):
        found[key] = (sample, changed, per, size)
  return found


def _numbers(x) -> np.ndarray:
  """`x` as numpy can compare it (bfloat16 as float32)."""
  if jnp.issubdtype(x.dtype, jnp.floating):
    return np.asarray(x, np.float32)
  return np.asarray(x)


def _tolerance(dtype, least: float) -> float:
  """Relative rounding a comparison in `dtype` must allow: `least`, or a
  few of the type's epsilons (bfloat16's is 2^-7)."""
  if not jnp.issubdtype(dtype, jnp.floating):
    return least
  return max(least, 4 * float(jnp.finfo(dtype).eps))


def _differs(a, b, tolerance):
  """Elementwise: `a` and `b` differ beyond rounding. A device's reduction
  order may vary between runs (atomics on GPUs); the probe's change moves
  what depends on it by far more than that."""
  if not np.issubdtype(a.dtype, np.floating):
    return a != b
  nan = np.isnan(a) & np.isnan(b)
  with np.errstate(invalid="ignore"):
    far = np.abs(a - b) > tolerance * np.maximum(np.abs(a), np.abs(b))
  return far & ~nan


# Primitives that draw or derive random keys and bits. A batch-shaped
# result of one of them is each sample's own only if it is computed from
# per-sample data: a batch-shaped operand that depends on the batch.
_RANDOM_PRIMITIVES = frozenset(
  {
    "random_bits",
    "random_split",
    "random_fold_in",
    "random_seed",
    "threefry2x32",
  }
)
# What a variable holds, as far as the walk can tell: nothing from the
# batch; the same row for every sample (a batch-independent value
# broadcast along the batch); or values computed from the batch.
_FIXED, _UNIFORM, _BATCH = 0, 1, 2
# A training stream's key, or one derived from it: its draws are each
# sample's own by the per-sample rule (`graphpipe.frontend.streams`).
_STREAM = 3
# Operations that keep every sample's row equal when their operands do.
_ROW_WISE = _RANDOM_PRIMITIVES | {
  "random_wrap",
  "random_unwrap",
  "convert_element_type",
}


def batch_shaped_draws(small, large) -> list[tuple[int, str, tuple]]:
  """Random draws in the shape of the batch that are not per-sample.

  A draw (random bits, a key split, a fold-in, keys seeded from numbers)
  whose result has a batch axis is sound under micro-batching only if it
  reads per-sample data, an operand with a batch axis computed from the
  batch (keys or seeds carried in the batch, per-sample ids to fold in),
  or gives every sample the same draw (a fixed key broadcast along the
  batch). Otherwise every micro-batch draws from the same source in its
  own shape, which is not its rows of the whole batch's draw:
  `bernoulli(key(0), p, h.shape)`, `split(key(0), B)` handed out per
  sample, `fold_in(key, arange(B))`, dropout given `nnx.Rngs(0)` inside
  the loss.

  Args:
    small, large: the same program at two batch sizes (a value or operand
      "has a batch axis" where its shape differs between them).

  Returns:
    (node index, primitive name, the result's shape at `small`) of each
    such draw, nested jaxprs included.
  """
  found = []
  held = {}  # value key -> what it holds (_FIXED, _UNIFORM, _BATCH)
  for node, (na, nb) in enumerate(zip(small.nodes, large.nodes, strict=True)):
    inputs = [
      _BATCH
      if key.startswith("batch:")
      else _STREAM
      if key.startswith("rng:")
      else held.get(key, _FIXED)
      for key in na.inputs
    ]

    def report(eqn, node=node):
      found.append((node, eqn.primitive.name, tuple(eqn.outvars[0].aval.shape)))

    outputs = _walk_draws(na.jaxpr.jaxpr, nb.jaxpr.jaxpr, inputs, report)
    held.update(zip(na.outputs, outputs, strict=True))
  return found


def _walk_draws(a, b, held_in, report) -> list[int]:
  """Follows what each variable of jaxpr `a` holds (`b` is the same jaxpr
  at another batch size; `held_in` for its inputs), reports the draws
  that are not per-sample, and returns what each output holds."""
  held = dict(zip(a.invars, held_in, strict=True))

  def of(atom):
    return held.get(atom, _FIXED) if _is_var(atom) else _FIXED

  for ea, eb in zip(a.eqns, b.eqns, strict=True):
    ins = [of(v) for v in ea.invars]
    batched = [
      _is_var(va) and va.aval.shape != vb.aval.shape
      for va, vb in zip(ea.invars, eb.invars, strict=True)
    ]
    name = ea.primitive.name
    if name in _RANDOM_PRIMITIVES and any(
      va.aval.shape != vb.aval.shape
      for va, vb in zip(ea.outvars, eb.outvars, strict=True)
    ):
      per_sample = _STREAM in ins or any(
        t == _BATCH and x for t, x in zip(ins, batched, strict=True)
      )
      same_rows = any(batched) and all(
        t == _UNIFORM for t, x in zip(ins, batched, strict=True) if x
      )
      if not per_sample and not same_rows:
        report(ea)
    if name == "broadcast_in_dim" and ins[0] == _FIXED and not batched[0]:
      outs = [
        _UNIFORM if va.aval.shape != vb.aval.shape else _FIXED
        for va, vb in zip(ea.outvars, eb.outvars, strict=True)
      ]
    elif name in _ROW_WISE:
      outs = [max(ins, default=_FIXED)] * len(ea.outvars)
    else:
      outs = _nested(ea, eb, ins, report)
    held.update(zip(ea.outvars, outs, strict=True))
  return [of(v) for v in a.outvars]


def _nested(ea, eb, ins, report) -> list[int]:
  """What each output of equation `ea` holds, walking its nested jaxprs
  (their draws are reported too). Calls, custom derivatives, remat and
  scan pass their operands to their body in order; cond and while are
  mapped by their layout. Otherwise (and for every operation without a
  body) an output holds batch values where any operand does, else
  nothing from the batch (a row-equal operand loses that mark)."""
  subs_a, subs_b = (
    [getattr(j, "jaxpr", j) for j in jex.core.jaxprs_in_params(e.params)]
    for e in (ea, eb)
  )
  plain = _BATCH if _BATCH in ins else _FIXED
  name, params = ea.primitive.name, ea.params
  if not subs_a:
    return [plain] * len(ea.outvars)
  if name == "cond":
    outs = [_BATCH if ins[0] == _BATCH else _FIXED] * len(ea.outvars)
    for sa, sb in zip(subs_a, subs_b, strict=True):
      got = _walk_draws(sa, sb, ins[1:], report)
      outs = [max(x, y) for x, y in zip(outs, got, strict=True)]
    return outs
  if name == "while":
    nc, nb = params["cond_nconsts"], params["body_nconsts"]
    cond_consts, body_consts = ins[:nc], ins[nc : nc + nb]
    carry = ins[nc + nb :]
    body_a, body_b = params["body_jaxpr"].jaxpr, eb.params["body_jaxpr"].jaxpr
    cond_a, cond_b = params["cond_jaxpr"].jaxpr, eb.params["cond_jaxpr"].jaxpr
    for _ in range(2):  # what the body puts in its carry, it held before
      got = _walk_draws(body_a, body_b, body_consts + carry, lambda e: None)
      carry = [max(x, y) for x, y in zip(carry, got, strict=True)]
    _walk_draws(body_a, body_b, body_consts + carry, report)
    _walk_draws(cond_a, cond_b, cond_consts + carry, report)
    return carry
  if len(subs_a) == 1 and len(subs_a[0].invars) == len(ins):
    body_a, body_b = subs_a[0], subs_b[0]
    if name == "scan":
      first = params["num_consts"]
      last = first + params["num_carry"]
      for _ in range(2):
        got = _walk_draws(body_a, body_b, ins, lambda e: None)
        pairs = zip(ins[first:last], got[: last - first], strict=True)
        carry = [max(x, y) for x, y in pairs]
        ins = ins[:first] + carry + ins[last:]
    outs = _walk_draws(body_a, body_b, ins, report)
    if len(outs) == len(ea.outvars):
      return outs
    return [plain] * len(ea.outvars)
  for sa, sb in zip(subs_a, subs_b, strict=True):
    _walk_draws(sa, sb, [plain] * len(sa.invars), report)
  return [plain] * len(ea.outvars)


def _is_var(atom) -> bool:
  return not isinstance(atom, jex.core.Literal)
