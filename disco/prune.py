"""Learned channel selection: which channels cross the links, and how many.

The unit of selection is a channel group: one mask bit (destination node j,
input channel c owned by another node), which gates the weight column
W[..., c, Q_j] of every layer reading that tensor through that mask. The
communication ratio r is kept groups / all groups over the model; it is the
bytes sent relative to dense channel parallelism when every mask keeps the
same fraction (the per-layer budget).

- Scores (`selection`): "magnitude" is the L2 norm of the group's weight
  column, over all layers sharing the mask; "random" is a fixed random
  number per group (the baseline, at the same r).
- Budget: "layer" keeps floor(r x groups) in every mask, so every layer's
  traffic, compute and weights shrink by the same factor; "global" keeps
  floor(r x all groups) over the model, ranking magnitudes normalised by
  each mask's RMS so that layers of different scale compete fairly.
- Masks only shrink: a group dropped once is never kept again.
- `GradualSchedule`: r falls from 1 to the target along a cubic
  (Zhu & Gupta, 2017) while training continues; fine-tuning then trains with
  the masks fixed (masks are not parameters, so optimizers leave them).
- `group_norm_penalty`: a group-lasso term (sum of the kept cross columns'
  norms) that training can add while pruning, so that the columns magnitude
  selection drops carry little weight by the time they are dropped.
"""

import dataclasses
import math
import numbers

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from disco.errors import PruneError, require_int
from disco.layers import CommMask, DiscoLayer, require_concrete_masks

SELECTIONS = ("magnitude", "random")
BUDGETS = ("layer", "global")


@dataclasses.dataclass(frozen=True, eq=False)
class MaskGroup:
  """One `CommMask` and the layers that read their input through it.

  Args:
    mask: the shared mask variable.
    layers: the DISCO layers using it.
    cross: boolean (nodes, channels): the bits that are channel groups.
  """

  mask: CommMask
  layers: tuple[DiscoLayer, ...]
  cross: np.ndarray

  def kept(self) -> np.ndarray:
    """Boolean (nodes, channels): the groups kept now."""
    return np.asarray(self.mask[...]) & self.cross

  def column_norms(self, host: bool = False):
    """(nodes, channels) L2 norms of each group's weight column.

    Traceable, so training can penalise them; with `host` computed in
    numpy. Bits that are not groups get the norm of the local column.
    """
    squares = 0.0
    for layer in self.layers:
      kernel = layer.kernel[...]
      kernel = np.asarray(kernel) if host else kernel
      by_column = (kernel**2).sum(axis=tuple(range(kernel.ndim - 2)))
      owner = np.eye(layer.num_nodes)[layer.out_split.owner()]
      squares = squares + (by_column @ owner).T
    return (squares + 1e-12) ** 0.5


def mask_groups(model: nnx.Module) -> list[MaskGroup]:
  """The model's distinct masks that have channel groups, in module order.

  Example:
    >>> from flax import nnx
    >>> from disco.models import ResNet, ResNetConfig
    >>> model = ResNet(ResNetConfig(num_nodes=2), rngs=nnx.Rngs(0))
    >>> len(mask_groups(model))  # the stem reads the replicated image
    7

  Args:
    model: a model built from DISCO layers.
  """
  require_concrete_masks(model, PruneError)
  groups = {}
  for _, module in nnx.iter_modules(model):
    if isinstance(module, DiscoLayer) and module.cross().any():
      key = id(module.mask)
      layers = groups[key].layers if key in groups else ()
      groups[key] = MaskGroup(module.mask, layers + (module,), module.cross())
  return list(groups.values())


def comm_ratio(model: nnx.Module) -> float:
  """Kept channel groups / all channel groups of the model (1 = dense; a
  model without cross-node weights, e.g. on one node, is dense: 1).

  Example:
    >>> from flax import nnx
    >>> from disco.layers import DiscoDense
    >>> comm_ratio(DiscoDense(8, 8, num_nodes=2, rngs=nnx.Rngs(0)))
    1.0

  Args:
    model: a model built from DISCO layers.
  """
  groups = mask_groups(model)
  total = sum(int(g.cross.sum()) for g in groups)
  kept = sum(int(g.kept().sum()) for g in groups)
  return kept / total if total else 1.0


