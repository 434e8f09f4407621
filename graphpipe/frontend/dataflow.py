"""Data flow of a traced jaxpr: who produces a variable, what an equation
reads, and the equations a set of values is computed by."""

from __future__ import annotations

import jax.extend as jex


def producers(jaxpr) -> dict:
  return {
    v: (i, k) for i, e in enumerate(jaxpr.eqns) for k, v in enumerate(e.outvars)
  }


def operands(eqn):
  return [v for v in eqn.invars if not isinstance(v, jex.core.Literal)]


def slice_of(jaxpr, producer, roots, stop=lambda v: False) -> list[int]:
  """Equations that compute `roots`, not looking past operands `stop`
  names (sorted: a topological order)."""
  needed, stack = set(), [v for v in roots if v in producer]
  while stack:
    i = producer[stack.pop()][0]
    if i in needed:
      continue
    needed.add(i)
    stack.extend(
      u for u in operands(jaxpr.eqns[i]) if u in producer and not stop(u)
    )
  return sorted(needed)
