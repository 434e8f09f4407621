"""A two-tower multi-task model: one input, two towers, two losses.

       +-> regression (layers.0 .. layers.L)     -> MSE ----------+
  x ---+                                                          +-> sum
       +-> classification (layers.0 .. layers.L) -> cross-entropy +

Both towers read the same input and each computes its own loss inside its
`__call__`; the model adds the two losses, with no join module before them.
The graph fans out at the input and fans in only at the final sum, a shape
the branchy models of the paper do not have.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from graphpipe.models import synthetic
from graphpipe.models.layers import (
  ZooConfig,
  apply_in_sequence,
  feed_forward_layers,
)


@dataclasses.dataclass(frozen=True)
class Config(ZooConfig):
  """Sizes of the two-tower model; the defaults are the paper-scale config.

  Example:
    >>> Config.paper().tower_layers, Config.tiny().hidden
    (4, 16)

  Args:
    in_features: width of the shared input (our choice: 1024).
    hidden: width of every tower layer.
    tower_layers: ReLU layers per tower, before the tower's output layer.
    num_classes: outputs of the classification tower (our choice).
  """

  in_features: int = 1024
  hidden: int = 4096
  tower_layers: int = 4
  num_classes: int = 1000

  @classmethod
  def tiny(cls) -> "Config":
    """Towers of 4 layers of 16 over an 8-wide input, 5 classes."""
    return cls(in_features=8, hidden=16, num_classes=5)


def _tower_sizes(config: Config, outputs: int) -> list[int]:
  return (
    [config.in_features] + [config.hidden] * config.tower_layers + [outputs]
  )


class RegressionTower(nnx.Module):
  """Feed-forward layers to one output, scored by mean squared error.

  Example:
    >>> tower = RegressionTower(Config.tiny(), rngs=nnx.Rngs(0))
    >>> tower(jnp.ones((2, 8)), jnp.zeros((2,))).shape
    ()

  Args:
    config: the sizes.
    rngs: random state for the weight initialisation.
  """

  def __init__(self, config: Config, *, rngs: nnx.Rngs):
    self.layers = feed_forward_layers(
      _tower_sizes(config, 1), activate_last=False, rngs=rngs
    )

  def __call__(self, x: jax.Array, targets: jax.Array) -> jax.Array:
    predictions = apply_in_sequence(self.layers, x)[:, 0]
    return jnp.mean((predictions - targets) ** 2)


class ClassificationTower(nnx.Module):
  """Feed-forward layers to class logits, scored by cross-entropy.

  Example:
    >>> tower = ClassificationTower(Config.tiny(), rngs=nnx.Rngs(0))
    >>> tower(jnp.ones((2, 8)), jnp.zeros((2,), jnp.int32)).shape
    ()

  Args:
    config: the sizes.
    rngs: random state for the weight initialisation.
  """

  def __init__(self, config: Config, *, rngs: nnx.Rngs):
    self.layers = feed_forward_layers(
      _tower_sizes(config, config.num_classes), activate_last=False, rngs=rngs
    )

  def __call__(self, x: jax.Array, labels: jax.Array) -> jax.Array:
    logits = apply_in_sequence(self.layers, x)
    return optax.softmax_cross_entropy_with_integer_labels(
      logits, labels
    ).mean()


class Model(nnx.Module):
  """Two towers over one input; returns the sum of their losses.

  Example:
    >>> config = Config.tiny()
    >>> model = Model(config, rngs=nnx.Rngs(0))
    >>> batch = make_batch(config, batch_size=2)
    >>> model(batch["x"], batch["targets"], batch["labels"]).shape
    ()

  Args:
    config: the sizes.
    rngs: random state for the weight initialisation.
  """

  def __init__(self, config: Config, *, rngs: nnx.Rngs):
    self.regression = RegressionTower(config, rngs=rngs)
    self.classification = ClassificationTower(config, rngs=rngs)

  def __call__(
    self, x: jax.Array, targets: jax.Array, labels: jax.Array
  ) -> jax.Array:
    return self.regression(x, targets) + self.classification(x, labels)


def loss_fn(model: Model, batch: dict) -> jax.Array:
  """The model's own loss, regression MSE plus classification cross-entropy.

  Example:
    >>> config = Config.tiny()
    >>> loss_fn(Model(config, rngs=nnx.Rngs(0)), make_batch(config, 2)).shape
    ()

  Args:
    model: a `Model`.
    batch: `x` (batch, in_features) float32, `targets` (batch,) float32 and
      `labels` (batch,) int32.
  """
  return model(batch["x"], batch["targets"], batch["labels"])


def _fields(config: Config, batch_size: int) -> dict[str, synthetic.Field]:
  return {
    "x": synthetic.Field((batch_size, config.in_features)),
    "targets": synthetic.Field((batch_size,)),
    "labels": synthetic.Field((batch_size,), np.int32, high=config.num_classes),
  }


make_batch, abstract_batch = synthetic.batch_functions(_fields)
