"""The four DISCO tasks: model, training loss and quality metric of each.

  task       model                       loss                  metric
  classify   ResNet or ViT               cross-entropy         accuracy
  superres   ESRGAN-style `SRNet`        L1 on pixels          psnr (dB)
  segment    DeepLabV3+-style `DeepLab`  per-pixel x-entropy   miou
  detect     SSD-style `SSD`             SSD loss              map50

`build(task, dataset, ...)` makes the model for a `disco.data.Dataset`,
`loss(model)` the training loss for `disco.train.fit`, `quality(model,
x, y)` the metric on held-out data; `predict` runs any model in batches.
PSNR and SSIM are over RGB in [0, 1] (outputs clipped), per tile, then
averaged; mIoU is over all classes (background included) from the
confusion of every held-out pixel; mAP@0.5 as `disco.detection`.
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from disco import detection, train
from disco.errors import ConfigError, DataError
from disco.models import ResNet, ResNetConfig, ViT, ViTConfig
from disco.models.deeplab import DeepLab, SegConfig
from disco.models.esrgan import SRConfig, SRNet, bicubic
from disco.models.ssd import SSD, SSDConfig

METRICS = {
  "classify": "accuracy",
  "superres": "psnr",
  "segment": "miou",
  "detect": "map50",
}


def build(task, dataset, *, num_nodes, width, seed, model="resnet", scale=2):
  """The task's model for `dataset`, built with seed `seed`.

  Example:
    >>> from disco import data
    >>> sample = data.synthetic(image_size=8, train=4, test=2)
    >>> build("classify", sample, num_nodes=2, width=8, seed=0).config.widths
    (8, 16, 32)

  Args:
    task: one of `METRICS`.
    dataset: a `disco.data.Dataset` of that task.
    num_nodes: nodes every layer is split over.
    width: the model's base width (see each config).
    seed: seed of the weights.
    model: for classify, "resnet" or "vit".
    scale: for superres, the upscaling factor.

  Raises:
    ConfigError: an unknown task or model.
  """
  size, _, channels = dataset.image_shape
  rngs = nnx.Rngs(seed)
  common = dict(num_nodes=num_nodes, image_size=size, in_channels=channels)
  if task == "classify" and model == "resnet":
    config = ResNetConfig(
      widths=(width, 2 * width, 4 * width),
      stem_width=width,
      num_classes=dataset.num_classes,
      **common,
    )
    return ResNet(config, rngs=rngs)
  if task == "classify" and model == "vit":
    config = ViTConfig(
      dim=4 * width,
      mlp_dim=8 * width,
      num_classes=dataset.num_classes,
      **common,
    )
    return ViT(config, rngs=rngs)
  if task == "superres":
    return SRNet(
      SRConfig(scale=scale, width=width, growth=width // 2, **common),
      rngs=rngs,
    )
  if task == "segment":
    config = SegConfig(width=width, num_classes=dataset.num_classes, **common)
    return DeepLab(config, rngs=rngs)
  if task == "detect":
    config = SSDConfig(width=width, num_classes=dataset.num_classes, **common)
    return SSD(config, rngs=rngs)
  raise ConfigError(
    f"no model {model!r} for task {task!r}: tasks are {sorted(METRICS)}"
  )


@dataclasses.dataclass(frozen=True)
class _DetectionLoss:
  """The SSD loss for one detector shape (hashable: jit treats it static)."""

  feature_sizes: tuple[int, ...]
  image_size: int
  anchors: int
  num_classes: int

  def priors(self) -> np.ndarray:
    return detection.default_boxes(
      self.feature_sizes, self.image_size, self.anchors
    )

  def __call__(self, outputs, truth):
    return detection.loss(outputs, truth, self.priors(), self.num_classes)


def _l1(outputs, targets):
  return jnp.mean(jnp.abs(outputs - targets))


def _pixel_cross_entropy(logits, classes):
  return train.classification_loss(logits, classes)


def loss(model):
  """The training loss of `model`'s task, for `disco.train.fit`.

  Example:
    >>> from disco.models.esrgan import SRNet, SRConfig
    >>> loss(SRNet(SRConfig(), rngs=nnx.Rngs(0))).__name__
    '_l1'
  """
  if isinstance(model, SRNet):
    return _l1
  if isinstance(model, DeepLab):
    return _pixel_cross_entropy
  if isinstance(model, SSD):
    config = model.config
    return _DetectionLoss(
      config.feature_sizes,
      config.image_size,
      config.anchors,
      config.num_classes,
    )
  return train.classification_loss


def task_of(model) -> str:
  """The task a model solves.

  Example:
    >>> task_of(SSD(SSDConfig(width=8), rngs=nnx.Rngs(0)))
    'detect'
  """
  kinds = {SRNet: "superres", DeepLab: "segment", SSD: "detect"}
  return kinds.get(type(model), "classify")


def predict(model, images, batch_size: int = 64) -> np.ndarray:
  """`model(images)` in eval mode, in batches (the last one padded).

  Example:
    >>> from disco.models.esrgan import SRNet, SRConfig
    >>> model = SRNet(SRConfig(), rngs=nnx.Rngs(0))
    >>> predict(model, np.zeros((3, 8, 8, 3), np.float32), 2).shape
    (3, 16, 16, 3)
  """
  model.eval()
  graphdef, state = nnx.split(model)
  outputs = []
  for start in range(0, len(images), batch_size):
    chunk = images[start : start + batch_size]
    padded = np.zeros((batch_size, *chunk.shape[1:]), np.float32)
    padded[: len(chunk)] = chunk
    outputs.append(np.asarray(_apply(graphdef, state, padded))[: len(chunk)])
  return np.concatenate(outputs)


@functools.partial(jax.jit, static_argnums=0)
def _apply(graphdef, state, images):
  return nnx.merge(graphdef, state)(images)


def quality(model, images, targets) -> float:
  """The task's metric of `model` on (images, targets).

  Example:
    >>> from disco import data
    >>> sample = data.synthetic(image_size=8, train=4, test=6)
    >>> model = build("classify", sample, num_nodes=2, width=8, seed=0)
    >>> 0 <= quality(model, sample.x_test, sample.y_test) <= 1
    True

  Raises:
    DataError: no images.
  """
  if len(images) == 0:
    raise DataError("no held-out images to measure quality on")
  task = task_of(model)
  if task == "classify":
    return train.accuracy(model, images, targets)
  outputs = predict(model, images)
  if task == "superres":
    return psnr(outputs, targets)
  if task == "segment":
    return mean_iou(outputs.argmax(-1), targets, model.config.num_classes)
  config = model.config
  priors = _DetectionLoss(
    config.feature_sizes, config.image_size, config.anchors, config.num_classes
  ).priors()
  found = [detection.detect(o, priors, config.num_classes) for o in outputs]
  return detection.mean_average_precision(found, targets, config.num_classes)


def psnr(outputs, targets) -> float:
  """Mean PSNR (dB) of images in [0, 1], outputs clipped.

  Example:
    >>> round(psnr(np.full((1, 4, 4, 3), 0.1), np.zeros((1, 4, 4, 3))), 1)
    20.0
  """
  outputs = np.clip(np.asarray(outputs, np.float64), 0, 1)
  error = np.mean((outputs - targets) ** 2, axis=(1, 2, 3))
  return float(np.mean(10 * np.log10(1.0 / np.maximum(error, 1e-12))))


def ssim(outputs, targets) -> float:
  """Mean SSIM (scikit-image, Gaussian window) of RGB images in [0, 1].

  Images must be at least 11 pixels wide (the window).

  Example:
    >>> image = np.random.default_rng(0).random((1, 16, 16, 3))
    >>> ssim(image, image)
    1.0
  """
  from skimage.metrics import structural_similarity

  outputs = np.clip(np.asarray(outputs, np.float64), 0, 1)
  values = [
    structural_similarity(
      o,
      np.asarray(t, np.float64),
      channel_axis=-1,
      data_range=1.0,
      gaussian_weights=True,
    )
    for o, t in zip(outputs, targets, strict=True)
  ]
  return float(np.mean(values))


def bicubic_baseline(images, targets, scale: int) -> dict:
  """PSNR and SSIM of bicubic upsampling of `images` against `targets`.

  Example:
    >>> low = np.full((1, 8, 8, 3), 0.5, np.float32)
    >>> round(bicubic_baseline(low, np.full((1, 16, 16, 3), 0.5), 2)["ssim"], 6)
    1.0
  """
  up = np.asarray(bicubic(jnp.asarray(images), scale))
  return {"psnr": psnr(up, targets), "ssim": ssim(up, targets)}


def mean_iou(predicted, classes, num_classes: int) -> float:
  """Mean over classes of intersection / union of every pixel.

  Classes absent from both prediction and truth are left out.

  Example:
    >>> mean_iou(np.array([[0, 1], [1, 1]]), np.array([[0, 1], [0, 1]]), 2)
    0.5833333333333333
  """
  predicted, classes = np.ravel(predicted), np.ravel(classes)
  confusion = np.bincount(
    classes * num_classes + predicted, minlength=num_classes**2
  ).reshape(num_classes, num_classes)
  inter = np.diag(confusion)
  union = confusion.sum(0) + confusion.sum(1) - inter
  present = union > 0
  return float(np.mean(inter[present] / union[present]))
