"""DISCO distributed inference: one device per node, sparse exchanges.

`distribute(model, mesh)` turns a DISCO ResNet or ViT into one jitted SPMD
program over a "node" mesh axis. Device j holds only node j's weights: for
every layer its local block and the cross-node columns its mask keeps
(`DiscoLayer.node_kernel`), batch norm folded in, and its channels of the
norms, class token and position embeddings. One inference:

  image: replicated; the stem / patch embedding reads it with no exchange
  for every DISCO layer, on node j:
    input = exchange(x)            # own channels | kept ones from others
    y = conv_or_matmul(input, node j's kernel rows in the same order)
    batch norm (folded), activations, pooling, residual adds: local
  ViT LayerNorm: two floats per token to every other node, exact
  logits: each node's classes to node 0 (`disco.exchange.gather_logits`)

What crosses a link is exactly what `disco.metrics.count` counts, and
`DistributedModel.bytes_per_inference` measures it from the compiled program
(`disco.hlo_bytes`). Dense channel parallelism (all masks one,
`disco.metrics.with_masks(model, True)`) runs through the same path.

Padding. `shard_map` needs every device's arrays to have one shape, so a
node that receives fewer channels than another in some layer holds zero
kernel rows up to the largest receiver's count, and uneven channel splits
pad to the largest block. With even splits and r = 0 or r = 1 there is
none; `DistributedModel.padding_bytes` reports it otherwise. No device can
hold less than the largest node's share; on the wire nothing is padded.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from disco import hlo_bytes
from disco.errors import DistributedError
from disco.exchange import (
  AXIS,
  ConvSpec,
  Exchange,
  NormSpec,
  conv,
  dense,
  exchange,
  gather_logits,
  layer_norm,
)
from disco.layers import DiscoLayer
from disco.models import ResNet, ViT
from disco.splits import Split
from graphpipe.models.attention import dot_product_attention

ITEMSIZE = 4  # float32 weights


class _Packer:
  """Builds one node's weights and counts what is real and what is padding."""

  def __init__(self, node: int):
    self.node = node
    self.share = 0  # values the node needs
    self.held = 0  # values it holds, padding included

  def array(self, values, real: int) -> np.ndarray:
    values = np.asarray(values, np.float32)
    self.share += real
    self.held += values.size
    return values

  def channels(self, values, split: Split) -> np.ndarray:
    """This node's channels (last axis) of `values`, padded to the widest."""
    values = np.asarray(values, np.float32)
    own = values[..., split.indices(self.node)]
    padded = np.zeros(values.shape[:-1] + (max(split.sizes),), np.float32)
    padded[..., : own.shape[-1]] = own
    return self.array(padded, own.size)

  def layer(self, layer: DiscoLayer, plan: Exchange | None, norm=None):
    """{"kernel", "bias"} of `layer` on this node, batch norm folded in.

    Kernel rows follow `plan.rows(node)` (all inputs for a replicated
    input); rows the node does not read and padding are zero.
    """
    node = self.node
    columns = layer.out_split.indices(node)
    width = max(layer.out_split.sizes)
    inputs = layer.node_inputs(node)
    rows = np.arange(layer.in_features) if plan is None else plan.rows(node)
    kept = np.isin(rows, inputs)
    if kept.sum() != len(inputs):
      raise DistributedError(
        f"{type(layer).__name__}: node {node} reads channels its exchange "
        "plan does not deliver"
      )
    node_kernel = np.asarray(layer.node_kernel(node), np.float32)
    scale = np.ones(len(columns), np.float32)
    shift = np.zeros(len(columns), np.float32)
    if layer.bias is not None:
      shift = np.asarray(layer.bias[...])[columns]
    if norm is not None:
      scale, shift = _fold(norm, columns, shift)
    kernel = np.zeros(layer.kernel.shape[:-2] + (len(rows), width), np.float32)
    kernel[..., np.flatnonzero(kept), : len(columns)] = (
      node_kernel[..., np.searchsorted(inputs, rows[kept]), :] * scale
    )
    bias = np.zeros(width, np.float32)
    bias[: len(columns)] = shift
    has_bias = layer.bias is not None or norm is not None
    return {
      "kernel": self.array(kernel, node_kernel.size),
      "bias": self.array(bias, len(columns) if has_bias else 0),
    }


