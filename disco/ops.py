"""How a DISCO forward applies its modules: on one device or on one node.

A DISCO model writes its forward pass once, as `forward(x, ops)`, and hands
to `ops` every step whose work depends on where it runs:

  ops.layer(module, x, norm=None)   a DISCO layer (then an optional batch
                                    norm after it) or a `DiscoLayerNorm`
  ops.param(variable)               a per-channel parameter, e.g. a class
                                    token
  ops.output(layer, x)              the last layer: its outputs, complete

Everything else (activations, pooling, residual adds, reshapes, attention
within a node's heads) acts per channel and is written as plain JAX. On one
device, `ONE_DEVICE` lets every module apply itself, so `model(x)` is
`model.forward(x, ONE_DEVICE)`, the same computation as calling the modules
directly. `disco.lowering.NodeOps` runs the same forward on one node inside
`shard_map`, with that node's weights and the sparse exchanges.
"""

from typing import Protocol

import jax
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


ONE_DEVICE = OneDevice()
