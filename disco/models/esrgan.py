"""An ESRGAN-style super-resolution generator built from DISCO layers.

The generator of Wang et al. (ESRGAN, 2018), small: a first conv, a trunk
of residual-in-residual dense blocks (RRDB: three residual dense blocks,
each a chain of convs that read every earlier feature map of the block,
scaled by 0.2 and added back), a trunk conv added to the first conv's
features, then per factor 2 a conv to 4x the channels and a pixel shuffle,
a conv at high resolution and the last conv to RGB. No batch norm
(ESRGAN removed it); LeakyReLU(0.2) after every conv but the fusing ones.

Over nodes (our choices):
- A dense block's conv reads the concatenation of the block input and
  every earlier output. It is written as a sum of one `DiscoConv` per
  piece, and all convs that read one piece share its `CommMask`, so each
  feature map crosses a link once (the union of what its readers keep),
  however many later convs read it.
- Pixel shuffle moves each group of 4 channels (c, sub-pixel) to one
  channel at 2x resolution. A node that owns whole groups keeps its
  channels: the upsampling conv's channels are split evenly, which needs
  `width % num_nodes == 0`.
- The input image is replicated, so the first conv communicates nothing,
  and with `bicubic_skip` the bicubic upsampling of the input is added to
  the output (the net learns the residual; our choice, for small budgets);
  the last conv then starts at zero, so the untrained net is bicubic.
- The last conv's RGB channels are gathered on node 0 (`ops.output`).
"""

import dataclasses

import jax
from flax import nnx

from disco import lowering
from disco.errors import ConfigError
from disco.layers import DiscoConv
from disco.models.resnet import pack_layers
from disco.ops import ONE_DEVICE, Ops

RESIDUAL_SCALE = 0.2


@dataclasses.dataclass(frozen=True)
class SRConfig:
  """The architecture of the super-resolution generator.

  Example:
    >>> SRConfig(scale=4).upsamplings
    2

  Args:
    num_nodes: number of nodes every layer is split over.
    scale: upscaling factor, 2 or 4.
    width: channels of the trunk (ESRGAN: 64).
    growth: channels each dense-block conv adds (ESRGAN: 32).
    blocks: RRDBs in the trunk (ESRGAN: 23).
    dense_blocks: residual dense blocks per RRDB (ESRGAN: 3).
    dense_layers: convs per dense block, the last one fusing back to
      `width` channels (ESRGAN: 5).
    bicubic_skip: add the bicubic upsampling of the input to the output.
    in_channels: channels of the input image.
    out_channels: channels of the output image.
    image_size: side of the (low-resolution) input the distributed program
      is compiled for; the model itself takes any size.
  """

  num_nodes: int = 2
  scale: int = 2
  width: int = 16
  growth: int = 8
  blocks: int = 1
  dense_blocks: int = 3
  dense_layers: int = 4
  bicubic_skip: bool = True
  in_channels: int = 3
  out_channels: int = 3
  image_size: int = 16

  @property
  def upsamplings(self) -> int:
    """Pixel-shuffle stages (x2 each)."""
    return {2: 1, 4: 2}.get(self.scale, 0)


def pixel_shuffle(x: jax.Array, factor: int) -> jax.Array:
  """(B, H, W, C f^2) -> (B, H f, W f, C): channel c f^2 + i f + j to (i, j).

  Example:
    >>> import jax.numpy as jnp
    >>> x = jnp.arange(8.0).reshape(1, 1, 1, 8)
    >>> pixel_shuffle(x, 2)[0, :, :, 0]
    Array([[0., 1.],
           [2., 3.]], dtype=float32)

  Args:
    x: NHWC features whose channels are groups of `factor`^2.
    factor: the upscaling factor.
  """
  batch, height, width, channels = x.shape
  out = channels // (factor * factor)
  x = x.reshape(batch, height, width, out, factor, factor)
  x = x.transpose(0, 1, 4, 2, 5, 3)
  return x.reshape(batch, height * factor, width * factor, out)


def bicubic(images: jax.Array, factor: int) -> jax.Array:
  """Bicubic upsampling by `factor` (Keys, a = -0.5), NHWC.

  Example:
    >>> import jax.numpy as jnp
    >>> bicubic(jnp.ones((1, 4, 4, 3)), 2).shape
    (1, 8, 8, 3)

  Args:
    images: NHWC images.
    factor: the upscaling factor.
  """
  batch, height, width, channels = images.shape
  shape = (batch, height * factor, width * factor, channels)
  return jax.image.resize(images, shape, "cubic")


def _lrelu(x: jax.Array) -> jax.Array:
  return nnx.leaky_relu(x, 0.2)


