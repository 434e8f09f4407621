"""Models built from DISCO layers, and a registry of their architectures.

The registry maps an architecture name to its config class and model class,
so a checkpoint can record "resnet" + its config and be rebuilt.
"""

from disco.errors import ConfigError
from disco.models.deeplab import DeepLab, SegConfig
from disco.models.esrgan import SRConfig, SRNet
from disco.models.resnet import ResNet, ResNetConfig, resnet50_config
from disco.models.ssd import SSD, SSDConfig
from disco.models.vit import ViT, ViTConfig, deit_tiny_config

ARCHITECTURES = {
  "resnet": (ResNetConfig, ResNet),
  "vit": (ViTConfig, ViT),
  "srnet": (SRConfig, SRNet),
  "deeplab": (SegConfig, DeepLab),
  "ssd": (SSDConfig, SSD),
}


def architecture_of(model) -> str:
  """The registry name of a model's architecture, e.g. "resnet".

  Example:
    >>> from flax import nnx
    >>> architecture_of(ResNet(ResNetConfig(), rngs=nnx.Rngs(0)))
    'resnet'

  Args:
    model: a model from this package.

  Raises:
    ConfigError: the model is not a registered architecture.
  """
  for name, (_, model_class) in ARCHITECTURES.items():
    if type(model) is model_class:
      return name
  raise ConfigError(
    f"{type(model).__name__} is not a registered architecture "
    f"({sorted(ARCHITECTURES)}): only those can be checkpointed"
  )


__all__ = [
  "ARCHITECTURES",
  "SSD",
  "DeepLab",
  "SRConfig",
  "SRNet",
  "SSDConfig",
  "SegConfig",
  "ResNet",
  "ResNetConfig",
  "ViT",
  "ViTConfig",
  "architecture_of",
  "deit_tiny_config",
  "resnet50_config",
]
