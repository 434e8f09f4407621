"""ResNet and ViT built from DISCO layers, for any number of nodes."""

import jax
import numpy as np
import pytest
from flax import nnx

from disco import metrics
from disco.errors import ConfigError, PartitionError
from disco.layers import DiscoLayer
from disco.models import ResNet, ResNetConfig, ViT, ViTConfig, resnet50_config
from disco.splits import Split
from disco.transformer import DiscoLayerNorm
from graphpipe.models.attention import dot_product_attention
from tests.disco.util import normal

IMAGES = np.random.default_rng(0).random((2, 16, 16, 1), np.float32)


@pytest.mark.parametrize("num_nodes", [1, 3, 4])
def test_resnet_any_number_of_nodes(num_nodes):
  model = ResNet(ResNetConfig(num_nodes=num_nodes), rngs=nnx.Rngs(0))
  assert model(IMAGES).shape == (2, 10)
  assert model.head.out_split.num_nodes == num_nodes


@pytest.mark.parametrize("num_nodes", [1, 2, 4])
def test_vit_any_number_of_nodes(num_nodes):
  model = ViT(ViTConfig(num_nodes=num_nodes, depth=1), rngs=nnx.Rngs(0))
  assert model(IMAGES).shape == (2, 10)


def _node_independence(model, first_layer):
  """Changes node 1's first-layer weights; returns how much the logits of
  node 0's classes and of node 1's classes move."""
  model.eval()
  before = model(IMAGES)
  q1 = first_layer.out_split.indices(1)
  noise = normal(1, first_layer.kernel.shape)
  kernel = first_layer.kernel[...]
  first_layer.kernel[...] = kernel.at[..., q1].add(noise[..., q1])
  after = model(IMAGES)
  head = model.head.out_split
  moved = np.abs(np.asarray(after - before))
  return moved[:, head.indices(0)].max(), moved[:, head.indices(1)].max()


def test_resnet_without_communication_is_independent_per_node():
  model = ResNet(ResNetConfig(num_nodes=2), rngs=nnx.Rngs(0))
  model = metrics.with_masks(model, False)
  node0, node1 = _node_independence(model, model.stem.conv)
  assert node0 == 0.0 and node1 > 1e-3


def test_vit_without_communication_is_independent_per_node():
  config = ViTConfig(num_nodes=2, depth=1, exchange_stats=False)
  model = metrics.with_masks(ViT(config, rngs=nnx.Rngs(0)), False)
  node0, node1 = _node_independence(model, model.patch_embed)
  assert node0 == 0.0 and node1 > 1e-4


def test_exact_layer_norm_crosses_nodes_even_without_masks():
  config = ViTConfig(num_nodes=2, depth=1, exchange_stats=True)
  model = metrics.with_masks(ViT(config, rngs=nnx.Rngs(0)), False)
  node0, _ = _node_independence(model, model.patch_embed)
  assert node0 > 0.0


def test_layer_norm_exact_and_per_node():
  x = normal(1, (3, 10)) * 3 + 1
  exact = DiscoLayerNorm(Split((6, 4)), rngs=nnx.Rngs(0))
  reference = nnx.LayerNorm(10, epsilon=1e-6, rngs=nnx.Rngs(0))
  np.testing.assert_allclose(exact(x), reference(x), rtol=1e-5, atol=1e-5)
  local = DiscoLayerNorm(Split((6, 4)), exchange_stats=False, rngs=nnx.Rngs(0))
  left = nnx.LayerNorm(6, epsilon=1e-6, rngs=nnx.Rngs(0))
  np.testing.assert_allclose(local(x)[:, :6], left(x[:, :6]), atol=1e-5)


def test_the_shared_attention_is_jax_dot_product_attention():
  query = normal(1, (2, 5, 3, 4))  # batch, queries, heads, head_dim
  key, value = normal(2, (2, 7, 3, 4)), normal(3, (2, 7, 3, 4))
  want = jax.nn.dot_product_attention(query, key, value)
  got = dot_product_attention(query, key, value)
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def test_bad_configs_are_clear_errors():
  with pytest.raises(ConfigError, match="heads"):
    ViT(ViTConfig(dim=30, num_heads=4), rngs=nnx.Rngs(0))
  with pytest.raises(ConfigError, match="patch"):
    ViT(ViTConfig(image_size=15), rngs=nnx.Rngs(0))
  with pytest.raises(PartitionError, match="attention heads"):
    ViT(ViTConfig(num_nodes=8), rngs=nnx.Rngs(0))
  with pytest.raises(PartitionError, match="cannot split"):
    ResNet(ResNetConfig(num_nodes=32), rngs=nnx.Rngs(0))
  with pytest.raises(ConfigError, match="unknown block"):
    ResNet(ResNetConfig(block="wide"), rngs=nnx.Rngs(0))
  with pytest.raises(ConfigError, match="one width per stage"):
    ResNet(ResNetConfig(stage_sizes=(1, 1)), rngs=nnx.Rngs(0))


def test_resnet50_structure():
  model = nnx.eval_shape(lambda: ResNet(resnet50_config(2), rngs=nnx.Rngs(0)))
  layers = [m for _, m in nnx.iter_modules(model) if isinstance(m, DiscoLayer)]
  assert len(layers) == 53 + 1  # convs with 4 projection shortcuts, and fc
  assert model.head.in_features == 2048
  assert model.stem.conv.kernel.shape == (7, 7, 3, 64)
