"""Super-resolution, segmentation and detection: models, data, metrics.

Distributed inference of every new model (pixel shuffle, atrous convs,
ASPP and the decoder's concatenations, the detection heads) must equal the
single-device masked model within 1e-5, with the compiled program's bytes
equal to the masks' count. Sizes are tiny: each case compiles in seconds.
"""

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from disco import data, detection, distributed, metrics, prune, scenes, tasks
from disco.errors import DataError
from disco.models import SSD, DeepLab, SegConfig, SRConfig, SRNet, SSDConfig
from tests.disco.distributed_worker import with_random_batch_norm
from tests.disco.util import normal

CASES = {
  "sr_x2": lambda: SRNet(
    SRConfig(scale=2, width=8, growth=4, dense_layers=3, image_size=8),
    rngs=nnx.Rngs(1),
  ),
  "sr_x4_3nodes": lambda: SRNet(
    SRConfig(
      num_nodes=3,
      scale=4,
      width=6,
      growth=3,
      dense_blocks=2,
      dense_layers=2,
      image_size=6,
    ),
    rngs=nnx.Rngs(2),
  ),
  "deeplab": lambda: DeepLab(
    SegConfig(width=8, image_size=16), rngs=nnx.Rngs(3)
  ),
  # Segmentation at 4 nodes: each node sends 3/4 of a layer's input.
  "deeplab_4nodes": lambda: DeepLab(
    SegConfig(num_nodes=4, width=8, image_size=16), rngs=nnx.Rngs(5)
  ),
  "ssd": lambda: SSD(SSDConfig(width=8, image_size=16), rngs=nnx.Rngs(4)),
}


@pytest.mark.parametrize("ratio", [0.3, 0.0])
@pytest.mark.parametrize("name", sorted(CASES))
def test_distributed_equals_the_masked_model_and_its_byte_count(name, ratio):
  model = CASES[name]()
  with_random_batch_norm(model, 5)
  if isinstance(model, SRNet):  # its last conv starts at zero
    model.last.kernel[...] = normal(6, model.last.kernel.shape)
  prune.to_ratio(model, ratio, selection="random", seed=1)
  model.eval()
  run = distributed.distribute(model)
  size, _, channels = run.image_shape
  images = normal(0, (2, size, size, channels))
  expected = np.asarray(model(images))
  np.testing.assert_allclose(run(images), expected, atol=1e-5, rtol=0)
  report = metrics.count(model)
  assert run.bytes_per_inference() == report.bytes_sent
  # With no communication only the outputs cross (to node 0).
  gathers = sum(c.bytes_sent for c in report.layers if c.kind == "gather")
  assert gathers > 0 and (report.bytes_sent == gathers) == (ratio == 0.0)


def test_the_models_take_low_precision_and_integer_images():
  # Distributed inference casts images to float32; the models themselves
  # raised a TypeError in their first convolution (lax takes one dtype), and
  # the super-resolution skip upsampled bfloat16 images in bfloat16.
  # Every model's first layer is a DiscoConv; SRNet also has the skip.
  models = {"sr_x2": CASES["sr_x2"]()}
  sample = data.synthetic(image_size=8, train=4, test=2)
  for model in ("resnet", "vit"):
    models[model] = tasks.build(
      "classify", sample, num_nodes=2, width=8, seed=0, model=model
    )
  for name, model in models.items():
    if isinstance(model, SRNet):
      model.last.kernel[...] = normal(6, model.last.kernel.shape)
    model.eval()
    size = model.config.image_size
    images = np.asarray(normal(0, (2, size, size, model.config.in_channels)))
    for dtype in (
      (jnp.bfloat16, jnp.uint8) if name == "resnet" else (jnp.bfloat16,)
    ):
      low = (np.abs(images) * 9).astype(dtype)
      graph, state = nnx.split(model)
      want = np.asarray(tasks._apply(graph, state, low.astype(np.float32)))
      got = tasks._apply(graph, state, jnp.asarray(low))
      assert got.dtype == jnp.float32, name
      np.testing.assert_array_equal(np.asarray(got), want, err_msg=name)
    if name == "sr_x2":
      run = distributed.distribute(model)
      scale = np.abs(want).max()
      np.testing.assert_allclose(run(low), want, atol=1e-6 * scale, rtol=0)


