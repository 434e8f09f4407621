"""Dense-prediction data that needs no download: photographs and shapes.

- `photographs()`: the photographs bundled with scikit-image
  (`skimage.data`) and PyWavelets (`pywt.data`), RGB float32 in [0, 1]
  (grey ones repeated over three channels), for super-resolution.
- `superres_pairs(...)`: (low-resolution, high-resolution) patch pairs of
  some of them; the low-resolution patch is the high-resolution one
  downscaled by `scale` (anti-aliased cubic, the usual SR degradation).
- `shape_scenes(...)`: scenes of coloured shapes drawn with
  `skimage.draw.random_shapes`, one shape at a time on a noisy grey
  background so that every pixel's class (0 = background, then
  `SHAPES`) and every shape's box are exact.

Both need the `data` extra (scikit-image, PyWavelets).
"""

import jax
import numpy as np

from disco.errors import DataError

SHAPES = ("rectangle", "circle", "triangle", "ellipse")
# skimage.data photographs that ship with the wheel (no download), then
# PyWavelets' three.
SKIMAGE_PHOTOS = (
  "astronaut",
  "camera",
  "coffee",
  "chelsea",
  "rocket",
  "coins",
  "moon",
  "page",
  "horse",
  "immunohistochemistry",
  "hubble_deep_field",
  "grass",
  "gravel",
  "brick",
  "clock",
  "colorwheel",
)
PYWT_PHOTOS = ("aero", "ascent", "camera")


def photographs() -> dict:
  """{name: RGB float32 image in [0, 1]} of every bundled photograph.

  Example:
    >>> images = photographs()
    >>> len(images) >= 15, images["pywt.aero"].shape
    (True, (512, 512, 3))

  Raises:
    DataError: scikit-image or PyWavelets is not installed.
  """
  try:
    import pywt.data
    import skimage.data
  except ImportError:
    raise DataError(
      "the photographs need scikit-image and PyWavelets: pip install .[data]"
    ) from None
  images = {}
  for name in SKIMAGE_PHOTOS:
    images[f"skimage.{name}"] = _rgb(getattr(skimage.data, name)())
  for name in PYWT_PHOTOS:
    images[f"pywt.{name}"] = _rgb(getattr(pywt.data, name)())
  return images


def _rgb(image: np.ndarray) -> np.ndarray:
  image = np.asarray(image)
  if image.dtype == np.uint8:
    image = image.astype(np.float32) / 255.0
  else:
    image = image.astype(np.float32)
    image = (image - image.min()) / max(float(image.max() - image.min()), 1e-6)
  if image.ndim == 2:
    image = np.repeat(image[..., None], 3, axis=-1)
  return image[..., :3]


