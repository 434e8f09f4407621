"""DISCO layers: channel-parallel dense and conv layers with sparse links.

Input channels are split into blocks P_1..P_N and output channels into
Q_1..Q_N, one block per node. Node j computes

  y[Q_j] = W_jj * x[P_j] + sum over i != j of (M_ji . W_ji) * x[P_i]

where * is a matmul or a convolution, W_jj is node j's local block, W_ji
its cross-node blocks, and M_ji a mask with one bit per (destination node j,
source input channel c in P_i) that gates the whole weight column W[..., c,
Q_j]. Node i sends node j exactly the channels c with M_ji[c] = 1. All masks
one is dense channel (tensor) parallelism; all zero is one independent group
per node (a grouped layer).

Storage. The layer keeps the full kernel of the equivalent dense layer
(`kernel[..., c, o]`) and a `CommMask` of shape (num_nodes, in_features): bit
[j, c] says whether node j reads input channel c. Node j holds the columns
`kernel[..., :, Q_j]`, less the rows its mask drops; `node_inputs`,
`node_kernel` and `sends` extract exactly that for a distributed runtime.
Bits where node j owns c are ignored: a node always reads its own channels.
Layers that read the same tensor may share one `CommMask` object, since what
crosses a link is a tensor's channel, whichever layers read it.

A layer whose input is replicated on every node (the model's input image)
reads all input channels locally: it has no cross-node columns, needs no
communication, and its input may have fewer channels than there are nodes.
"""

import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from disco.errors import ConfigError, InputError, PartitionError
from disco.observe import Observed, OpCost, positions
from disco.splits import split_channels


class CommMask(nnx.Variable):
  """Cross-node channel mask of a DISCO layer: not trainable.

  A boolean array of shape (num_nodes, in_features); [j, c] = True when node j
  reads input channel c. Its own variable type lets optimizers and
  `nnx.state(model, CommMask)` tell it apart from parameters.

  Example:
    >>> import jax.numpy as jnp
    >>> mask = CommMask(jnp.ones((2, 8), bool))
    >>> mask[...].shape
    (2, 8)
  """


def abstract_variables(model: nnx.Module, kind=nnx.Variable) -> list[str]:
  """Paths of `model`'s variables of `kind` that hold no values: a model
  built under `nnx.eval_shape` (paper-scale accounting) has shapes only.

  Example:
    >>> make = lambda: DiscoDense(4, 4, num_nodes=2, rngs=nnx.Rngs(0))
    >>> layer = nnx.eval_shape(make)
    >>> abstract_variables(layer, CommMask)
    ['mask']
  """
  return [
    ".".join(str(p) for p in path)
    for path, variable in nnx.to_flat_state(nnx.state(model, kind))
    if isinstance(variable.get_value(), jax.ShapeDtypeStruct)
  ]


def require_concrete_masks(model: nnx.Module, error) -> None:
  """Raises `error` where `model`'s masks are abstract (`nnx.eval_shape`):
  what is sent, kept and counted is read from their values."""
  abstract = abstract_variables(model, CommMask)
  if abstract:
    raise error(
      f"the masks of {type(model).__name__} have shapes but no values "
      f"({abstract[0]}{', ...' if len(abstract) > 1 else ''}): it was built "
      "abstractly (nnx.eval_shape); set them first, e.g. "
      "disco.metrics.with_masks(model, True) for all masks one"
    )


