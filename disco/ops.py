"""How a DISCO forward applies its modules: on one device or on one node.

A DISCO model writes its forward pass once, as `forward(x, ops)`, and hands
to `ops` every step whose work depends on where it runs:

  ops.layer(module, x, norm=None)   a DISCO layer (then an optional batch
                                    norm after it) or a `DiscoLayerNorm`
  ops.param(variable)               a per-channel parameter, e.g. a class
                                    token
  ops.output(layer, x)              the last layer: its outputs, complete
                                    (a model may have several)
  ops.concat(tensors, splits)       channels of several tensors, node by
                                    node (each node keeps its blocks)

Everything else (activations, pooling, residual adds, reshapes, attention
within a node's heads) acts per channel and is written as plain JAX. On one
device, `ONE_DEVICE` lets every module apply itself, so `model(x)` is
`model.forward(x, ONE_DEVICE)`, the same computation as calling the modules
directly. `disco.lowering.NodeOps` runs the same forward on one node inside
`shard_map`, with that node's weights and the sparse exchanges.
"""

from typing import Protocol

import jax
import jax.numpy as jnp
from flax import nnx


class Ops(Protocol):
  """What a DISCO forward asks of the place it runs on (see the module).

  Example: `OneDevice`.
  """

  def layer(self, module: nnx.Module, x: jax.Array, norm=None) -> jax.Array:
    """`module` (a DISCO layer or LayerNorm) on `x`, then batch norm `norm`."""
    ...

  def param(self, variable: nnx.Variable) -> jax.Array:
    """The value of a per-channel parameter."""
    ...

  def output(self, layer: nnx.Module, x: jax.Array) -> jax.Array:
    """The model's last layer on `x`: its outputs, all channels."""
    ...

  def concat(self, tensors, splits) -> jax.Array:
    """`tensors` concatenated by channels, node by node.

    Node j's channels of the result are its block of `tensors[0]`, then
    its block of `tensors[1]`, ...: a fixed relabelling of the plain
    concatenation that keeps every channel on its node, split as
    `disco.splits.concatenated(splits)`.
    """
    ...


class OneDevice:
  """`Ops` on one device: every module applies itself.

  Example:
    >>> import jax.numpy as jnp
    >>> from flax import nnx
    >>> from disco.layers import DiscoDense
    >>> layer = DiscoDense(4, 2, num_nodes=2, rngs=nnx.Rngs(0))
    >>> x = jnp.ones((1, 4))
    >>> bool((ONE_DEVICE.layer(layer, x) == layer(x)).all())
    True
  """

  def layer(self, module: nnx.Module, x: jax.Array, norm=None) -> jax.Array:
    """`module(x)`, then `norm` of it when given."""
    y = module(x)
    return y if norm is None else norm(y)

  def param(self, variable: nnx.Variable) -> jax.Array:
    """`variable[...]`."""
    return variable[...]

  def output(self, layer: nnx.Module, x: jax.Array) -> jax.Array:
    """`layer(x)`."""
    return layer(x)

  def concat(self, tensors, splits) -> jax.Array:
    """Node by node concatenation (see `Ops.concat`).

    Example (node 0 owns a0 and b0, node 1 a1 and b1):
      >>> from disco.splits import Split
      >>> a, b = jnp.array([[0., 1.]]), jnp.array([[2., 3.]])
      >>> ONE_DEVICE.concat([a, b], [Split((1, 1)), Split((1, 1))])
      Array([[0., 2., 1., 3.]], dtype=float32)
    """
    pieces = []
    for node in range(splits[0].num_nodes):
      for x, split in zip(tensors, splits, strict=True):
        start = split.start(node)
        pieces.append(x[..., start : start + split.sizes[node]])
    return jnp.concatenate(pieces, axis=-1)


ONE_DEVICE = OneDevice()
