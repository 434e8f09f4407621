"""Training and evaluation of DISCO models (classification by default).

One jitted step serves every phase and every model of one architecture:
the masks and the hyperparameters (learning rate, weight decay, group-lasso
weight) are arguments, not constants, so pruning between steps and moving
from dense training to fine-tuning never recompile::

  fit(model, ...):
    params, masks, rest = split(model)            # rest: batch statistics
    for each epoch, for each shuffled batch:
      params, rest = step(params, masks, rest, batch, lr(step), ...)
      (saliency selection: the step also moves the average of the squared
       gate derivatives, prune.SaliencyMeter; gates selection: the step
       scales the groups' columns by sampled hard-concrete gates and
       trains their log_alpha with the weights, prune.HardConcreteGates)
      if the schedule prunes after this step:      # host side, rare
        write params back, prune to r(step), read the masks again
        (gates: at its last pruning the gates are folded into the weights)
    write everything back; the model is left in eval mode
"""

import dataclasses
import functools
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from disco import prune
from disco.errors import DataError, PruneError, require_int, require_number
from disco.layers import CommMask


@dataclasses.dataclass(frozen=True)
class TrainConfig:
  """Hyperparameters of one training run (AdamW, warmup + cosine decay).

  Example:
    >>> TrainConfig(epochs=10).batch_size
    64

  Args:
    epochs: passes over the training set.
    batch_size: images per step (the last partial batch is dropped).
    learning_rate: peak learning rate.
    weight_decay: decoupled weight decay.
    warmup_epochs: epochs of linear warmup.
    group_lasso: weight of `prune.group_norm_penalty` while a schedule is
      pruning (0 = none).
  """

  epochs: int
  batch_size: int = 64
  learning_rate: float = 3e-3
  weight_decay: float = 1e-4
  warmup_epochs: float = 1.0
  group_lasso: float = 0.0

  def __post_init__(self):
    require_int("epochs", self.epochs, 0)
    require_int("batch_size", self.batch_size, 1)
    for name in ("learning_rate", "weight_decay", "warmup_epochs"):
      require_number(name, getattr(self, name))
    require_number("group_lasso", self.group_lasso)

  def steps_per_epoch(self, examples: int) -> int:
    """Training steps in one epoch over `examples` images."""
    return max(examples // self.batch_size, 1)


def fit(
  model: nnx.Module,
  images: np.ndarray,
  labels: np.ndarray,
  config: TrainConfig,
  *,
  seed: int = 0,
  schedule: prune.GradualSchedule | None = None,
  progress=None,
  loss=None,
) -> list[float]:
  """Trains `model` in place; optionally prunes along `schedule`.

  Example:
    >>> from flax import nnx
    >>> from disco import data
    >>> from disco.models import ResNet, ResNetConfig
    >>> sample = data.synthetic(train=64, test=8)
    >>> model = ResNet(ResNetConfig(), rngs=nnx.Rngs(0))
    >>> losses = fit(model, sample.x_train, sample.y_train,
    ...              TrainConfig(epochs=1))

  Args:
    model: a model built from DISCO layers (batch norm allowed).
    images: training images.
    labels: integer labels.
    config: hyperparameters.
    seed: seed of the batch order.
    schedule: gradual pruning, counted in steps of this run; after its last
      step the masks stay fixed (fine-tuning). With selection "saliency"
      the steps while it prunes also measure each channel group's saliency
      (`prune.SaliencyMeter`, over about one epoch of batches), which each
      pruning ranks by; with selection "gates" they train one
      hard-concrete gate per group (`prune.HardConcreteGates`), which
      each pruning ranks by, folded into the weights at the last.
    progress: called with one line of text per epoch.
    loss: (model outputs, a batch of `labels`) -> mean loss, a function
      jit can treat as static (default: `classification_loss`). `labels`
      may be any array of per-example targets.

  Returns:
    the mean training loss of every epoch.

  Raises:
    DataError: fewer images than one batch; labels not one per image, or
      (with `classification_loss`) not class indices of the model.
    PruneError: a schedule longer than the run (its target would not be
      reached); a bytes budget whose groups' bytes cannot be counted (no
      input shape: `GradualSchedule(input_shape=...)`).
  """
  if len(images) < config.batch_size:
    raise DataError(
      f"{len(images)} training images are fewer than one batch of "
      f"{config.batch_size}"
    )
  loss_of = loss or classification_loss
  if loss_of is classification_loss:
    _check_labels(model, images, np.asarray(labels))
  elif len(labels) != len(images):
    raise DataError(f"{len(labels)} labels for {len(images)} images")
  steps_per_epoch = config.steps_per_epoch(len(images))
  total = config.epochs * steps_per_epoch
  if schedule is not None and schedule.steps > total:
    raise PruneError(
      f"the pruning schedule takes {schedule.steps} steps, the run "
      f"{total} ({config.epochs} epochs of {steps_per_epoch}): its target "
      f"ratio {schedule.target_ratio} would not be reached"
    )
  # optax needs at least one warmup step and one decay step.
  warmup = max(min(int(config.warmup_epochs * steps_per_epoch), total - 1), 1)
  learning_rates = np.asarray(
    optax.warmup_cosine_decay_schedule(
      0.0,
      config.learning_rate,
      warmup,
      max(total, 2),
      end_value=config.learning_rate * 1e-2,
    )(jnp.arange(total))
  )
  model.train()
  graphdef, params, masks, rest = nnx.split(model, nnx.Param, CommMask, ...)
  opt_state = optax.adamw(0.0).init(params)
  rng = np.random.default_rng(seed)
  losses = []
  step = 0
  # Saliency selection: the squared gate derivatives averaged over about
  # one epoch of batches, carried through the jitted step.
  meter = average = None
  if schedule is not None and schedule.selection == "saliency":
    meter = prune.SaliencyMeter(horizon=steps_per_epoch)
    average = meter.zeros([g.cross for g in prune.mask_groups(model)])
  # Gates selection: the gates' log_alpha and their Adam state, trained
  # while the schedule prunes.
  gates = None
  if schedule is not None and schedule.selection == "gates":
    log_alphas = prune.HardConcreteGates.init(
      [g.cross for g in prune.mask_groups(model)]
    )
    gates = (log_alphas, optax.adam(0.0).init(log_alphas))
    gate_key = jax.random.key(seed)
  # The bytes budget: each group's bytes, counted once (a trace).
  group_bytes = None if schedule is None else schedule.group_bytes(model)
  # The gates' penalty reads them in every step: on the device once.
  penalty_bytes = None
  if gates is not None and group_bytes is not None:
    penalty_bytes = [jnp.asarray(b, jnp.float32) for b in group_bytes]
  for epoch in range(config.epochs):
    start = time.perf_counter()
    order = rng.permutation(len(images))
    epoch_loss = jnp.zeros(())
    for batch in range(steps_per_epoch):
      pruning = schedule is not None and step < schedule.steps
      measuring = pruning and meter is not None
      gating = None
      if pruning and gates is not None:
        gating = (
          *gates,
          gate_key,
          step,
          schedule.gate_penalty,
          schedule.gate_learning_rate,
          penalty_bytes,
        )
      index = order[batch * config.batch_size : (batch + 1) * config.batch_size]
      params, rest, opt_state, loss, average, gated = _train_step(
        graphdef,
        params,
        masks,
        rest,
        opt_state,
        images[index],
        labels[index],
        learning_rates[step],
        config.weight_decay,
        config.group_lasso if pruning else 0.0,
        loss_of,
        meter.decay if measuring else None,
        average if measuring else None,
        gating,
      )
      if gated is not None:
        gates = gated
      epoch_loss = epoch_loss + loss
      step += 1
      if schedule is not None and schedule.due(step):
        nnx.update(model, params, rest)
        scores = None if meter is None else meter.scores(average)
        learned = None
        if gates is not None:
          learned = [np.asarray(a, np.float64) for a in gates[0]]
        schedule.apply(
          model, step, saliency=scores, gates=learned, group_bytes=group_bytes
        )
        if gates is not None and step == schedule.steps:
          # The last pruning: the kept groups' test-time gates go into
          # their weights, and training goes on without gates.
          prune.HardConcreteGates.fold(model, gates[0])
          params = nnx.state(model, nnx.Param)
          gates = None
        masks = nnx.state(model, CommMask)
    losses.append(float(epoch_loss) / steps_per_epoch)
    if progress is not None:
      ratio = prune.comm_ratio(nnx.merge(graphdef, params, masks, rest))
      progress(
        f"epoch {epoch + 1}/{config.epochs} loss {losses[-1]:.4f} "
        f"comm ratio {ratio:.3f} ({time.perf_counter() - start:.1f}s)"
      )
  nnx.update(model, params, masks, rest)
  model.eval()
  return losses


def _check_labels(model, images, labels: np.ndarray) -> None:
  """DataError unless `labels` are one class index of `model` per image
  (its config's `num_classes`, where it has one): a column of labels,
  (n, 1), compared every prediction with every label (an accuracy of 1.0
  where every prediction was wrong)."""
  if labels.ndim != 1:
    raise DataError(
      f"labels must be one class index per image, shape ({len(images)},), "
      f"got shape {labels.shape}"
    )
  if len(labels) != len(images):
    raise DataError(f"{len(labels)} labels for {len(images)} images")
  if labels.dtype.kind not in "iu":
    raise DataError(
      f"labels must be integer class indices, got dtype {labels.dtype}"
    )
  classes = getattr(getattr(model, "config", None), "num_classes", None)
  if labels.size and (
    labels.min() < 0 or (classes is not None and labels.max() >= classes)
  ):
    raise DataError(
      f"labels must be in [0, {classes if classes is not None else 'classes'})"
      f", got {labels.min()}..{labels.max()}"
    )


def accuracy(
  model: nnx.Module, images: np.ndarray, labels: np.ndarray, batch_size=500
) -> float:
  """Fraction of `images` whose top logit is the label (eval mode).

  Example:
    >>> from flax import nnx
    >>> from disco import data
    >>> from disco.models import ResNet, ResNetConfig
    >>> sample = data.synthetic(train=8, test=8)
    >>> model = ResNet(ResNetConfig(), rngs=nnx.Rngs(0))
    >>> 0 <= accuracy(model, sample.x_test, sample.y_test) <= 1
    True

  Args:
    model: a classifier.
    images: images.
    labels: integer labels.
    batch_size: images per forward pass (the last batch is padded).
  """
  labels = np.asarray(labels)
  _check_labels(model, images, labels)
  model.eval()
  graphdef, state = nnx.split(model)
  correct = 0
  for start in range(0, len(images), batch_size):
    chunk = images[start : start + batch_size]
    padded = np.zeros((batch_size, *chunk.shape[1:]), chunk.dtype)
    padded[: len(chunk)] = chunk
    predicted = np.asarray(_predict(graphdef, state, padded))[: len(chunk)]
    correct += int(np.sum(predicted == labels[start : start + len(chunk)]))
  return correct / len(images)


def classification_loss(logits: jax.Array, labels: jax.Array) -> jax.Array:
  """Mean softmax cross-entropy of integer labels.

  Example:
    >>> float(classification_loss(jnp.zeros((2, 4)), jnp.array([0, 3])))
    1.386...
  """
  return jnp.mean(
    optax.softmax_cross_entropy_with_integer_labels(logits, labels)
  )


@functools.partial(jax.jit, static_argnums=(0, 10, 11))
def _train_step(
  graphdef,
  params,
  masks,
  rest,
  opt_state,
  images,
  labels,
  learning_rate,
  weight_decay,
  group_lasso,
  loss_of,
  decay,
  average,
  gating,
):
  """One AdamW step; with a saliency `average` (and its `decay`), also the
  average moved by this batch's squared gate derivatives of the task loss
  (`prune.SaliencyMeter`); None otherwise. With `gating` (log_alphas,
  their Adam state, the run's gate key, the step, which is folded into
  the key here, the penalty weight, their learning rate, the groups'
  bytes or None: the penalty counts bytes with the bytes budget), the
  forward pass runs with sampled hard-concrete gates on the groups and
  the gates take an Adam step too: (log_alphas, state) is returned, None
  otherwise."""

  def penalty_of(params):
    return prune.group_norm_penalty(
      nnx.merge(graphdef, params, masks, rest, copy=True)
    )

  def loss_fn(params, log_alphas):
    # copy=True: the batch statistics are updated inside this trace.
    model = nnx.merge(graphdef, params, masks, rest, copy=True)
    penalty = group_lasso * penalty_of(params)
    if log_alphas is not None:
      gates = prune.HardConcreteGates
      penalty = penalty + gating[4] * gates.open_fraction(
        model, log_alphas, gating[6]
      )
      key = jax.random.fold_in(gating[2], gating[3])
      gates.gated(model, gates.sample(log_alphas, key))
    loss = loss_of(model(images), labels)
    *_, new_rest = nnx.split(model, nnx.Param, CommMask, ...)
    return loss + penalty, (loss, new_rest)

  log_alphas = None if gating is None else gating[0]
  (_, (loss, new_rest)), (grads, gate_grads) = jax.value_and_grad(
    loss_fn, argnums=(0, 1), has_aux=True
  )(params, log_alphas)
  gated = None
  if gating is not None:
    updates, gate_state = optax.adam(gating[5]).update(gate_grads, gating[1])
    gated = (optax.apply_updates(log_alphas, updates), gate_state)
  if average is not None:
    # The task loss's gradients: the group-lasso term's taken out (it has
    # no data in it, so its gradient costs no forward pass).
    penalty = jax.grad(penalty_of)(params)
    task = jax.tree.map(lambda g, p: g - group_lasso * p, grads, penalty)
    gates = prune.gate_gradients(
      nnx.merge(graphdef, params, masks, rest, copy=True),
      nnx.merge(graphdef, task, masks, rest, copy=True),
    )
    average = prune.SaliencyMeter.moved(average, gates, decay)
  optimizer = optax.adamw(learning_rate, weight_decay=weight_decay)
  updates, opt_state = optimizer.update(grads, opt_state, params)
  params = optax.apply_updates(params, updates)
  return params, new_rest, opt_state, loss, average, gated


@functools.partial(jax.jit, static_argnums=0)
def _predict(graphdef, state, images):
  return jnp.argmax(nnx.merge(graphdef, state)(images), axis=-1)
