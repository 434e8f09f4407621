"""DLRM as evaluated in GraphPipe: dense MLP branches and embedding bags.

  dense_i  -> dense.i  (layers.0 .. layers.3) --+
  sparse_j -> sparse.j (one embedding bag)    --+-> concat -> top -> logit

Feature interaction is a plain concatenation (as in the paper), followed by
the top feed-forward layers and one click logit with a sigmoid binary
cross-entropy.
"""

import dataclasses
import math
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from graphpipe.errors import ModelConfigError
from graphpipe.models import synthetic
from graphpipe.models.layers import MLP, ZooConfig


@dataclasses.dataclass(frozen=True)
class Config(ZooConfig):
  """Sizes of DLRM; the defaults are the paper config.

  Example:
    >>> Config.paper().table_rows, Config.tiny().table_rows
    (1000000, 50)

  Args:
    num_dense: dense-feature branches.
    dense_layers: feed-forward layers per dense branch.
    dense_features: input width of each dense branch (our choice: 1024).
    hidden: width of every dense-branch and top layer.
    num_sparse: sparse-feature branches, one embedding bag each.
    table_rows: rows of each embedding table.
    embedding_dim: width of each embedding row.
    bag_size: table rows summed per sample.
    top_layers: ReLU layers of width `hidden` after the interaction, before
      the output logit (our choice: 3).
  """

  num_dense: int = 7
  dense_layers: int = 4
  dense_features: int = 1024
  hidden: int = 4096
  num_sparse: int = 7
  table_rows: int = 1_000_000
  embedding_dim: int = 64
  bag_size: int = 100
  top_layers: int = 3

  @classmethod
  def tiny(cls) -> "Config":
    """7 + 7 branches; 2 dense layers of 32, tables of 50 x 8, bags of 4."""
    return cls(
      dense_layers=2,
      dense_features=8,
      hidden=32,
      table_rows=50,
      embedding_dim=8,
      bag_size=4,
      top_layers=2,
    )

  @property
  def interaction_width(self) -> int:
    """Width of the concatenated dense and sparse features."""
    return self.num_dense * self.hidden + self.num_sparse * self.embedding_dim


class EmbeddingBag(nnx.Module):
  """Sum of the embedding-table rows named by each sample's bag of indices.

  Example:
    >>> bag = EmbeddingBag(50, 8, rngs=nnx.Rngs(0))
    >>> bag(jnp.zeros((2, 4), jnp.int32)).shape
    (2, 8)

  Args:
    num_rows: rows of the table.
    dim: width of a row.
    rngs: random state for the table initialisation.
  """

  def __init__(self, num_rows: int, dim: int, *, rngs: nnx.Rngs):
    # The reference DLRM's table init: uniform in +-1/sqrt(rows).
    bound = 1.0 / math.sqrt(num_rows)
    self.table = nnx.Param(
      jax.random.uniform(
        rngs.params(), (num_rows, dim), minval=-bound, maxval=bound
      )
    )

  def __call__(self, indices: jax.Array) -> jax.Array:
    return jnp.take(self.table[...], indices, axis=0).sum(axis=1)


class Model(nnx.Module):
  """DLRM: dense MLP branches and embedding bags, concatenated, then an MLP.

  Example:
    >>> config = Config.tiny()
    >>> model = Model(config, rngs=nnx.Rngs(0))
    >>> batch = make_batch(config, batch_size=2)
    >>> model(*branch_inputs(batch, config.num_dense, config.num_sparse)).shape
    (2,)

  Args:
    config: the sizes.
    rngs: random state for the weight initialisation.
  """

  def __init__(self, config: Config, *, rngs: nnx.Rngs):
    dense_sizes = [config.dense_features] + [
      config.hidden
    ] * config.dense_layers
    self.dense = nnx.List(
      [MLP(dense_sizes, rngs=rngs) for _ in range(config.num_dense)]
    )
    self.sparse = nnx.List(
      [
        EmbeddingBag(config.table_rows, config.embedding_dim, rngs=rngs)
        for _ in range(config.num_sparse)
      ]
    )
    top_sizes = (
      [config.interaction_width] + [config.hidden] * config.top_layers + [1]
    )
    self.top = MLP(top_sizes, activate_last=False, rngs=rngs)

  def __call__(
    self, dense: Sequence[jax.Array], sparse: Sequence[jax.Array]
  ) -> jax.Array:
    if len(dense) != len(self.dense) or len(sparse) != len(self.sparse):
      raise ModelConfigError(
        f"the model has {len(self.dense)} dense and {len(self.sparse)} "
        f"sparse branches but got {len(dense)} and {len(sparse)} inputs"
      )
    features = [b(x) for b, x in zip(self.dense, dense, strict=True)]
    features += [b(i) for b, i in zip(self.sparse, sparse, strict=True)]
    return self.top(jnp.concatenate(features, axis=-1))[:, 0]


def dense_key(index: int) -> str:
  """The batch key of dense branch `index`'s features, e.g. 'dense_0'."""
  return f"dense_{index}"


def sparse_key(index: int) -> str:
  """The batch key of sparse branch `index`'s indices, e.g. 'sparse_0'."""
  return f"sparse_{index}"


def branch_inputs(batch: dict, num_dense: int, num_sparse: int) -> tuple:
  """The dense and the sparse inputs of `batch`, each in branch order.

  Example:
    >>> dense, sparse = branch_inputs(make_batch(Config.tiny(), 2), 7, 7)
    >>> dense[0].shape, sparse[0].shape
    ((2, 8), (2, 4))

  Args:
    batch: a batch from `make_batch` (or its abstract twin).
    num_dense: dense branches to read.
    num_sparse: sparse branches to read.
  """
  dense = [batch[dense_key(i)] for i in range(num_dense)]
  sparse = [batch[sparse_key(i)] for i in range(num_sparse)]
  return dense, sparse


def loss_fn(model: Model, batch: dict) -> jax.Array:
  """Mean sigmoid binary cross-entropy of the click logit on `batch`.

  Example:
    >>> config = Config.tiny()
    >>> loss_fn(Model(config, rngs=nnx.Rngs(0)), make_batch(config, 2)).shape
    ()

  Args:
    model: a `Model`.
    batch: `dense_i` (batch, dense_features) float32, `sparse_j` (batch,
      bag_size) int32 row indices, `labels` (batch,) int32 in {0, 1}.
  """
  logits = model(*branch_inputs(batch, len(model.dense), len(model.sparse)))
  labels = batch["labels"].astype(logits.dtype)
  return optax.sigmoid_binary_cross_entropy(logits, labels).mean()


def _fields(config: Config, batch_size: int) -> dict[str, synthetic.Field]:
  fields = {
    dense_key(i): synthetic.Field((batch_size, config.dense_features))
    for i in range(config.num_dense)
  }
  for i in range(config.num_sparse):
    fields[sparse_key(i)] = synthetic.Field(
      (batch_size, config.bag_size), np.int32, high=config.table_rows
    )
  fields["labels"] = synthetic.Field((batch_size,), np.int32, high=2)
  return fields


make_batch, abstract_batch = synthetic.batch_functions(_fields)