class DiscoLayer(Observed):
  """What DiscoDense and DiscoConv share: splits, mask, kernel and bias.

  Not used directly; see `DiscoDense` and `DiscoConv` for examples.

  Args:
    in_features: input channels.
    out_features: output channels.
    kernel_shape: leading kernel dimensions (() for dense, (kh, kw) for conv).
    num_nodes: number of nodes the channels are split over.
    in_split: sizes of the input channel blocks (default: even split).
    out_split: sizes of the output channel blocks (default: even split).
    replicated_input: every node holds the whole input (the model's input);
      there is then nothing to communicate and no mask bit matters.
    mask: a `CommMask` to share with another layer reading the same tensor;
      by default a new one, all ones (dense).
    use_bias: add a bias per output channel.
    kernel_init: initializer of the kernel (default: LeCun normal).
    rngs: random number streams.
  """

  def __init__(
    self,
    in_features: int,
    out_features: int,
    kernel_shape: tuple[int, ...],
    *,
    num_nodes: int,
    in_split=None,
    out_split=None,
    replicated_input: bool = False,
    mask: CommMask | None = None,
    use_bias: bool = True,
    kernel_init=None,
    rngs: nnx.Rngs,
  ):
    name = f"{type(self).__name__}({in_features} -> {out_features})"
    # A replicated input belongs to every node: it has no split.
    self.in_split = (
      None
      if replicated_input
      else split_channels(
        in_features, num_nodes, in_split, what=f"input channels of {name}"
      )
    )
    self.out_split = split_channels(
      out_features, num_nodes, out_split, what=f"output channels of {name}"
    )
    self.replicated_input = replicated_input
    self.in_features = in_features
    self.out_features = out_features
    kernel_init = kernel_init or nnx.initializers.lecun_normal()
    self.kernel = nnx.Param(
      kernel_init(
        rngs.params(), (*kernel_shape, in_features, out_features), jnp.float32
      )
    )
    self.bias = (
      nnx.Param(jnp.zeros((out_features,), jnp.float32)) if use_bias else None
    )
    if mask is None:
      mask = CommMask(jnp.ones((num_nodes, in_features), bool))
    elif tuple(mask.shape) != (num_nodes, in_features):
      raise PartitionError(
        f"a shared mask of shape {tuple(mask.shape)} does not fit {name} "
        f"over {num_nodes} nodes: it needs ({num_nodes}, {in_features})"
      )
    self.mask = mask

  @property
  def num_nodes(self) -> int:
    """Number of nodes."""
    return self.out_split.num_nodes

  def owns(self) -> np.ndarray:
    """Boolean (num_nodes, in_features): inputs a node has without a link."""
    if self.replicated_input:
      return np.ones((self.num_nodes, self.in_features), bool)
    return self.in_split.owns()

  def cross(self) -> np.ndarray:
    """Boolean (num_nodes, in_features): the bits of the mask that count."""
    return ~self.owns()

  def reads(self):
    """Boolean (num_nodes, in_features): the inputs each node reads.

    A numpy array when the mask is concrete, so bookkeeping (costs,
    extraction) runs no device op; a traced array inside a trace.
    """
    mask = self.mask[...]
    if not isinstance(mask, jax.core.Tracer):
      mask = np.asarray(mask)
    return mask | self.owns()

  def masked_kernel(self) -> jax.Array:
    """The kernel with every column no node reads set to zero."""
    gate = self.reads()[self.out_split.owner()].T
    return self.kernel[...] * gate.astype(self.kernel.dtype)

  def node_inputs(self, node: int) -> np.ndarray:
    """Input channels `node` reads (own and received), ascending."""
    return np.flatnonzero(self.reads()[node])

  def node_kernel(self, node: int) -> jax.Array:
    """The weights `node` holds: kernel[..., node_inputs(node), Q_node]."""
    kernel = self.kernel[...][..., self.node_inputs(node), :]
    return kernel[..., self.out_split.indices(node)]

  def sends(self, source: int, destination: int) -> np.ndarray:
    """Input channels that `source` sends to `destination`, ascending.

    Empty for a replicated input and for source == destination.
    """
    if self.replicated_input or source == destination:
      return np.zeros((0,), int)
    channels = self.in_split.indices(source)
    return channels[np.asarray(self.mask[...])[destination, channels]]

  def cost(self, input_shape, output_shape) -> OpCost:
    """Costs with masked columns skipped: see `Observed.cost`."""
    reads = self.reads()
    width = np.asarray(self.out_split.sizes)
    fan_in = reads.sum(axis=1) * math.prod(self.kernel.shape[:-2])
    in_positions = positions(input_shape)
    out_positions = positions(output_shape)
    params = fan_in * width + (width if self.bias is not None else 0)
    crossing = None if self.replicated_input else reads & self.cross()
    return OpCost(
      flops=_ints(2 * out_positions * fan_in * width),
      params=_ints(params),
      inputs=_ints(in_positions * reads.sum(axis=1)),
      outputs=_ints(out_positions * width),
      receives=crossing,
      in_owner=None if crossing is None else self.in_split.owner(),
      in_positions=in_positions,
    )

  def _add_bias(self, y: jax.Array) -> jax.Array:
    return y if self.bias is None else y + self.bias[...]


