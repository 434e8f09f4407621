"""Checkpoints: round trip with masks, and refusal of the wrong model."""

import json
import os

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from disco import checkpoint, prune
from disco.errors import CheckpointError, DiscoError
from disco.models import ResNet, ResNetConfig, ViT, ViTConfig


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
  model = ResNet(ResNetConfig(num_nodes=2), rngs=nnx.Rngs(0))
  prune.to_ratio(model, 0.2)
  model.eval()
  folder = str(tmp_path_factory.mktemp("ckpt"))
  checkpoint.save(model, folder)
  return model, folder


def test_round_trip_keeps_weights_masks_and_sharing(saved):
  model, folder = saved
  loaded = checkpoint.load(folder, expect=ResNetConfig(num_nodes=2))
  x = jnp.linspace(0, 1, 2 * 16 * 16).reshape(2, 16, 16, 1)
  np.testing.assert_allclose(loaded(x), model(x), rtol=1e-6, atol=1e-6)
  assert prune.comm_ratio(loaded) == prune.comm_ratio(model)
  block = loaded.blocks[1]
  assert block.shortcut.conv.mask is block.conv1.conv.mask
  np.testing.assert_array_equal(loaded.head.sends(1, 0), model.head.sends(1, 0))


def test_another_architecture_is_refused(saved):
  _, folder = saved
  with pytest.raises(CheckpointError, match="holds a resnet, not a vit"):
    checkpoint.load(folder, expect="vit")
  with pytest.raises(CheckpointError, match="not ResNetConfig"):
    checkpoint.load(folder, expect=ResNetConfig(num_nodes=4))


def test_arrays_that_do_not_fit_the_config_are_refused(saved, tmp_path):
  _, folder = saved
  header = json.load(open(os.path.join(folder, checkpoint.CONFIG_FILE)))
  header["config"]["widths"] = [8, 16, 64]
  os.symlink(
    os.path.join(folder, checkpoint.ARRAYS_FILE),
    tmp_path / checkpoint.ARRAYS_FILE,
  )
  json.dump(header, open(tmp_path / checkpoint.CONFIG_FILE, "w"))
  with pytest.raises(CheckpointError, match="architecture needs"):
    checkpoint.load(str(tmp_path))


def test_vit_checkpoint_does_not_load_as_resnet(tmp_path):
  vit = ViT(ViTConfig(num_nodes=2, depth=1), rngs=nnx.Rngs(0))
  checkpoint.save(vit, str(tmp_path))
  with pytest.raises(DiscoError, match="not a resnet"):
    checkpoint.load(str(tmp_path), expect="resnet")
  assert isinstance(checkpoint.load(str(tmp_path)), ViT)


def test_not_a_checkpoint(tmp_path):
  with pytest.raises(CheckpointError, match="not a disco checkpoint"):
    checkpoint.load(str(tmp_path))
  (tmp_path / checkpoint.CONFIG_FILE).write_text('{"format": "other"}')
  with pytest.raises(CheckpointError, match="header"):
    checkpoint.load(str(tmp_path))
