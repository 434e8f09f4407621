"""The states of `graphpipe.frontend.samplewise` and their algebra.

A `State` says what a traced value holds (see the package docstring);
`join` merges two (loop carries, branches); layouts are the virtual
dimensions of a batch axis, (size, holds the samples) pairs, row-major.
"""

from __future__ import annotations

import dataclasses

import jax.extend as jex

FREE, ROWS, POSITION, GLOBAL, MIXED = (
  "free",
  "rows",
  "position",
  "global",
  "mixed",
)


@dataclasses.dataclass(frozen=True)
class State:
  """What a traced value holds (see the module docstring)."""

  kind: str
  params: bool = False
  axis: int | None = None
  layout: tuple | None = None
  summed: bool = False
  local: bool = False
  why: str = ""
  # FREE: a key of a training stream (or derived from one), whose draws
  # follow the per-sample rule (`graphpipe.frontend.streams`).
  stream: bool = False

  @property
  def batched(self) -> bool:
    """Has a batch axis (ROWS, POSITION, or MIXED with a batch shape)."""
    return self.kind in (ROWS, POSITION) or (
      self.kind == MIXED and self.axis is not None
    )

  @property
  def blocked(self) -> bool:
    """ROWS whose samples' elements are consecutive blocks of the axis."""
    if self.kind != ROWS:
      return False
    if self.layout is None:
      return True
    return canonical(self.layout)[0][1]


def free(params=False, stream=False) -> State:
  return State(FREE, params, stream=stream)


def rows(axis: int, size: int, params=False) -> State:
  """A batch leaf (or any value) whose axis holds one block per sample."""
  return State(ROWS, params, axis, ((size, True),))


def describe(eqn) -> str:
  """'reduce_max at loss.py:12 (my_loss)': the equation, where it was
  written."""
  where = ""
  try:
    from jax._src import source_info_util

    where = source_info_util.summarize(eqn.source_info)
  except Exception:  # an internal API: the primitive alone still helps
    pass
  return f"{eqn.primitive.name} at {where}" if where else eqn.primitive.name


def mixed(why: str, params: bool, axis=None) -> State:
  return State(MIXED, params, axis, why=why)


def canonical(layout):
  """Size-1 entries dropped and neighbouring non-sample entries merged."""
  out = []
  for size, samples in layout:
    if size == 1 and not samples:
      continue
    if out and not samples and not out[-1][1]:
      out[-1] = (out[-1][0] * size, False)
    else:
      out.append((size, samples))
  return tuple(out)


def same_layout(a, b) -> bool:
  return a is None or b is None or canonical(a) == canonical(b)


def is_var(atom) -> bool:
  return not isinstance(atom, jex.core.Literal)


def shape_of(atom):
  return tuple(getattr(atom.aval, "shape", ()))


def batch_axes(small, large) -> list[int]:
  """Axes whose size differs between two traces of one value."""
  if len(small) != len(large):
    return [-1]
  return [
    i for i, (a, b) in enumerate(zip(small, large, strict=True)) if a != b
  ]


def join(a: State, b: State) -> State:
  """What a value holds when it may hold either (loop carries, branches)."""
  params = a.params or b.params
  if a == b:
    return a
  for s in (a, b):
    if s.kind == MIXED:
      return dataclasses.replace(s, params=params)
  kinds = {a.kind, b.kind}
  if kinds == {ROWS} and a.axis == b.axis and same_layout(a.layout, b.layout):
    return State(ROWS, params, a.axis, a.layout or b.layout)
  if kinds <= {FREE, GLOBAL}:
    if kinds == {FREE}:
      return free(params)
    return State(
      GLOBAL, params, local=a.local or b.local
    )  # summed no longer: a value of several origins
  return mixed(
    "a value that holds samples differently on different paths",
    params,
    a.axis if a.batched else b.axis,
  )


# Elementwise primitives: operands of one shape (or size-1 dimensions and
# scalars broadcast), each output element from the same element of each
# operand.
