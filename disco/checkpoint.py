"""Saving and loading trained DISCO models with their architecture.

A checkpoint is a folder with two files:

- `config.json`: {"format": "disco-checkpoint", "version": 1,
  "architecture": "resnet", "config": {...the config dataclass...},
  "arrays": {"blocks.0.conv1.conv.kernel": {"shape": [...], "dtype": ...}},
  and optionally "data": {"dataset": "digits", "test_fraction": 0.2, ...},
  the data the model was trained on (`data_settings`), so that its
  held-out split can be found again}
- `arrays.npz`: every variable of the model (parameters, batch statistics,
  masks) under its path, read back with `allow_pickle=False`.

`load` rebuilds the model from the recorded architecture and refuses a
checkpoint whose arrays do not fit it, or whose architecture is not the one
the caller expects. A mask shared by several layers is stored once, under
the path of its first user. For a distributed runtime, the loaded model's
DISCO layers give each node's weights (`node_kernel`) and the channels each
node sends each other node (`sends`).
"""

import dataclasses
import json
import os
import zipfile

import jax.numpy as jnp
import numpy as np
from flax import nnx

from disco.errors import CheckpointError
from disco.models import ARCHITECTURES, architecture_of

FORMAT = "disco-checkpoint"
VERSION = 1
CONFIG_FILE = "config.json"
ARRAYS_FILE = "arrays.npz"


def save(
  model: nnx.Module, directory: str, *, data: dict | None = None
) -> None:
  """Writes `model` (a registered architecture) to `directory`.

  Example:
    >>> import tempfile
    >>> from flax import nnx
    >>> from disco.models import ResNet, ResNetConfig
    >>> folder = tempfile.mkdtemp()
    >>> save(ResNet(ResNetConfig(), rngs=nnx.Rngs(0)), folder)
    >>> load(folder, expect="resnet").config.num_nodes
    2

  Args:
    model: a model from `disco.models`.
    directory: created if missing; existing checkpoint files are replaced.
    data: JSON-able settings of the data the model was trained on (its
      dataset and the options that choose its held-out split), read back
      by `data_settings`.

  Raises:
    CheckpointError: `directory` cannot be a folder (a file is there).
  """
  architecture = architecture_of(model)
  arrays = {
    _key(path): np.asarray(variable.get_value())
    for path, variable in nnx.to_flat_state(nnx.state(model))
  }
  header = {
    "format": FORMAT,
    "version": VERSION,
    "architecture": architecture,
    "config": dataclasses.asdict(model.config),
    "arrays": {
      key: {"shape": list(value.shape), "dtype": str(value.dtype)}
      for key, value in arrays.items()
    },
  }
  if data is not None:
    header["data"] = dict(data)
  try:
    os.makedirs(directory, exist_ok=True)
  except OSError as err:  # a file, or a path under one
    raise CheckpointError(
      f"cannot write a checkpoint to {directory!r}: {err.strerror}"
    ) from err
  np.savez(os.path.join(directory, ARRAYS_FILE), **arrays)
  with open(os.path.join(directory, CONFIG_FILE), "w") as file:
    json.dump(header, file, indent=1)