def _fold(norm: nnx.BatchNorm, columns, bias):
  """(scale, shift) of inference-mode batch norm after a layer's bias."""
  scale = np.asarray(norm.scale[...])[columns] / np.sqrt(
    np.asarray(norm.var[...])[columns] + norm.epsilon
  )
  shift = np.asarray(norm.bias[...])[columns] + scale * (
    bias - np.asarray(norm.mean[...])[columns]
  )
  return scale.astype(np.float32), shift.astype(np.float32)


@dataclasses.dataclass(frozen=True, eq=False)
class _Program:
  """A model lowered for nodes: per-node weights and the SPMD forward."""

  params: list  # per node: a pytree of numpy arrays
  shares: tuple[int, ...]  # values each node needs
  held: int  # values each device holds
  forward: object  # (this node's params, images) -> logits, complete on 0
  image_shape: tuple[int, int, int]
  num_classes: int


def _resnet(model: ResNet) -> _Program:
  config = model.config
  # Per block: [(conv + batch norm unit, exchange of its input)], shortcut.
  blocks = []
  for block in model.blocks:
    units = [block.conv1, block.conv2, getattr(block, "conv3", None)]
    units = [unit for unit in units if unit is not None]
    readers = [unit.conv for unit in (block.conv1, block.shortcut) if unit]
    plans = [Exchange.of(readers)] + [Exchange.of([u.conv]) for u in units[1:]]
    blocks.append((list(zip(units, plans, strict=True)), block.shortcut))
  head_plan = Exchange.of([model.head])

  def pack(packer):
    def convbn(unit, plan):
      return packer.layer(unit.conv, plan, unit.norm)

    packed_blocks = []
    for chain, shortcut in blocks:
      packed = {"chain": [convbn(unit, plan) for unit, plan in chain]}
      if shortcut is not None:
        packed["shortcut"] = convbn(shortcut, chain[0][1])
      packed_blocks.append(packed)
    return {
      "stem": convbn(model.stem, None),
      "blocks": packed_blocks,
      "head": packer.layer(model.head, head_plan),
    }

  stem = _conv_spec(model.stem.conv)
  static = [
    (
      [(_conv_spec(unit.conv), plan) for unit, plan in chain],
      None if shortcut is None else _conv_spec(shortcut.conv),
    )
    for chain, shortcut in blocks
  ]
  head_split = model.head.out_split

  def forward(p, images):
    x = nnx.relu(conv(images, p["stem"], stem))
    if config.stem_pool:
      x = nnx.max_pool(x, (3, 3), strides=(2, 2), padding="SAME")
    for bp, (chain, shortcut) in zip(p["blocks"], static, strict=True):
      block_input = exchange(x, chain[0][1])
      y = conv(block_input, bp["chain"][0], chain[0][0])
      for params, (spec, plan) in zip(bp["chain"][1:], chain[1:], strict=True):
        y = conv(exchange(nnx.relu(y), plan), params, spec)
      skip = x
      if shortcut is not None:
        skip = conv(block_input, bp["shortcut"], shortcut)
      x = nnx.relu(y + skip)
    pooled = jnp.mean(x, axis=(1, 2))
    logits = dense(exchange(pooled, head_plan), p["head"])
    return gather_logits(logits, head_split)

  return _program(model, pack, forward)