def to_ratio(
  model: nnx.Module,
  comm_ratio: float,
  *,
  budget: str = "layer",
  selection: str = "magnitude",
  seed: int = 0,
) -> None:
  """Sets the masks in place to keep the best `comm_ratio` of the groups.

  Example:
    >>> from flax import nnx
    >>> from disco.layers import DiscoDense
    >>> layer = DiscoDense(8, 8, num_nodes=2, rngs=nnx.Rngs(0))
    >>> to_ratio(layer, 0.25)
    >>> comm_ratio(layer)
    0.25

  Args:
    model: a model built from DISCO layers.
    comm_ratio: target fraction of channel groups kept, in [0, 1].
    budget: "layer" (the fraction in every mask) or "global" (over the
      model).
    selection: "magnitude" or "random".
    seed: seed of the random scores.

  Raises:
    PruneError: a ratio outside [0, 1], an unknown option, a target that
      would keep a group already dropped, or (magnitude selection) weights
      that are not finite.
  """
  comm_ratio = check_ratio(comm_ratio)
  require_int("seed", seed, 0, PruneError)
  _check_choices(budget, selection)
  if not any(isinstance(m, DiscoLayer) for _, m in nnx.iter_modules(model)):
    raise PruneError(
      f"{type(model).__name__} has no DISCO layers: there is nothing to prune"
    )
  groups = mask_groups(model)
  scores = [
    _scores(g, index, selection, seed) for index, g in enumerate(groups)
  ]
  if budget == "layer":
    for group, score in zip(groups, scores, strict=True):
      keep = _keep_count(comm_ratio, int(group.cross.sum()))
      _check_can_keep(keep, int(group.kept().sum()), comm_ratio)
      _set_mask(group, _top(score, group.kept(), keep))
    return
  total = sum(int(g.cross.sum()) for g in groups)
  kept = [g.kept() for g in groups]
  keep = _keep_count(comm_ratio, total)
  _check_can_keep(keep, sum(int(k.sum()) for k in kept), comm_ratio)
  # One ranking over every kept group of the model.
  flat = np.concatenate([s[k] for s, k in zip(scores, kept, strict=True)])
  chosen = np.zeros(flat.shape, bool)
  chosen[np.argsort(-flat, kind="stable")[:keep]] = True
  offset = 0
  for group, kept_now in zip(groups, kept, strict=True):
    new = np.zeros_like(kept_now)
    new[kept_now] = chosen[offset : offset + int(kept_now.sum())]
    offset += int(kept_now.sum())
    _set_mask(group, new)


def check_ratio(comm_ratio) -> float:
  """`comm_ratio` as a float; PruneError unless it is a real number (a
  Python or numpy one, or a 0-d array) in [0, 1].

  Example:
    >>> check_ratio(np.float32(0.5))
    0.5

  Args:
    comm_ratio: a communication ratio.
  """
  value = _real(comm_ratio)
  if value is None or not 0 <= value <= 1:
    raise PruneError(
      f"communication ratio must be in [0, 1] (1 = dense, 0 = no "
      f"communication), got {comm_ratio!r}"
    )
  return value


def _check_choices(budget, selection) -> None:
  if budget not in BUDGETS or selection not in SELECTIONS:
    raise PruneError(
      f"budget must be one of {BUDGETS} and selection one of {SELECTIONS}, "
      f"got {budget!r} and {selection!r}"
    )


def _real(value) -> float | None:
  """`value` as a float if it is a real number (a Python, numpy or 0-d
  array one; not a bool), else None."""
  if isinstance(value, bool | np.bool_):
    return None
  if isinstance(value, numbers.Real):
    return float(value)
  if getattr(value, "ndim", None) == 0 and np.dtype(value.dtype).kind in "fiu":
    return float(value)
  return None


