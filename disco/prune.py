"""Learned channel selection: which channels cross the links, and how many.

The unit of selection is a channel group: one mask bit (destination node j,
input channel c owned by another node), which gates the weight column
W[..., c, Q_j] of every layer reading that tensor through that mask. The
communication ratio r is kept groups / all groups over the model; it is the
bytes sent relative to dense channel parallelism when every mask keeps the
same fraction (the per-layer budget). The "bytes" budget reads r as the
fraction of the groups' bytes instead (`comm_ratio` still counts groups).

- Scores (`selection`): "saliency" is the loss increase expected when the
  group's gate closes, measured while training: with a gate g scaling the
  group's weight columns (g = 1 now), d loss / d g = sum(W * dL/dW) over
  those columns of every layer sharing the mask, and the second-order
  (Fisher) estimate of the increase is 1/2 E[(d loss / d g)^2], averaged
  over training batches (an exponential average over about one epoch;
  Molchanov et al., 2019, on gates instead of filters). `train.fit`
  accumulates it during a schedule that selects by saliency.
  "gates" learns one hard-concrete gate per group (Louizos et al., 2018)
  while the pruning schedule runs: the group's weight columns are scaled
  by a stochastic gate in [0, 1] whose log-odds log_alpha are trained with
  the weights, under a penalty on the expected fraction of open gates
  (`HardConcreteGates`); each pruning keeps the groups of largest
  log_alpha, and when the schedule ends each kept group's deterministic
  gate is folded into its weights (`fold_gates`), so the model that
  leaves training is masks and weights only.
  "magnitude" is the L2 norm of the group's weight column, over all layers
  sharing the mask; "random" is a fixed random number per group (the
  baseline, at the same r).
- Budget: "layer" keeps floor(r x groups) in every mask, so every layer's
  traffic, compute and weights shrink by the same factor; "global" keeps
  floor(r x all groups) over the model, ranking magnitudes normalised by
  each mask's RMS so that layers of different scale compete fairly;
  "bytes" ranks the groups of the whole model by score per byte (a
  group's bytes are its tensor's positions times the item size:
  `disco.metrics.group_bytes`) and keeps them in that order, skipping
  any that would take the bytes over r x the bytes of all groups, so r
  is a fraction of the traffic the masks control (not the outputs
  gathered to node 0) and no layer is floored to nothing. Random
  selection ranks by its random numbers alone (a random choice within
  the same budget, made at the schedule's final ratio first so that it
  fills the bytes as the ranking per byte does: `disco.byte_budget`),
  and gates by their probability of being open.
- Masks only shrink: a group dropped once is never kept again. A ratio
  above the kept groups is refused (with the bytes budget: bytes at least
  one largest group above them; a smaller rise keeps the groups as they
  are, since a falling schedule also ends up to one group short).
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

from disco import byte_budget
from disco.errors import PruneError, require_int, require_number
from disco.layers import CommMask, DiscoLayer, require_concrete_masks

SELECTIONS = ("saliency", "gates", "magnitude", "random")
BUDGETS = ("layer", "global", "bytes")


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
    return (self.column_squares(host) + 1e-12) ** 0.5

  def column_squares(self, host: bool = False):
    """(nodes, channels) sums of squares of each group's weight column
    (`column_norms` squared, without its epsilon)."""
    return self.column_sums(
      [layer.kernel[...] ** 2 for layer in self.layers], host
    )

  def column_sums(self, per_layer, host: bool = False):
    """(nodes, channels): values shaped like each layer's kernel (in
    `layers` order) summed over every group's weight column: the kernel's
    leading (spatial) axes and the output channels of each destination."""
    total = 0.0
    for layer, values in zip(self.layers, per_layer, strict=True):
      values = np.asarray(values) if host else values
      by_column = values.sum(axis=tuple(range(values.ndim - 2)))
      owner = np.eye(layer.num_nodes)[layer.out_split.owner()]
      total = total + (by_column @ owner).T
    return total


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


def gate_gradients(model: nnx.Module, grads: nnx.Module) -> list[jax.Array]:
  """Per mask group (`mask_groups` order), (nodes, channels) derivatives of
  the loss by each channel group's gate: a gate g scaling the group's
  weight columns, at g = 1, d loss / d g = sum(W * dL/dW) over them.

  Traceable: `train.fit` computes it inside its training step.

  Example:
    >>> import jax
    >>> from flax import nnx
    >>> from disco.layers import DiscoDense
    >>> layer = DiscoDense(4, 4, num_nodes=2, rngs=nnx.Rngs(0))
    >>> x = jnp.ones((3, 4))
    >>> graphdef, _, rest = nnx.split(layer, nnx.Param, ...)
    >>> grads = nnx.grad(lambda m: jnp.sum(m(x) ** 2))(layer)
    >>> of_grads = nnx.merge(graphdef, grads, rest)
    >>> [g.shape for g in gate_gradients(layer, of_grads)]
    [(2, 4)]

  Args:
    model: a model built from DISCO layers.
    grads: the same model holding, in place of its parameters, the
      gradients of the loss by them.
  """
  out = []
  for group, of_grads in zip(
    mask_groups(model), mask_groups(grads), strict=True
  ):
    out.append(
      group.column_sums(
        [
          layer.kernel[...] * grad.kernel[...]
          for layer, grad in zip(group.layers, of_grads.layers, strict=True)
        ]
      )
    )
  return out


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
  saliency=None,
  gates=None,
  group_bytes=None,
  final_ratio=None,
) -> None:
  """Sets the masks in place to keep the best `comm_ratio` of the groups
  (of their bytes with budget "bytes").

  Example:
    >>> from flax import nnx
    >>> from disco.layers import DiscoDense
    >>> layer = DiscoDense(8, 8, num_nodes=2, rngs=nnx.Rngs(0))
    >>> to_ratio(layer, 0.25)
    >>> comm_ratio(layer)
    0.25

  Args:
    model: a model built from DISCO layers.
    comm_ratio: target fraction of channel groups kept (of their bytes
      with budget "bytes"), in [0, 1].
    budget: "layer" (the fraction of groups in every mask), "global" (of
      the model's groups) or "bytes" (of the bytes of the model's groups).
    selection: "saliency", "gates", "magnitude" or "random".
    seed: seed of the random scores.
    saliency: with selection "saliency", the scores: one (nodes, channels)
      array per mask group in `mask_groups` order (what `train.fit`
      accumulates, `SaliencyMeter`).
    gates: with selection "gates", the gates' log_alpha, shaped like
      `saliency` (what `train.fit` learns, `HardConcreteGates`).
    group_bytes: with budget "bytes", each group's bytes per inference,
      shaped like `saliency`; by default `disco.metrics.group_bytes(model)`
      (the input shape from the model's config).
    final_ratio: with selection "random" and budget "bytes", the ratio
      the pruning schedule ends at, at most `comm_ratio` (default
      `comm_ratio`): the random choice at it is kept first, so that the
      last pruning fills its bytes (`disco.byte_budget`).

  Raises:
    PruneError: a ratio outside [0, 1], an unknown option, a target that
      would keep a group already dropped, saliency or gates selection
      without scores of the model's shapes, or scores (weights for magnitude
      selection) that are not finite; budget "bytes" with group bytes not
      of the masks' shapes, negative or not finite, or without them where
      the model's config gives no input shape.
  """
  comm_ratio = check_ratio(comm_ratio)
  require_int("seed", seed, 0, PruneError)
  _check_choices(budget, selection)
  if not any(isinstance(m, DiscoLayer) for _, m in nnx.iter_modules(model)):
    raise PruneError(
      f"{type(model).__name__} has no DISCO layers: there is nothing to prune"
    )
  groups = mask_groups(model)
  if not groups:
    return  # one node: nothing crosses a link, nothing to choose
  given = _check_measured(groups, selection, saliency, gates)
  scores = [
    _scores(g, index, selection, seed, given) for index, g in enumerate(groups)
  ]
  if final_ratio is not None:
    if (selection, budget) != ("random", "bytes"):
      raise PruneError(
        "final_ratio is read by random selection under the bytes budget "
        f"only, got selection {selection!r}, budget {budget!r}"
      )
    final_ratio = check_ratio(final_ratio)
    if final_ratio > comm_ratio:
      raise PruneError(
        f"final_ratio {final_ratio} is above the ratio pruned to now "
        f"({comm_ratio}): a schedule ends below where it is"
      )
  if group_bytes is not None and budget != "bytes":
    raise PruneError(
      f"group_bytes were given to budget {budget!r}, which counts groups: "
      "pass budget='bytes'"
    )
  if budget == "bytes":
    crosses = [g.cross for g in groups]
    costs = byte_budget.group_bytes(model, crosses, group_bytes)
    kept = [g.kept() for g in groups]
    if selection == "gates":
      scores = [HardConcreteGates.open_probability(s, True) for s in scores]
    chosen = byte_budget.fill(
      crosses, kept, scores, costs, comm_ratio, selection, final_ratio
    )
    _set_masks(groups, kept, chosen)
    return
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
  _set_masks(groups, kept, chosen)


def _set_masks(groups, kept, chosen) -> None:
  """Each mask's kept groups from `chosen`, a flag per kept group of the
  model in `groups` order."""
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
    budget: "layer", "global" or "bytes" (see `to_ratio`).
    selection: "saliency", "gates", "magnitude" or "random"; saliency and
      gates need the scores `train.fit` measures (`apply`'s `saliency` or
      `gates`).
    gate_penalty: with selection "gates", the weight of the expected
      fraction of open gates in the loss (with budget "bytes", of their
      bytes: `HardConcreteGates.open_fraction`).
    gate_learning_rate: with selection "gates", Adam's learning rate of
      the gates' log_alpha.
    seed: seed of the random scores.
    input_shape: with budget "bytes", the input shape the groups' bytes
      are counted at (`disco.metrics.group_bytes`); by default the
      model's config gives it.
  """

  target_ratio: float
  steps: int
  every: int = 10
  budget: str = "layer"
  selection: str = "magnitude"
  seed: int = 0
  gate_penalty: float = 1.0
  gate_learning_rate: float = 0.05
  input_shape: tuple | None = None

  def __post_init__(self):
    object.__setattr__(self, "target_ratio", check_ratio(self.target_ratio))
    require_number("gate_penalty", self.gate_penalty, error=PruneError)
    require_number(
      "gate_learning_rate", self.gate_learning_rate, True, PruneError
    )
    require_int("seed", self.seed, 0, PruneError)
    # A fractional `steps` was taken and `due` never met the last step: the
    # schedule stopped short of its target without a word.
    require_int("steps", self.steps, 1, PruneError)
    require_int("every", self.every, 1, PruneError)
    _check_choices(self.budget, self.selection)
    if self.input_shape is not None:
      if self.budget != "bytes":
        raise PruneError(
          f"input_shape is read by the bytes budget only, got budget "
          f"{self.budget!r}"
        )
      shape = self.input_shape
      if not isinstance(shape, tuple | list) or not all(
        isinstance(d, int) and not isinstance(d, bool) and d >= 1 for d in shape
      ):
        raise PruneError(
          f"input_shape must be a tuple of ints >= 1 (batch first), got "
          f"{shape!r}"
        )
      object.__setattr__(self, "input_shape", tuple(shape))

  def group_bytes(self, model: nnx.Module):
    """With budget "bytes", each group's bytes (`disco.metrics.group_bytes`
    at `input_shape`), to count once and pass to every `apply`; else None.
    """
    if self.budget != "bytes":
      return None
    crosses = [g.cross for g in mask_groups(model)]
    return byte_budget.group_bytes(model, crosses, None, self.input_shape)

  def ratio_at(self, step: int) -> float:
    """The communication ratio the masks should have after `step` steps."""
    progress = min(max(step / self.steps, 0.0), 1.0)
    return self.target_ratio + (1 - self.target_ratio) * (1 - progress) ** 3

  def due(self, step: int) -> bool:
    """Whether to prune after `step` training steps."""
    return 0 < step <= self.steps and (
      step % self.every == 0 or step == self.steps
    )

  def apply(
    self,
    model: nnx.Module,
    step: int,
    saliency=None,
    gates=None,
    group_bytes=None,
  ) -> None:
    """Prunes `model` to `ratio_at(step)` (`saliency`, `gates`,
    `group_bytes`: see `to_ratio`; the bytes budget counts them here if
    not given)."""
    if self.budget == "bytes" and group_bytes is None:
      group_bytes = self.group_bytes(model)
    to_ratio(
      model,
      self.ratio_at(step),
      budget=self.budget,
      selection=self.selection,
      seed=self.seed,
      saliency=saliency,
      gates=gates,
      group_bytes=group_bytes,
      final_ratio=self.target_ratio
      if (self.selection, self.budget) == ("random", "bytes")
      else None,
    )


