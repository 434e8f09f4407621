"""Costs of one inference on N nodes: bytes between nodes, FLOPs, weights.

`count(model)` traces one forward pass of a batch of one abstractly (no
compute) and asks every observed module (`disco.observe`) what its call
costs each node, from the masks as they are:

- FLOPs: 2 x multiply-adds of convs, dense layers and attention matmuls;
  a column no node reads is skipped, so node j of a DISCO layer does
  2 x output positions x kernel area x (inputs it reads) x (its outputs).
  Elementwise work (norms, activations, pooling, residual adds) is not
  counted, as in the usual ResNet/ViT FLOP figures.
- Bytes: node i sends node j the kept channels (mask bits) of each tensor
  it owns, every position of them, in `itemsize`-byte values. Layers that
  read the same tensor send each channel once (the union of their masks).
  The replicated input image crosses no link. LayerNorm statistics (see
  `disco.transformer`) and the gather of the outputs to node 0 count too
  (one gather per `ops.output` of the model's forward: a detector has one
  per head).
- Parameters per node: the columns a node holds with the rows its mask
  drops left out, plus norm parameters of its channels; parameters outside
  observed modules (class token, position embeddings, batch norm) are
  counted in full on every node, an upper bound.
- Memory per node: its parameters plus the largest working set of one op
  (the inputs it reads and the outputs it writes), in `itemsize` bytes.

`group_bytes` gives the bytes of each channel group (mask bit) on its own,
what the "bytes" pruning budget (`disco.prune.to_ratio`) spends.
`compare` puts this next to dense channel parallelism (the same model with
all masks one) and a single device holding the dense model, and
`LatencyModel` turns a report into a time per inference.
"""

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from disco.errors import MetricsError, require_int, require_number
from disco.layers import CommMask, DiscoLayer, require_concrete_masks
from disco.observe import Observed, positions
from disco.ops import OneDevice
from disco.splits import split_channels


@dataclasses.dataclass(frozen=True)
class LayerCost:
  """One observed call's costs for one inference.

  Example:
    >>> cost = LayerCost("head", "DiscoDense", (40, 40), (20, 20),
    ...                  ((0, 8), (8, 0)), (40, 40), 56)
    >>> cost.bytes_sent, cost.messages
    (16, 2)

  Args:
    name: the module's path in the model.
    kind: the module's class.
    flops: per node.
    params: per node.
    traffic: bytes sent, [source][destination].
    working_set: activation bytes each node holds for the call.
    single_device_working_set: activation bytes of the call on one device.
  """

  name: str
  kind: str
  flops: tuple[int, ...]
  params: tuple[int, ...]
  traffic: tuple[tuple[int, ...], ...]
  working_set: tuple[int, ...]
  single_device_working_set: int

  @property
  def bytes_sent(self) -> int:
    """Bytes crossing links, over all node pairs."""
    return int(sum(map(sum, self.traffic)))

  @property
  def messages(self) -> int:
    """Ordered node pairs that exchange anything."""
    return sum(1 for row in self.traffic for value in row if value)

  @property
  def calls(self) -> int:
    """Collective calls that carry the layer's traffic.

    The program (`disco.exchange`) sends the pairs of one shift
    (destination - source, modulo the nodes) and one length in one
    `ppermute`; pairs of one shift have distinct sources and destinations.

    Example (node 0 sends 8 bytes, node 1 sends 4: two lengths, two calls):
      >>> cost = LayerCost("head", "DiscoDense", (40, 40), (20, 20),
      ...                  ((0, 8), (4, 0)), (40, 40), 56)
      >>> cost.messages, cost.calls
      (2, 2)
    """
    nodes = len(self.traffic)
    return len(
      {
        ((j - i) % nodes, sent)
        for i, row in enumerate(self.traffic)
        for j, sent in enumerate(row)
        if sent
      }
    )


