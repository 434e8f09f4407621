"""SSD detection: default boxes, matching, loss, decoding, NMS and mAP.

Boxes are (top, left, bottom, right) in pixels; ground truth comes padded,
rows (class, top, left, bottom, right) with class -1 for no object
(`disco.scenes.shape_scenes`).

- Default boxes: on a map of side m, one centre per cell, `anchors` boxes
  of scale s (a fraction of the image) and aspect ratios 1, 2, 1/2.
- Matching (SSD): a default box is positive for the object it overlaps
  most when their IoU is at least 0.5, and every object's best default box
  is positive for it; the rest are background.
- Loss: softmax cross-entropy with hard negative mining (the 3 negatives
  per positive with the highest loss) plus smooth L1 on the positives'
  offsets (centre / size, variances 0.1 and 0.2), over the positives.
- `detect`: per class, boxes above a score threshold, greedy NMS at IoU
  0.45, the best `top_k` kept. `mean_average_precision`: VOC-style
  all-point AP at IoU 0.5 per class, averaged.
"""

import jax
import jax.numpy as jnp
import numpy as np

from disco.errors import ConfigError, DataError, require_int

SCALES = (0.25, 0.45, 0.7)
# Default boxes' aspect ratios (width / height): `anchors` takes the first.
ASPECTS = (1.0, 2.0, 0.5)
VARIANCES = (0.1, 0.2)


def check_anchors(anchors) -> None:
  """ConfigError unless 1 <= anchors <= len(ASPECTS): with more, the heads
  emitted boxes no default box matched."""
  require_int("anchors", anchors, 1)
  if anchors > len(ASPECTS):
    raise ConfigError(
      f"anchors must be at most {len(ASPECTS)} (aspect ratios {ASPECTS}), "
      f"got {anchors}"
    )


def default_boxes(feature_sizes, image_size: int, anchors: int = 3):
  """(boxes, 4) default boxes (top, left, bottom, right) in pixels.

  In the order the SSD heads emit them: map by map, cell by cell (row
  major), `anchors` per cell.

  Example:
    >>> default_boxes((2,), 8, anchors=1)
    array([[0., 0., 4., 4.],
           [0., 4., 4., 8.],
           [4., 0., 8., 4.],
           [4., 4., 8., 8.]], dtype=float32)
  """
  check_anchors(anchors)
  aspects = ASPECTS[:anchors]
  rows = []
  scales = SCALES
  if len(feature_sizes) != len(SCALES):
    scales = [1.0 / size for size in feature_sizes]
  for size, scale in zip(feature_sizes, scales, strict=True):
    for r in range(size):
      for c in range(size):
        cy, cx = (r + 0.5) / size, (c + 0.5) / size
        for aspect in aspects:
          h, w = scale / np.sqrt(aspect), scale * np.sqrt(aspect)
          rows.append((cy - h / 2, cx - w / 2, cy + h / 2, cx + w / 2))
  return (np.asarray(rows) * image_size).astype(np.float32)


def iou(a, b, xp=jnp):
  """IoU of every box of a (n, 4) with every box of b (m, 4): (n, m).

  Example:
    >>> iou(np.array([[0, 0, 2, 2.]]), np.array([[1, 0, 3, 2.]]), np)
    array([[0.33333333]])
  """
  top = xp.maximum(a[:, None, 0], b[None, :, 0])
  left = xp.maximum(a[:, None, 1], b[None, :, 1])
  bottom = xp.minimum(a[:, None, 2], b[None, :, 2])
  right = xp.minimum(a[:, None, 3], b[None, :, 3])
  inter = xp.clip(bottom - top, 0, None) * xp.clip(right - left, 0, None)
  area_a = (a[:, 2] - a[:, 0]) * (a[:, 3] - a[:, 1])
  area_b = (b[:, 2] - b[:, 0]) * (b[:, 3] - b[:, 1])
  return inter / (area_a[:, None] + area_b[None, :] - inter + 1e-9)