def _program(model, pack, forward) -> _Program:
  """Packs every node's weights with `pack(packer)`."""
  config = model.config
  packers = [_Packer(node) for node in range(config.num_nodes)]
  params = [pack(packer) for packer in packers]
  size = config.image_size
  return _Program(
    params,
    tuple(packer.share for packer in packers),
    packers[0].held,
    forward,
    (size, size, config.in_channels),
    config.num_classes,
  )


def _vit(model: ViT) -> _Program:
  config = model.config
  blocks = list(model.blocks)
  plans = [
    {
      "qkv": Exchange.of([b.attn.query, b.attn.key, b.attn.value]),
      "proj": Exchange.of([b.attn.proj]),
      "fc1": Exchange.of([b.mlp.fc1]),
      "fc2": Exchange.of([b.mlp.fc2]),
    }
    for b in blocks
  ]
  head_plan = Exchange.of([model.head])
  split = model.patch_embed.out_split

  def pack(packer):
    def norm(module):
      return {
        "scale": packer.channels(module.scale[...], module.split),
        "bias": packer.channels(module.bias[...], module.split),
      }

    packed_blocks = []
    for block, plan in zip(blocks, plans, strict=True):
      attn, mlp = block.attn, block.mlp
      packed_blocks.append(
        {
          "norm1": norm(block.norm1),
          "query": packer.layer(attn.query, plan["qkv"]),
          "key": packer.layer(attn.key, plan["qkv"]),
          "value": packer.layer(attn.value, plan["qkv"]),
          "proj": packer.layer(attn.proj, plan["proj"]),
          "norm2": norm(block.norm2),
          "fc1": packer.layer(mlp.fc1, plan["fc1"]),
          "fc2": packer.layer(mlp.fc2, plan["fc2"]),
        }
      )
    return {
      "patch": packer.layer(model.patch_embed, None),
      "cls": packer.channels(model.cls_token[...][0, 0], split),
      "pos": packer.channels(model.pos_embed[...][0], split),
      "blocks": packed_blocks,
      "norm": norm(model.norm),
      "head": packer.layer(model.head, head_plan),
    }

  patch = _conv_spec(model.patch_embed)
  norm_spec = NormSpec(split, config.exchange_stats, model.norm.epsilon)
  head_dim = config.dim // config.num_heads
  head_split = model.head.out_split

  def attention(x, bp):
    # Each node attends with its own heads; padding heads stay zero.
    q, k, v = (dense(x, bp[name]) for name in ("query", "key", "value"))
    heads = (*q.shape[:-1], q.shape[-1] // head_dim, head_dim)
    q, k, v = q.reshape(heads), k.reshape(heads), v.reshape(heads)
    attended = dot_product_attention(q, k, v)
    return attended.reshape(attended.shape[:-2] + (-1,))

  def forward(p, images):
    x = conv(images, p["patch"], patch)
    x = x.reshape(x.shape[0], -1, x.shape[-1])
    cls = jnp.broadcast_to(p["cls"], (x.shape[0], 1, x.shape[-1]))
    x = jnp.concatenate([cls, x], axis=1) + p["pos"]
    for bp, plan in zip(p["blocks"], plans, strict=True):
      h = layer_norm(x, bp["norm1"], norm_spec)
      attended = attention(exchange(h, plan["qkv"]), bp)
      x = x + dense(exchange(attended, plan["proj"]), bp["proj"])
      h = layer_norm(x, bp["norm2"], norm_spec)
      hidden = nnx.gelu(dense(exchange(h, plan["fc1"]), bp["fc1"]))
      x = x + dense(exchange(hidden, plan["fc2"]), bp["fc2"])
    h = layer_norm(x[:, 0], p["norm"], norm_spec)
    logits = dense(exchange(h, head_plan), p["head"])
    return gather_logits(logits, head_split)

  return _program(model, pack, forward)


def _conv_spec(layer) -> ConvSpec:
  return ConvSpec(layer.strides, layer.padding)


_LOWERINGS = {ResNet: _resnet, ViT: _vit}


@dataclasses.dataclass(frozen=True, eq=False)
class DistributedModel:
  """A DISCO model compiled for its nodes: call it like the model.

  Built by `distribute`. Each device of `mesh` holds one node's weights
  (`params`, sharded over the `node` axis); a call runs one SPMD program
  whose only collectives are the sparse exchanges, the LayerNorm
  statistics and the gather of the logits on node 0.

  Example: see `distribute`.

  Args:
    mesh: the mesh, one device per node on axis "node".
    params: per-node weights, each leaf (num_nodes, ...) sharded by node.
    share_bytes: bytes of the weights each node needs.
    held_bytes: bytes of weights every device holds (padding included).
    image_shape: (height, width, channels) of one input image.
    num_classes: number of logits.
    program: the jitted SPMD function (params, images) -> (nodes, batch,
      classes) logits, complete in row 0.
  """

  mesh: Mesh
  params: dict
  share_bytes: tuple[int, ...]
  held_bytes: int
  image_shape: tuple[int, int, int]
  num_classes: int
  program: object
  _compiled: dict = dataclasses.field(default_factory=dict, repr=False)

  @property
  def num_nodes(self) -> int:
    """Number of nodes (devices)."""
    return self.mesh.shape[AXIS]

  @property
  def padding_bytes(self) -> tuple[int, ...]:
    """Bytes of zeros each device holds so that all shapes agree."""
    return tuple(self.held_bytes - share for share in self.share_bytes)

  def place(self, images) -> jax.Array:
    """`images` (batch, height, width, channels), replicated on the nodes.

    Raises:
      DistributedError: not a batch of images of this model's shape.
    """
    images = np.asarray(images)
    shape = self.image_shape
    if (
      images.ndim != 4
      or images.shape[1:] != self.image_shape
      or images.shape[0] < 1
      or not np.issubdtype(images.dtype, np.number)
    ):
      raise DistributedError(
        f"expected images of shape (batch, {', '.join(map(str, shape))}) "
        f"with batch >= 1, got {images.dtype} {images.shape}"
      )
    images = images.astype(np.float32)
    sharding = NamedSharding(self.mesh, P())
    return jax.make_array_from_callback(
      images.shape, sharding, lambda index: images[index]
    )

  def compiled(self, batch_size: int):
    """The compiled program for batches of `batch_size` (cached)."""
    if batch_size not in self._compiled:
      images = jax.ShapeDtypeStruct(
        (batch_size, *self.image_shape),
        jnp.float32,
        sharding=NamedSharding(self.mesh, P()),
      )
      lowered = self.program.lower(self.params, images)
      self._compiled[batch_size] = lowered.compile()
    return self._compiled[batch_size]

  def apply(self, placed: jax.Array) -> jax.Array:
    """Runs on placed images (`place`); (nodes, batch, classes), row 0 real."""
    return self.compiled(placed.shape[0])(self.params, placed)

  def __call__(self, images) -> np.ndarray:
    """The logits of `images`, (batch, classes), as node 0 holds them.

    Every process of a multi-process run must call it (the logits are
    gathered from node 0's process).
    """
    out = self.apply(self.place(images))
    if out.is_fully_addressable:
      return np.asarray(out)[0]
    from jax.experimental import multihost_utils

    return np.asarray(multihost_utils.process_allgather(out, tiled=True))[0]

  def bytes_per_inference(self, batch_size: int = 1) -> int:
    """Bytes the compiled program's collectives send for one image.

    Read from the program compiled for `batch_size` (`disco.hlo_bytes`) and
    divided by it.
    """
    text = self.compiled(batch_size).as_text()
    total = hlo_bytes.total_bytes(text)
    if total % batch_size:
      raise DistributedError(
        f"{total} bytes sent for a batch of {batch_size} is not a multiple "
        "of the batch: something crosses per batch, not per image"
      )
    return total // batch_size

  def device_weight_bytes(self) -> dict:
    """Bytes of weights on each of this process's devices, by node."""
    held = {}
    for leaf in jax.tree.leaves(self.params):
      for shard in leaf.addressable_shards:
        node = shard.index[0].start or 0
        held[node] = held.get(node, 0) + shard.data.nbytes
    return dict(sorted(held.items()))


def node_mesh(num_nodes: int, devices=None) -> Mesh:
  """A one-axis mesh ("node") over the first `num_nodes` devices.

  Example:
    >>> node_mesh(2).shape["node"]
    2

  Args:
    num_nodes: number of nodes.
    devices: devices to take them from (default: `jax.devices()`).

  Raises:
    DistributedError: fewer devices than nodes.
  """
  devices = list(jax.devices() if devices is None else devices)
  if len(devices) < num_nodes:
    raise DistributedError(
      f"{num_nodes} nodes need {num_nodes} devices, {len(devices)} found; on "
      "CPU set XLA_FLAGS=--xla_force_host_platform_device_count="
      f"{num_nodes} before JAX starts"
    )
  return Mesh(np.array(devices[:num_nodes]), (AXIS,))


def distribute(model: nnx.Module, mesh: Mesh | None = None) -> DistributedModel:
  """Splits `model` over devices for inference, one device per node.

  Example:
    >>> import numpy as np
    >>> from flax import nnx
    >>> from disco import prune
    >>> from disco.models import ResNet, ResNetConfig
    >>> model = ResNet(ResNetConfig(num_nodes=2), rngs=nnx.Rngs(0))
    >>> prune.to_ratio(model, 0.2)
    >>> model.eval()
    >>> run = distribute(model)
    >>> images = np.ones((2, 16, 16, 1), np.float32)
    >>> bool(np.allclose(run(images), model(images), atol=1e-5))
    True
    >>> from disco import metrics
    >>> run.bytes_per_inference() == metrics.count(model).bytes_sent
    True

  Args:
    model: a `disco.models.ResNet` or `ViT` (its masks as they are; batch
      norm in inference mode, from its running statistics).
    mesh: a mesh with a "node" axis of the model's node count (and no other
      axis larger than one); default: the first devices.

  Raises:
    DistributedError: another kind of model, or a mesh that does not fit.
  """
  lowering = _LOWERINGS.get(type(model))
  if lowering is None:
    raise DistributedError(
      f"{type(model).__name__} cannot be distributed: only "
      f"{sorted(c.__name__ for c in _LOWERINGS)} models can"
    )
  nodes = model.config.num_nodes
  if mesh is None:
    mesh = node_mesh(nodes)
  elif AXIS not in mesh.axis_names or mesh.shape[AXIS] != nodes:
    raise DistributedError(
      f"the model is split over {nodes} nodes; the mesh has axes "
      f"{dict(mesh.shape)}: it needs a '{AXIS}' axis of size {nodes}"
    )
  elif mesh.size != nodes:
    raise DistributedError(
      f"mesh {dict(mesh.shape)} has other axes larger than one; distributed "
      f"inference uses only the '{AXIS}' axis"
    )
  program = lowering(model)
  stacked = jax.tree.map(lambda *xs: np.stack(xs), *program.params)
  sharding = NamedSharding(mesh, P(AXIS))
  params = jax.tree.map(
    lambda a: jax.make_array_from_callback(
      a.shape, sharding, lambda index: a[index]
    ),
    stacked,
  )

  def body(params, images):
    local = jax.tree.map(lambda a: a[0], params)
    return program.forward(local, images)[None]

  spmd = jax.shard_map(
    body, mesh=mesh, in_specs=(P(AXIS), P()), out_specs=P(AXIS)
  )
  return DistributedModel(
    mesh=mesh,
    params=params,
    share_bytes=tuple(ITEMSIZE * s for s in program.shares),
    held_bytes=ITEMSIZE * program.held,
    image_shape=program.image_shape,
    num_classes=program.num_classes,
    program=jax.jit(spmd),
  )