class SaliencyMeter:
  """Exponential average of the squared gate derivatives over batches.

  `update` is traceable (`train.fit` runs it inside its jitted step, the
  average an argument and a result of the step); `scores` are 1/2 the
  average: the Fisher estimate of the loss increase when each group's
  gate closes (`to_ratio`'s `saliency`).

  Example:
    >>> meter = SaliencyMeter(horizon=1)
    >>> state = meter.zeros([np.ones((2, 3))])
    >>> state = meter.update(state, [jnp.ones((2, 3))])
    >>> float(SaliencyMeter.scores(state)[0][0, 0])
    0.5

  Args:
    horizon: batches the average spans (its decay is 1 - 1 / horizon).
  """

  def __init__(self, horizon: int):
    require_int("horizon", horizon, 1, PruneError)
    self.decay = 1.0 - 1.0 / horizon

  @staticmethod
  def zeros(shapes_of) -> list[jax.Array]:
    """The starting average: zeros shaped like each of `shapes_of`."""
    return [jnp.zeros(np.shape(a), jnp.float32) for a in shapes_of]

  def update(self, average, gate_grads) -> list[jax.Array]:
    """`average` moved towards this batch's squared `gate_grads`."""
    return self.moved(average, gate_grads, self.decay)

  @staticmethod
  def moved(average, gate_grads, decay) -> list[jax.Array]:
    """`update` with the decay given (static inside a jitted step)."""
    return [
      decay * a + (1.0 - decay) * jnp.square(g)
      for a, g in zip(average, gate_grads, strict=True)
    ]

  @staticmethod
  def scores(average) -> list[np.ndarray]:
    """The estimated loss increases, on the host."""
    return [0.5 * np.asarray(a, np.float64) for a in average]