@dataclasses.dataclass(frozen=True)
class CostReport:
  """The costs of one inference, per layer and in total.

  Example:
    >>> import jax.numpy as jnp
    >>> from flax import nnx
    >>> from disco.layers import DiscoDense
    >>> report = count(DiscoDense(8, 4, num_nodes=2, rngs=nnx.Rngs(0)),
    ...                input_shape=(1, 8))
    >>> report.flops, report.bytes_sent
    (64, 40)

  Args:
    num_nodes: number of nodes.
    layers: one entry per observed call, in call order, then the output
      gather.
    shared_params: parameters counted on every node.
    total_params: parameters of the whole model.
    itemsize: bytes per value.
  """

  num_nodes: int
  layers: tuple[LayerCost, ...]
  shared_params: int
  total_params: int
  itemsize: int

  @property
  def flops(self) -> int:
    """FLOPs over all nodes."""
    return int(sum(sum(layer.flops) for layer in self.layers))

  @property
  def flops_per_node(self) -> tuple[int, ...]:
    """FLOPs of each node."""
    return tuple(
      int(sum(layer.flops[j] for layer in self.layers))
      for j in range(self.num_nodes)
    )

  @property
  def bytes_sent(self) -> int:
    """Bytes over all links."""
    return int(sum(layer.bytes_sent for layer in self.layers))

  @property
  def params_per_node(self) -> tuple[int, ...]:
    """Parameters each node holds."""
    return tuple(
      self.shared_params + int(sum(layer.params[j] for layer in self.layers))
      for j in range(self.num_nodes)
    )

  @property
  def memory_per_node(self) -> tuple[int, ...]:
    """Bytes of parameters plus the largest working set, per node."""
    return tuple(
      self.params_per_node[j] * self.itemsize
      + max(layer.working_set[j] for layer in self.layers)
      for j in range(self.num_nodes)
    )

  @property
  def single_device_memory(self) -> int:
    """The same measure for the whole model on one device."""
    return self.total_params * self.itemsize + max(
      layer.single_device_working_set for layer in self.layers
    )

  def summary(self) -> dict:
    """Totals as plain numbers (per node: the busiest node)."""
    return {
      "num_nodes": self.num_nodes,
      "flops": self.flops,
      "flops_per_node": max(self.flops_per_node),
      "bytes_sent": self.bytes_sent,
      "params_per_node": max(self.params_per_node),
      "memory_per_node": max(self.memory_per_node),
      "total_params": self.total_params,
    }

  def table(self) -> str:
    """A per-layer table: FLOPs, bytes sent, parameters of the busiest node."""
    lines = [f"{'layer':40} {'kind':20} {'MFLOPs':>9} {'KB sent':>9} "]
    lines[0] += f"{'params/node':>12}"
    for layer in self.layers:
      lines.append(
        f"{layer.name:40.40} {layer.kind:20.20} "
        f"{sum(layer.flops) / 1e6:9.3f} {layer.bytes_sent / 1e3:9.3f} "
        f"{max(layer.params):12d}"
      )
    return "\n".join(lines)


def count(model: nnx.Module, input_shape=None, *, itemsize: int = 4):
  """Counts the costs of one inference of `model` on one input.

  Example:
    >>> from flax import nnx
    >>> from disco.models import ResNet, ResNetConfig
    >>> model = ResNet(ResNetConfig(num_nodes=2), rngs=nnx.Rngs(0))
    >>> count(model).num_nodes
    2

  Args:
    model: a model (or layer) built from DISCO layers; its parameters may be
      abstract (`nnx.eval_shape`), its masks must be concrete.
    input_shape: shape of the input, batch first; by default the model's
      `config` gives (1, image_size, image_size, in_channels). A batch of
      b counts b inferences (every figure b times batch 1's).
    itemsize: bytes per activation value sent or held.

  Returns:
    a `CostReport`.

  Raises:
    MetricsError: no input shape is known, the model has no DISCO layer
      or abstract masks, or itemsize is not a positive int.
  """
  modules, num_nodes, calls, outputs = _checked_trace(
    model, input_shape, itemsize
  )
  costs = [modules[path].cost(x.shape, y.shape) for path, x, y in calls]
  traffic = _tensor_traffic(calls, costs, num_nodes, itemsize)
  layers = []
  for (path, x, y), cost, sent in zip(calls, costs, traffic, strict=True):
    layers.append(
      LayerCost(
        name=".".join(str(p) for p in path) or type(model).__name__,
        kind=type(modules[path]).__name__,
        flops=cost.flops,
        params=cost.params,
        traffic=_rows(sent),
        working_set=tuple(
          (i + o) * itemsize
          for i, o in zip(cost.inputs, cost.outputs, strict=True)
        ),
        single_device_working_set=(math.prod(x.shape) + math.prod(y.shape))
        * itemsize,
      )
    )
  for name, split, shape in outputs:
    layers.append(_output_gather(name, split, shape, num_nodes, itemsize))
  total, shared = _param_counts(model, {path for path, _, _ in calls})
  return CostReport(num_nodes, tuple(layers), shared, total, itemsize)