def _encode(boxes, priors):
  variance_center, variance_size = VARIANCES
  size_p = priors[:, 2:] - priors[:, :2]
  center_p = (priors[:, :2] + priors[:, 2:]) / 2
  size = jnp.maximum(boxes[:, 2:] - boxes[:, :2], 1e-3)
  center = (boxes[:, :2] + boxes[:, 2:]) / 2
  return jnp.concatenate(
    [
      (center - center_p) / size_p / variance_center,
      jnp.log(size / size_p) / variance_size,
    ],
    axis=-1,
  )


def decode(offsets, priors):
  """Boxes (top, left, bottom, right) from offsets to `priors`.

  Example:
    >>> priors = np.array([[0, 0, 4, 4.]], np.float32)
    >>> np.asarray(decode(np.zeros((1, 4), np.float32), priors))
    array([[0., 0., 4., 4.]], dtype=float32)
  """
  variance_center, variance_size = VARIANCES
  size_p = priors[:, 2:] - priors[:, :2]
  center_p = (priors[:, :2] + priors[:, 2:]) / 2
  center = center_p + offsets[:, :2] * variance_center * size_p
  size = size_p * jnp.exp(offsets[:, 2:] * variance_size)
  return jnp.concatenate([center - size / 2, center + size / 2], axis=-1)


def match(truth, priors):
  """(class per default box, encoded offsets) for one image's padded boxes.

  Example:
    >>> priors = default_boxes((2,), 8, anchors=1)
    >>> truth = np.array([[2, 0, 0, 4, 4], [-1, 0, 0, 0, 0]], np.float32)
    >>> np.asarray(match(truth, priors)[0])
    array([2, 0, 0, 0], dtype=int32)
  """
  valid = truth[:, 0] >= 0
  overlap = jnp.where(valid[None, :], iou(priors, truth[:, 1:]), -1.0)
  best_truth = jnp.argmax(overlap, axis=1)
  best_overlap = jnp.max(overlap, axis=1)
  # Every object's best default box is its own (padding rows go nowhere).
  best_prior = jnp.where(valid, jnp.argmax(overlap, axis=0), len(priors))
  forced = jnp.zeros(len(priors), bool).at[best_prior].set(True, mode="drop")
  owner = best_truth.at[best_prior].set(jnp.arange(len(truth)), mode="drop")
  positive = (best_overlap >= 0.5) | forced
  classes = jnp.where(positive, truth[owner, 0], 0).astype(jnp.int32)
  return classes, _encode(truth[owner, 1:], priors)


def loss(outputs, truth, priors, num_classes: int, negatives: int = 3):
  """Mean SSD loss of a batch: `outputs` (batch, boxes, classes + 4).

  Example:
    >>> priors = default_boxes((2,), 8, anchors=1)
    >>> truth = np.array([[[1, 0, 0, 4, 4]]], np.float32)
    >>> float(loss(np.zeros((1, 4, 6), np.float32), truth, priors, 2)) > 0
    True
  """
  classes, targets = jax.vmap(match, in_axes=(0, None))(truth, priors)
  logits, offsets = outputs[..., :num_classes], outputs[..., num_classes:]
  log_p = jax.nn.log_softmax(logits)
  ce = -jnp.take_along_axis(log_p, classes[..., None], axis=-1)[..., 0]
  positive = classes > 0
  count = positive.sum(axis=1, keepdims=True)
  background = jnp.where(positive, -jnp.inf, -log_p[..., 0])
  rank = jnp.argsort(jnp.argsort(-background, axis=1), axis=1)
  hard = rank < negatives * jnp.maximum(count, 1)
  chosen = positive | (hard & ~positive)
  diff = jnp.abs(offsets - targets)
  smooth = jnp.where(diff < 1, 0.5 * diff**2, diff - 0.5).sum(-1)
  total = (ce * chosen).sum() + (smooth * positive).sum()
  return total / jnp.maximum(positive.sum(), 1)