def load(directory: str, *, expect=None) -> nnx.Module:
  """Rebuilds the model saved in `directory`.

  Example: see `save`.

  Args:
    directory: a folder written by `save`.
    expect: None, an architecture name ("resnet", "vit") or a config the
      checkpoint must equal.

  Returns:
    the model in eval mode, with its masks.

  Raises:
    CheckpointError: missing or malformed files, another architecture or
      config than `expect`, or arrays that do not fit the architecture.
  """
  header = _read_header(directory)
  config_class, model_class = ARCHITECTURES[header["architecture"]]
  config = _config(config_class, header.get("config"), directory)
  _check_expected(header["architecture"], config, expect, directory)
  try:
    abstract = nnx.eval_shape(lambda: model_class(config, rngs=nnx.Rngs(0)))
  except (TypeError, ValueError) as error:  # DiscoErrors are ValueErrors
    raise CheckpointError(
      f"{directory}: the recorded config does not build a "
      f"{header['architecture']} ({error}); the file was edited or damaged"
    ) from None
  graphdef, state = nnx.split(abstract)
  try:
    with np.load(os.path.join(directory, ARRAYS_FILE)) as stored:
      arrays = {key: stored[key] for key in stored.files}
  except (OSError, ValueError, zipfile.BadZipFile) as error:
    raise CheckpointError(
      f"{directory}: unreadable arrays ({error}); the file is truncated or "
      "damaged"
    ) from None
  expected = {_key(p): v for p, v in nnx.to_flat_state(state)}
  if set(arrays) != set(expected):
    extra = sorted(set(arrays) - set(expected))[:5]
    missing = sorted(set(expected) - set(arrays))[:5]
    raise CheckpointError(
      f"{directory} does not fit a {header['architecture']} with its "
      f"recorded config: unexpected arrays {extra}, missing {missing}"
    )
  for key, variable in expected.items():
    value = arrays[key]
    if value.shape != variable.shape or value.dtype != variable.dtype:
      raise CheckpointError(
        f"{directory}: {key} is {value.dtype}{list(value.shape)}, the "
        f"architecture needs {variable.dtype}{list(variable.shape)}"
      )
    variable.set_value(jnp.asarray(value))
  model = nnx.merge(graphdef, state)
  model.eval()
  return model


def data_settings(directory: str) -> dict | None:
  """The data settings `save` recorded for the model in `directory`, or
  None where it recorded none (checkpoints of other code).

  Example:
    >>> import tempfile
    >>> from flax import nnx
    >>> from disco.models import ResNet, ResNetConfig
    >>> folder = tempfile.mkdtemp()
    >>> model = ResNet(ResNetConfig(), rngs=nnx.Rngs(0))
    >>> save(model, folder, data={"dataset": "digits", "test_fraction": 0.2})
    >>> data_settings(folder)
    {'dataset': 'digits', 'test_fraction': 0.2}

  Raises:
    CheckpointError: missing or malformed header, or a "data" entry that
      is not an object.
  """
  header = _read_header(directory)
  data = header.get("data")
  if data is not None and not isinstance(data, dict):
    raise CheckpointError(
      f"{directory}: the recorded data settings are not an object: {data!r}"
    )
  return data


def _key(path) -> str:
  return ".".join(str(part) for part in path)


def _read_header(directory: str) -> dict:
  path = os.path.join(directory, CONFIG_FILE)
  try:
    with open(path) as file:
      header = json.load(file)
  except (OSError, ValueError) as error:
    raise CheckpointError(
      f"{directory} is not a disco checkpoint: cannot read {CONFIG_FILE} "
      f"({error})"
    ) from None
  if not isinstance(header, dict) or header.get("format") != FORMAT:
    raise CheckpointError(f"{path} is not a {FORMAT} header")
  if header.get("version") != VERSION:
    raise CheckpointError(
      f"{path} has format version {header.get('version')!r}; this code "
      f"reads version {VERSION!r}"
    )
  architecture = header.get("architecture")
  if not isinstance(architecture, str) or architecture not in ARCHITECTURES:
    raise CheckpointError(
      f"{path}: unknown architecture {header.get('architecture')!r}; known: "
      f"{sorted(ARCHITECTURES)}"
    )
  return header


def _config(config_class, fields, directory):
  names = {f.name for f in dataclasses.fields(config_class)}
  if not isinstance(fields, dict) or set(fields) != names:
    raise CheckpointError(
      f"{directory}: the recorded config does not match "
      f"{config_class.__name__} (fields {sorted(names)})"
    )
  # JSON has no tuples; every list in a config is a tuple field.
  values = {
    k: tuple(v) if isinstance(v, list) else v for k, v in fields.items()
  }
  try:
    return config_class(**values)
  except (TypeError, ValueError) as error:  # DiscoErrors are ValueErrors
    raise CheckpointError(
      f"{directory}: the recorded config is not a valid "
      f"{config_class.__name__} ({error}); the file was edited or damaged"
    ) from None


def _check_expected(architecture, config, expect, directory):
  if expect is None:
    return
  if isinstance(expect, str):
    if expect != architecture:
      raise CheckpointError(
        f"{directory} holds a {architecture}, not a {expect}"
      )
    return
  if expect != config:
    raise CheckpointError(
      f"{directory} holds a {architecture} with config {config}, not {expect}"
    )
