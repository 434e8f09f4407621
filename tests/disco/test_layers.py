"""DiscoDense / DiscoConv: dense and grouped limits, per-node extraction."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from disco.errors import DiscoError, PartitionError
from disco.layers import CommMask, DiscoConv, DiscoDense
from disco.splits import Split, split_channels
from tests.disco.util import normal


def _random_mask(layer, seed):
  bits = np.random.default_rng(seed).random(layer.mask.shape) < 0.5
  layer.mask[...] = jnp.asarray(bits)


def _conv(x, kernel, strides=(1, 1)):
  return jax.lax.conv_general_dilated(
    x, kernel, strides, "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC")
  )


@pytest.mark.parametrize("num_nodes", [2, 4])
def test_dense_with_masks_one_is_a_dense_layer(num_nodes):
  layer = DiscoDense(12, 8, num_nodes=num_nodes, rngs=nnx.Rngs(0))
  layer.bias[...] = jnp.arange(8.0)
  reference = nnx.Linear(12, 8, rngs=nnx.Rngs(1))
  reference.kernel[...] = layer.kernel[...]
  reference.bias[...] = layer.bias[...]
  x = normal(2, (3, 5, 12))
  np.testing.assert_allclose(layer(x), reference(x), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("num_nodes", [2, 4])
def test_conv_with_masks_one_is_a_dense_conv(num_nodes):
  layer = DiscoConv(8, 12, 3, strides=2, num_nodes=num_nodes, rngs=nnx.Rngs(0))
  layer.bias[...] = jnp.linspace(-1, 1, 12)
  reference = nnx.Conv(8, 12, (3, 3), strides=2, rngs=nnx.Rngs(1))
  reference.kernel[...] = layer.kernel[...]
  reference.bias[...] = layer.bias[...]
  x = normal(2, (2, 9, 9, 8))
  np.testing.assert_allclose(layer(x), reference(x), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("num_nodes", [2, 4])
def test_dense_with_masks_zero_is_grouped(num_nodes):
  layer = DiscoDense(12, 8, num_nodes=num_nodes, rngs=nnx.Rngs(0))
  layer.bias[...] = jnp.arange(8.0)
  layer.mask[...] = jnp.zeros(layer.mask.shape, bool)
  x = normal(2, (3, 12))
  y = layer(x)
  kernel, bias = layer.kernel[...], layer.bias[...]
  for node in range(num_nodes):
    p, q = layer.in_split.indices(node), layer.out_split.indices(node)
    expected = x[:, p] @ kernel[np.ix_(p, q)] + bias[q]
    np.testing.assert_allclose(y[:, q], expected, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize(
  "num_nodes, in_split", [(2, None), (4, None), (3, (2, 5, 1))]
)
def test_conv_with_masks_zero_is_grouped(num_nodes, in_split):
  layer = DiscoConv(
    8, 6, 3, num_nodes=num_nodes, in_split=in_split, rngs=nnx.Rngs(0)
  )
  layer.mask[...] = jnp.zeros(layer.mask.shape, bool)
  x = normal(2, (2, 6, 6, 8))
  y = layer(x)
  for node in range(num_nodes):
    p, q = layer.in_split.indices(node), layer.out_split.indices(node)
    block = layer.kernel[...][:, :, p][..., q]
    expected = _conv(x[..., p], block) + layer.bias[...][q]
    np.testing.assert_allclose(y[..., q], expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("num_nodes", [2, 3])
def test_per_node_weights_and_sends_rebuild_the_output(num_nodes):
  """What a distributed runtime reads: each node's kernel and the channels
  every other node sends it reproduce the layer's output."""
  layer = DiscoConv(9, 6, 3, num_nodes=num_nodes, rngs=nnx.Rngs(0))
  _random_mask(layer, 3)
  x = normal(1, (1, 5, 5, 9))
  y = layer(x)
  for node in range(num_nodes):
    received = [layer.in_split.indices(node)] + [
      layer.sends(src, node) for src in range(num_nodes) if src != node
    ]
    inputs = np.sort(np.concatenate(received))
    np.testing.assert_array_equal(inputs, layer.node_inputs(node))
    q = layer.out_split.indices(node)
    expected = _conv(x[..., inputs], layer.node_kernel(node))
    expected = expected + layer.bias[...][q]
    np.testing.assert_allclose(y[..., q], expected, rtol=1e-5, atol=1e-5)


def test_sends_are_the_mask_bits_of_the_source_block():
  layer = DiscoDense(4, 4, num_nodes=2, rngs=nnx.Rngs(0))
  layer.mask[...] = jnp.array([[1, 1, 0, 1], [1, 0, 1, 1]], bool)
  np.testing.assert_array_equal(layer.sends(1, 0), [3])
  np.testing.assert_array_equal(layer.sends(0, 1), [0])
  assert layer.sends(0, 0).size == 0


def test_replicated_input_needs_no_split_and_sends_nothing():
  layer = DiscoConv(
    1, 4, 3, num_nodes=4, replicated_input=True, rngs=nnx.Rngs(0)
  )
  assert not layer.cross().any()
  assert all(layer.sends(i, j).size == 0 for i in range(4) for j in range(4))
  layer.mask[...] = jnp.zeros(layer.mask.shape, bool)
  reference = _conv(jnp.ones((1, 4, 4, 1)), layer.kernel[...])
  np.testing.assert_allclose(layer(jnp.ones((1, 4, 4, 1))), reference)


def test_mask_is_its_own_variable_type():
  layer = DiscoDense(4, 4, num_nodes=2, rngs=nnx.Rngs(0))
  params = nnx.state(layer, nnx.Param)
  masks = nnx.state(layer, CommMask)
  assert "mask" not in params and set(masks) == {"mask"}
  assert masks["mask"][...].dtype == jnp.bool_


def test_more_nodes_than_channels_is_a_clear_error():
  with pytest.raises(PartitionError, match="cannot split 3 input channels"):
    DiscoDense(3, 8, num_nodes=4, rngs=nnx.Rngs(0))
  with pytest.raises(DiscoError, match="output channels"):
    DiscoConv(8, 2, 3, num_nodes=4, rngs=nnx.Rngs(0))


def test_bad_splits_and_shared_masks_are_refused():
  with pytest.raises(PartitionError):
    split_channels(8, 2, (3, 4))
  with pytest.raises(PartitionError):
    Split((4, 0))
  first = DiscoDense(8, 4, num_nodes=2, rngs=nnx.Rngs(0))
  with pytest.raises(PartitionError, match="shared mask"):
    DiscoDense(6, 4, num_nodes=2, mask=first.mask, rngs=nnx.Rngs(0))


def test_even_split_sizes():
  assert split_channels(10, 4).sizes == (3, 3, 2, 2)
  np.testing.assert_array_equal(Split((2, 1)).owner(), [0, 0, 1])