def test_shape_scenes_have_exact_masks_and_boxes():
  images, classes, boxes = scenes.shape_scenes(12, size=24, seed=3)
  assert images.min() >= 0 and images.max() <= 1
  for scene in range(12):
    rows = boxes[scene][boxes[scene, :, 0] >= 0]
    assert len(rows) >= 1
    covered = np.zeros((24, 24), bool)
    for cls, top, left, bottom, right in rows.astype(int):
      inside = classes[scene, top:bottom, left:right] == cls
      assert inside.any(axis=1).all() and inside.any(axis=0).all()
      covered[top:bottom, left:right] = True
    assert not (classes[scene] > 0)[~covered].any()


def test_the_dataset_picker_checks_its_task():
  with pytest.raises(DataError, match="no dataset 'digits' for task"):
    data.load("segment", "digits")
  seg = data.load("segment", "shapes", scene_size=16, scenes=8)
  assert seg.y_train.shape == (6, 16, 16) and seg.num_classes == 5
  validation = data.holdout(seg, 0.5)
  assert len(validation.x_train) == len(validation.x_test) == 3


def test_detection_matching_loss_and_map():
  priors = detection.default_boxes((4, 2, 1), 16)
  assert priors.shape == (3 * (16 + 4 + 1), 4)
  truth = np.array([[[2, 2, 3, 9, 8], [-1, 0, 0, 0, 0]]], np.float32)
  classes, offsets = detection.match(truth[0], priors)
  positive = np.flatnonzero(np.asarray(classes))
  assert len(positive) >= 1 and set(np.asarray(classes)[positive]) == {2}
  # Perfect outputs (the matched offsets, confident classes) decode to the
  # box, score a lower loss than zeros, and reach mAP 1.
  logits = np.where(np.eye(3)[np.asarray(classes)] > 0, 8.0, -8.0)
  perfect = np.concatenate([logits, np.asarray(offsets)], -1)[None]
  zeros = np.zeros_like(perfect)
  loss = detection.loss(perfect, truth, priors, 3)
  assert float(loss) < float(detection.loss(zeros, truth, priors, 3))
  decoded = np.asarray(detection.decode(perfect[0, :, 3:], priors))
  np.testing.assert_allclose(decoded[positive[0]], truth[0, 0, 1:], atol=1e-3)
  found = [detection.detect(perfect[0], priors, 3)]
  assert detection.mean_average_precision(found, truth, 3) == 1.0
  wrong = [[(1, score, box) for _, score, box in found[0]]]
  assert detection.mean_average_precision(wrong, truth, 3) == 0.0


def test_quality_metrics():
  target = np.zeros((1, 4, 4, 3))
  assert tasks.psnr(target + 0.01, target) == pytest.approx(40.0)
  classes = np.array([[0, 0, 1, 2]])
  assert tasks.mean_iou(classes, classes, 3) == 1.0
  assert tasks.mean_iou(np.array([[0, 0, 1, 1]]), classes, 3) == pytest.approx(
    (1 + 0.5 + 0) / 3
  )
  low = np.random.default_rng(0).random((2, 8, 8, 3)).astype(np.float32)
  high = np.asarray(np.repeat(np.repeat(low, 2, 1), 2, 2))
  baseline = tasks.bicubic_baseline(low, high, 2)
  assert 15 < baseline["psnr"] < 40 and 0 < baseline["ssim"] < 1


def _link(mbit, call_seconds):
  return {"bytes_per_second": mbit * 1e6 / 8, "message_latency": call_seconds}


