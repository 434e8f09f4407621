"""A model type outside disco becomes distributable by registering a lowering.

The net here is defined only in this test: its forward pass is written once
against `disco.ops`, and its lowering says what each node holds; nothing
central changes. Lowerings that miss what the forward reads are refused.
"""

import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from disco import distributed, lowering, metrics, prune
from disco.errors import DistributedError
from disco.layers import DiscoConv, DiscoDense
from disco.ops import ONE_DEVICE
from tests.disco.util import normal


@dataclasses.dataclass(frozen=True)
class TinyConfig:
  num_nodes: int = 2
  image_size: int = 8
  in_channels: int = 2
  num_classes: int = 5


class TinyNet(nnx.Module):
  """conv (replicated image) -> batch norm -> relu -> conv -> pool -> dense."""

  def __init__(self, config: TinyConfig, *, rngs: nnx.Rngs):
    self.config = config
    nodes = config.num_nodes
    self.stem = DiscoConv(
      config.in_channels,
      6,
      3,
      replicated_input=True,
      num_nodes=nodes,
      rngs=rngs,
    )
    self.norm = nnx.BatchNorm(6, rngs=rngs)
    self.conv = DiscoConv(6, 8, 3, strides=2, num_nodes=nodes, rngs=rngs)
    self.head = DiscoDense(8, config.num_classes, num_nodes=nodes, rngs=rngs)

  def __call__(self, x):
    return self.forward(x, ONE_DEVICE)

  def forward(self, x, ops):
    x = nnx.relu(ops.layer(self.stem, x, norm=self.norm))
    x = nnx.relu(ops.layer(self.conv, x))
    return ops.output(self.head, jnp.mean(x, axis=(1, 2)))


class Unregistered(TinyNet):
  pass


class Forgetful(TinyNet):
  pass


class Unfolded(TinyNet):
  pass


@lowering.register(TinyNet)
def _tiny_weights(model, packer):
  packer.layer(model.stem, norm=model.norm)
  packer.layer(model.conv)
  packer.layer(model.head)


@lowering.register(Forgetful)
def _forgets_the_head(model, packer):
  packer.layer(model.stem, norm=model.norm)
  packer.layer(model.conv)


@lowering.register(Unfolded)
def _forgets_the_norm(model, packer):
  packer.layer(model.stem)
  packer.layer(model.conv)
  packer.layer(model.head)


def build(cls, ratio=0.5):
  model = cls(TinyConfig(), rngs=nnx.Rngs(0))
  model.norm.mean[...] = jnp.linspace(-0.2, 0.2, 6)
  model.norm.var[...] = jnp.linspace(0.5, 2.0, 6)
  prune.to_ratio(model, ratio)
  model.eval()
  return model


def test_a_registered_model_runs_distributed_like_one_device():
  model = build(TinyNet)
  images = normal(0, (3, 8, 8, 2))
  run = distributed.distribute(model)
  np.testing.assert_allclose(run(images), model(images), rtol=0, atol=1e-5)
  assert run.bytes_per_inference(3) == metrics.count(model).bytes_sent
  assert TinyNet in lowering.registered()


def test_a_model_without_lowering_is_refused():
  with pytest.raises(DistributedError, match="register"):
    distributed.distribute(build(Unregistered))


@pytest.mark.parametrize(
  "cls, message",
  [(Forgetful, "packed no weights"), (Unfolded, "batch norm")],
  ids=["missing-weights", "missing-fold"],
)
def test_a_lowering_that_misses_what_the_forward_reads_is_refused(cls, message):
  run = distributed.distribute(build(cls))
  with pytest.raises(DistributedError, match=message):
    run(np.ones((1, 8, 8, 2), np.float32))
