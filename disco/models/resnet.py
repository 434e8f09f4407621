"""ResNets built from DISCO layers, for any number of nodes.

Every tensor's channels are split evenly over the nodes. Convolutions are
`DiscoConv`s; batch norm, ReLU, max pooling, global average pooling and the
residual add act per channel, so they stay on the node that owns the
channel. The stem reads the replicated input image and so communicates
nothing. A projection shortcut reads the block input like the block's first
conv, so the two share one `CommMask`: a channel crosses a link once, for
both. The classifier head is a `DiscoDense` whose cross-node columns are
masked like any other layer; each node then holds the logits of its own
block of classes.

Every module's forward pass is written once, as `forward(x, ops)`
(`disco.ops`): calling a module runs it on one device, and the lowering at
the end of this file gives `disco.distributed` each node's weights for the
same forward pass.
"""

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

from disco import lowering
from disco.errors import ConfigError, require_int
from disco.layers import DiscoConv, DiscoDense, DiscoLayer
from disco.ops import ONE_DEVICE, Ops

_CONV_INIT = nnx.initializers.variance_scaling(2.0, "fan_in", "normal")


@dataclasses.dataclass(frozen=True)
class ResNetConfig:
  """The architecture of a ResNet; defaults give a small CIFAR-style net.

  Example:
    >>> ResNetConfig(num_nodes=4).widths
    (8, 16, 32)

  Args:
    num_nodes: number of nodes every layer is split over.
    block: "basic" (two 3x3 convs) or "bottleneck" (1x1, 3x3, 1x1 with 4x
      expansion, stride on the 3x3 as in ResNet v1.5).
    stage_sizes: blocks per stage.
    widths: channels of each stage (inner width for bottleneck blocks).
    stem_width: output channels of the stem conv.
    stem_kernel: kernel size of the stem conv.
    stem_stride: stride of the stem conv.
    stem_pool: a 3x3 stride-2 max pool after the stem.
    in_channels: channels of the input image.
    num_classes: classifier outputs.
    image_size: side of the square input image.
  """

  num_nodes: int = 2
  block: str = "basic"
  stage_sizes: tuple[int, ...] = (1, 1, 1)
  widths: tuple[int, ...] = (8, 16, 32)
  stem_width: int = 8
  stem_kernel: int = 3
  stem_stride: int = 1
  stem_pool: bool = False
  in_channels: int = 1
  num_classes: int = 10
  image_size: int = 16


def resnet50_config(num_nodes: int = 2) -> ResNetConfig:
  """The ResNet-50 architecture for 224x224 ImageNet images.

  Example:
    >>> resnet50_config(2).stage_sizes
    (3, 4, 6, 3)

  Args:
    num_nodes: number of nodes.
  """
  return ResNetConfig(
    num_nodes=num_nodes,
    block="bottleneck",
    stage_sizes=(3, 4, 6, 3),
    widths=(64, 128, 256, 512),
    stem_width=64,
    stem_kernel=7,
    stem_stride=2,
    stem_pool=True,
    in_channels=3,
    num_classes=1000,
    image_size=224,
  )


class ConvBN(nnx.Module):
  """A bias-free DiscoConv followed by batch norm.

  Example:
    >>> import jax.numpy as jnp
    >>> from flax import nnx
    >>> layer = ConvBN(4, 8, 3, num_nodes=2, rngs=nnx.Rngs(0))
    >>> layer.forward(jnp.ones((1, 4, 4, 4)), ONE_DEVICE).shape
    (1, 4, 4, 8)

  Args:
    in_features: input channels.
    out_features: output channels.
    kernel_size: side of the kernel.
    rngs: random number streams.
    **kw: the other arguments of `DiscoConv` (strides, dilation, splits,
      a shared mask, ...).
  """

  def __init__(self, in_features, out_features, kernel_size, *, rngs, **kw):
    self.conv = DiscoConv(
      in_features,
      out_features,
      kernel_size,
      use_bias=False,
      kernel_init=_CONV_INIT,
      rngs=rngs,
      **kw,
    )
    self.norm = nnx.BatchNorm(out_features, momentum=0.9, rngs=rngs)

  def forward(self, x: jax.Array, ops: Ops) -> jax.Array:
    return ops.layer(self.conv, x, norm=self.norm)