def test_latency_prediction_on_a_shared_link():
  from experiments import disco_latency

  settings = {"comm_ratio": 0.2, "message_latency": None}
  row = {"model": "resnet", "batch": 64, "one_device_ms": 5.0}
  slow = disco_latency.predict(row, _link(100, 2e-4), settings)
  fast = disco_latency.predict(row, _link(10000, 2e-4), settings)
  assert slow["predicted_disco_ms"] < slow["predicted_dense_ms"]
  assert fast["predicted_dense_ms"] < slow["predicted_dense_ms"]
  # On a shared link both nodes' bytes queue on one bucket: slower than
  # each node on its own link, never more than twice (two senders).
  model = disco_latency.build("resnet", True, 0.2)
  report = metrics.count(model, input_shape=(64, 16, 16, 1))
  own = metrics.LatencyModel(1e9, 100e6 / 8, 1e-4)
  shared = metrics.LatencyModel(1e9, 100e6 / 8, 1e-4, shared=True)
  assert own.latency(report) < shared.latency(report) < 2 * own.latency(report)
  assert disco_latency.namespace_command(100, "true")[-1].endswith("&& true")
  assert disco_latency.timed_batches(1) == [1]
  assert disco_latency.timed_batches(64) == [1, 64]


def test_link_fit_takes_the_call_cost_from_small_calls():
  from experiments import disco_latency

  # Below the 64 KB burst a call costs its fixed part whatever its bytes
  # (the bucket lets them through): a straight line through every point
  # would have put that on the bandwidth. A slow warm-up-like outlier
  # among them is ignored.
  call, rate = 2.5e-4, 12.5e6
  points = [[128, 3e-3], [2048, 2e-3], [8192, call], [32768, 3e-4]]
  points += [[b, call + b / rate] for b in (131072, 524288)]
  fit = disco_latency.fit_link(points)
  assert fit["message_latency"] == pytest.approx(call)
  assert fit["bytes_per_second"] == pytest.approx(rate)
  # [bytes, median, 10th percentile]: the cost from the quick column, the
  # bandwidth from the medians.
  stalled = [[b, 4e-3 if b < 2**16 else t, t] for b, t in points]
  assert disco_latency.fit_link(stalled) == pytest.approx(fit)
  with pytest.raises(ValueError, match="no timed call above"):
    disco_latency.fit_link(points[:4])
  with pytest.raises(ValueError, match="no timed call within"):
    disco_latency.fit_link(points[4:])
  with pytest.raises(ValueError, match="no positive slope"):
    disco_latency.fit_link([[128, 1e-3], [2048, 1e-3], [2**17, 1e-3]])


def test_chain_fit_is_the_cost_of_one_more_call_in_a_program():
  from experiments import disco_latency

  # 0.3 ms for a program of one call, 0.1 ms for each call chained after
  points = [[c, 2e-4 + 1e-4 * c] for c in disco_latency.CHAIN_CALLS]
  fit = disco_latency.fit_chain(points[::-1])
  assert fit["chain_call"] == pytest.approx(1e-4)
  with pytest.raises(ValueError, match="two call counts"):
    disco_latency.fit_chain([[4, 1e-3], [4, 2e-3]])


@pytest.mark.parametrize("size", [20])
def test_detector_boxes_match_its_default_boxes_at_any_image_size(size):
  # Stride-2 'SAME' convs round up: at 20 px the maps are 5, 3 and 2 wide,
  # where `feature_sizes` once said 5, 2 and 1 (114 boxes against 90 default
  # boxes: the loss and mAP failed to broadcast).
  scenes = data.load("detect", "shapes", scene_size=size, scenes=8)
  model = tasks.build("detect", scenes, num_nodes=2, width=8, seed=0)
  boxes = model(jnp.asarray(scenes.x_test[:1])).shape[1]
  assert boxes == model.config.anchors * sum(
    side * side for side in model.config.feature_sizes
  )
  outputs = model(jnp.asarray(scenes.x_test))
  assert np.isfinite(float(tasks.loss(model)(outputs, scenes.y_test)))
  assert 0 <= tasks.quality(model, scenes.x_test, scenes.y_test) <= 1
