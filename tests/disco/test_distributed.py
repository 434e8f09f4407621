"""Distributed inference against the single-device masked model.

Every case checks logits, bytes from the compiled program against
`disco.metrics`, and the weights on each device against the node's share.
Compiled programs are cached per case: each test reuses them.
"""

import functools
import importlib
import json
import os
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax import lax
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from disco import checkpoint, distributed, hlo_bytes, metrics, prune
from disco.errors import DiscoError, HloError
from disco.layers import DiscoLayer
from disco.models import (
  DeepLab,
  ResNet,
  ResNetConfig,
  SegConfig,
  ViT,
  ViTConfig,
)
from disco.transformer import DiscoLayerNorm
from graphpipe.runtime.launch import launch
from tests.disco import distributed_worker
from tests.disco.util import normal

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(__file__)))
WORKER = os.path.join(os.path.dirname(__file__), "distributed_worker.py")

# (architecture, nodes, comm ratio); "vit_uneven": 3 heads and 7 classes
# over 2 nodes, so channel blocks and logits are split unevenly. One node:
# nothing to exchange (it once failed building the empty exchange).
CASES = [
  ("resnet", 1, 1.0),
  ("vit", 1, 1.0),
  ("resnet", 2, 0.0),
  ("resnet", 2, 0.25),
  ("resnet", 2, 1.0),
  ("resnet", 4, 0.0),
  ("resnet", 4, 0.5),
  ("resnet", 4, 1.0),
  ("vit", 2, 0.0),
  ("vit", 2, 0.3),
  ("vit", 2, 1.0),
  ("vit", 4, 0.3),
  ("vit_uneven", 2, 0.5),
]
IDS = [f"{a}-{n}nodes-r{r}" for a, n, r in CASES]


def build(architecture: str, nodes: int, ratio: float):
  if architecture == "resnet":
    config = ResNetConfig(num_nodes=nodes, num_classes=12)
    model = ResNet(config, rngs=nnx.Rngs(nodes))
    distributed_worker.with_random_batch_norm(model, 7)
  elif architecture == "vit":
    config = ViTConfig(num_nodes=nodes, dim=32, depth=1, mlp_dim=64)
    model = ViT(config, rngs=nnx.Rngs(nodes))
    distributed_worker.with_random_vit_weights(model, 8)
  else:
    config = ViTConfig(
      num_nodes=nodes, dim=24, num_heads=3, depth=1, num_classes=7
    )
    model = ViT(config, rngs=nnx.Rngs(1))
    distributed_worker.with_random_vit_weights(model, 9)
  prune.to_ratio(model, ratio)
  model.eval()
  return model


@functools.cache
def compiled(case):
  model = build(*case)
  images = normal(sum(map(ord, str(case))), (2, 16, 16, 1))
  run = distributed.distribute(model)
  return model, images, run, run(images)


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_outputs_equal_the_masked_model(case):
  model, images, _, logits = compiled(case)
  np.testing.assert_allclose(logits, model(images), rtol=0, atol=1e-5)


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_measured_bytes_equal_the_mask_count(case):
  model, images, run, _ = compiled(case)
  assert run.bytes_per_inference(len(images)) == metrics.count(model).bytes_sent


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_each_device_holds_its_node_share(case):
  model, _, run, _ = compiled(case)
  nodes = run.num_nodes
  shares = tuple(4 * node_share(model, node) for node in range(nodes))
  assert run.share_bytes == shares
  held = run.device_weight_bytes()
  assert list(held) == list(range(nodes))
  for node in range(nodes):
    assert held[node] == shares[node] + run.padding_bytes[node]
  even = case[0] != "vit_uneven"
  if even and case[2] in (0.0, 1.0):
    assert run.padding_bytes == (0,) * nodes
  if even:  # no device holds more than its 1/N of the model
    total = 4 * metrics.count(model).total_params
    assert max(held.values()) <= total / nodes


def node_share(model, node: int) -> int:
  """Values node `node` needs, from the layers' own accessors."""
  values = 0
  for _, module in nnx.iter_modules(model):
    if isinstance(module, DiscoLayer):
      # Its kernel block plus a bias or a folded batch-norm shift.
      values += module.node_kernel(node).size
      values += len(module.out_split.indices(node))
    elif isinstance(module, DiscoLayerNorm):
      values += 2 * module.split.sizes[node]
  if isinstance(model, ViT):
    own = model.patch_embed.out_split.sizes[node]
    values += own * (1 + model.config.num_patches + 1)  # cls + positions
  return values


def test_dense_parallelism_runs_through_the_same_path():
  model, images, _, _ = compiled(("resnet", 2, 0.25))
  dense_model = metrics.with_masks(model, True)
  dense = distributed.distribute(dense_model)
  np.testing.assert_allclose(dense(images), dense_model(images), atol=1e-5)
  assert dense.bytes_per_inference(1) == metrics.count(dense_model).bytes_sent
  assert dense.bytes_per_inference(1) > 3 * metrics.count(model).bytes_sent


