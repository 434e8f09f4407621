"""Bad input to every public disco entry point: each row of
docs/guide/bad_input.md's table ("Bad input, everywhere") is one case here: the
DISCO layers, pruning, the loaders, checkpoints, cost counting and distributed
inference. Each asserts disco's own error class and a message that says what to
fix, or (NaN inputs) the documented propagation.
"""

import json
import os
import pickle

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from disco import (
  checkpoint,
  data,
  detection,
  distributed,
  metrics,
  prune,
  train,
)
from disco.errors import (
  CheckpointError,
  ConfigError,
  DataError,
  DistributedError,
  InputError,
  MetricsError,
  PartitionError,
  PruneError,
)
from disco.layers import DiscoConv, DiscoDense
from disco.models import ResNet, ResNetConfig, SSDConfig, ViT, ViTConfig
from tests.bad_input_table import table_tests


def dense():
  return DiscoDense(8, 4, num_nodes=2, rngs=nnx.Rngs(0))


def conv():
  return DiscoConv(8, 16, 3, num_nodes=2, rngs=nnx.Rngs(0))


class Evil:
  def __reduce__(self):
    return (os.system, ("echo tampered",))


class Ctx:
  def __init__(self, folder):
    self.folder = str(folder)
    self.model = ResNet(ResNetConfig(num_nodes=2), rngs=nnx.Rngs(0))
    self.model.eval()  # as distributed inference runs it
    self.saved = os.path.join(self.folder, "ckpt")
    checkpoint.save(self.model, self.saved)

  def copy(self, name, edit_config=None, edit_arrays=None):
    """A copy of the saved checkpoint with its files edited."""
    out = os.path.join(self.folder, name)
    os.makedirs(out, exist_ok=True)
    for file in (checkpoint.CONFIG_FILE, checkpoint.ARRAYS_FILE):
      with open(os.path.join(self.saved, file), "rb") as f:
        raw = f.read()
      edit = edit_config if file == checkpoint.CONFIG_FILE else edit_arrays
      with open(os.path.join(out, file), "wb") as f:
        f.write(edit(raw) if edit else raw)
    return out

  def pickle_file(self, name, obj):
    path = os.path.join(self.folder, name)
    with open(path, "wb") as f:
      pickle.dump(obj, f, protocol=2)
    return path


@pytest.fixture(scope="module")
def ctx(tmp_path_factory):
  return Ctx(tmp_path_factory.mktemp("disco_bad_input"))


def config_field(field, value):
  def edit(raw):
    header = json.loads(raw)
    header["config"][field] = value
    return json.dumps(header).encode()

  return edit


def header_field(field, value):
  def edit(raw):
    header = json.loads(raw)
    header[field] = value
    return json.dumps(header).encode()

  return edit


def drop(field):
  def edit(raw):
    header = json.loads(raw)
    del header[field]
    return json.dumps(header).encode()

  return edit


def _with_nan(layer):
  layer.kernel[...] = layer.kernel[...].at[0, 0].set(jnp.nan)
  return layer


def _abstract():
  model = nnx.eval_shape(lambda: ResNet(ResNetConfig(), rngs=nnx.Rngs(0)))
  model.eval()
  return model