class HardConcreteGates:
  """One hard-concrete gate per channel group (Louizos et al., 2018).

  A gate with log-odds log_alpha is z = min(1, max(0, s (zeta - gamma) +
  gamma)), s = sigmoid((logit(u) + log_alpha) / beta), u ~ U(0, 1): it is
  exactly 0 or 1 with positive probability and differentiable in
  log_alpha between. `gated` scales each group's weight columns by its
  gate (the bits that are not groups by 1), the same columns
  `gate_gradients` differentiates by; `open_fraction` is the expected
  fraction of kept groups whose gate is not 0, over all the model's
  groups (with the bytes budget, of their bytes), which training adds to
  the loss times `GradualSchedule`'s `gate_penalty`. All traceable,
  except `fold`.

  Example:
    >>> from flax import nnx
    >>> from disco.layers import DiscoDense
    >>> layer = DiscoDense(4, 4, num_nodes=2, rngs=nnx.Rngs(0))
    >>> gates = HardConcreteGates.init([g.cross for g in mask_groups(layer)])
    >>> round(float(HardConcreteGates.open_fraction(layer, gates)), 3)
    0.99
    >>> z = HardConcreteGates.deterministic(jnp.asarray([-9.0, 0.0, 9.0]))
    >>> [round(float(v), 3) for v in z]
    [0.0, 0.5, 1.0]
  """

  BETA = 2.0 / 3.0
  GAMMA = -0.1
  ZETA = 1.1
  # Open at the start (a kept gate is exactly 1 with probability 0.80,
  # mean 0.91): pruning starts from a trained dense model.
  INITIAL_LOG_ALPHA = 3.0

  @classmethod
  def init(cls, crosses) -> list[jax.Array]:
    """Starting log_alpha, one (nodes, channels) array per mask group."""
    return [
      jnp.full(np.shape(c), cls.INITIAL_LOG_ALPHA, jnp.float32) for c in crosses
    ]

  @classmethod
  def sample(cls, log_alphas, key) -> list[jax.Array]:
    """One gate draw per group."""
    out = []
    for index, log_alpha in enumerate(log_alphas):
      u = jax.random.uniform(
        jax.random.fold_in(key, index),
        log_alpha.shape,
        minval=1e-6,
        maxval=1.0 - 1e-6,
      )
      s = jax.nn.sigmoid((jnp.log(u) - jnp.log1p(-u) + log_alpha) / cls.BETA)
      out.append(jnp.clip(s * (cls.ZETA - cls.GAMMA) + cls.GAMMA, 0.0, 1.0))
    return out

  @classmethod
  def deterministic(cls, log_alpha):
    """The gate at test time: min(1, max(0, sigmoid(log_alpha) (zeta -
    gamma) + gamma))."""
    s = jax.nn.sigmoid(log_alpha)
    return jnp.clip(s * (cls.ZETA - cls.GAMMA) + cls.GAMMA, 0.0, 1.0)

  @classmethod
  def open_probability(cls, log_alpha, host: bool = False):
    """P(z != 0) of each gate; with `host` in numpy float64 (float32
    saturates to 1 above log_alpha ~17, where a ranking needs it)."""
    shifted = log_alpha - cls.BETA * np.log(-cls.GAMMA / cls.ZETA)
    if host:
      return 1.0 / (1.0 + np.exp(-np.asarray(shifted, np.float64)))
    return jax.nn.sigmoid(shifted)

  @classmethod
  def open_fraction(
    cls, model: nnx.Module, log_alphas, group_bytes=None
  ) -> jax.Array:
    """Expected number of open gates among the kept groups of `model`,
    over all its groups (traceable: the masks may be traced); with
    `group_bytes` (one array per mask group, `disco.metrics.group_bytes`)
    the expected open bytes over all the groups' bytes instead, the
    quantity the bytes budget limits: a gate on a large tensor then costs
    as much more as it sends."""
    groups = mask_groups(model)
    if group_bytes is None:
      group_bytes = [np.ones(np.shape(g.cross), np.float32) for g in groups]
    weights = [
      jnp.where(g.cross, jnp.asarray(b, jnp.float32), 0.0)
      for g, b in zip(groups, group_bytes, strict=True)
    ]
    total = sum(jnp.sum(w) for w in weights)
    opened = sum(
      jnp.sum(cls.open_probability(a) * (g.mask[...] & g.cross) * w)
      for g, a, w in zip(groups, log_alphas, weights, strict=True)
    )
    return opened / jnp.maximum(total, 1.0)

  @staticmethod
  def gated(model: nnx.Module, gates) -> None:
    """Scales, in place, every group's weight columns in `model` by its
    gate in `gates` (one (nodes, channels) array per mask group; the bits
    that are not groups are left alone). Traceable: `train.fit` calls it
    on the model it merges inside its step."""
    for group, gate in zip(mask_groups(model), gates, strict=True):
      factor = jnp.where(group.cross, gate, 1.0)
      for layer in group.layers:
        column = factor[layer.out_split.owner()].T
        layer.kernel[...] = layer.kernel[...] * column.astype(
          layer.kernel.dtype
        )

  @classmethod
  def fold(cls, model: nnx.Module, log_alphas) -> None:
    """Multiplies, in place, every kept group's weight columns by its
    deterministic gate: the model then computes what the gated model
    computes at test time, with masks and weights only."""
    cls.gated(model, [cls.deterministic(a) for a in log_alphas])


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


