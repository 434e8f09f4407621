"""A DISCO model lowered for its nodes: per-node weights and forward pass.

`disco.distributed.distribute` needs, for every node, the weights it holds
and a forward pass over them. The forward pass is the model's own
`forward(x, ops)` (`disco.ops`), run inside `shard_map` with `NodeOps`. The
weights come from the model's lowering: a function next to the model class
that hands a `Packer` every module and parameter the forward gives `ops`:

  @lowering.register(MyModel)
  def _node_weights(model: MyModel, packer: lowering.Packer) -> None:
    packer.layer(model.conv, norm=model.norm)   # batch norm folded in
    packer.param(model.token, model.conv.out_split)
    packer.layer(model.head)

`lower(model)` runs it once per node. Weights are keyed by the module's path
in the model, which is how `NodeOps` finds them, so a lowering says only
what a node holds. Exchange plans come from the masks: layers that share a
`CommMask` read one tensor (`disco.layers`), so each mask gets one
`disco.exchange.Exchange`. One inference, on node j:

  image: replicated; the stem / patch embedding reads it with no exchange
  for every DISCO layer:
    input = exchange(x)            # own channels | kept ones from others
    y = conv_or_matmul(input, node j's kernel rows in the same order)
    batch norm: folded into the layer's kernel and bias
  activations, pooling, residual adds, attention within heads: local
  LayerNorm: two floats per token to every other node, exact
  output: each node's channels to node 0 (`disco.exchange.gather_logits`)

Padding. `shard_map` needs every device's arrays to have one shape, so a
node that receives fewer channels than another in some layer holds zero
kernel rows up to the largest receiver's count, and uneven channel splits
pad to the largest block. With even splits and r = 0 or r = 1 there is
none; `Packer.held - Packer.share` counts it otherwise. No device can hold
less than the largest node's share; on the wire nothing is padded.
"""

import dataclasses
from collections.abc import Callable

import jax
import numpy as np
from flax import nnx

from disco.errors import DistributedError
from disco.exchange import (
  ConvSpec,
  Exchange,
  NormSpec,
  concat,
  conv,
  dense,
  exchange,
  gather_logits,
  layer_norm,
)
from disco.layers import DiscoConv, DiscoLayer
from disco.splits import Split
from disco.transformer import DiscoLayerNorm

_LOWERINGS: dict[type, Callable] = {}


def register(model_class: type):
  """Registers the decorated function as the lowering of `model_class`.

  Example:
    >>> from disco.models import ResNet
    >>> ResNet in registered()
    True

  Args:
    model_class: the model class; `model_class.forward(x, ops)` is its
      forward pass. The function, `(model, packer) -> None`, gives `packer`
      every module and parameter that forward hands to `ops`.
  """

  def decorate(node_weights: Callable) -> Callable:
    _LOWERINGS[model_class] = node_weights
    return node_weights

  return decorate


def registered() -> tuple[type, ...]:
  """The model classes that have a lowering."""
  return tuple(_LOWERINGS)


