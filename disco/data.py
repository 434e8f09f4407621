"""Image classification data that needs no download.

- `digits`: scikit-learn's bundled handwritten digits (1,797 real 8x8
  images, 10 classes), resized for the CNN, with a stratified held-out split.
- `cifar10`: the standard CIFAR-10 python batch files from a local folder,
  read with a restricted unpickler (`disco.safe_pickle`).
- `synthetic`: noisy class prototypes, for smoke tests.

Images are float32 NHWC in [0, 1]; labels int32.
"""

import dataclasses
import os

import jax
import numpy as np

from disco import safe_pickle
from disco.errors import DataError

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
    num_classes: number of classes.
  """

  name: str
  x_train: np.ndarray
  y_train: np.ndarray
  x_test: np.ndarray
  y_test: np.ndarray
  num_classes: int

  @property
  def image_shape(self) -> tuple[int, int, int]:
    """(height, width, channels) of one image."""
    return tuple(self.x_train.shape[1:])


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
  if image_size < 1 or not 0 < test_fraction < 1:
    raise DataError(
      f"digits needs image_size >= 1 and test_fraction in (0, 1), got "
      f"{image_size} and {test_fraction}"
    )
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
  rng = np.random.default_rng(seed)
  test = np.zeros(len(labels), bool)
  for label in np.unique(labels):
    members = rng.permutation(np.flatnonzero(labels == label))
    test[members[: round(test_fraction * len(members))]] = True
  train = rng.permutation(np.flatnonzero(~test))
  return Dataset(
    "digits", images[train], labels[train], images[test], labels[test], 10
  )


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
  if min(num_classes, image_size, channels, train, test) < 1:
    raise DataError(
      "synthetic needs num_classes, image_size, channels, train and test "
      f"of at least 1, got {num_classes}, {image_size}, {channels}, {train}, "
      f"{test}"
    )
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
