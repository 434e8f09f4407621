"""A plain sequential transformer, the control model.

  tokens -> encoder (layers.0 .. layers.L-1) -> pool -> classifier

One chain of pre-LN transformer layers of the MMT size, with the same
pooling and classifier head as the branchy models. On such a model the paper
finds graph pipelining matches the sequential baselines.
"""

import dataclasses

import jax
import numpy as np
import optax
from flax import nnx

from graphpipe.models import synthetic
from graphpipe.models.layers import TransformerConfig, TransformerStack


@dataclasses.dataclass(frozen=True)
class Config(TransformerConfig):
  """Sizes of the sequential transformer; the defaults are the paper config.

  16 layers is our choice (the paper's sequential control has the MMT layer
  size; 16 layers give a chain long enough for 16-stage pipelines).

  Example:
    >>> Config.paper().num_layers, Config.tiny().num_layers
    (16, 4)

  Args:
    num_layers: transformer layers in the chain.
    seq_len: tokens per sample.
    hidden: model width.
    num_heads: attention heads per layer.
    ffn: inner width of each layer's feed-forward block.
    num_classes: classifier outputs (our choice).
  """

  num_layers: int = 16
  seq_len: int = 256
  hidden: int = 1024
  num_heads: int = 16
  ffn: int = 4096
  num_classes: int = 1000

  @classmethod
  def tiny(cls) -> "Config":
    """4 layers of width 16 (~2k parameters a layer), seq 8."""
    return cls(
      num_layers=4, seq_len=8, hidden=16, num_heads=2, ffn=32, num_classes=5
    )


class Model(nnx.Module):
  """A transformer encoder, mean-pooled and classified.

  Example:
    >>> config = Config.tiny()
    >>> model = Model(config, rngs=nnx.Rngs(0))
    >>> model(make_batch(config, batch_size=2)["tokens"]).shape
    (2, 5)

  Args:
    config: the sizes.
    rngs: random state for the weight initialisation.
  """

  def __init__(self, config: Config, *, rngs: nnx.Rngs):
    # One stack module (depth 1) keeps each layer at capture depth 2, the
    # depth every model of the zoo registers.
    self.encoder = TransformerStack(
      config.num_layers,
      config.hidden,
      config.num_heads,
      config.ffn,
      rngs=rngs,
    )
    self.classifier = nnx.Linear(config.hidden, config.num_classes, rngs=rngs)

  def __call__(self, tokens: jax.Array) -> jax.Array:
    return self.classifier(self.encoder(tokens).mean(axis=1))


def loss_fn(model: Model, batch: dict) -> jax.Array:
  """Mean softmax cross-entropy of the model on `batch`.

  Example:
    >>> config = Config.tiny()
    >>> loss_fn(Model(config, rngs=nnx.Rngs(0)), make_batch(config, 2)).shape
    ()

  Args:
    model: a `Model`.
    batch: `tokens` (batch, seq, hidden) float32, `labels` (batch,) int32.
  """
  logits = model(batch["tokens"])
  return optax.softmax_cross_entropy_with_integer_labels(
    logits, batch["labels"]
  ).mean()


def _fields(config: Config, batch_size: int) -> dict[str, synthetic.Field]:
  return {
    "tokens": synthetic.Field((batch_size, config.seq_len, config.hidden)),
    "labels": synthetic.Field((batch_size,), np.int32, high=config.num_classes),
  }


make_batch, abstract_batch = synthetic.batch_functions(_fields)