class BasicBlock(nnx.Module):
  """Two 3x3 DISCO convs with a residual connection.

  Example:
    >>> import jax.numpy as jnp
    >>> from flax import nnx
    >>> block = BasicBlock(8, 16, 2, num_nodes=2, rngs=nnx.Rngs(0))
    >>> block(jnp.ones((1, 8, 8, 8))).shape
    (1, 4, 4, 16)

  Args:
    in_features: input channels.
    width: output channels.
    stride: stride of the first conv and of the shortcut.
    num_nodes: number of nodes.
    rngs: random number streams.
    dilation: dilation of both 3x3 convs (atrous, for dense prediction).
    mask: the `CommMask` of another layer reading the block's input, for
      the first conv and the shortcut to share (default: a new one).
  """

  def __init__(
    self, in_features, width, stride, *, num_nodes, rngs, dilation=1, mask=None
  ):
    self.conv1 = ConvBN(
      in_features,
      width,
      3,
      strides=stride,
      dilation=dilation,
      num_nodes=num_nodes,
      mask=mask,
      rngs=rngs,
    )
    self.conv2 = ConvBN(
      width, width, 3, dilation=dilation, num_nodes=num_nodes, rngs=rngs
    )
    self.shortcut = _shortcut(
      in_features, width, stride, self.conv1, num_nodes, rngs
    )

  def __call__(self, x: jax.Array) -> jax.Array:
    return self.forward(x, ONE_DEVICE)

  def forward(self, x: jax.Array, ops: Ops) -> jax.Array:
    """The block on one device or on a node (`disco.ops`)."""
    y = self.conv2.forward(nnx.relu(self.conv1.forward(x, ops)), ops)
    return nnx.relu(y + _skip(self.shortcut, x, ops))


class Bottleneck(nnx.Module):
  """1x1, 3x3 (strided), 1x1 DISCO convs with 4x expansion and a residual.

  Example:
    >>> import jax.numpy as jnp
    >>> from flax import nnx
    >>> block = Bottleneck(16, 8, 2, num_nodes=2, rngs=nnx.Rngs(0))
    >>> block(jnp.ones((1, 8, 8, 16))).shape
    (1, 4, 4, 32)

  Args:
    in_features: input channels.
    width: inner channels; the block outputs 4 * width.
    stride: stride of the 3x3 conv and of the shortcut.
    num_nodes: number of nodes.
    rngs: random number streams.
  """

  def __init__(self, in_features, width, stride, *, num_nodes, rngs):
    self.conv1 = ConvBN(in_features, width, 1, num_nodes=num_nodes, rngs=rngs)
    self.conv2 = ConvBN(
      width, width, 3, strides=stride, num_nodes=num_nodes, rngs=rngs
    )
    self.conv3 = ConvBN(width, 4 * width, 1, num_nodes=num_nodes, rngs=rngs)
    self.shortcut = _shortcut(
      in_features, 4 * width, stride, self.conv1, num_nodes, rngs
    )

  def __call__(self, x: jax.Array) -> jax.Array:
    return self.forward(x, ONE_DEVICE)

  def forward(self, x: jax.Array, ops: Ops) -> jax.Array:
    """The block on one device or on a node (`disco.ops`)."""
    y = nnx.relu(self.conv2.forward(nnx.relu(self.conv1.forward(x, ops)), ops))
    y = self.conv3.forward(y, ops)
    return nnx.relu(y + _skip(self.shortcut, x, ops))


def _skip(shortcut: ConvBN | None, x: jax.Array, ops: Ops) -> jax.Array:
  return x if shortcut is None else shortcut.forward(x, ops)


def _shortcut(in_features, out_features, stride, first, num_nodes, rngs):
  if stride == 1 and in_features == out_features:
    return None
  return ConvBN(
    in_features,
    out_features,
    1,
    strides=stride,
    num_nodes=num_nodes,
    mask=first.conv.mask,
    rngs=rngs,
  )


