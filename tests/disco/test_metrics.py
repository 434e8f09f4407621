"""Bytes, FLOPs and parameters against hand counts; paper-scale accounting."""

import jax.numpy as jnp
import pytest
from flax import nnx

from disco import metrics, prune
from disco.errors import DiscoError
from disco.layers import CommMask, DiscoConv, DiscoDense
from disco.models import (
  ResNet,
  ResNetConfig,
  ViT,
  ViTConfig,
  deit_tiny_config,
  resnet50_config,
)


class TwoLayers(nnx.Module):
  """conv 4 -> 6 (3x3, no bias) on 5x5, global mean, dense 6 -> 4."""

  def __init__(self):
    rngs = nnx.Rngs(0)
    self.conv = DiscoConv(4, 6, 3, num_nodes=2, use_bias=False, rngs=rngs)
    self.dense = DiscoDense(6, 4, num_nodes=2, rngs=rngs)

  def __call__(self, x):
    return self.dense(jnp.mean(self.conv(x), axis=(1, 2)))


def _two_layers(sparse: bool):
  model = TwoLayers()
  if sparse:
    # conv: node 0 reads channel 2 (node 1's); node 1 reads nothing of 0's.
    model.conv.mask[...] = jnp.array([[1, 1, 1, 0], [0, 0, 1, 1]], bool)
    # dense: node 1 reads channel 0 (node 0's); node 0 reads nothing of 1's.
    model.dense.mask[...] = jnp.array(
      [[1, 1, 1, 0, 0, 0], [1, 0, 0, 1, 1, 1]], bool
    )
  return model


def test_two_layer_sparse_hand_count():
  report = metrics.count(_two_layers(True), input_shape=(1, 5, 5, 4))
  conv, dense, gather = report.layers
  # conv: 25 positions x 9 taps x (inputs read) x 3 outputs x 2.
  assert conv.flops == (2 * 25 * 9 * 3 * 3, 2 * 25 * 9 * 2 * 3)
  assert conv.params == (9 * 3 * 3, 9 * 2 * 3)
  # node 1 sends channel 2 (25 values, 4 bytes each) to node 0.
  assert conv.traffic == ((0, 0), (100, 0))
  # dense: 1 position; node 0 reads 3 inputs, node 1 reads 4; 2 outputs.
  assert dense.flops == (2 * 3 * 2, 2 * 4 * 2)
  assert dense.params == (3 * 2 + 2, 4 * 2 + 2)
  assert dense.traffic == ((0, 4), (0, 0))
  # node 1 sends its 2 logits to node 0.
  assert gather.traffic == ((0, 0), (8, 0))
  assert report.bytes_sent == 112
  assert report.flops == 4050 + 2700 + 12 + 16
  assert report.params_per_node == (81 + 8, 54 + 10)
  assert report.total_params == 9 * 4 * 6 + 6 * 4 + 4


def test_two_layer_dense_hand_count():
  report = metrics.count(_two_layers(False), input_shape=(1, 5, 5, 4))
  conv, dense, _ = report.layers
  assert conv.flops == (2 * 25 * 9 * 4 * 3,) * 2
  assert conv.traffic == ((0, 200), (200, 0))
  assert dense.flops == (2 * 6 * 2,) * 2
  assert dense.traffic == ((0, 12), (12, 0))
  assert report.bytes_sent == 400 + 24 + 8
  assert report.flops == 10800 + 48


def test_latency_model_on_the_two_layer_example():
  report = metrics.count(_two_layers(True), input_shape=(1, 5, 5, 4))
  link = metrics.LatencyModel(
    flops_per_second=1e6, bytes_per_second=1e3, message_latency=0.5
  )
  compute = (4050 + 16) / 1e6  # the slower node of each layer
  communication = 3 * 0.5 + (100 + 4 + 8) / 1e3
  assert link.latency(report) == pytest.approx(compute + communication)
  assert link.single_device_latency(report) == pytest.approx(6778 / 1e6)


def test_layers_reading_one_tensor_send_each_channel_once():
  model = ResNet(ResNetConfig(num_nodes=2), rngs=nnx.Rngs(0))
  block = model.blocks[1]
  assert block.shortcut.conv.mask is block.conv1.conv.mask
  layers = {layer.name: layer for layer in metrics.count(model).layers}
  first = layers["blocks.1.conv1.conv"]
  # 8 channels at 16x16: each node sends its 4 to the other, once.
  assert first.bytes_sent == 2 * 4 * 16 * 16 * 4
  assert layers["blocks.1.shortcut.conv"].bytes_sent == 0


def test_no_communication_model_sends_only_the_logits():
  model = ResNet(ResNetConfig(num_nodes=2), rngs=nnx.Rngs(0))
  report = metrics.count(metrics.with_masks(model, False))
  assert report.bytes_sent == 5 * 4  # node 1's five logits
  assert prune.comm_ratio(model) == 1.0  # the original is untouched


def test_compare_dense_is_half_the_single_device_per_node():
  model = ResNet(ResNetConfig(num_nodes=2), rngs=nnx.Rngs(0))
  costs = metrics.compare(model)
  assert costs["dense"]["flops"] == costs["single_device"]["flops"]
  assert costs["dense"]["flops_per_node"] * 2 == costs["dense"]["flops"]
  assert costs["single_device"]["bytes_sent"] == 0


