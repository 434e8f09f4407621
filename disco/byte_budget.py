"""The bytes budget of `disco.prune.to_ratio`: each channel group's bytes,
and which kept groups fit r x the bytes of all groups.

Groups are ranked by score per byte and kept in that order, skipping any
that would take the bytes over the budget. Random selection ranks by its
random numbers alone, and makes the choice it ends with first: masks only
shrink, so a random order chosen afresh at each pruning of a gradual
schedule keeps large groups that the last budgets cannot hold once the
small ones have been dropped on the way, and ends far below its bytes
(the random arm of a comparison would then send fewer bytes than the
selection it is compared with). With `final_ratio`, the groups that the
random order keeps at the schedule's final ratio, chosen from every
group, come first at every pruning, then the others in the same order:
the last pruning keeps exactly that choice, within one group of its
budget.
"""

import numpy as np

from disco import metrics
from disco.errors import MetricsError, PruneError


def group_bytes(model, crosses, given, input_shape=None) -> list[np.ndarray]:
  """The bytes of every group: `given` (one array per mask group), or
  counted at `input_shape` (`disco.metrics.group_bytes`), checked against
  the masks' group flags `crosses`."""
  if given is None:
    try:
      given = metrics.group_bytes(model, input_shape)
    except MetricsError as error:
      raise PruneError(
        f"the bytes budget needs each group's bytes: {error} (pass "
        "group_bytes=disco.metrics.group_bytes(model, input_shape), or a "
        "GradualSchedule's input_shape)"
      ) from None
  costs = [np.asarray(c, np.float64) for c in given]
  shapes = [np.shape(c) for c in crosses]
  if [c.shape for c in costs] != shapes:
    raise PruneError(
      f"group bytes of shapes {[c.shape for c in costs]} for mask groups of "
      f"shapes {shapes}: they were counted on another model"
    )
  for index, (cost, cross) in enumerate(zip(costs, crosses, strict=True)):
    values = cost[cross]
    if not np.all(np.isfinite(values)) or np.any(values < 0):
      raise PruneError(
        f"the group bytes of mask group {index} must be finite and at least "
        f"0, got {values.min() if values.size else values}"
      )
  return costs


def _first_fit(order, cost, target) -> np.ndarray:
  """Flags of the items taken in `order` while their bytes fit `target`."""
  chosen = np.zeros(cost.shape, bool)
  used = 0.0
  for index in order:
    if used + cost[index] <= target:
      chosen[index] = True
      used += cost[index]
  return chosen


def fill(
  crosses,
  kept,
  values,
  costs,
  comm_ratio: float,
  selection: str,
  final_ratio: float | None = None,
) -> np.ndarray:
  """A flag per kept group (in mask order, then channel order) saying
  whether it stays.

  Example:
    One mask of four groups of 4, 1, 1 and 2 bytes (8 in all), half of
    the bytes kept. By score per byte: the two 1-byte groups, then the
    2-byte one (the 4-byte group scores most, but least per byte). At
    random, the order of the random numbers: 4 bytes, then nothing fits.

    >>> every = [np.ones(4, bool)]
    >>> costs = [np.array([4.0, 1.0, 1.0, 2.0])]
    >>> fill(every, every, [np.array([3.0, 1.0, 1.0, 1.0])], costs, 0.5,
    ...      "saliency").tolist()
    [False, True, True, True]
    >>> fill(every, every, [np.array([0.9, 0.1, 0.2, 0.3])], costs, 0.5,
    ...      "random").tolist()
    [True, False, False, False]

  Args:
    crosses: per mask group, which bits are channel groups.
    kept: per mask group, the channel groups kept now.
    values: per mask group, the groups' scores (for "gates" their
      probability of being open; for "random" numbers in [0, 1)).
    costs: per mask group, the groups' bytes.
    comm_ratio: the fraction of all groups' bytes to fit.
    selection: "random" ranks by `values` alone; any other selection by
      value per byte (free groups first).
    final_ratio: with "random", the ratio the schedule ends at (default
      `comm_ratio`): its random choice, from every group, comes first.
  """
  total = sum(float(c[x].sum()) for c, x in zip(costs, crosses, strict=True))
  # The epsilon absorbs float error in products that are whole numbers.
  target = comm_ratio * total * (1 + 1e-9)
  value = np.concatenate([v[k] for v, k in zip(values, kept, strict=True)])
  cost = np.concatenate([c[k] for c, k in zip(costs, kept, strict=True)])
  held = float(cost.sum())
  largest = max(
    (float(c[x].max()) for c, x in zip(costs, crosses, strict=True) if x.any()),
    default=0.0,
  )
  # Ratios that fall (a schedule) leave the kept bytes short of the target
  # by less than one group (the last group left out did not fit); a gap of
  # a whole largest group means the ratio rose above what was kept.
  if target - held >= largest > 0:
    raise PruneError(
      f"ratio {comm_ratio} of the bytes would keep groups already dropped "
      f"(the kept groups send {held:,.0f} of {total:,.0f} bytes): masks only "
      "shrink; start again from a model with all masks one "
      "(disco.metrics.with_masks(model, True))"
    )
  if selection != "random":
    key = np.divide(
      value, cost, out=np.full_like(value, np.inf), where=cost > 0
    )
    return _first_fit(np.argsort(-key, kind="stable"), cost, target)
  final = comm_ratio if final_ratio is None else final_ratio
  every = np.concatenate([v[x] for v, x in zip(values, crosses, strict=True)])
  every_cost = np.concatenate(
    [c[x] for c, x in zip(costs, crosses, strict=True)]
  )
  ends = _first_fit(
    np.argsort(-every, kind="stable"), every_cost, final * total * (1 + 1e-9)
  )
  # The final choice as flags per mask group, then over the kept groups.
  ends_of, offset = [], 0
  for cross in crosses:
    flags = np.zeros(np.shape(cross), bool)
    flags[cross] = ends[offset : offset + int(cross.sum())]
    offset += int(cross.sum())
    ends_of.append(flags)
  first = np.concatenate([e[k] for e, k in zip(ends_of, kept, strict=True)])
  order = np.lexsort((-value, ~first))  # the final choice, then the rest
  return _first_fit(order, cost, target)