def test_two_processes_equal_one_process():
  model, images = distributed_worker.case()
  run = distributed.distribute(model, distributed.node_mesh(2))
  want = run(images)
  env = {"PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
  outputs = launch([WORKER], 2, 1, env=env, timeout=300)
  for process, out in enumerate(outputs):
    line = [x for x in out.splitlines() if x.startswith("RESULT ")][-1]
    result = json.loads(line[len("RESULT ") :])
    assert result["process"] == process and result["devices"] == 2
    assert result["local_weight_bytes"] == {str(process): run.held_bytes}
    np.testing.assert_array_equal(np.float32(result["logits"]), want)
    assert result["bytes_per_inference"] == metrics.count(model).bytes_sent


def test_mesh_of_another_size_is_refused():
  model, _, _, _ = compiled(("resnet", 2, 0.0))
  with pytest.raises(DiscoError, match="needs a 'node' axis of size 2"):
    distributed.distribute(model, distributed.node_mesh(4))
  other = Mesh(np.array(jax.devices()[:2]), ("model",))
  with pytest.raises(DiscoError, match="'node' axis"):
    distributed.distribute(model, other)


@pytest.mark.parametrize(
  "images",
  [np.ones((2, 8, 8, 1)), np.ones((16, 16, 1)), np.ones((0, 16, 16, 1))],
  ids=["wrong-size", "no-batch", "empty-batch"],
)
def test_input_of_the_wrong_shape_is_refused(images):
  _, _, run, _ = compiled(("resnet", 2, 0.0))
  with pytest.raises(DiscoError, match=r"expected images of shape \(batch"):
    run(images)


def test_bfloat16_images_are_taken_like_float16_ones():
  # Refused before ("expected images of shape ..."): numpy does not count
  # ml_dtypes' bfloat16 as a number.
  _, images, run, _ = compiled(("resnet", 2, 0.0))
  low = np.asarray(images).astype(jnp.bfloat16)
  want = run(low.astype(np.float32))
  np.testing.assert_array_equal(np.asarray(run(low)), np.asarray(want))


def test_unsupported_model_and_too_few_devices_are_refused():
  with pytest.raises(DiscoError, match="cannot be distributed"):
    distributed.distribute(nnx.Linear(2, 2, rngs=nnx.Rngs(0)))
  with pytest.raises(DiscoError, match="need 16 devices"):
    distributed.node_mesh(16)


def test_experiment_refuses_a_checkpoint_that_does_not_match(tmp_path):
  disco_infer = importlib.import_module("experiments.disco_infer")
  model, _, _, _ = compiled(("resnet", 2, 0.0))
  checkpoint.save(model, str(tmp_path / "ckpt"))
  settings = disco_infer.Settings(str(tmp_path / "ckpt"), num_nodes=4)
  with pytest.raises(DiscoError, match="split over 2 nodes"):
    disco_infer.run(settings, str(tmp_path / "out"))
  # Not a classifier: refused by name (a numpy broadcast error before).
  seg = SegConfig(width=8, in_channels=1, image_size=16, num_classes=10)
  checkpoint.save(DeepLab(seg, rngs=nnx.Rngs(0)), str(tmp_path / "seg"))
  with pytest.raises(DiscoError, match="holds a deeplab; disco_infer"):
    disco_infer.run(disco_infer.Settings(str(tmp_path / "seg")), "unused")
  # A split other than the recorded one scored training images (half of
  # a 0.4 digits split was a 0.2 run's training images); without the
  # flags the recorded one is used.
  checkpoint.save(
    model,
    str(tmp_path / "rec"),
    data={"dataset": "mnist", "test_fraction": 0.2},
  )
  for given, message in [
    ({"test_fraction": 0.4}, "trained with test_fraction=0.2; --test_frac"),
    ({"dataset": "digits"}, "trained with dataset='mnist'"),
  ]:
    settings = disco_infer.Settings(str(tmp_path / "rec"), **given)
    with pytest.raises(DiscoError, match=message):
      disco_infer.run(settings, "unused")
  settings = importlib.import_module("experiments.disco_settings")
  split = settings.held_out_split(str(tmp_path / "rec"), None, None)
  assert split == ("mnist", {"test_fraction": 0.2})
  (tmp_path / "ckpt" / "arrays.npz").write_bytes(b"not an archive")
  with pytest.raises(DiscoError, match="unreadable arrays"):
    disco_infer.run(disco_infer.Settings(str(tmp_path / "ckpt")), "unused")
  # The flags' bounds hold for callers of run too (repeats=0 gave NaN
  # latencies, batch_size=0 a traceback).
  for given, message in [
    ({"repeats": 0}, "repeats must be an int >= 1"),
    ({"batch_size": 0}, "batch_size must be an int >= 1"),
    ({"message_latency": -1e-4}, "message_latency must be a finite"),
  ]:
    with pytest.raises(DiscoError, match=message):
      disco_infer.Settings(str(tmp_path / "ckpt"), **given)


def test_hlo_counter_counts_every_collective_kind():
  mesh = Mesh(np.array(jax.devices()[:4]), ("node",))

  def body(x):  # x: (2, 3) float32 per device, 24 bytes
    moved = lax.ppermute(x, "node", [(0, 1), (1, 2)])
    gathered = lax.all_gather(x, "node")
    summed = lax.psum(x, "node")
    blocks = jnp.broadcast_to(x.reshape(1, 6), (4, 6))  # 96 bytes
    swapped = lax.all_to_all(blocks, "node", 0, 0)
    return moved + gathered.sum(0) + summed + swapped.sum()

  program = jax.jit(
    jax.shard_map(body, mesh=mesh, in_specs=P("node"), out_specs=P("node"))
  )
  text = program.lower(np.ones((8, 3), np.float32)).compile().as_text()
  sent = {}
  for collective in hlo_bytes.collective_bytes(text):
    sent[collective.kind] = sent.get(collective.kind, 0) + collective.bytes_sent
  assert sent == {
    "collective-permute": 2 * 24,
    "all-gather": 4 * 3 * 24,
    "all-reduce": 2 * 3 * 24,
    "all-to-all": 3 * 96,
  }


def test_hlo_counter_refuses_collectives_in_a_loop():
  mesh = Mesh(np.array(jax.devices()[:2]), ("node",))

  def body(x):
    step = lambda _, y: lax.ppermute(y, "node", [(0, 1), (1, 0)]) * 1.5
    return lax.fori_loop(0, 7, step, x)

  program = jax.jit(
    jax.shard_map(body, mesh=mesh, in_specs=P("node"), out_specs=P("node"))
  )
  text = program.lower(np.ones((2, 3), np.float32)).compile().as_text()
  with pytest.raises(HloError, match="straight-line"):
    hlo_bytes.collective_bytes(text)


def test_experiment_writes_results_and_plot(tmp_path):
  disco_infer = importlib.import_module("experiments.disco_infer")
  model, _, _, _ = compiled(("resnet", 2, 0.25))
  checkpoint.save(model, str(tmp_path / "ckpt"))
  settings = disco_infer.Settings(
    str(tmp_path / "ckpt"), dataset="synthetic", batch_size=8, repeats=2
  )
  results = disco_infer.run(settings, str(tmp_path / "out"))
  written = json.loads((tmp_path / "out" / "results.json").read_text())
  assert written["accuracy"] == written["accuracy_single_device"]
  assert written["max_abs_error_vs_single_device"] < 1e-5
  measured = written["bytes_per_inference_measured"]
  assert measured == written["bytes_per_inference_from_masks"]
  assert (
    written["bytes_per_inference_dense_measured"]
    == (written["bytes_per_inference_dense"])
  )
  for runner in ("one_device", "dense_parallel", "disco"):
    assert set(written["latency_ms"][runner]) >= {"per_image", "per_batch"}
  curves = written["latency_model"]["predicted_ms"]["per_batch"]
  assert set(curves) >= {"one_device", "disco_2_nodes", "disco_4_nodes"}
  assert results["plot"] is None or os.path.isfile(results["plot"])


def test_a_model_in_training_mode_is_warned_about():
  # Distributed inference normalises with running statistics; a model left
  # in training mode gave other outputs than model(x) without a word.
  model = ResNet(ResNetConfig(num_nodes=2), rngs=nnx.Rngs(0))
  with pytest.warns(UserWarning, match="in training mode"):
    distributed.distribute(model)
  model.eval()
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    distributed.distribute(model)


def test_experiment_on_a_one_node_checkpoint(tmp_path):
  # A one-node model has no cross-node weights: its comm ratio read 0 (no
  # communication), so the 2- and 4-node "disco" predictions were of the
  # no-communication model, and dense / DISCO bytes printed "0 (0.0x)".
  disco_infer = importlib.import_module("experiments.disco_infer")
  model, _, _, _ = compiled(("resnet", 1, 1.0))
  assert prune.comm_ratio(model) == 1.0
  checkpoint.save(model, str(tmp_path / "ckpt"))
  settings = disco_infer.Settings(
    str(tmp_path / "ckpt"),
    num_nodes=1,
    dataset="synthetic",
    batch_size=4,
    repeats=1,
  )
  written = disco_infer.run(settings, str(tmp_path / "out"))
  assert written["bytes_per_inference_measured"] == 0
  assert written["dense_over_disco_bytes"] is None
  latency = written["latency_model"]
  assert latency["comm_ratio"] == 1.0
  for key in ("per_image", "per_batch"):
    curves = latency["predicted_ms"][key]
    for nodes in (2, 4):
      assert curves[f"disco_{nodes}_nodes"] == curves[f"dense_{nodes}_nodes"]