def downscale(images: np.ndarray, scale: int) -> np.ndarray:
  """NHWC images shrunk by `scale` (anti-aliased cubic), float32.

  Example:
    >>> downscale(np.ones((1, 8, 8, 3), np.float32), 2).shape
    (1, 4, 4, 3)
  """
  n, height, width, channels = images.shape
  shape = (n, height // scale, width // scale, channels)
  return np.asarray(jax.image.resize(images, shape, "cubic", antialias=True))


def superres_pairs(
  images, patch: int, scale: int, count: int | None, seed: int
) -> tuple[np.ndarray, np.ndarray]:
  """(low-res, high-res) patches: random crops, or every tile if no count.

  Example:
    >>> image = np.random.default_rng(0).random((64, 64, 3), np.float32)
    >>> low, high = superres_pairs([image], 8, 2, None, 0)
    >>> low.shape, high.shape
    ((16, 8, 8, 3), (16, 16, 16, 3))

  Args:
    images: RGB images (any sizes, each at least one high-res patch).
    patch: side of a low-resolution patch.
    scale: upscaling factor; high-res patches are `patch * scale` wide.
    count: random crops, spread evenly over the images; None for every
      non-overlapping tile of every image.
    seed: seed of the crops.
  """
  side = patch * scale
  rng = np.random.default_rng(seed)
  crops = []
  for index, image in enumerate(images):
    height, width = image.shape[:2]
    if min(height, width) < side:
      raise DataError(
        f"a high-resolution patch of side {side} ({patch} x {scale}) does "
        f"not fit an image of {height} x {width}: use a smaller patch or "
        "scale"
      )
    if count is None:
      corners = [
        (r, c)
        for r in range(0, height - side + 1, side)
        for c in range(0, width - side + 1, side)
      ]
    else:
      share = count // len(images) + (index < count % len(images))
      corners = zip(
        rng.integers(0, height - side + 1, share),
        rng.integers(0, width - side + 1, share),
        strict=True,
      )
    crops.extend(image[r : r + side, c : c + side] for r, c in corners)
  high = np.stack(crops).astype(np.float32)
  return downscale(high, scale), high


def shape_scenes(
  count: int, size: int = 32, max_shapes: int = 3, seed: int = 0
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
  """Scenes of shapes: images, per-pixel classes and boxes.

  Example:
    >>> images, classes, boxes = shape_scenes(2, size=24)
    >>> images.shape, classes.shape, boxes.shape
    ((2, 24, 24, 3), (2, 24, 24), (2, 3, 5))

  Args:
    count: number of scenes.
    size: side of a scene.
    max_shapes: shapes per scene (1 to `max_shapes`, not overlapping).
    seed: seed of everything.

  Returns:
    images (count, size, size, 3) float32 in [0, 1]; classes (count, size,
    size) int32, 0 for background and 1 + index in `SHAPES`; boxes
    (count, max_shapes, 5) float32 rows (class, top, left, bottom, right)
    in pixels (bottom / right exclusive), class -1 for no shape.

  Raises:
    DataError: scikit-image is not installed, or a size under 10 (shapes
      are a fifth to a half of it; smaller, scikit-image cannot draw them).
  """
  if isinstance(size, bool) or not isinstance(size, int) or size < 10:
    raise DataError(f"shape scenes need a size of at least 10, got {size!r}")
  if count < 0 or max_shapes < 1:
    raise DataError(
      f"shape scenes need count >= 0 and max_shapes >= 1, got {count} and "
      f"{max_shapes}"
    )
  try:
    from skimage.draw import random_shapes
  except ImportError:
    raise DataError(
      "shape scenes need scikit-image: pip install .[data]"
    ) from None
  rng = np.random.default_rng(seed)
  images = np.empty((count, size, size, 3), np.float32)
  classes = np.zeros((count, size, size), np.int32)
  boxes = np.full((count, max_shapes, 5), -1.0, np.float32)
  for scene in range(count):
    grey = rng.uniform(0.3, 0.7)
    image = grey + 0.08 * rng.standard_normal((size, size, 3))
    wanted = rng.integers(1, max_shapes + 1)
    placed = 0
    for _ in range(8 * max_shapes):
      if placed == wanted:
        break
      kind = int(rng.integers(len(SHAPES)))
      drawn, _ = random_shapes(
        (size, size),
        max_shapes=1,
        min_shapes=1,
        shape=SHAPES[kind],
        min_size=size // 5,
        max_size=size // 2,
        rng=int(rng.integers(2**31)),
        channel_axis=-1,
      )
      mask = (drawn != 255).any(axis=-1)
      if mask.sum() < 4 or (mask & (classes[scene] > 0)).any():
        continue
      rows, cols = np.flatnonzero(mask.any(1)), np.flatnonzero(mask.any(0))
      classes[scene][mask] = kind + 1
      image[mask] = drawn[mask] / 255.0
      boxes[scene, placed] = (
        kind + 1,
        rows[0],
        cols[0],
        rows[-1] + 1,
        cols[-1] + 1,
      )
      placed += 1
    images[scene] = np.clip(image, 0, 1)
  return images, classes, boxes
