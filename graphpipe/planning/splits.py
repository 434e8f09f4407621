"""The fastest plan over the ways to split layers (`fastest_split`).

A split is fixed when the model is captured (`capture(...,
split_layers=...)`), so a planner given one graph cannot choose it: this
captures each combination of the part counts asked for, plans each with
the same options and keeps the fastest simulated plan. The reproduction's
branch sweep does the same for one layer
(`experiments.reproduce.best_over_splits`).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Mapping, Sequence

from graphpipe.core.graph import OpGraph
from graphpipe.core.stages import Plan
from graphpipe.errors import PlanError
from graphpipe.planning.search import plan
from graphpipe.simulator.engine import simulate


def fastest_split(
  capture_with: Callable[[dict[str, int]], OpGraph],
  num_devices: int,
  batch_size: int,
  choices: Mapping[str, Sequence[int]],
  **plan_options,
) -> tuple[dict[str, int], OpGraph, Plan, list[dict]]:
  """The fastest plan over every combination of `choices`' part counts.

  Example:
    >>> model = nnx.Sequential(nnx.Linear(4, 64, rngs=nnx.Rngs(0)),
    ...                        nnx.Linear(64, 1, rngs=nnx.Rngs(1)))
    >>> loss_fn = lambda m, b: jnp.mean((m(b["x"]) - b["y"]) ** 2)
    >>> batch = {"x": jnp.ones((8, 4)), "y": jnp.ones((8, 1))}
    >>> split, graph, p, tried = graphpipe.fastest_split(
    ...     lambda s: graphpipe.capture(loss_fn, model, batch, split_layers=s),
    ...     4, 8, {"layers.0": (1, 2, 4)})
    >>> [t["split_layers"] for t in tried]
    [{}, {'layers.0': 2}, {'layers.0': 4}]

  Args:
    capture_with: split_layers -> the captured graph, e.g.
      `lambda s: graphpipe.capture(loss_fn, model, batch, split_layers=s)`.
    num_devices, batch_size: as `graphpipe.plan`'s.
    choices: layer (a parameter or module name, as `split_layers` takes
      it) -> the part counts to try, 1 for the layer whole.
    **plan_options: `graphpipe.plan`'s other options, the same for every
      combination; with `lockstep=True` plans are compared as the runtime
      steps them (`simulate(..., lockstep=True)`), else as the paper's
      asynchronous pipeline.

  Returns:
    (the chosen split_layers, its graph, its plan, per combination a dict
    of its split_layers and its simulated iteration_time_s, or the
    `error` that left it without a plan).

  Raises:
    PlanError: no combination has a plan (each one's reason is named),
      or `choices` is empty or holds a count below 1.
  """
  if not choices:
    raise PlanError("fastest_split needs choices: layer -> part counts")
  names = list(choices)
  for name in names:
    counts = list(choices[name])
    if not counts or any(
      not isinstance(c, int) or isinstance(c, bool) or c < 1 for c in counts
    ):
      raise PlanError(
        f"choices[{name!r}] must be part counts >= 1 (1: whole), got "
        f"{choices[name]!r}"
      )
  lockstep = bool(plan_options.get("lockstep", False))
  best, tried = None, []
  for counts in itertools.product(*(choices[n] for n in names)):
    split = {n: c for n, c in zip(names, counts, strict=True) if c > 1}
    graph = capture_with(dict(split))
    try:
      p = plan(graph, num_devices, batch_size, **plan_options)
    except PlanError as err:
      tried.append({"split_layers": split, "error": str(err)})
      continue
    seconds = simulate(p, graph, lockstep=lockstep).iteration_time_s
    tried.append({"split_layers": split, "iteration_time_s": seconds})
    if best is None or seconds < best[0]:
      best = (seconds, split, graph, p)
  if best is None:
    reasons = "; ".join(f"{t['split_layers']}: {t['error']}" for t in tried)
    raise PlanError(f"no split of {names} has a plan: {reasons}")
  return best[1], best[2], best[3], tried