def group_bytes(
  model: nnx.Module, input_shape=None, *, itemsize: int = 4
) -> list[np.ndarray]:
  """The bytes one inference sends for each channel group, per mask group.

  A group (destination j, channel c of another node) sends every position
  of channel c of each tensor read through its mask. Where masks of
  different layers read one tensor, `count` sends a channel once for all
  of them and this counts it for each: the figures bound the bytes from
  above, and equal them where no two masks read one tensor (every model
  in `disco.models`).

  Example:
    >>> from flax import nnx
    >>> from disco.layers import DiscoConv
    >>> conv = DiscoConv(4, 4, (3, 3), num_nodes=2, rngs=nnx.Rngs(0))
    >>> group_bytes(conv, (1, 5, 5, 4))[0].tolist()  # 25 positions x 4 B
    [[0, 0, 100, 100], [100, 100, 0, 0]]

  Args:
    model: a model built from DISCO layers, masks concrete.
    input_shape: as for `count`.
    itemsize: bytes per value sent.

  Returns:
    one int (nodes, channels) array per mask group in
    `disco.prune.mask_groups` order: bytes for a group's bit, 0 elsewhere.

  Raises:
    MetricsError: as `count`.
  """
  modules, _, calls, _ = _checked_trace(model, input_shape, itemsize)
  read = {}  # mask id -> {tensor id: positions of the tensor}
  for path, x, _ in calls:
    module = modules[path]
    if isinstance(module, DiscoLayer) and not module.replicated_input:
      read.setdefault(id(module.mask), {})[id(x)] = positions(x.shape)
  # `disco.prune.mask_groups`' order (prune reads this module: no import
  # back): distinct masks with channel groups, in module order.
  crosses = {}
  for _, module in nnx.iter_modules(model):
    if isinstance(module, DiscoLayer) and module.cross().any():
      crosses.setdefault(id(module.mask), module.cross())
  return [
    np.where(cross, sum(read.get(key, {}).values()), 0) * itemsize
    for key, cross in crosses.items()
  ]


def with_masks(model: nnx.Module, keep: bool) -> nnx.Module:
  """A copy of `model` with every mask bit set to `keep`.

  `with_masks(model, True)` is dense channel parallelism of the same
  weights; `with_masks(model, False)` is one independent group per node.

  Example:
    >>> from flax import nnx
    >>> from disco.layers import DiscoDense
    >>> dense = with_masks(DiscoDense(4, 4, num_nodes=2, rngs=nnx.Rngs(0)),
    ...                    keep=True)

  Args:
    model: a model built from DISCO layers.
    keep: the value of every mask bit.
  """
  _require_model(model)
  copy = nnx.clone(model)
  for mask in _masks(copy):
    mask.set_value(jnp.full(mask.shape, keep))
  return copy


def compare(model: nnx.Module, input_shape=None, *, itemsize: int = 4):
  """The model's costs beside dense channel parallelism and one device.

  Example:
    >>> from flax import nnx
    >>> from disco.models import ResNet, ResNetConfig
    >>> model = ResNet(ResNetConfig(num_nodes=2), rngs=nnx.Rngs(0))
    >>> compare(model)["dense"]["bytes_sent"] > 0
    True

  Args:
    model: a model built from DISCO layers.
    input_shape: as for `count`.
    itemsize: bytes per value.

  Returns:
    {"disco": ..., "dense": ..., "single_device": ...}, each a `summary()`
    dictionary; the single device holds the dense model and sends nothing.
  """
  disco = count(model, input_shape, itemsize=itemsize)
  dense = count(with_masks(model, True), input_shape, itemsize=itemsize)
  return {
    "disco": disco.summary(),
    "dense": dense.summary(),
    "single_device": single_device_summary(dense),
  }


def single_device_summary(dense: CostReport) -> dict:
  """`CostReport.summary()` figures for the dense model on one device.

  Example:
    >>> from flax import nnx
    >>> from disco.layers import DiscoDense
    >>> dense = count(DiscoDense(8, 4, num_nodes=2, rngs=nnx.Rngs(0)),
    ...               input_shape=(1, 8))
    >>> single_device_summary(dense)["params_per_node"]
    36

  Args:
    dense: the report of the model with all masks one.
  """
  return {
    "num_nodes": 1,
    "flops": dense.flops,
    "flops_per_node": dense.flops,
    "bytes_sent": 0,
    "params_per_node": dense.total_params,
    "memory_per_node": dense.single_device_memory,
    "total_params": dense.total_params,
  }