BLOCKS = {"basic": BasicBlock, "bottleneck": Bottleneck}


class ResNet(nnx.Module):
  """A ResNet whose every conv and the head are DISCO layers.

  Example:
    >>> import jax.numpy as jnp
    >>> from flax import nnx
    >>> model = ResNet(ResNetConfig(num_nodes=2), rngs=nnx.Rngs(0))
    >>> model(jnp.ones((2, 16, 16, 1))).shape
    (2, 10)

  Args:
    config: the architecture.
    rngs: random number streams.

  Raises:
    ConfigError: an unknown block type, stage sizes and widths of
      different lengths, or an image size, channel or class count under 1.
  """

  def __init__(self, config: ResNetConfig, *, rngs: nnx.Rngs):
    for name in ("image_size", "in_channels", "num_classes"):
      # An image of side 0 ran on as a model of 0x0 logits' inputs.
      require_int(name, getattr(config, name), 1)
    if config.block not in BLOCKS:
      raise ConfigError(
        f"unknown block {config.block!r}: use one of {sorted(BLOCKS)}"
      )
    if len(config.stage_sizes) != len(config.widths):
      raise ConfigError(
        f"{len(config.stage_sizes)} stage sizes and {len(config.widths)} "
        "widths: give one width per stage"
      )
    self.config = config
    nodes = config.num_nodes
    self.stem = ConvBN(
      config.in_channels,
      config.stem_width,
      config.stem_kernel,
      strides=config.stem_stride,
      replicated_input=True,
      num_nodes=nodes,
      rngs=rngs,
    )
    block_type = BLOCKS[config.block]
    expansion = 4 if config.block == "bottleneck" else 1
    blocks = []
    features = config.stem_width
    for stage, (size, width) in enumerate(
      zip(config.stage_sizes, config.widths, strict=True)
    ):
      for index in range(size):
        stride = 2 if stage > 0 and index == 0 else 1
        blocks.append(
          block_type(features, width, stride, num_nodes=nodes, rngs=rngs)
        )
        features = expansion * width
    self.blocks = nnx.List(blocks)
    self.head = DiscoDense(
      features, config.num_classes, num_nodes=nodes, rngs=rngs
    )

  def __call__(self, x: jax.Array) -> jax.Array:
    return self.forward(x, ONE_DEVICE)

  def forward(self, x: jax.Array, ops: Ops) -> jax.Array:
    """The logits on one device, or on a node (`disco.ops`)."""
    x = nnx.relu(self.stem.forward(x, ops))
    if self.config.stem_pool:
      x = nnx.max_pool(x, (3, 3), strides=(2, 2), padding="SAME")
    for block in self.blocks:
      x = block.forward(x, ops)
    return ops.output(self.head, jnp.mean(x, axis=(1, 2)))


def pack_layers(model: nnx.Module, packer: lowering.Packer) -> None:
  """Packs every DISCO layer of `model`, batch norm folded into a ConvBN's.

  The lowering of any model whose DISCO layers are all in `ConvBN`s or
  applied on their own (the ResNet, the super-resolution, segmentation and
  detection nets).

  Example:
    >>> from flax import nnx
    >>> lowered = lowering.lower(ResNet(ResNetConfig(), rngs=nnx.Rngs(0)))
    >>> sorted(lowered.params[0])[:2]
    ['blocks/0/conv1/conv', 'blocks/0/conv2/conv']

  Args:
    model: the model.
    packer: the node's packer.
  """
  folded = set()
  for _, module in nnx.iter_modules(model):
    if isinstance(module, ConvBN):
      packer.layer(module.conv, norm=module.norm)
      folded.add(id(module.conv))
  for _, module in nnx.iter_modules(model):
    if isinstance(module, DiscoLayer) and id(module) not in folded:
      packer.layer(module)


@lowering.register(ResNet)
def _node_weights(model: ResNet, packer: lowering.Packer) -> None:
  """Every conv with its batch norm folded in, and the head."""
  pack_layers(model, packer)
