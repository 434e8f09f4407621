"""A DeepLabV3+-style segmentation network built from DISCO layers.

Small, after Chen et al. (DeepLabV3+, 2018): a residual encoder to 1/4
resolution whose last block is atrous (dilated), atrous spatial pyramid
pooling (ASPP: a 1x1 conv, 3x3 convs at several dilation rates and an
image-pooling branch, concatenated and projected by a 1x1 conv), and a
decoder that upsamples the ASPP features to 1/2 resolution, concatenates
them with reduced features of an early layer (the skip), refines with a
3x3 conv and classifies every pixel; the logits are upsampled to the
input's size (bilinear).

Over nodes (our choices): all layers reading one tensor share its
`CommMask` (every ASPP branch reads the encoder's output through one; the
skip's reduction and the next block read the early features through
another), so a channel crosses a link once for all its readers.
Concatenations are node by node (`ops.concat`): each node keeps its own
channels of every branch, and the conv reading the concatenation has the
matching input split (`disco.splits.concatenated`). Resizing and pooling
act per channel, so they stay local. The per-pixel logits are gathered on
node 0 (`ops.output`) before the last upsampling.
"""

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

from disco import lowering
from disco.layers import DiscoConv
from disco.models.resnet import BasicBlock, ConvBN, pack_layers
from disco.ops import ONE_DEVICE, Ops
from disco.splits import concatenated


@dataclasses.dataclass(frozen=True)
class SegConfig:
  """The architecture of the segmentation network.

  Example:
    >>> SegConfig(width=8).rates
    (2, 4)

  Args:
    num_nodes: number of nodes every layer is split over.
    width: channels of the early layers; the encoder ends at 2 * width.
    rates: dilation rates of the ASPP's 3x3 branches.
    num_classes: classes per pixel (background included).
    in_channels: channels of the input image.
    image_size: side of the input the distributed program is compiled for.
  """

  num_nodes: int = 2
  width: int = 16
  rates: tuple[int, ...] = (2, 4)
  num_classes: int = 5
  in_channels: int = 3
  image_size: int = 32


def resize(x: jax.Array, height: int, width: int) -> jax.Array:
  """Bilinear resize of NHWC features to (height, width).

  Example:
    >>> resize(jnp.ones((1, 2, 2, 3)), 4, 4).shape
    (1, 4, 4, 3)
  """
  shape = (x.shape[0], height, width, x.shape[-1])
  return jax.image.resize(x, shape, "linear")


class DeepLab(nnx.Module):
  """DeepLabV3+-style network (see the module docstring).

  Example:
    >>> model = DeepLab(SegConfig(width=8), rngs=nnx.Rngs(0))
    >>> model(jnp.ones((1, 32, 32, 3))).shape
    (1, 32, 32, 5)

  Args:
    config: the architecture.
    rngs: random number streams.
  """

  def __init__(self, config: SegConfig, *, rngs: nnx.Rngs):
    self.config = config
    w, nodes = config.width, config.num_nodes
    kw = dict(num_nodes=nodes, rngs=rngs)
    self.stem = ConvBN(config.in_channels, w, 3, replicated_input=True, **kw)
    self.down1 = BasicBlock(w, w, 2, **kw)  # 1/2: the decoder's skip
    self.down2 = BasicBlock(w, 2 * w, 2, **kw)  # 1/4
    self.atrous = BasicBlock(2 * w, 2 * w, 1, dilation=2, **kw)
    self.aspp_1x1 = ConvBN(2 * w, w, 1, **kw)
    shared = self.aspp_1x1.conv.mask
    self.aspp_atrous = nnx.List(
      [ConvBN(2 * w, w, 3, dilation=r, mask=shared, **kw) for r in config.rates]
    )
    self.aspp_pool = ConvBN(2 * w, w, 1, mask=shared, **kw)
    branches = [self.aspp_1x1, *self.aspp_atrous, self.aspp_pool]
    self.project = ConvBN(
      w * len(branches),
      w,
      1,
      in_split=concatenated(b.conv.out_split for b in branches),
      **kw,
    )
    self.reduce = ConvBN(w, w // 2, 1, mask=self.down2.conv1.conv.mask, **kw)
    self.refine = ConvBN(
      w + w // 2,
      w,
      3,
      in_split=concatenated(
        [self.project.conv.out_split, self.reduce.conv.out_split]
      ),
      **kw,
    )
    self.classify = DiscoConv(w, config.num_classes, 1, **kw)

  def __call__(self, x: jax.Array) -> jax.Array:
    return self.forward(x, ONE_DEVICE)

  def forward(self, x: jax.Array, ops: Ops) -> jax.Array:
    """Per-pixel logits on one device, or on a node (`disco.ops`)."""
    height, width = x.shape[1:3]
    relu = nnx.relu
    y = relu(self.stem.forward(x, ops))
    early = self.down1.forward(y, ops)
    deep = self.atrous.forward(self.down2.forward(early, ops), ops)
    branches = [relu(self.aspp_1x1.forward(deep, ops))]
    branches += [relu(b.forward(deep, ops)) for b in self.aspp_atrous]
    pooled = jnp.mean(deep, axis=(1, 2), keepdims=True)
    pooled = relu(self.aspp_pool.forward(pooled, ops))
    branches.append(jnp.broadcast_to(pooled, branches[0].shape))
    modules = [self.aspp_1x1, *self.aspp_atrous, self.aspp_pool]
    splits = [m.conv.out_split for m in modules]
    y = relu(self.project.forward(ops.concat(branches, splits), ops))
    y = resize(y, *early.shape[1:3])
    skip = relu(self.reduce.forward(early, ops))
    splits = [self.project.conv.out_split, self.reduce.conv.out_split]
    y = relu(self.refine.forward(ops.concat([y, skip], splits), ops))
    return resize(ops.output(self.classify, y), height, width)


@lowering.register(DeepLab)
def _node_weights(model: DeepLab, packer: lowering.Packer) -> None:
  """Every conv with its batch norm folded in, and the classifier."""
  pack_layers(model, packer)