@dataclasses.dataclass(frozen=True)
class GradualSchedule:
  """Prune from r = 1 to `target_ratio` along a cubic over `steps` steps.

  r(t) = target + (1 - target) (1 - t / steps)^3, applied every `every`
  training steps and at the last step.

  Example:
    >>> schedule = GradualSchedule(target_ratio=0.2, steps=100, every=10)
    >>> [round(schedule.ratio_at(t), 3) for t in (0, 50, 100)]
    [1.0, 0.3, 0.2]

  Args:
    target_ratio: the final communication ratio.
    steps: training steps from the first to the last pruning.
    every: training steps between prunings.
    budget: "layer" or "global" (see `to_ratio`).
    selection: "magnitude" or "random".
    seed: seed of the random scores.
  """

  target_ratio: float
  steps: int
  every: int = 10
  budget: str = "layer"
  selection: str = "magnitude"
  seed: int = 0

  def __post_init__(self):
    object.__setattr__(self, "target_ratio", check_ratio(self.target_ratio))
    require_int("seed", self.seed, 0, PruneError)
    # A fractional `steps` was taken and `due` never met the last step: the
    # schedule stopped short of its target without a word.
    require_int("steps", self.steps, 1, PruneError)
    require_int("every", self.every, 1, PruneError)
    _check_choices(self.budget, self.selection)

  def ratio_at(self, step: int) -> float:
    """The communication ratio the masks should have after `step` steps."""
    progress = min(max(step / self.steps, 0.0), 1.0)
    return self.target_ratio + (1 - self.target_ratio) * (1 - progress) ** 3

  def due(self, step: int) -> bool:
    """Whether to prune after `step` training steps."""
    return 0 < step <= self.steps and (
      step % self.every == 0 or step == self.steps
    )

  def apply(self, model: nnx.Module, step: int) -> None:
    """Prunes `model` to `ratio_at(step)`."""
    to_ratio(
      model,
      self.ratio_at(step),
      budget=self.budget,
      selection=self.selection,
      seed=self.seed,
    )


def group_norm_penalty(model: nnx.Module) -> jax.Array:
  """Sum of the L2 norms of the kept channel groups' weight columns.

  Example:
    >>> from flax import nnx
    >>> from disco.layers import DiscoDense
    >>> layer = DiscoDense(8, 8, num_nodes=2, rngs=nnx.Rngs(0))
    >>> float(group_norm_penalty(layer)) > 0
    True

  Args:
    model: a model built from DISCO layers (traceable).
  """
  total = jnp.zeros(())
  for group in mask_groups(model):
    weight = group.mask[...] & group.cross
    total = total + jnp.sum(group.column_norms() * weight)
  return total


def _scores(group: MaskGroup, index: int, selection: str, seed: int):
  if selection == "random":
    # One fixed number per group, so a gradual schedule drops a fixed order.
    return np.random.default_rng([seed, index]).random(group.cross.shape)
  norms = group.column_norms(host=True)
  if not np.all(np.isfinite(norms[group.cross])):
    # NaN scores sorted below every other: the mask kept nothing, silently.
    raise PruneError(
      f"the weights read through mask group {index} (of "
      f"{type(group.layers[0]).__name__} layers) hold NaN or inf: their "
      "channel groups cannot be ranked by magnitude; check the training "
      "(a learning rate too high, non-finite inputs) or the checkpoint"
    )
  rms = np.sqrt(np.mean(np.square(norms[group.cross])))
  return norms / max(rms, 1e-12)


def _keep_count(comm_ratio: float, groups: int) -> int:
  # Floor, so the bytes sent never exceed the ratio; the epsilon absorbs
  # float error in products like 0.2 * 40 that are whole numbers.
  return math.floor(comm_ratio * groups + 1e-9)


def _check_can_keep(keep: int, kept: int, comm_ratio: float) -> None:
  if keep > kept:
    raise PruneError(
      f"ratio {comm_ratio} would keep {keep} channel groups where only {kept} "
      "are left: masks only shrink; start again from a model with all masks "
      "one (disco.metrics.with_masks(model, True))"
    )


def _top(score: np.ndarray, candidates: np.ndarray, keep: int) -> np.ndarray:
  """The `keep` highest-scoring candidates, as a boolean mask."""
  flat = np.where(candidates, score, -np.inf).ravel()
  chosen = np.zeros(flat.shape, bool)
  chosen[np.argsort(-flat, kind="stable")[:keep]] = True
  return chosen.reshape(score.shape) & candidates


def _set_mask(group: MaskGroup, kept_groups: np.ndarray) -> None:
  # Bits that are not channel groups (a node's own channels) stay one.
  group.mask[...] = jnp.asarray(kept_groups | ~group.cross)