@dataclasses.dataclass(frozen=True)
class LatencyModel:
  """Time per inference from compute rate, link bandwidth and latency.

  Layers run one after another. A layer takes the slowest node's FLOPs at
  `flops_per_second`, plus, when it communicates, `message_latency` per
  collective call (`LayerCost.calls`: the program sends the pairs of one
  shift and one length in one call, and calls run one after another) and
  the slowest sender's bytes at `bytes_per_second` (each node has its own
  link). Compute and communication do not overlap: an upper bound. With
  `shared` the nodes share one link (a bus, or one throttled loopback):
  all senders' bytes then pass it one after another.

  A call's fixed cost on a real link (software, synchronisation, the
  round trip) is not the wire's: `experiments.disco_latency` fits it, with
  the bandwidth, from ppermute calls timed on the link itself.

  With `burst_bytes` the link is a token bucket (`tc ... tbf rate R burst
  B`) and inferences run back to back: a layer's bytes up to the burst
  pass at once, only those beyond it at `bytes_per_second`; and no
  inference passes more bytes than the rate allows over its time, so the
  latency is at least a link's bytes at the rate. Without it (a wire)
  every byte goes at `bytes_per_second`.

  Example:
    >>> from flax import nnx
    >>> from disco.layers import DiscoDense
    >>> report = count(DiscoDense(8, 4, num_nodes=2, rngs=nnx.Rngs(0)),
    ...                input_shape=(1, 8))
    >>> link = LatencyModel(1e9, 1e6, 1e-3)
    >>> round(link.latency(report), 6)
    0.002024

  Args:
    flops_per_second: compute rate of one node.
    bytes_per_second: bandwidth of a node's link.
    message_latency: seconds added per collective call.
    shared: the nodes share one link of `bytes_per_second`.
    burst_bytes: the burst of a token-bucket link; None: a wire.
  """

  flops_per_second: float
  bytes_per_second: float
  message_latency: float
  shared: bool = False
  burst_bytes: float | None = None

  def __post_init__(self):
    # Rates of 0 divided by zero; negative ones gave negative latencies.
    for name in ("flops_per_second", "bytes_per_second"):
      require_number(name, getattr(self, name), True, MetricsError)
    require_number("message_latency", self.message_latency, False, MetricsError)
    if self.burst_bytes is not None:
      require_number("burst_bytes", self.burst_bytes, False, MetricsError)

  def layer_times(self, report: CostReport) -> list[tuple[float, float]]:
    """(compute seconds, communication seconds) per layer."""
    times = []
    for layer in report.layers:
      compute = max(layer.flops) / self.flops_per_second
      sends = [sum(row) for row in layer.traffic]
      sent = sum(sends) if self.shared else max(sends)
      if self.burst_bytes is not None:
        sent = max(0, sent - self.burst_bytes)
      calls = layer.calls * self.message_latency
      times.append((compute, calls + sent / self.bytes_per_second))
    return times

  def latency(self, report: CostReport) -> float:
    """Seconds per inference on the nodes."""
    seconds = float(sum(c + s for c, s in self.layer_times(report)))
    if self.burst_bytes is None:
      return seconds
    senders = np.sum(
      [np.sum(layer.traffic, axis=1) for layer in report.layers], 0
    )
    link_bytes = float(np.sum(senders) if self.shared else np.max(senders))
    return max(seconds, link_bytes / self.bytes_per_second)

  def single_device_latency(self, report: CostReport) -> float:
    """Seconds per inference of the same FLOPs on one device."""
    return report.flops / self.flops_per_second


def _input_shape(model, input_shape):
  if input_shape is not None:
    return tuple(input_shape)
  config = getattr(model, "config", None)
  if config is None or not hasattr(config, "image_size"):
    raise MetricsError(
      f"pass input_shape: {type(model).__name__} has no config.image_size"
    )
  size = config.image_size
  return (1, size, size, config.in_channels)


class _Outputs(OneDevice):
  """One-device ops that note every output the forward gathers."""

  def __init__(self, names):
    self.names = names
    self.seen = []  # (name, split, shape)

  def output(self, layer, x):
    y = layer(x)
    self.seen.append((self.names[id(layer)], layer.out_split, y.shape))
    return y