def half(raw):
  return raw[: len(raw) // 2]


def flip_middle(raw):
  flipped = bytearray(raw)
  for i in range(len(raw) // 2, len(raw) // 2 + 64):
    flipped[i] ^= 0xFF
  return bytes(flipped)


ROWS = [
  # DiscoDense / DiscoConv
  (
    "dense-no-input-channels",
    lambda c: DiscoDense(0, 4, num_nodes=2, rngs=nnx.Rngs(0)),
    PartitionError,
    "cannot split 0 input channels",
  ),
  (
    "dense-zero-nodes",
    lambda c: DiscoDense(8, 4, num_nodes=0, rngs=nnx.Rngs(0)),
    PartitionError,
    "num_nodes must be at least 1",
  ),
  (
    "dense-more-nodes-than-channels",
    lambda c: DiscoDense(2, 4, num_nodes=4, rngs=nnx.Rngs(0)),
    PartitionError,
    "use fewer nodes or a wider layer",
  ),
  (
    "dense-split-not-covering",
    lambda c: DiscoDense(8, 4, num_nodes=2, in_split=(3, 3), rngs=nnx.Rngs(0)),
    PartitionError,
    "does not cover 8 channels",
  ),
  (
    "dense-negative-split",
    lambda c: DiscoDense(
      8, 4, num_nodes=2, in_split=(10, -2), rngs=nnx.Rngs(0)
    ),
    PartitionError,
    "at least 1 for every node",
  ),
  (
    "dense-input-wrong-width",
    lambda c: dense()(jnp.ones((3, 7))),
    InputError,
    r"C = 8, got \(3, 7\)",
  ),
  (
    "dense-input-scalar",
    lambda c: dense()(jnp.float32(1)),
    InputError,
    "takes inputs of shape",
  ),
  (
    "conv-kernel-0",
    lambda c: DiscoConv(8, 16, 0, num_nodes=2, rngs=nnx.Rngs(0)),
    ConfigError,
    "kernel size, strides and dilation must be at least 1",
  ),
  (
    "conv-strides-0",
    lambda c: DiscoConv(8, 16, 3, strides=0, num_nodes=2, rngs=nnx.Rngs(0)),
    ConfigError,
    "at least 1",
  ),
  (
    "conv-dilation-0",
    lambda c: DiscoConv(8, 16, 3, dilation=0, num_nodes=2, rngs=nnx.Rngs(0)),
    ConfigError,
    "dilation must be at least 1",
  ),
  (
    "conv-input-not-nhwc",
    lambda c: conv()(jnp.ones((8, 8, 8))),
    InputError,
    r"\(batch, height, width, C\)",
  ),
  (
    "conv-input-wrong-channels",
    lambda c: conv()(jnp.ones((1, 8, 8, 3))),
    InputError,
    "C = 8",
  ),
  (
    "model-config-zero-nodes",
    lambda c: ResNet(ResNetConfig(num_nodes=0), rngs=nnx.Rngs(0)),
    PartitionError,
    "num_nodes must be at least 1",
  ),
  # disco.prune
  *[
    (
      f"prune-ratio-{name}",
      lambda c, r=ratio: prune.to_ratio(dense(), r),
      PruneError,
      r"must be in \[0, 1\]",
    )
    for name, ratio in [("negative", -0.1), ("above-1", 1.5), ("nan", np.nan)]
  ],
  (
    "prune-budget-unknown",
    lambda c: prune.to_ratio(dense(), 0.5, budget="bogus"),
    PruneError,
    "budget must be one of",
  ),
  (
    "prune-selection-unknown",
    lambda c: prune.to_ratio(dense(), 0.5, selection="bogus"),
    PruneError,
    "selection one of",
  ),
  (
    "prune-model-without-disco-layers",
    lambda c: prune.to_ratio(nnx.Linear(2, 2, rngs=nnx.Rngs(0)), 0.5),
    PruneError,
    "no DISCO layers",
  ),
  (
    "prune-schedule-zero-steps",
    lambda c: prune.GradualSchedule(0.5, 0),
    PruneError,
    "steps must be an int >= 1",
  ),
  # A fractional step count stopped the schedule short of its target.
  (
    "prune-schedule-fractional-steps",
    lambda c: prune.GradualSchedule(0.2, steps=14.9, every=5),
    PruneError,
    "steps must be an int >= 1, got 14.9",
  ),
  # Refused at the first prune before, after `every` training steps.
  (
    "prune-schedule-unknown-budget",
    lambda c: prune.GradualSchedule(0.2, steps=10, budget="foo"),
    PruneError,
    "budget must be one of",
  ),
  (
    "prune-bytes-without-input-shape",
    lambda c: prune.to_ratio(dense(), 0.5, budget="bytes"),
    PruneError,
    "needs each group's bytes",
  ),
  (
    "prune-bytes-negative",
    lambda c: prune.to_ratio(
      dense(),
      0.5,
      budget="bytes",
      group_bytes=[-np.ones(g.cross.shape) for g in prune.mask_groups(dense())],
    ),
    PruneError,
    "at least 0",
  ),
  (
    "prune-bytes-given-to-layer-budget",
    lambda c: prune.to_ratio(
      dense(),
      0.5,
      group_bytes=[np.ones(g.cross.shape) for g in prune.mask_groups(dense())],
    ),
    PruneError,
    "pass budget='bytes'",
  ),
  # Four anchors built heads of 84 boxes against 63 default boxes; loss and
  # mAP then failed to broadcast.
  (
    "ssd-anchors-beyond-aspects",
    lambda c: SSDConfig(anchors=4),
    ConfigError,
    "anchors must be at most 3",
  ),
  # Three training scenes x 0.15 held out none: disco_train failed after
  # dense training.
  (
    "data-holdout-empty",
    lambda c: data.holdout(data.synthetic(train=3, test=2), 0.15),
    DataError,
    "leaves 0 to validate on",
  ),
  # disco.train
  (
    "train-epochs-negative",
    lambda c: train.TrainConfig(epochs=-1),
    ConfigError,
    "epochs must be an int >= 0",
  ),
  (
    "train-batch-size-0",
    lambda c: train.TrainConfig(epochs=1, batch_size=0),
    ConfigError,
    "batch_size must be an int >= 1",
  ),
  (
    "train-learning-rate-nan",
    lambda c: train.TrainConfig(epochs=1, learning_rate=float("nan")),
    ConfigError,
    "learning_rate must be a finite number >= 0",
  ),
  # disco.detection (tasks.quality of an SSD model): an IndexError before
  (
    "map-targets-of-one-image-without-the-image-axis",
    lambda c: detection.mean_average_precision(
      [[]], np.array([[1, 0, 0, 4, 4]], np.float32), 2
    ),
    DataError,
    r"must be \(images, objects, 5\).*got \(1, 5\)",
  ),
  (
    "map-targets-of-other-images",
    lambda c: detection.mean_average_precision(
      [[], []], np.zeros((3, 1, 5), np.float32), 2
    ),
    DataError,
    "2 images' detections against 3 images' targets",
  ),
  # disco.data
  (
    "load-unknown-option",
    lambda c: data.load("classify", "digits", imagesize=8),
    DataError,
    r"unknown dataset options \['imagesize'\]",
  ),
  (
    "shapes-fewer-than-4-scenes",
    lambda c: data.load("detect", "shapes", scenes=3),
    DataError,
    "at least 4 scenes",
  ),
  (
    "shapes-size-under-10",
    lambda c: data.load("segment", "shapes", scenes=8, scene_size=8),
    DataError,
    "size of at least 10",
  ),
  (
    "photos-patches-0",
    lambda c: data.load("superres", "photos", patches=0),
    DataError,
    "patches >= 1",
  ),
  (
    "photos-scale-0",
    lambda c: data.load("superres", "photos", scale=0),
    DataError,
    "scale >= 1",
  ),
  (
    "photos-patch-larger-than-the-photographs",
    lambda c: data.load("superres", "photos", patch=500, patches=2),
    DataError,
    "does not fit an image",
  ),
  (
    "digits-image-size-0",
    lambda c: data.digits(image_size=0),
    DataError,
    "image_size must be an int >= 1",
  ),
  (
    # mnist returned (4000, 0, 0, 1) images and disco_train trained on them.
    "mnist-image-size-0",
    lambda c: data.mnist(image_size=0),
    DataError,
    "image_size must be an int >= 1, got 0",
  ),
  (
    "digits-fractional-image-size",  # a raw JAX TypeError
    lambda c: data.digits(image_size=2.5),
    DataError,
    "image_size must be an int >= 1, got 2.5",
  ),
  (
    "holdout-nan",  # a raw ValueError from round()
    lambda c: data.holdout(data.synthetic(train=8, test=2), float("nan")),
    DataError,
    r"holdout takes a fraction in \(0, 1\), got nan",
  ),
  (
    "cifar10-folder-none",  # a raw TypeError from os.path.join
    lambda c: data.cifar10(None),
    DataError,
    "cifar10 takes a folder path, got None",
  ),
  (
    # An empty held-out split: disco_infer failed with "need at least one
    # array to concatenate".
    "digits-test-fraction-holding-out-nothing",
    lambda c: data.digits(test_fraction=0.001),
    DataError,
    "holds out no image of the 1797 digits images",
  ),
  (
    "digits-test-fraction-above-1",
    lambda c: data.digits(test_fraction=1.5),
    DataError,
    r"test_fraction in \(0, 1\)",
  ),
  (
    "synthetic-zero-classes",
    lambda c: data.synthetic(num_classes=0),
    DataError,
    "num_classes must be an int >= 1",
  ),
  (
    "synthetic-fractional-image-size",  # a raw TypeError
    lambda c: data.synthetic(image_size=4.5),
    DataError,
    "image_size must be an int >= 1, got 4.5",
  ),
  (
    "synthetic-zero-train",
    lambda c: data.synthetic(train=0),
    DataError,
    "train must be an int >= 1",
  ),
  (
    "cifar10-missing-folder",
    lambda c: data.cifar10(os.path.join(c.folder, "none")),
    DataError,
    "is not a CIFAR-10 python folder",
  ),
  (
    "cifar10-truncated-batch",
    lambda c: data.read_cifar10_batch(
      _write(c, "truncated", b"\x80\x02garbage")
    ),
    DataError,
    "is not a valid pickle",
  ),
  (
    "cifar10-tampered-pickle",
    lambda c: data.read_cifar10_batch(c.pickle_file("evil", Evil())),
    DataError,
    "refusing to load posix.system",
  ),
  (
    "cifar10-wrong-array-shape",
    lambda c: data.read_cifar10_batch(
      c.pickle_file(
        "shape", {b"data": np.zeros((2, 5), np.uint8), b"labels": [1, 2]}
      )
    ),
    DataError,
    r"uint8 array of shape \(n, 3072\)",
  ),
  (
    "cifar10-label-out-of-range",
    lambda c: data.read_cifar10_batch(
      c.pickle_file(
        "labels", {b"data": np.zeros((2, 3072), np.uint8), b"labels": [1, 99]}
      )
    ),
    DataError,
    r"ints in 0\.\.9",
  ),
  (
    "cifar10-label-count-mismatch",
    lambda c: data.read_cifar10_batch(
      c.pickle_file(
        "count", {b"data": np.zeros((2, 3072), np.uint8), b"labels": [1]}
      )
    ),
    DataError,
    "a list of 2 ints",
  ),
  # disco.checkpoint
  (
    "checkpoint-missing",
    lambda c: checkpoint.load(os.path.join(c.folder, "none")),
    CheckpointError,
    "is not a disco checkpoint",
  ),
  (
    "checkpoint-truncated-config",
    lambda c: checkpoint.load(c.copy("c1", edit_config=half)),
    CheckpointError,
    "cannot read config.json",
  ),
  (
    "checkpoint-truncated-arrays",
    lambda c: checkpoint.load(c.copy("c2", edit_arrays=half)),
    CheckpointError,
    "unreadable arrays",
  ),
  (
    "checkpoint-flipped-array-bytes",
    lambda c: checkpoint.load(c.copy("c3", edit_arrays=flip_middle)),
    CheckpointError,
    "unreadable arrays .*CRC",
  ),
  (
    "checkpoint-edited-num-nodes",
    lambda c: checkpoint.load(
      c.copy("c4", edit_config=config_field("num_nodes", 4))
    ),
    CheckpointError,
    "the architecture needs bool",
  ),
  (
    "checkpoint-edited-num-nodes-type",
    lambda c: checkpoint.load(
      c.copy("c5", edit_config=config_field("num_nodes", "two"))
    ),
    CheckpointError,
    "the recorded config does not build a resnet",
  ),
  (
    "checkpoint-edited-num-nodes-negative",
    lambda c: checkpoint.load(
      c.copy("c6", edit_config=config_field("num_nodes", -1))
    ),
    CheckpointError,
    "the recorded config does not build",
  ),
  (
    "checkpoint-edited-unknown-field",
    lambda c: checkpoint.load(
      c.copy("c7", edit_config=config_field("depth", 3))
    ),
    CheckpointError,
    "does not match ResNetConfig",
  ),
  (
    "checkpoint-of-another-model",
    lambda c: checkpoint.load(c.saved, expect="vit"),
    CheckpointError,
    "holds a resnet, not a vit",
  ),
  (
    "checkpoint-of-another-config",
    lambda c: checkpoint.load(c.saved, expect=ResNetConfig(num_nodes=4)),
    CheckpointError,
    "not ResNetConfig",
  ),
  (
    "checkpoint-save-over-a-file",
    lambda c: checkpoint.save(c.model, _write(c, "file", b"x")),
    CheckpointError,
    "cannot write a checkpoint to",
  ),
  (
    "conv-padding-unknown",
    lambda c: DiscoConv(8, 4, 3, num_nodes=2, padding="FULL", rngs=nnx.Rngs(0)),
    ConfigError,
    'padding must be "SAME" or "VALID"',
  ),
  (
    "conv-kernel-3d",
    lambda c: DiscoConv(8, 4, (3, 3, 3), num_nodes=2, rngs=nnx.Rngs(0)),
    ConfigError,
    r"kernel_size takes an int or \(height, width\)",
  ),
  (
    "vit-patch-size-0",
    lambda c: ViT(ViTConfig(patch_size=0), rngs=nnx.Rngs(0)),
    ConfigError,
    "patch size must be at least 1",
  ),
  (
    "prune-seed-negative",
    lambda c: prune.to_ratio(dense(), 0.5, selection="random", seed=-1),
    PruneError,
    "seed must be an int >= 0",
  ),
  (
    "distributed-bytes-batch-0",
    lambda c: distributed.distribute(c.model).bytes_per_inference(0),
    DistributedError,
    "batch_size must be an int >= 1",
  ),
  # disco.metrics / disco.distributed
  (
    "metrics-input-not-an-image",
    lambda c: metrics.count(c.model, (7, 7, 5)),
    InputError,
    "C = ",
  ),
  (
    "node-mesh-zero-nodes",
    lambda c: distributed.node_mesh(0),
    DistributedError,
    "num_nodes must be an int >= 1, got 0",
  ),
  (
    "node-mesh-fractional-nodes",  # a raw TypeError
    lambda c: distributed.node_mesh(2.5),
    DistributedError,
    "num_nodes must be an int >= 1, got 2.5",
  ),
  (
    "dense-fractional-nodes",  # a raw TypeError
    lambda c: DiscoDense(8, 4, num_nodes=2.0, rngs=nnx.Rngs(0)),
    PartitionError,
    "num_nodes must be an int, got 2.0",
  ),
  (
    "conv-kernel-a-string",  # a raw ValueError from int("a")
    lambda c: DiscoConv(8, 4, "ab", num_nodes=2, rngs=nnx.Rngs(0)),
    ConfigError,
    r"kernel_size takes an int or \(height, width\), got 'ab'",
  ),
  (
    "distributed-call-complex",  # the imaginary part was dropped
    lambda c: distributed.distribute(c.model)(
      np.ones((2, 16, 16, 1), np.complex64)
    ),
    DistributedError,
    "images must be real numbers, got complex64",
  ),
  (
    "node-mesh-more-nodes-than-devices",
    lambda c: distributed.node_mesh(64),
    DistributedError,
    "64 nodes need 64 devices, 8 found",
  ),
  (
    "distribute-mesh-of-another-size",
    lambda c: distributed.distribute(c.model, distributed.node_mesh(3)),
    DistributedError,
    "needs a 'node' axis of size 2",
  ),
  (
    # Said "expected images of shape ..., got <U1 (2, 16, 16, 1)": the
    # shape was right.
    "distributed-call-strings",
    lambda c: distributed.distribute(c.model)(np.full((2, 16, 16, 1), "a")),
    DistributedError,
    "images must be real numbers, got <U1",
  ),
  (
    # A raw "incompatible shapes for broadcasting" (larger image), or a
    # silent crop (18 x 18 run as 16 x 16).
    "metrics-vit-image-of-another-size",
    lambda c: metrics.count(
      ViT(ViTConfig(num_nodes=2), rngs=nnx.Rngs(0)), (1, 18, 18, 1)
    ),
    InputError,
    r"this ViT takes images of shape \(batch, 16, 16, 1\), got",
  ),
  (
    "latency-model-rate-0",  # ZeroDivisionError before
    lambda c: metrics.LatencyModel(0, 1e6, 0),
    MetricsError,
    "flops_per_second must be a finite number > 0",
  ),
  (
    "latency-model-negative-bandwidth",  # a positive latency before
    lambda c: metrics.LatencyModel(1e9, -1e6, 0),
    MetricsError,
    "bytes_per_second must be a finite number > 0",
  ),
  (
    "latency-model-negative-message-latency",  # negative latencies before
    lambda c: metrics.LatencyModel(1e9, 1e6, -1.0),
    MetricsError,
    "message_latency must be a finite number >= 0",
  ),
  # Found by probing on 2026-12-03.
  (
    # numpy compared every prediction with every label: accuracy 1.0
    # where every prediction was wrong, above 1 with several.
    "accuracy-labels-as-a-column",
    lambda c: train.accuracy(
      c.model, np.zeros((6, 16, 16, 1), np.float32), np.zeros((6, 1), int)
    ),
    DataError,
    r"one class index per image, shape \(6,\), got shape \(6, 1\)",
  ),
  (
    "accuracy-more-labels-than-images",
    lambda c: train.accuracy(
      c.model, np.zeros((6, 16, 16, 1), np.float32), np.zeros(12, int)
    ),
    DataError,
    "12 labels for 6 images",
  ),
  (
    # The NaN scores sorted below the node's own bits: every group of the
    # mask was dropped (comm ratio 0 for 0.5 asked), silently.
    "prune-nan-weights",
    lambda c: prune.to_ratio(_with_nan(dense()), 0.5),
    PruneError,
    "hold NaN or inf",
  ),
  (
    # 'ShapeDtypeStruct' object is not subscriptable, from inside flax.
    "metrics-abstract-masks",
    lambda c: metrics.count(_abstract()),
    MetricsError,
    r"have shapes but no values .*with_masks\(model, True\)",
  ),
  (
    "prune-abstract-masks",
    lambda c: prune.comm_ratio(_abstract()),
    PruneError,
    "have shapes but no values",
  ),
  (
    "distribute-abstract-model",
    lambda c: distributed.distribute(metrics.with_masks(_abstract(), True)),
    DistributedError,
    "built abstractly",
  ),
  (
    "metrics-negative-itemsize",  # -34964 bytes sent before
    lambda c: metrics.count(c.model, itemsize=-4),
    MetricsError,
    "itemsize must be an int >= 1, got -4",
  ),
  (
    "metrics-with-masks-not-a-model",  # a raw IndexError
    lambda c: metrics.with_masks(3, True),
    MetricsError,
    "expected a model built from DISCO layers, got int",
  ),
  (
    # Built, counted and distributed a model of 0x0 images.
    "resnet-image-size-0",
    lambda c: ResNet(ResNetConfig(image_size=0), rngs=nnx.Rngs(0)),
    ConfigError,
    "image_size must be an int >= 1, got 0",
  ),
  (
    "resnet-no-input-channels",  # ZeroDivisionError in flax's initialiser
    lambda c: ResNet(ResNetConfig(in_channels=0), rngs=nnx.Rngs(0)),
    ConfigError,
    "in_channels must be an int >= 1, got 0",
  ),
  (
    "vit-image-size-0",
    lambda c: ViT(ViTConfig(image_size=0), rngs=nnx.Rngs(0)),
    ConfigError,
    "image_size must be an int >= 1, got 0",
  ),
  (
    "checkpoint-edited-config-removed",  # a raw KeyError
    lambda c: checkpoint.load(c.copy("c8", edit_config=drop("config"))),
    CheckpointError,
    "the recorded config does not match ResNetConfig",
  ),
  (
    "checkpoint-edited-architecture-list",  # unhashable type: 'list'
    lambda c: checkpoint.load(
      c.copy("c9", edit_config=header_field("architecture", ["resnet"]))
    ),
    CheckpointError,
    r"unknown architecture \['resnet'\]",
  ),
  (
    # "has format version 1; this code reads version 1"
    "checkpoint-edited-version-string",
    lambda c: checkpoint.load(
      c.copy("c10", edit_config=header_field("version", "1"))
    ),
    CheckpointError,
    "has format version '1'; this code reads version 1",
  ),
  (
    # A model of 0x0 images loaded silently.
    "checkpoint-edited-image-size-0",
    lambda c: checkpoint.load(
      c.copy("c11", edit_config=config_field("image_size", 0))
    ),
    CheckpointError,
    r"does not build a resnet \(image_size must be an int >= 1, got 0\)",
  ),
  (
    "checkpoint-data-settings-not-an-object",
    lambda c: checkpoint.data_settings(
      c.copy("c12", edit_config=header_field("data", [1]))
    ),
    CheckpointError,
    "the recorded data settings are not an object",
  ),
  (
    "distributed-call-wrong-shape",
    lambda c: distributed.distribute(c.model)(
      np.ones((2, 8, 8, 1), np.float32)
    ),
    DistributedError,
    r"expected images of shape \(batch, 16, 16, 1\)",
  ),
]


def _write(c, name, raw):
  path = os.path.join(c.folder, name)
  with open(path, "wb") as f:
    f.write(raw)
  return path


test_bad_input_is_refused_clearly, test_row_ids_are_unique = table_tests(ROWS)


def test_nan_inputs_propagate_as_documented():
  """A NaN input is not refused (a per-call check would cost a pass over
  the input): the outputs it reaches are NaN, the others are untouched."""
  layer = dense()
  x = np.ones((3, 8), np.float32)
  x[1] = np.nan
  y = np.asarray(layer(jnp.asarray(x)))
  assert np.isnan(y[1]).all() and np.isfinite(y[[0, 2]]).all()
