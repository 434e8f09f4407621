"""An SSD-style single-shot detector built from DISCO layers.

After Liu et al. (SSD, 2016), small: a residual backbone whose last three
stages give feature maps at strides 4, 8 and 16; on each map a 3x3 class
head (`anchors` default boxes x classes, background included) and a 3x3
box head (`anchors` x 4 offsets). `disco.detection` has the default boxes,
matching, loss, decoding, non-maximum suppression and mAP.

Over nodes (our choices): every layer reading a feature map reads it
through one shared `CommMask` (the class and box heads, and the next
stage's first conv and shortcut), so each channel crosses a link once; each
head's outputs are gathered on node 0 (`ops.output`, six gathers), then
reshaped to one row per default box and concatenated: (batch, boxes,
classes + 4).
"""

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

from disco import detection, lowering
from disco.layers import DiscoConv
from disco.models.resnet import BasicBlock, ConvBN, pack_layers
from disco.ops import ONE_DEVICE, Ops


@dataclasses.dataclass(frozen=True)
class SSDConfig:
  """The architecture of the detector.

  Example:
    >>> SSDConfig().feature_sizes
    (8, 4, 2)

  Args:
    num_nodes: number of nodes every layer is split over.
    width: channels of the first stage; the feature maps have 2 * width.
    anchors: default boxes per feature-map cell.
    num_classes: classes, background (0) included.
    in_channels: channels of the input image.
    image_size: side of the input.
  """

  num_nodes: int = 2
  width: int = 16
  anchors: int = 3
  num_classes: int = 5
  in_channels: int = 3
  image_size: int = 32

  def __post_init__(self):
    detection.check_anchors(self.anchors)

  @property
  def feature_sizes(self) -> tuple[int, ...]:
    """Sides of the three feature maps (strides 4, 8, 16). A stride-2
    'SAME' conv rounds up, so a side that strides do not divide does too
    (20 px: 5, 3, 2)."""
    return tuple(-(-self.image_size // s) for s in (4, 8, 16))


class SSD(nnx.Module):
  """SSD-style detector (see the module docstring).

  Example:
    >>> model = SSD(SSDConfig(width=8), rngs=nnx.Rngs(0))
    >>> model(jnp.ones((1, 32, 32, 3))).shape   # 3 (64 + 16 + 4) boxes
    (1, 252, 9)

  Args:
    config: the architecture.
    rngs: random number streams.
  """

  def __init__(self, config: SSDConfig, *, rngs: nnx.Rngs):
    self.config = config
    w, k = config.width, config.anchors
    kw = dict(num_nodes=config.num_nodes, rngs=rngs)
    self.stem = ConvBN(config.in_channels, w, 3, replicated_input=True, **kw)
    self.stages = nnx.List(
      [
        BasicBlock(w, w, 2, **kw),  # 1/2
        BasicBlock(w, 2 * w, 2, **kw),  # 1/4: map 1
        BasicBlock(2 * w, 2 * w, 2, **kw),  # 1/8: map 2
        BasicBlock(2 * w, 2 * w, 2, **kw),  # 1/16: map 3
      ]
    )
    classes, boxes = [], []
    for index in range(len(config.feature_sizes)):
      following = index + 2 < len(self.stages)
      mask = self.stages[index + 2].conv1.conv.mask if following else None
      head = DiscoConv(2 * w, k * config.num_classes, 3, mask=mask, **kw)
      classes.append(head)
      boxes.append(DiscoConv(2 * w, k * 4, 3, mask=head.mask, **kw))
    self.class_heads = nnx.List(classes)
    self.box_heads = nnx.List(boxes)

  def __call__(self, x: jax.Array) -> jax.Array:
    return self.forward(x, ONE_DEVICE)

  def forward(self, x: jax.Array, ops: Ops) -> jax.Array:
    """(batch, boxes, classes + 4): class logits, then box offsets."""
    y = nnx.relu(self.stem.forward(x, ops))
    maps = []
    for index, stage in enumerate(self.stages):
      y = stage.forward(y, ops)
      if index >= 1:
        maps.append(y)
    rows = []
    batch, classes = x.shape[0], self.config.num_classes
    for feature, cls, box in zip(
      maps, self.class_heads, self.box_heads, strict=True
    ):
      logits = ops.output(cls, feature).reshape(batch, -1, classes)
      offsets = ops.output(box, feature).reshape(batch, -1, 4)
      rows.append(jnp.concatenate([logits, offsets], axis=-1))
    return jnp.concatenate(rows, axis=1)


@lowering.register(SSD)
def _node_weights(model: SSD, packer: lowering.Packer) -> None:
  """Every conv with its batch norm folded in, and the heads."""
  pack_layers(model, packer)