class Packer:
  """One node's weights, keyed by path, and how many values are padding.

  Given to a model's lowering (see the module docstring) by `lower`.

  Example (node 1 of a 2-node ResNet; the head reads its 16 channels and
  the 16 node 0 sends, and writes its 5 of the 10 classes):
    >>> from flax import nnx
    >>> from disco.models import ResNet, ResNetConfig
    >>> lowered = lower(ResNet(ResNetConfig(num_nodes=2), rngs=nnx.Rngs(0)))
    >>> lowered.params[1]["head"]["kernel"].shape
    (32, 5)

  Args:
    node: the node.
    names: {id of a module or variable of the model: its path}.
    plans: {path of a `CommMask`: the exchange of the tensor it gates}.
  """

  def __init__(self, node: int, names: dict, plans: dict):
    self.node = node
    self.params = {}  # path -> this node's arrays
    self.folded = {}  # path of a DISCO layer -> path of its batch norm
    self.share = 0  # values the node needs
    self.held = 0  # values it holds, padding included
    self._names = names
    self._plans = plans

  def layer(self, module: nnx.Module, norm: nnx.BatchNorm | None = None):
    """Packs a DISCO layer (batch norm `norm` folded in) or a LayerNorm.

    A layer's kernel rows follow its exchange plan's `rows(node)` (all
    inputs for a replicated input); rows the node does not read and padding
    are zero. A `DiscoLayerNorm` keeps the node's channels.
    """
    name = _path(self._names, module)
    if isinstance(module, DiscoLayerNorm):
      self.params[name] = {
        "scale": self._channels(module.scale[...], module.split),
        "bias": self._channels(module.bias[...], module.split),
      }
      return
    if not isinstance(module, DiscoLayer):
      raise DistributedError(
        f"{name}: cannot pack a {type(module).__name__}; only DISCO layers "
        "and DiscoLayerNorm have per-node weights"
      )
    self.folded[name] = None if norm is None else _path(self._names, norm)
    self.params[name] = self._layer(module, self._plan(module), norm)

  def param(self, variable: nnx.Variable, split: Split) -> None:
    """Packs this node's channels (last axis) of `variable`."""
    self.params[_path(self._names, variable)] = self._channels(
      variable[...], split
    )

  def _plan(self, layer: DiscoLayer) -> Exchange | None:
    if layer.replicated_input:
      return None
    return self._plans[_path(self._names, layer.mask)]

  def _array(self, values, real: int) -> np.ndarray:
    values = np.asarray(values, np.float32)
    self.share += real
    self.held += values.size
    return values

  def _channels(self, values, split: Split) -> np.ndarray:
    """This node's channels (last axis) of `values`, padded to the widest."""
    values = np.asarray(values, np.float32)
    own = values[..., split.indices(self.node)]
    padded = np.zeros(values.shape[:-1] + (max(split.sizes),), np.float32)
    padded[..., : own.shape[-1]] = own
    return self._array(padded, own.size)

  def _layer(self, layer: DiscoLayer, plan: Exchange | None, norm) -> dict:
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
      "kernel": self._array(kernel, node_kernel.size),
      "bias": self._array(bias, len(columns) if has_bias else 0),
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


class NodeOps:
  """`disco.ops.Ops` on one node, inside `shard_map` over the "node" axis.

  A tensor that several layers read through one mask is exchanged once,
  for all of them. `lower` builds one for every trace of the forward pass;
  example: `disco.distributed.distribute`.

  Args:
    params: this node's weights, {path: arrays}, as packed.
    names: {id of a module or variable of the model run: its path}.
    plans: {path of a `CommMask`: its exchange plan}.
    folded: {path of a DISCO layer: path of the batch norm folded into it}.
  """

  def __init__(self, params: dict, names: dict, plans: dict, folded: dict):
    self._params = params
    self._names = names
    self._plans = plans
    self._folded = folded
    self._inputs = {}  # (id(tensor), id(plan)) -> (tensor, layer input)

  def layer(self, module: nnx.Module, x: jax.Array, norm=None) -> jax.Array:
    """The node's part of `module` on its part of `x`; `norm` is folded."""
    weights = self._weights(module)
    if isinstance(module, DiscoLayerNorm):
      spec = NormSpec(module.split, module.exchange_stats, module.epsilon)
      return layer_norm(x, weights, spec)
    name = _path(self._names, module)
    norm_name = None if norm is None else _path(self._names, norm)
    if self._folded[name] != norm_name:
      raise DistributedError(
        f"the forward applies {name} then batch norm {norm_name}, its "
        f"lowering folded {self._folded[name]} into it"
      )
    if not module.replicated_input:
      x = self._input(x, self._plans[_path(self._names, module.mask)])
    if isinstance(module, DiscoConv):
      spec = ConvSpec(module.strides, module.padding, module.dilation)
      return conv(x, weights, spec)
    return dense(x, weights)

  def param(self, variable: nnx.Variable) -> jax.Array:
    """The node's channels of `variable`."""
    return self._weights(variable)

  def output(self, layer: nnx.Module, x: jax.Array) -> jax.Array:
    """Every node's outputs of `layer`, complete on node 0."""
    return gather_logits(self.layer(layer, x), layer.out_split)

  def concat(self, tensors, splits) -> jax.Array:
    """The node's blocks of `tensors`, one after another (no exchange)."""
    return concat(tensors, splits)

  def _weights(self, owner):
    name = _path(self._names, owner)
    if name not in self._params:
      raise DistributedError(
        f"the forward hands {name} ({type(owner).__name__}) to ops, but the "
        "model's lowering packed no weights for it"
      )
    return self._params[name]

  def _input(self, x: jax.Array, plan: Exchange) -> jax.Array:
    key = (id(x), id(plan))
    for other_x, other_plan in self._inputs:
      if other_x == id(x) and other_plan != id(plan):
        raise DistributedError(
          "a tensor is read through two different CommMasks: its channels "
          "would cross the links once per mask; let every layer that reads "
          "one tensor share one mask (disco.layers)"
        )
    if key not in self._inputs:
      # Keeping x alive keeps its id from being reused during the trace.
      self._inputs[key] = (x, exchange(x, plan))
    return self._inputs[key][1]


