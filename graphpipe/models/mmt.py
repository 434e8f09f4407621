"""Multi-modal transformer (MMT), the GraphPipe paper's main branchy model.

One pre-LN transformer branch per modality; the branch outputs are
concatenated along features, mean-pooled over the sequence and classified.

  modality_0 -> branches.0 (layers.0 .. layers.L-1) --+
  ...                                                 +-> concat, pool
  modality_N -> branches.N (layers.0 .. layers.L-1) --+     -> classifier

The inputs are token features (batch, seq, hidden) as a modality encoder
would emit them; there is no input projection, so each branch is exactly its
transformer layers.
"""

import dataclasses
from collections.abc import Sequence

import jax
import numpy as np
import optax
from flax import nnx

from graphpipe.models import synthetic
from graphpipe.models.layers import (
  TransformerConfig,
  TransformerStack,
  concat_branches,
)


@dataclasses.dataclass(frozen=True)
class Config(TransformerConfig):
  """Sizes of a multi-branch transformer; the defaults are the paper's MMT.

  Example:
    >>> Config.paper().num_branches, Config.tiny().num_layers
    (4, 2)

  Args:
    num_branches: modalities, one transformer branch each.
    num_layers: transformer layers per branch.
    seq_len: tokens per modality.
    hidden: model width (the concatenation is `num_branches * hidden` wide).
    num_heads: attention heads per layer.
    ffn: inner width of each layer's feed-forward block.
    num_classes: classifier outputs (our choice; the paper gives none).
  """

  num_branches: int = 4
  num_layers: int = 8
  seq_len: int = 256
  hidden: int = 1024
  num_heads: int = 16
  ffn: int = 4096
  num_classes: int = 1000

  @classmethod
  def tiny(cls) -> "Config":
    """4 branches x 2 layers of width 16 (~2k parameters a layer), seq 8."""
    return cls(
      num_layers=2, seq_len=8, hidden=16, num_heads=2, ffn=32, num_classes=5
    )


class Model(nnx.Module):
  """Parallel transformer branches, concatenated, pooled and classified.

  Example:
    >>> config = Config.tiny()
    >>> model = Model(config, rngs=nnx.Rngs(0))
    >>> batch = make_batch(config, batch_size=2)
    >>> model(modalities(batch, config.num_branches)).shape
    (2, 5)

  Args:
    config: the sizes.
    rngs: random state for the weight initialisation.
  """

  def __init__(self, config: Config, *, rngs: nnx.Rngs):
    self.branches = nnx.List(
      [
        TransformerStack(
          config.num_layers,
          config.hidden,
          config.num_heads,
          config.ffn,
          rngs=rngs,
        )
        for _ in range(config.num_branches)
      ]
    )
    self.classifier = nnx.Linear(
      config.num_branches * config.hidden, config.num_classes, rngs=rngs
    )

  def __call__(self, inputs: Sequence[jax.Array]) -> jax.Array:
    features = concat_branches(self.branches, inputs, "modality")
    return self.classifier(features.mean(axis=1))


def modality_key(index: int) -> str:
  """The batch key of modality `index`'s token features, e.g. 'modality_0'."""
  return f"modality_{index}"


def modalities(batch: dict, num_branches: int) -> list:
  """The per-branch inputs of `batch`, in branch order.

  Example:
    >>> len(modalities(make_batch(Config.tiny(), 2), 4))
    4

  Args:
    batch: a batch from `make_batch` (or its abstract twin).
    num_branches: how many modalities to read.
  """
  return [batch[modality_key(i)] for i in range(num_branches)]


def loss_fn(model: Model, batch: dict) -> jax.Array:
  """Mean softmax cross-entropy of the model on `batch`.

  Example:
    >>> config = Config.tiny()
    >>> loss_fn(Model(config, rngs=nnx.Rngs(0)), make_batch(config, 2)).shape
    ()

  Args:
    model: a `Model`.
    batch: `modality_i` features (batch, seq, hidden) float32 for every
      branch i and `labels` (batch,) int32.
  """
  logits = model(modalities(batch, len(model.branches)))
  return optax.softmax_cross_entropy_with_integer_labels(
    logits, batch["labels"]
  ).mean()


def _fields(config: Config, batch_size: int) -> dict[str, synthetic.Field]:
  tokens = (batch_size, config.seq_len, config.hidden)
  fields = {
    modality_key(i): synthetic.Field(tokens) for i in range(config.num_branches)
  }
  fields["labels"] = synthetic.Field(
    (batch_size,), np.int32, high=config.num_classes
  )
  return fields


make_batch, abstract_batch = synthetic.batch_functions(_fields)