def _check_measured(groups, selection, saliency, gates):
  """The measured scores of `selection` ("saliency" or "gates") as host
  arrays, None for the others; PruneError where they are missing, given
  to a selection that does not read them, or not one array of each mask's
  shape."""
  given = {"saliency": saliency, "gates": gates}
  for name, value in given.items():
    if value is not None and selection != name:
      raise PruneError(
        f"{name} scores were given to selection {selection!r}, which does "
        f"not read them: pass selection={name!r}"
      )
  if selection not in given:
    return None
  if given[selection] is None:
    measured = (
      "the loss change measured while training"
      if selection == "saliency"
      else "gates learned while training"
    )
    raise PruneError(
      f"selection {selection!r} ranks channel groups by {measured}: prune "
      f"with train.fit and a GradualSchedule(selection={selection!r}), or "
      f"pass the scores ({selection}=, one (nodes, channels) array per mask "
      "group)"
    )
  scores = [np.asarray(s, np.float64) for s in given[selection]]
  shapes = [g.cross.shape for g in groups]
  if [s.shape for s in scores] != shapes:
    raise PruneError(
      f"{selection} scores of shapes {[s.shape for s in scores]} for mask "
      f"groups of shapes {shapes}: they were measured on another model"
    )
  return scores


def _scores(group, index, selection, seed, measured):
  if selection == "random":
    # One fixed number per group, so a gradual schedule drops a fixed order.
    return np.random.default_rng([seed, index]).random(group.cross.shape)
  if selection in ("saliency", "gates"):
    score = measured[index]
    if not np.all(np.isfinite(score[group.cross])):
      raise PruneError(
        f"the {selection} scores of mask group {index} (of "
        f"{type(group.layers[0]).__name__} layers) hold NaN or inf: the "
        "training that measured it diverged (a learning rate too high, "
        "non-finite inputs)"
      )
    return score
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
