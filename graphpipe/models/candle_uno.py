"""CANDLE-Uno as evaluated in GraphPipe: feature MLP branches and a head.

  features_0 -> branches.0 (layers.0 .. layers.3) --+
  ...                                               +-> concat -> head -> y
  features_N -> branches.N (layers.0 .. layers.3) --+

Each branch encodes one feature group (cell expression, drug descriptors,
...); the head regresses a scalar response with a mean squared error.
"""

import dataclasses
from collections.abc import Sequence

import jax
import jax.numpy as jnp
from flax import nnx

from graphpipe.models import synthetic
from graphpipe.models.layers import MLP, ZooConfig, concat_branches


@dataclasses.dataclass(frozen=True)
class Config(ZooConfig):
  """Sizes of CANDLE-Uno; the defaults are the paper config.

  Example:
    >>> Config.paper().num_branches, Config.tiny().branch_layers
    (7, 2)

  Args:
    num_branches: feature branches (7 in the paper, up to 16 in its
      branch-scaling study).
    branch_layers: feed-forward layers per branch.
    in_features: input width of each branch (our choice: 1024).
    hidden: width of every branch and head layer.
    head_layers: ReLU layers of width `hidden` after the concatenation,
      before the scalar output (our choice: 3).
  """

  num_branches: int = 7
  branch_layers: int = 4
  in_features: int = 1024
  hidden: int = 4096
  head_layers: int = 3

  @classmethod
  def tiny(cls) -> "Config":
    """7 branches x 2 layers of 32 (~1k parameters a layer), 1 head layer."""
    return cls(branch_layers=2, in_features=8, hidden=32, head_layers=1)


class Model(nnx.Module):
  """Parallel feed-forward branches, concatenated, then a regression head.

  Example:
    >>> config = Config.tiny()
    >>> model = Model(config, rngs=nnx.Rngs(0))
    >>> batch = make_batch(config, batch_size=2)
    >>> model(branch_inputs(batch, config.num_branches)).shape
    (2,)

  Args:
    config: the sizes.
    rngs: random state for the weight initialisation.
  """

  def __init__(self, config: Config, *, rngs: nnx.Rngs):
    branch_sizes = [config.in_features] + [config.hidden] * config.branch_layers
    self.branches = nnx.List(
      [MLP(branch_sizes, rngs=rngs) for _ in range(config.num_branches)]
    )
    head_sizes = (
      [config.num_branches * config.hidden]
      + [config.hidden] * config.head_layers
      + [1]
    )
    self.head = MLP(head_sizes, activate_last=False, rngs=rngs)

  def __call__(self, inputs: Sequence[jax.Array]) -> jax.Array:
    features = concat_branches(self.branches, inputs, "feature")
    return self.head(features)[:, 0]


def features_key(index: int) -> str:
  """The batch key of branch `index`'s input, e.g. 'features_0'."""
  return f"features_{index}"


def branch_inputs(batch: dict, num_branches: int) -> list:
  """The per-branch inputs of `batch`, in branch order.

  Example:
    >>> len(branch_inputs(make_batch(Config.tiny(), 2), 7))
    7

  Args:
    batch: a batch from `make_batch` (or its abstract twin).
    num_branches: how many branch inputs to read.
  """
  return [batch[features_key(i)] for i in range(num_branches)]


def loss_fn(model: Model, batch: dict) -> jax.Array:
  """Mean squared error of the predicted response on `batch`.

  Example:
    >>> config = Config.tiny()
    >>> loss_fn(Model(config, rngs=nnx.Rngs(0)), make_batch(config, 2)).shape
    ()

  Args:
    model: a `Model`.
    batch: `features_i` (batch, in_features) float32 for every branch i and
      `targets` (batch,) float32.
  """
  predictions = model(branch_inputs(batch, len(model.branches)))
  return jnp.mean((predictions - batch["targets"]) ** 2)


def _fields(config: Config, batch_size: int) -> dict[str, synthetic.Field]:
  fields = {
    features_key(i): synthetic.Field((batch_size, config.in_features))
    for i in range(config.num_branches)
  }
  fields["targets"] = synthetic.Field((batch_size,))
  return fields


make_batch, abstract_batch = synthetic.batch_functions(_fields)
