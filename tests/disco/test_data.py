"""Digits, the CIFAR-10 batch loader and its restricted unpickler."""

import os
import pickle

import numpy as np
import pytest

from disco import data, safe_pickle
from disco.errors import DataError, DiscoError


def _write_batch(path, images, labels, protocol=2):
  """A batch file in the CIFAR-10 python format (bytes keys, as Python 2
  wrote them)."""
  batch = {
    b"batch_label": b"testing batch 1 of 1",
    b"labels": list(labels),
    b"data": images,
    b"filenames": [b"image_%d.png" % i for i in range(len(labels))],
  }
  with open(path, "wb") as file:
    pickle.dump(batch, file, protocol=protocol)


def _cifar_folder(folder, per_batch=4):
  rng = np.random.default_rng(0)
  names = data.CIFAR10_TRAIN + (data.CIFAR10_TEST,)
  for index, name in enumerate(names):
    images = rng.integers(0, 256, (per_batch, 3072), dtype=np.uint8)
    labels = [(index + i) % 10 for i in range(per_batch)]
    _write_batch(os.path.join(folder, name), images, labels)
  return folder


class _Exploit:
  def __init__(self, marker):
    self.marker = marker

  def __reduce__(self):
    return (os.system, (f"touch {self.marker}",))


def test_digits_are_resized_and_split_by_class():
  dataset = data.digits(image_size=16, test_fraction=0.4)
  assert dataset.image_shape == (16, 16, 1)
  assert len(dataset.x_train) + len(dataset.x_test) == 1797
  assert 0.0 <= dataset.x_train.min() and dataset.x_train.max() <= 1.0
  test_counts = np.bincount(dataset.y_test, minlength=10)
  all_counts = test_counts + np.bincount(dataset.y_train, minlength=10)
  np.testing.assert_allclose(test_counts / all_counts, 0.4, atol=0.01)


def test_cifar10_folder_loads_in_nhwc(tmp_path):
  folder = _cifar_folder(str(tmp_path))
  dataset = data.cifar10(folder)
  assert dataset.x_train.shape == (20, 32, 32, 3)
  assert dataset.x_test.shape == (4, 32, 32, 3)
  raw = pickle.load(open(tmp_path / "test_batch", "rb"), encoding="bytes")
  first = raw[b"data"][0]
  # channel-major rows: red plane, green plane, blue plane
  image = dataset.x_test[0] * 255.0
  assert image[0, 1, 0] == pytest.approx(first[1])
  assert image[0, 0, 1] == pytest.approx(first[1024])
  assert image[1, 0, 2] == pytest.approx(first[2048 + 32])
  np.testing.assert_array_equal(dataset.y_test, raw[b"labels"])


@pytest.mark.parametrize("protocol", [2, pickle.HIGHEST_PROTOCOL])
def test_batch_written_by_python3_loads(tmp_path, protocol):
  path = str(tmp_path / "batch")
  _write_batch(path, np.zeros((2, 3072), np.uint8), [3, 4], protocol)
  images, labels = data.read_cifar10_batch(path)
  assert images.shape == (2, 32, 32, 3) and list(labels) == [3, 4]


def test_malicious_pickle_is_refused_without_running(tmp_path):
  marker = tmp_path / "pwned"
  path = tmp_path / "data_batch_1"
  with open(path, "wb") as file:
    pickle.dump({b"data": _Exploit(marker), b"labels": []}, file, protocol=2)
  with pytest.raises(DataError, match="refusing to load posix.system|system"):
    data.read_cifar10_batch(str(path))
  assert not marker.exists()
  with pytest.raises(DataError, match="refusing"):
    safe_pickle.load(pickle.dumps(_Exploit(marker)))
  assert not marker.exists()


def test_wrong_format_is_a_clear_error(tmp_path):
  with pytest.raises(DataError, match="missing"):
    data.cifar10(str(tmp_path))
  garbage = tmp_path / "garbage"
  garbage.write_bytes(b"not a pickle at all")
  with pytest.raises(DataError, match="not a valid pickle"):
    data.read_cifar10_batch(str(garbage))
  wrong = tmp_path / "wrong"
  _write_batch(str(wrong), np.zeros((2, 100), np.uint8), [1, 2])
  with pytest.raises(DataError, match="3072"):
    data.read_cifar10_batch(str(wrong))
  labels = tmp_path / "labels"
  _write_batch(str(labels), np.zeros((2, 3072), np.uint8), [1, 12])
  with pytest.raises(DiscoError, match="labels"):
    data.read_cifar10_batch(str(labels))
  with open(tmp_path / "list", "wb") as file:
    pickle.dump([1, 2], file)
  with pytest.raises(DataError, match="dict"):
    data.read_cifar10_batch(str(tmp_path / "list"))


def test_synthetic_is_reproducible():
  a, b = data.synthetic(seed=3), data.synthetic(seed=3)
  np.testing.assert_array_equal(a.x_train, b.x_train)
  assert a.x_test.shape == (128, 16, 16, 1)