def _abstract(build, ratio):
  """A paper-scale model without weights (shapes only), masks at `ratio`."""
  model = nnx.eval_shape(build)
  for _, mask in nnx.to_flat_state(nnx.state(model, CommMask)):
    mask.set_value(jnp.ones(mask.shape, bool))
  prune.to_ratio(model, ratio, selection="random")
  return model


def test_resnet50_accounting_at_r_0_2():
  model = _abstract(lambda: ResNet(resnet50_config(2), rngs=nnx.Rngs(0)), 0.2)
  costs = metrics.compare(model)
  single, dense, disco = (
    costs["single_device"],
    costs["dense"],
    costs["disco"],
  )
  assert single["params_per_node"] == 25_557_032  # torchvision's count
  assert single["flops"] == pytest.approx(2 * 4.09e9, rel=0.01)
  assert disco["bytes_sent"] <= 0.2 * dense["bytes_sent"]
  assert disco["flops"] <= 0.65 * single["flops"]
  assert disco["params_per_node"] <= 0.35 * single["params_per_node"]
  assert disco["memory_per_node"] < 0.5 * single["memory_per_node"]


def test_deit_tiny_accounting_counts_layer_norm_statistics():
  model = _abstract(lambda: ViT(deit_tiny_config(2), rngs=nnx.Rngs(0)), 0.0)
  report = metrics.count(model)
  norms = [layer for layer in report.layers if layer.kind == "DiscoLayerNorm"]
  # 24 block norms over 197 tokens and the final one over the class token:
  # each node sends the other 2 floats per token.
  assert sum(n.bytes_sent for n in norms) == (24 * 197 + 1) * 2 * 2 * 4
  gather = report.layers[-1].bytes_sent
  assert report.bytes_sent == sum(n.bytes_sent for n in norms) + gather


def test_count_needs_an_input_shape_and_disco_layers():
  with pytest.raises(DiscoError, match="input_shape"):
    metrics.count(TwoLayers())
  with pytest.raises(DiscoError, match="no DISCO layer"):
    metrics.count(nnx.Linear(2, 2, rngs=nnx.Rngs(0)), input_shape=(1, 2))


@pytest.mark.parametrize("kind", ["vit", "resnet"])
def test_a_batch_counts_its_inferences(kind):
  # Attention squared the batch's tokens: a tiny ViT at batch 64 counted 8x
  # the FLOPs, and disco_infer calibrated its latency model on them.
  if kind == "vit":
    model = ViT(ViTConfig(num_nodes=2, dim=32, depth=1, mlp_dim=64),
                rngs=nnx.Rngs(0))  # fmt: skip
  else:
    model = ResNet(ResNetConfig(num_nodes=2), rngs=nnx.Rngs(0))
  c = model.config
  one = metrics.count(model)
  many = metrics.count(
    model, input_shape=(5, c.image_size, c.image_size, c.in_channels)
  )
  assert many.flops == 5 * one.flops and many.bytes_sent == 5 * one.bytes_sent


@pytest.mark.parametrize("num_nodes, ratio", [(2, 0.2), (4, 0.1), (4, 1.0)])
def test_calls_are_the_compiled_programs_collectives(num_nodes, ratio):
  # The latency model charges one message cost per collective call: its
  # count must be what the program really issues, at 2 and 4 nodes,
  # masked (pairs of unequal lengths: one call each) and dense.
  from disco import distributed, hlo_bytes

  model = ResNet(ResNetConfig(num_nodes=num_nodes), rngs=nnx.Rngs(0))
  prune.to_ratio(model, ratio, selection="random", seed=1)
  model.eval()
  report = metrics.count(model)
  run = distributed.distribute(model, distributed.node_mesh(num_nodes))
  text = run.compiled(1).as_text()
  collectives = hlo_bytes.collective_bytes(text)
  assert {c.kind for c in collectives} == {"collective-permute"}
  assert sum(layer.calls for layer in report.layers) == len(collectives)
  # Calls beyond one per shift: pairs of one shift but unequal lengths.
  split = sum(layer.calls - _shifts(layer) for layer in report.layers)
  assert (split > 0) == (ratio < 1)


def _shifts(layer):
  nodes = len(layer.traffic)
  return len(
    {
      (j - i) % nodes
      for i in range(nodes)
      for j in range(nodes)
      if layer.traffic[i][j]
    }
  )


def test_token_bucket_link_passes_the_burst_and_bounds_by_the_rate():
  report = metrics.count(_two_layers(False), input_shape=(1, 5, 5, 4))
  compute = (5400 + 24) / 1e6  # every node reads all inputs
  calls = 3 * 0.5  # conv, dense, the logits gathered: one call each
  wire = metrics.LatencyModel(1e6, 1e3, 0.5, shared=True)
  assert wire.latency(report) == pytest.approx(compute + calls + 432 / 1e3)
  # A 300-byte burst: only the conv's 400 bytes exceed it, by 100.
  bucket = metrics.LatencyModel(1e6, 1e3, 0.5, shared=True, burst_bytes=300)
  assert bucket.latency(report) == pytest.approx(compute + calls + 100 / 1e3)
  # At a slow rate the bytes bound a run of back-to-back inferences.
  slow = metrics.LatencyModel(1e6, 10.0, 0.5, shared=True, burst_bytes=1e6)
  assert slow.latency(report) == pytest.approx(432 / 10.0)
  with pytest.raises(DiscoError, match="burst_bytes must be a finite"):
    metrics.LatencyModel(1e6, 1e3, 0.5, burst_bytes=-1)
