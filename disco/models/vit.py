"""A small vision transformer (DeiT-style) built from DISCO layers.

Patch embedding is a `DiscoConv` reading the replicated image (no
communication); the embedding dimension and the heads are split over the
nodes (see `disco.transformer`); the class token and position embeddings
are per channel, so each node keeps its own channels of them; the head is a
`DiscoDense` reading the class token.

The forward pass is written once, as `forward(x, ops)` (`disco.ops`); the
lowering at the end of this file gives `disco.distributed` each node's
weights for it.
"""

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

from disco import lowering
from disco.errors import ConfigError, InputError, require_int
from disco.layers import DiscoConv, DiscoDense, DiscoLayer
from disco.ops import ONE_DEVICE, Ops
from disco.transformer import (
  DiscoLayerNorm,
  DiscoMLP,
  DiscoSelfAttention,
  head_split,
)


@dataclasses.dataclass(frozen=True)
class ViTConfig:
  """The architecture of a ViT; defaults give a tiny net for 16x16 digits.

  Example:
    >>> ViTConfig(num_nodes=2).num_patches
    16

  Args:
    num_nodes: number of nodes.
    image_size: side of the square input image.
    patch_size: side of a square patch.
    in_channels: channels of the input image.
    dim: embedding channels.
    depth: transformer blocks.
    num_heads: attention heads (split evenly over the nodes).
    mlp_dim: hidden channels of each MLP.
    num_classes: classifier outputs.
    exchange_stats: exact LayerNorm (see `disco.transformer`).
  """

  num_nodes: int = 2
  image_size: int = 16
  patch_size: int = 4
  in_channels: int = 1
  dim: int = 64
  depth: int = 2
  num_heads: int = 4
  mlp_dim: int = 128
  num_classes: int = 10
  exchange_stats: bool = True

  @property
  def num_patches(self) -> int:
    """Patches per image."""
    return (self.image_size // self.patch_size) ** 2


def deit_tiny_config(num_nodes: int = 2) -> ViTConfig:
  """DeiT-Tiny for 224x224 ImageNet images (for cost accounting).

  Example:
    >>> deit_tiny_config(2).dim
    192

  Args:
    num_nodes: number of nodes.
  """
  return ViTConfig(
    num_nodes=num_nodes,
    image_size=224,
    patch_size=16,
    in_channels=3,
    dim=192,
    depth=12,
    num_heads=3,
    mlp_dim=768,
    num_classes=1000,
  )


class EncoderBlock(nnx.Module):
  """Pre-norm transformer block: x + attn(norm(x)), then x + mlp(norm(x)).

  Example:
    >>> import jax.numpy as jnp
    >>> from flax import nnx
    >>> block = EncoderBlock(ViTConfig(), rngs=nnx.Rngs(0))
    >>> block(jnp.ones((1, 17, 64))).shape
    (1, 17, 64)

  Args:
    config: the architecture.
    rngs: random number streams.
  """

  def __init__(self, config: ViTConfig, *, rngs: nnx.Rngs):
    split = head_split(config.dim, config.num_heads, config.num_nodes)
    norm = dict(exchange_stats=config.exchange_stats, rngs=rngs)
    self.norm1 = DiscoLayerNorm(split, **norm)
    self.attn = DiscoSelfAttention(
      config.dim, config.num_heads, num_nodes=config.num_nodes, rngs=rngs
    )
    self.norm2 = DiscoLayerNorm(split, **norm)
    self.mlp = DiscoMLP(split, config.mlp_dim, rngs=rngs)

  def __call__(self, x: jax.Array) -> jax.Array:
    return self.forward(x, ONE_DEVICE)

  def forward(self, x: jax.Array, ops: Ops) -> jax.Array:
    """The block on one device or on a node (`disco.ops`)."""
    x = x + self.attn.forward(ops.layer(self.norm1, x), ops)
    return x + self.mlp.forward(ops.layer(self.norm2, x), ops)


class ViT(nnx.Module):
  """A vision transformer whose every linear map is a DISCO layer.

  Example:
    >>> import jax.numpy as jnp
    >>> from flax import nnx
    >>> model = ViT(ViTConfig(num_nodes=2), rngs=nnx.Rngs(0))
    >>> model(jnp.ones((2, 16, 16, 1))).shape
    (2, 10)

  Args:
    config: the architecture.
    rngs: random number streams.

  Raises:
    ConfigError: the image does not tile into patches, or the heads do not
      divide the embedding.
  """

  def __init__(self, config: ViTConfig, *, rngs: nnx.Rngs):
    for name in ("image_size", "in_channels", "num_classes"):
      require_int(name, getattr(config, name), 1)
    if config.patch_size < 1:
      raise ConfigError(
        f"patch size must be at least 1, got {config.patch_size}"
      )
    if config.image_size % config.patch_size:
      raise ConfigError(
        f"image size {config.image_size} is not a multiple of the patch "
        f"size {config.patch_size}"
      )
    if config.dim % config.num_heads:
      raise ConfigError(
        f"{config.num_heads} heads do not divide the embedding of "
        f"{config.dim} channels"
      )
    self.config = config
    split = head_split(config.dim, config.num_heads, config.num_nodes)
    self.patch_embed = DiscoConv(
      config.in_channels,
      config.dim,
      config.patch_size,
      strides=config.patch_size,
      padding="VALID",
      replicated_input=True,
      num_nodes=config.num_nodes,
      out_split=split,
      rngs=rngs,
    )
    init = nnx.initializers.truncated_normal(0.02)
    self.cls_token = nnx.Param(jnp.zeros((1, 1, config.dim), jnp.float32))
    self.pos_embed = nnx.Param(
      init(rngs.params(), (1, config.num_patches + 1, config.dim))
    )
    self.blocks = nnx.List(
      [EncoderBlock(config, rngs=rngs) for _ in range(config.depth)]
    )
    self.norm = DiscoLayerNorm(
      split, exchange_stats=config.exchange_stats, rngs=rngs
    )
    self.head = DiscoDense(
      config.dim,
      config.num_classes,
      num_nodes=config.num_nodes,
      in_split=split,
      rngs=rngs,
    )

  def __call__(self, x: jax.Array) -> jax.Array:
    return self.forward(x, ONE_DEVICE)

  def forward(self, x: jax.Array, ops: Ops) -> jax.Array:
    """The logits on one device, or on a node (`disco.ops`)."""
    c = self.config
    want = (c.image_size, c.image_size, c.in_channels)
    if x.ndim != 4 or tuple(x.shape[1:]) != want:
      # The position embeddings fix the patch count: a larger image failed
      # to broadcast, a smaller one not a multiple of the patch was cropped.
      raise InputError(
        f"this ViT takes images of shape (batch, {', '.join(map(str, want))})"
        f", got {tuple(x.shape)}"
      )
    x = ops.layer(self.patch_embed, x)
    x = x.reshape(x.shape[0], -1, x.shape[-1])
    cls = ops.param(self.cls_token)
    cls = jnp.broadcast_to(cls, (x.shape[0], 1, x.shape[-1]))
    x = jnp.concatenate([cls, x], axis=1) + ops.param(self.pos_embed)
    for block in self.blocks:
      x = block.forward(x, ops)
    return ops.output(self.head, ops.layer(self.norm, x[:, 0]))


@lowering.register(ViT)
def _node_weights(model: ViT, packer: lowering.Packer) -> None:
  """Every DISCO layer and LayerNorm; the node's embedding channels."""
  for _, module in nnx.iter_modules(model):
    if isinstance(module, (DiscoLayer, DiscoLayerNorm)):
      packer.layer(module)
  split = model.patch_embed.out_split
  packer.param(model.cls_token, split)
  packer.param(model.pos_embed, split)