def detect(outputs, priors, num_classes, threshold=0.05, top_k=20):
  """Detections of one image: list of (class, score, box) after NMS.

  Example:
    >>> priors = default_boxes((2,), 8, anchors=1)
    >>> out = np.zeros((4, 6), np.float32); out[0, 1] = 5.0
    >>> [(c, round(s, 2)) for c, s, _ in detect(out, priors, 2, 0.6)]
    [(1, 0.99)]
  """
  outputs = np.asarray(outputs)
  logits = outputs[:, :num_classes]
  scores = np.exp(logits - logits.max(-1, keepdims=True))
  scores /= scores.sum(-1, keepdims=True)
  boxes = np.asarray(decode(outputs[:, num_classes:], priors))
  found = []
  for cls in range(1, num_classes):
    keep = np.flatnonzero(scores[:, cls] > threshold)
    order = keep[np.argsort(-scores[keep, cls])]
    while len(order):
      best, order = order[0], order[1:]
      found.append((cls, float(scores[best, cls]), boxes[best]))
      if len(order):
        overlap = iou(boxes[best][None], boxes[order], np)[0]
        order = order[overlap < 0.45]
  found.sort(key=lambda d: -d[1])
  return found[:top_k]


def mean_average_precision(detections, truths, num_classes, threshold=0.5):
  """VOC all-point AP at IoU `threshold`, averaged over classes 1..

  Example (one perfect detection):
    >>> truth = np.array([[[1, 0, 0, 4, 4]]], np.float32)
    >>> found = [[(1, 0.9, np.array([0, 0, 4, 4.]))]]
    >>> mean_average_precision(found, truth, 2)
    1.0

  Args:
    detections: per image, `detect`'s list.
    truths: (images, objects, 5) padded ground truth.
    num_classes: classes, background included.
    threshold: IoU for a true positive.

  Raises:
    DataError: truths not (images, objects, 5), or not one per detection
      list.
  """
  truths = np.asarray(truths)
  if truths.ndim != 3 or truths.shape[-1] != 5:
    raise DataError(
      "detection targets must be (images, objects, 5): per object a class "
      f"and a box (x0, y0, x1, y1), class -1 padding; got {truths.shape}"
    )
  if len(truths) != len(detections):
    raise DataError(
      f"{len(detections)} images' detections against {len(truths)} images' "
      "targets"
    )
  precisions = []
  for cls in range(1, num_classes):
    scored = []
    objects = 0
    for image, (found, truth) in enumerate(
      zip(detections, truths, strict=True)
    ):
      objects += int((truth[:, 0] == cls).sum())
      scored += [(s, image, box) for c, s, box in found if c == cls]
    if objects == 0:
      continue
    scored.sort(key=lambda d: -d[0])
    used = set()
    hits = []
    for _, image, box in scored:
      rows = np.flatnonzero(truths[image][:, 0] == cls)
      overlap = (
        iou(box[None], truths[image][rows, 1:], np)[0] if len(rows) else []
      )
      best = int(np.argmax(overlap)) if len(rows) else -1
      hit = best >= 0 and overlap[best] >= threshold
      hit = hit and (image, rows[best]) not in used
      if hit:
        used.add((image, rows[best]))
      hits.append(hit)
    precisions.append(_average_precision(np.asarray(hits, bool), objects))
  return float(np.mean(precisions)) if precisions else 0.0


def _average_precision(hits: np.ndarray, objects: int) -> float:
  if len(hits) == 0:
    return 0.0
  tp = np.cumsum(hits)
  recall = np.concatenate([[0.0], tp / objects, [1.0]])
  precision = np.concatenate([[0.0], tp / np.arange(1, len(hits) + 1), [0.0]])
  for i in range(len(precision) - 2, -1, -1):
    precision[i] = max(precision[i], precision[i + 1])
  steps = np.flatnonzero(recall[1:] != recall[:-1])
  return float(
    np.sum((recall[steps + 1] - recall[steps]) * precision[steps + 1])
  )