@dataclasses.dataclass(frozen=True, eq=False)
class Lowered:
  """A model lowered for its nodes. Example: `lower`.

  Args:
    params: per node, its weights {path: arrays}.
    shares: values each node needs.
    held: values each device holds, padding included.
    forward: (this node's params, images) -> this node's outputs, complete
      on node 0; runs inside `shard_map` over "node".
  """

  params: list
  shares: tuple[int, ...]
  held: int
  forward: Callable


def lower(model: nnx.Module) -> Lowered:
  """Packs every node's weights and builds the per-node forward pass.

  Example:
    >>> from flax import nnx
    >>> from disco.models import ResNet, ResNetConfig
    >>> lowered = lower(ResNet(ResNetConfig(num_nodes=2), rngs=nnx.Rngs(0)))
    >>> len(lowered.params), lowered.shares[0] <= lowered.held
    (2, True)

  Args:
    model: a model whose class has a registered lowering.

  Raises:
    DistributedError: a model without a lowering, or a lowering that does
      not pack what the forward reads.
  """
  node_weights = _LOWERINGS.get(type(model))
  if node_weights is None:
    raise DistributedError(
      f"{type(model).__name__} cannot be distributed: only "
      f"{sorted(c.__name__ for c in _LOWERINGS)} models can (a model class "
      "registers its lowering with disco.lowering.register)"
    )
  names = _names(model)
  plans = _exchange_plans(model, names)
  packers = [Packer(node, names, plans) for node in range(_num_nodes(model))]
  for packer in packers:
    node_weights(model, packer)
  # The program runs the forward of a copy without weights: one that read a
  # weight past `ops` would fail here rather than put all of it on a node.
  structure = _without_weights(model)
  structure_names = _names(structure)
  folded = packers[0].folded

  def forward(params, images):
    ops = NodeOps(params, structure_names, plans, folded)
    return structure.forward(images, ops)

  return Lowered(
    [packer.params for packer in packers],
    tuple(packer.share for packer in packers),
    packers[0].held,
    forward,
  )


def _names(model: nnx.Module) -> dict:
  """{id of every module and variable: its path, "/"-joined}."""
  return {
    id(node): "/".join(map(str, path))
    for path, node in nnx.iter_graph(model)
    if isinstance(node, (nnx.Module, nnx.Variable))
  }


def _path(names: dict, owner) -> str:
  if id(owner) not in names:
    raise DistributedError(
      f"a {type(owner).__name__} that is not part of the model was handed "
      "to a lowering's packer or to ops"
    )
  return names[id(owner)]


def _exchange_plans(model: nnx.Module, names: dict) -> dict:
  """{path of a mask: the exchange plan of the tensor read through it}."""
  readers = {}
  for _, module in nnx.iter_modules(model):
    if isinstance(module, DiscoLayer) and not module.replicated_input:
      readers.setdefault(names[id(module.mask)], []).append(module)
  return {name: Exchange.of(layers) for name, layers in readers.items()}


def _num_nodes(model: nnx.Module) -> int:
  for _, module in nnx.iter_modules(model):
    if isinstance(module, DiscoLayer):
      return module.num_nodes
  raise DistributedError(f"{type(model).__name__} has no DISCO layer")


def _without_weights(model: nnx.Module) -> nnx.Module:
  graphdef, state = nnx.split(model)
  shapes = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), state)
  return nnx.merge(graphdef, shapes)