def _checked_trace(model, input_shape, itemsize):
  """`count`'s checks, then `_trace`: (modules by path, nodes, calls,
  outputs)."""
  _require_model(model)
  require_int("itemsize", itemsize, 1, MetricsError)
  require_concrete_masks(model, MetricsError)
  input_shape = _input_shape(model, input_shape)
  modules = dict(nnx.iter_modules(model))
  layers = [m for m in modules.values() if isinstance(m, DiscoLayer)]
  if not layers:
    raise MetricsError(f"{type(model).__name__} has no DISCO layer to count")
  num_nodes = layers[0].num_nodes
  return (modules, num_nodes, *_trace(model, input_shape, num_nodes))


def _trace(model, input_shape, num_nodes):
  """Runs the forward abstractly.

  Returns (path, x, y) per observed call, and (name, split, shape) per
  output gathered on node 0: those `ops.output` receives when the model
  has a `forward(x, ops)`, else the model's output split evenly.
  """
  graphdef, state = nnx.split(model)
  calls = []
  outputs = []

  def forward(state, x):
    # A copy, so the hook and any batch-norm update stay inside the trace.
    clone = nnx.merge(graphdef, state, copy=True)
    for path, module in nnx.iter_modules(clone):
      if isinstance(module, Observed):
        module.observer = lambda _, x, y, path=path: calls.append((path, x, y))
    if not hasattr(clone, "forward"):
      return clone(x)
    names = {id(m): ".".join(map(str, p)) for p, m in nnx.iter_modules(clone)}
    ops = _Outputs(names)
    y = clone.forward(x, ops)
    outputs.extend(ops.seen)
    return y

  x = jax.ShapeDtypeStruct(input_shape, jnp.float32)
  output = jax.eval_shape(forward, state, x)
  if not outputs:
    channels = output.shape[-1]
    split = split_channels(channels, num_nodes, what="model outputs")
    outputs.append(("", split, output.shape))
  return calls, outputs


def _tensor_traffic(calls, costs, num_nodes, itemsize):
  """Bytes [source, destination] per call; a tensor's channels cross once."""
  traffic = [np.zeros((num_nodes, num_nodes), np.int64) for _ in calls]
  first_reader = {}
  union = {}
  for index, ((_, x, _), cost) in enumerate(zip(calls, costs, strict=True)):
    if cost.extra_traffic is not None:
      traffic[index] += cost.extra_traffic * itemsize
    if cost.receives is None:
      continue
    # The tracer object identifies the tensor; `calls` keeps it alive.
    key = id(x)
    first_reader.setdefault(key, index)
    if key in union:
      union[key] = (union[key][0] | cost.receives, cost)
    else:
      union[key] = (cost.receives, cost)
  for key, (receives, cost) in union.items():
    owner = np.eye(num_nodes, dtype=np.int64)[cost.in_owner]
    channels = receives.astype(np.int64) @ owner  # [destination, source]
    traffic[first_reader[key]] += channels.T * cost.in_positions * itemsize
  return traffic


def _output_gather(name, split, shape, num_nodes, itemsize):
  """An output, split like its layer's outputs, gathered on node 0."""
  per_channel = math.prod(shape[:-1]) * itemsize
  traffic = np.zeros((num_nodes, num_nodes), np.int64)
  for node in range(1, num_nodes):
    traffic[node, 0] = split.sizes[node] * per_channel
  return LayerCost(
    name=f"(output {name} gathered to node 0)".replace("output  ", "output "),
    kind="gather",
    flops=(0,) * num_nodes,
    params=(0,) * num_nodes,
    traffic=_rows(traffic),
    working_set=(0,) * num_nodes,
    single_device_working_set=0,
  )


def _param_counts(model, observed_paths):
  """(all parameters, parameters outside observed modules)."""
  total = shared = 0
  for path, param in nnx.to_flat_state(nnx.state(model, nnx.Param)):
    size = math.prod(param.shape)
    total += size
    if not any(path[: len(p)] == p for p in observed_paths):
      shared += size
  return total, shared


def _require_model(model) -> None:
  if not isinstance(model, nnx.Module):
    raise MetricsError(
      f"expected a model built from DISCO layers, got {type(model).__name__}"
    )


def _masks(model):
  return [mask for _, mask in nnx.to_flat_state(nnx.state(model, CommMask))]


def _rows(matrix) -> tuple[tuple[int, ...], ...]:
  return tuple(tuple(int(v) for v in row) for row in matrix)
