"""DISCO distributed inference: one device per node, sparse exchanges.

`distribute(model, mesh)` turns a DISCO model (`disco.models.ResNet`,
`ViT`, or any model class with a registered lowering, `disco.lowering`)
into one jitted SPMD program over a "node" mesh axis. Device j holds only
node j's weights: for every layer its local block and the cross-node
columns its mask keeps (`DiscoLayer.node_kernel`), batch norm folded in,
and its channels of the norms, class token and position embeddings. The
program runs the model's own forward pass on every node, exchanging only
the channels the masks keep (`disco.lowering` has the loop).

What crosses a link is exactly what `disco.metrics.count` counts, and
`DistributedModel.bytes_per_inference` measures it from the compiled program
(`disco.hlo_bytes`). Dense channel parallelism (all masks one,
`disco.metrics.with_masks(model, True)`) runs through the same path. Arrays
of one shape on every device mean some padding where nodes differ
(`DistributedModel.padding_bytes`); on the wire nothing is padded.
"""

import dataclasses
import warnings

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from disco import hlo_bytes, lowering
from disco.errors import DistributedError, require_int
from disco.exchange import AXIS
from disco.layers import abstract_variables

ITEMSIZE = 4  # float32 weights


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
  num_classes: int | None
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
    if not jnp.issubdtype(images.dtype, jnp.number) or jnp.issubdtype(
      images.dtype, jnp.complexfloating
    ):  # bfloat16 is a number; complex ones lost their imaginary part
      raise DistributedError(f"images must be real numbers, got {images.dtype}")
    if (
      images.ndim != 4
      or images.shape[1:] != self.image_shape
      or images.shape[0] < 1
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
    require_int("batch_size", batch_size, 1, DistributedError)
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
  require_int("num_nodes", num_nodes, 1, DistributedError)
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
    model: a `disco.models.ResNet`, `ViT` or another model with a
      registered lowering (`disco.lowering`); its masks as they are, batch
      norm in inference mode (from its running statistics).
    mesh: a mesh with a "node" axis of the model's node count (and no other
      axis larger than one); default: the first devices.

  Raises:
    DistributedError: a model without a lowering, or a mesh that does not
      fit.
  """
  training = any(
    isinstance(m, nnx.BatchNorm) and not m.use_running_average
    for _, m in nnx.iter_modules(model)
  )
  if training:
    warnings.warn(
      "the model is in training mode; distributed inference normalises "
      "with batch norm's running statistics (inference mode), so it equals "
      "the model after model.eval(), not model(x) as it is now",
      stacklevel=2,
    )
  abstract = abstract_variables(model)
  if abstract:
    raise DistributedError(
      f"{type(model).__name__} has shapes but no values ({abstract[0]}"
      f"{', ...' if len(abstract) > 1 else ''}): it was built abstractly "
      "(nnx.eval_shape); distributed inference needs its trained weights "
      "(disco.checkpoint.load)"
    )
  lowered = lowering.lower(model)
  nodes = len(lowered.params)
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
  stacked = jax.tree.map(lambda *xs: np.stack(xs), *lowered.params)
  sharding = NamedSharding(mesh, P(AXIS))
  params = jax.tree.map(
    lambda a: jax.make_array_from_callback(
      a.shape, sharding, lambda index: a[index]
    ),
    stacked,
  )

  def body(params, images):
    local = jax.tree.map(lambda a: a[0], params)
    return lowered.forward(local, images)[None]

  spmd = jax.shard_map(
    body, mesh=mesh, in_specs=(P(AXIS), P()), out_specs=P(AXIS)
  )
  config = model.config
  size = config.image_size
  return DistributedModel(
    mesh=mesh,
    params=params,
    share_bytes=tuple(ITEMSIZE * s for s in lowered.shares),
    held_bytes=ITEMSIZE * lowered.held,
    image_shape=(size, size, config.in_channels),
    num_classes=getattr(config, "num_classes", None),
    program=jax.jit(spmd),
  )