class DenseBlock(nnx.Module):
  """A residual dense block: convs reading all earlier maps, scaled skip.

  Example:
    >>> import jax.numpy as jnp
    >>> block = DenseBlock(8, 4, 3, num_nodes=2, rngs=nnx.Rngs(0))
    >>> block(jnp.ones((1, 4, 4, 8))).shape
    (1, 4, 4, 8)

  Args:
    width: channels in and out.
    growth: channels each inner conv adds.
    layers: convs in the block (the last fuses back to `width`).
    num_nodes: number of nodes.
    rngs: random number streams.
  """

  def __init__(self, width, growth, layers, *, num_nodes, rngs):
    init = nnx.initializers.variance_scaling(0.1, "fan_in", "normal")
    piece_widths = [width] + [growth] * (layers - 1)
    convs, masks = [], {}
    for index in range(layers):
      out = width if index == layers - 1 else growth
      row = []
      for piece in range(index + 1):
        conv = DiscoConv(
          piece_widths[piece],
          out,
          3,
          num_nodes=num_nodes,
          use_bias=piece == 0,
          mask=masks.get(piece),
          kernel_init=init,
          rngs=rngs,
        )
        masks.setdefault(piece, conv.mask)
        row.append(conv)
      convs.append(nnx.List(row))
    self.convs = nnx.List(convs)

  def __call__(self, x: jax.Array) -> jax.Array:
    return self.forward(x, ONE_DEVICE)

  def forward(self, x: jax.Array, ops: Ops) -> jax.Array:
    """The block on one device or on a node (`disco.ops`)."""
    pieces = [x]
    for index, row in enumerate(self.convs):
      y = sum(ops.layer(conv, p) for conv, p in zip(row, pieces, strict=True))
      if index < len(self.convs) - 1:
        pieces.append(_lrelu(y))
    return x + RESIDUAL_SCALE * y


class RRDB(nnx.Module):
  """Residual-in-residual dense block: dense blocks, then a scaled skip.

  Example:
    >>> import jax.numpy as jnp
    >>> block = RRDB(8, 4, 2, 3, num_nodes=2, rngs=nnx.Rngs(0))
    >>> block(jnp.ones((1, 4, 4, 8))).shape
    (1, 4, 4, 8)

  Args:
    width: channels in and out.
    growth: channels each inner conv adds.
    dense_blocks: dense blocks in the chain.
    layers: convs per dense block.
    num_nodes: number of nodes.
    rngs: random number streams.
  """

  def __init__(self, width, growth, dense_blocks, layers, *, num_nodes, rngs):
    self.blocks = nnx.List(
      [
        DenseBlock(width, growth, layers, num_nodes=num_nodes, rngs=rngs)
        for _ in range(dense_blocks)
      ]
    )

  def __call__(self, x: jax.Array) -> jax.Array:
    return self.forward(x, ONE_DEVICE)

  def forward(self, x: jax.Array, ops: Ops) -> jax.Array:
    """The block on one device or on a node (`disco.ops`)."""
    y = x
    for block in self.blocks:
      y = block.forward(y, ops)
    return x + RESIDUAL_SCALE * y


class SRNet(nnx.Module):
  """The super-resolution generator (see the module docstring).

  Example:
    >>> import jax.numpy as jnp
    >>> model = SRNet(SRConfig(num_nodes=2, scale=2), rngs=nnx.Rngs(0))
    >>> model(jnp.ones((1, 8, 8, 3))).shape
    (1, 16, 16, 3)

  Args:
    config: the architecture.
    rngs: random number streams.

  Raises:
    ConfigError: a scale other than 2 or 4, or a width the nodes cannot
      share in whole pixel-shuffle groups.
  """

  def __init__(self, config: SRConfig, *, rngs: nnx.Rngs):
    if config.upsamplings == 0:
      raise ConfigError(f"scale must be 2 or 4, got {config.scale}")
    if config.width % config.num_nodes:
      raise ConfigError(
        f"width {config.width} must be a multiple of the {config.num_nodes} "
        "nodes, so that each node shuffles whole groups of channels"
      )
    self.config = config
    nodes, width = config.num_nodes, config.width
    conv = lambda i, o, **kw: DiscoConv(
      i, o, 3, num_nodes=nodes, rngs=rngs, **kw
    )
    self.first = conv(config.in_channels, width, replicated_input=True)
    self.trunk = nnx.List(
      [
        RRDB(
          width,
          config.growth,
          config.dense_blocks,
          config.dense_layers,
          num_nodes=nodes,
          rngs=rngs,
        )
        for _ in range(config.blocks)
      ]
    )
    self.trunk_conv = conv(width, width)
    self.upsample = nnx.List(
      [conv(width, 4 * width) for _ in range(config.upsamplings)]
    )
    self.hr_conv = conv(width, width)
    # With the bicubic skip the last conv starts at zero, so the untrained
    # net is bicubic upsampling and training only adds detail.
    last_init = nnx.initializers.zeros if config.bicubic_skip else None
    self.last = conv(width, config.out_channels, kernel_init=last_init)

  def __call__(self, x: jax.Array) -> jax.Array:
    return self.forward(x, ONE_DEVICE)

  def forward(self, x: jax.Array, ops: Ops) -> jax.Array:
    """The high-resolution image on one device, or on a node."""
    features = ops.layer(self.first, x)
    y = features
    for block in self.trunk:
      y = block.forward(y, ops)
    y = features + ops.layer(self.trunk_conv, y)
    for conv in self.upsample:
      y = _lrelu(pixel_shuffle(ops.layer(conv, y), 2))
    y = ops.output(self.last, _lrelu(ops.layer(self.hr_conv, y)))
    if self.config.bicubic_skip:
      # In the output's precision (bfloat16 images would round it).
      y = y + bicubic(x.astype(y.dtype), self.config.scale)
    return y


@lowering.register(SRNet)
def _node_weights(model: SRNet, packer: lowering.Packer) -> None:
  """Every DISCO conv (no batch norm)."""
  pack_layers(model, packer)