class DiscoDense(DiscoLayer):
  """A dense layer split over nodes with masked cross-node columns.

  With all masks one it computes exactly `x @ kernel + bias`.

  Example:
    >>> import jax.numpy as jnp
    >>> from flax import nnx
    >>> layer = DiscoDense(8, 4, num_nodes=2, rngs=nnx.Rngs(0))
    >>> layer(jnp.ones((3, 8))).shape
    (3, 4)
    >>> layer.mask[...] = jnp.zeros((2, 8), bool)  # two independent halves
    >>> layer.sends(0, 1)
    array([], dtype=int64)

  Args:
    in_features: input channels (last axis).
    out_features: output channels.
    **kwargs: the splits, mask and initializers of `DiscoLayer`.
  """

  def __init__(self, in_features: int, out_features: int, **kwargs):
    super().__init__(in_features, out_features, (), **kwargs)

  def __call__(self, x: jax.Array) -> jax.Array:
    _check_input(self, x, None)
    y = self._add_bias(x @ self.masked_kernel())
    self.observe(x, y)
    return y


class DiscoConv(DiscoLayer):
  """A 2-D convolution (NHWC) split over nodes with masked cross-node columns.

  With all masks one it computes exactly the convolution with `kernel`.

  Example:
    >>> import jax.numpy as jnp
    >>> from flax import nnx
    >>> conv = DiscoConv(8, 16, 3, num_nodes=2, strides=2, rngs=nnx.Rngs(0))
    >>> conv(jnp.ones((1, 8, 8, 8))).shape
    (1, 4, 4, 16)
    >>> atrous = DiscoConv(8, 8, 3, num_nodes=2, dilation=2, rngs=nnx.Rngs(0))
    >>> atrous(jnp.ones((1, 8, 8, 8))).shape
    (1, 8, 8, 8)

  Args:
    in_features: input channels (last axis).
    out_features: output channels.
    kernel_size: an int or (height, width).
    strides: an int or (height, width).
    padding: "SAME" or "VALID".
    dilation: an int or (height, width): the kernel's dilation (atrous
      convolution; 1 = none).
    **kwargs: the splits, mask and initializers of `DiscoLayer`.
  """

  def __init__(
    self,
    in_features: int,
    out_features: int,
    kernel_size,
    *,
    strides=1,
    padding: str = "SAME",
    dilation=1,
    **kwargs,
  ):
    kernel_size = _pair(kernel_size, "kernel_size")
    strides, dilation = _pair(strides, "strides"), _pair(dilation, "dilation")
    if min(kernel_size) < 1 or min(strides) < 1 or min(dilation) < 1:
      raise ConfigError(
        "kernel size, strides and dilation must be at least 1, got "
        f"{kernel_size}, {strides} and {dilation}"
      )
    if padding not in ("SAME", "VALID"):
      raise ConfigError(f'padding must be "SAME" or "VALID", got {padding!r}')
    super().__init__(in_features, out_features, kernel_size, **kwargs)
    self.strides = strides
    self.padding = padding
    self.dilation = dilation

  def __call__(self, x: jax.Array) -> jax.Array:
    _check_input(self, x, 4)
    kernel = self.masked_kernel()
    # lax's convolution takes one dtype; `x @ kernel` promotes, so does this
    # (bfloat16 or uint8 images meet float32 weights).
    dtype = jnp.result_type(x, kernel)
    y = jax.lax.conv_general_dilated(
      jnp.asarray(x, dtype),
      kernel.astype(dtype),
      window_strides=self.strides,
      padding=self.padding,
      rhs_dilation=self.dilation,
      dimension_numbers=("NHWC", "HWIO", "NHWC"),
    )
    y = self._add_bias(y)
    self.observe(x, y)
    return y


def _ints(values) -> tuple[int, ...]:
  return tuple(int(v) for v in values)


def _pair(value, name: str = "size") -> tuple[int, int]:
  """An int or (height, width) as (height, width); ConfigError otherwise."""
  if isinstance(value, int):
    return (value, value)
  try:
    pair = tuple(int(v) for v in value)
  except (TypeError, ValueError):  # "ab", 2.5
    pair = ()
  if len(pair) != 2:
    raise ConfigError(f"{name} takes an int or (height, width), got {value!r}")
  return pair


def _check_input(layer, x, ndim) -> None:
  """The input's channels (last axis) and, for a conv, NHWC rank."""
  shape = tuple(np.shape(x))
  if (ndim is not None and len(shape) != ndim) or (
    not shape or shape[-1] != layer.in_features
  ):
    want = "(batch, height, width, C)" if ndim == 4 else "(..., C)"
    raise InputError(
      f"{type(layer).__name__}({layer.in_features} -> "
      f"{layer.out_features}) takes inputs of shape {want} with C = "
      f"{layer.in_features}, got {shape}"
    )
