"""What nodes do inside the SPMD program: the sparse exchange and local ops.

Every function here runs inside `jax.shard_map` over the "node" axis, on one
node's channels. The exchange of one tensor before a DISCO layer:

  for each ordered pair (i -> j) whose send list is not empty:  # static
    buffer = x[..., sends(i, j)]         # gathered on node i, compact
    ppermute(buffer, [(i, j)])           # pairs of one shift and one
                                         # length share a call
  layer input on node j = [x | received from 0, 1, ... | zeros]

so only the channels the masks keep cross a link, each pair's buffer has
exactly that pair's length, and a pair with nothing to send sends nothing.
The zeros pad node j's received channels to the most any node receives,
since every device's arrays have one shape. LayerNorm statistics and the
gather of the logits on node 0 are the two other cross-node steps.
"""

import dataclasses
import itertools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from disco.errors import PartitionError
from disco.splits import Split

AXIS = "node"


@dataclasses.dataclass(frozen=True, eq=False)
class Exchange:
  """The static plan of one tensor's exchange between nodes.

  Node i sends node j the channels `sends[i][j]` (global indices,
  ascending): the union of what the layers reading the tensor keep. Node
  j's layer input is its own block padded to `width`, then what it
  received, source by source, padded to `received_width`; `rows(j)` names
  the channel of every position.

  Example:
    >>> from flax import nnx
    >>> from disco.layers import DiscoDense
    >>> layer = DiscoDense(4, 2, num_nodes=2, rngs=nnx.Rngs(0))
    >>> layer.mask[...] = layer.mask[...].at[1, 0].set(False)
    >>> plan = Exchange.of([layer])
    >>> plan.rows(0), plan.rows(1)
    (array([0, 1, 2, 3]), array([ 2,  3,  1, -1]))

  Args:
    split: how the tensor's channels are split over the nodes.
    sends: [source][destination] channel lists.
  """

  split: Split
  sends: tuple[tuple[np.ndarray, ...], ...]

  @classmethod
  def of(cls, layers) -> "Exchange":
    """The plan for a tensor read by `layers` (DISCO layers, one split)."""
    split = layers[0].in_split
    if any(layer.in_split != split for layer in layers):
      raise PartitionError("layers reading one tensor split it differently")
    nodes = range(split.num_nodes)
    sends = tuple(
      tuple(
        np.unique(np.concatenate([layer.sends(i, j) for layer in layers]))
        for j in nodes
      )
      for i in nodes
    )
    return cls(split, sends)

  @property
  def num_nodes(self) -> int:
    """Number of nodes."""
    return self.split.num_nodes

  @property
  def width(self) -> int:
    """Channels of the tensor each device holds (the largest block)."""
    return max(self.split.sizes)

  def received(self, node: int) -> np.ndarray:
    """Channels `node` receives, source by source."""
    lists = [self.sends[i][node] for i in range(self.num_nodes) if i != node]
    # One node has no sources: it receives nothing.
    return np.concatenate([np.zeros(0, int), *lists]).astype(int)

  @property
  def received_width(self) -> int:
    """Received channels each device has room for (the most any node gets)."""
    return max(len(self.received(j)) for j in range(self.num_nodes))

  def rows(self, node: int) -> np.ndarray:
    """The channel at every position of `node`'s layer input; -1: padding."""
    own = self.split.indices(node)
    received = self.received(node)
    return np.concatenate(
      [
        own,
        np.full(self.width - len(own), -1),
        received,
        np.full(self.received_width - len(received), -1),
      ]
    )

  def offset(self, source: int, destination: int) -> int:
    """Where `source`'s channels start among what `destination` receives."""
    return sum(
      len(self.sends[i][destination]) for i in range(source) if i != destination
    )

  def permutations(self) -> list[tuple[tuple[int, int], ...]]:
    """Non-empty pairs grouped into ppermute calls of one buffer length.

    Pairs of one shift (j - i mod N) have distinct sources and destinations,
    so any of them with the same length can share a call.
    """
    groups = {}
    for i, j in itertools.permutations(range(self.num_nodes), 2):
      length = len(self.sends[i][j])
      if length:
        shift = (j - i) % self.num_nodes
        groups.setdefault((shift, length), []).append((i, j))
    return [tuple(pairs) for _, pairs in sorted(groups.items())]


def exchange(x: jax.Array, plan: Exchange) -> jax.Array:
  """Inside shard_map: this node's layer input, [own | received | zeros].

  Example (node 1 receives only channel 1 of node 0's):
    >>> import jax, numpy as np
    >>> from flax import nnx
    >>> from jax.sharding import Mesh, PartitionSpec as P
    >>> from disco.layers import DiscoDense
    >>> layer = DiscoDense(4, 2, num_nodes=2, rngs=nnx.Rngs(0))
    >>> layer.mask[...] = layer.mask[...].at[1, 0].set(False)
    >>> plan = Exchange.of([layer])
    >>> mesh = Mesh(np.array(jax.devices()[:2]), (AXIS,))
    >>> run = jax.shard_map(lambda x: exchange(x, plan), mesh=mesh,
    ...                     in_specs=P(None, AXIS), out_specs=P(None, AXIS))
    >>> run(np.arange(4.0, dtype=np.float32)[None])  # node 0 | node 1
    Array([[0., 1., 2., 3., 2., 3., 1., 0.]], dtype=float32)

  Args:
    x: this node's channels of the tensor, (..., plan.width).
    plan: the tensor's exchange plan.
  """
  if plan.received_width == 0:
    return x
  received = jnp.zeros(x.shape[:-1] + (plan.received_width,), x.dtype)
  for pairs in plan.permutations():
    sources = {i: plan.sends[i][j] - plan.split.start(i) for i, j in pairs}
    buffer = _per_node_take(x, sources)
    got = lax.ppermute(buffer, AXIS, pairs)
    offsets = {j: plan.offset(i, j) for i, j in pairs}
    received = received + _per_node_place(got, offsets, plan.received_width)
  return jnp.concatenate([x, received], axis=-1)


def _per_node_take(x, indices: dict) -> jax.Array:
  """x[..., indices[me]]: static when every source takes the same channels."""
  lists = list(indices.values())
  if all(np.array_equal(lists[0], other) for other in lists[1:]):
    first = lists[0]
    if np.array_equal(first, np.arange(first[0], first[0] + len(first))):
      return x[..., first[0] : first[0] + len(first)]
    return jnp.take(x, first, axis=-1)
  table = np.zeros((lax.axis_size(AXIS), len(lists[0])), int)
  for node, channels in indices.items():
    table[node] = channels
  return jnp.take(x, jnp.asarray(table)[lax.axis_index(AXIS)], axis=-1)


def _per_node_place(got, offsets: dict, width: int) -> jax.Array:
  """`got` at channel offsets[me] of zeros of `width` (zeros elsewhere)."""
  pad = [(0, 0)] * (got.ndim - 1)
  values = set(offsets.values())
  if len(values) == 1:
    start = values.pop()
    return jnp.pad(got, pad + [(start, width - start - got.shape[-1])])
  table = np.zeros(lax.axis_size(AXIS), int)
  for node, start in offsets.items():
    table[node] = start
  start = jnp.asarray(table)[lax.axis_index(AXIS)]
  widened = jnp.pad(got, pad + [(0, width - got.shape[-1])])
  return jnp.roll(widened, start, axis=-1)


def _per_node(values) -> jax.Array | int:
  """values[me]: a Python number when every node has the same."""
  if len(set(values)) == 1:
    return values[0]
  return jnp.asarray(values)[lax.axis_index(AXIS)]


def gather_logits(y: jax.Array, split: Split) -> jax.Array:
  """Inside shard_map: every node's logits, complete on node 0.

  Node i sends its `split.sizes[i]` classes to node 0, one ppermute per
  source (a call may have one pair per destination).

  Example (3 classes on node 0, 2 on node 1, padded to 3):
    >>> import jax, numpy as np
    >>> from jax.sharding import Mesh, PartitionSpec as P
    >>> mesh = Mesh(np.array(jax.devices()[:2]), (AXIS,))
    >>> run = jax.shard_map(lambda y: gather_logits(y, Split((3, 2))),
    ...                     mesh=mesh, in_specs=P(AXIS), out_specs=P(AXIS))
    >>> run(np.array([[1, 2, 3], [4, 5, 0]], np.float32))[0]
    Array([1., 2., 3., 4., 5.], dtype=float32)

  Args:
    y: this node's logits, (..., max(split.sizes)).
    split: how the classes are split over the nodes.
  """
  pieces = [y[..., : split.sizes[0]]]
  for source in range(1, split.num_nodes):
    piece = y[..., : split.sizes[source]]
    pieces.append(lax.ppermute(piece, AXIS, [(source, 0)]))
  return jnp.concatenate(pieces, axis=-1)


def concat(tensors, splits) -> jax.Array:
  """Inside shard_map: this node's blocks of `tensors`, one after another.

  The node's channels of `disco.ops.Ops.concat`: no communication. Each
  tensor is padded to its widest block; the result keeps the real
  channels first and pads to the widest node's total.

  Example (uneven: node 0 holds 2 + 1 channels, node 1 holds 1 + 1):
    >>> import jax, numpy as np
    >>> from jax.sharding import Mesh, PartitionSpec as P
    >>> mesh = Mesh(np.array(jax.devices()[:2]), (AXIS,))
    >>> splits = [Split((2, 1)), Split((1, 1))]
    >>> run = jax.shard_map(lambda a, b: concat([a, b], splits), mesh=mesh,
    ...                     in_specs=P(None, AXIS), out_specs=P(None, AXIS))
    >>> run(np.array([[1, 2, 3, 0]], np.float32),   # a: [1 2] | [3 pad]
    ...     np.array([[4, 5]], np.float32))          # b: [4] | [5]
    Array([[1., 2., 4., 3., 5., 0.]], dtype=float32)

  Args:
    tensors: this node's channels of each tensor, (..., max(split.sizes)).
    splits: how each tensor's channels are split over the nodes.
  """
  if all(len(set(split.sizes)) == 1 for split in splits):
    return jnp.concatenate(tensors, axis=-1)
  nodes = splits[0].num_nodes
  widths = [max(split.sizes) for split in splits]
  zero = sum(widths)  # the index of an appended zero channel
  width = max(sum(split.sizes[j] for split in splits) for j in range(nodes))
  table = np.full((nodes, width), zero)
  for node in range(nodes):
    positions = []
    for k, split in enumerate(splits):
      positions.extend(sum(widths[:k]) + np.arange(split.sizes[node]))
    table[node, : len(positions)] = positions
  padded = jnp.concatenate(
    list(tensors) + [jnp.zeros(tensors[0].shape[:-1] + (1,), tensors[0].dtype)],
    axis=-1,
  )
  return jnp.take(padded, jnp.asarray(table)[lax.axis_index(AXIS)], axis=-1)


@dataclasses.dataclass(frozen=True)
class NormSpec:
  """The static part of a LayerNorm split over nodes.

  Example:
    >>> NormSpec(Split((4, 4)), True, 1e-6).width
    4

  Args:
    split: how its channels are split.
    exchange_stats: exact (statistics exchanged) or per-node statistics.
    epsilon: added to the variance.
  """

  split: Split
  exchange_stats: bool
  epsilon: float

  @property
  def width(self) -> int:
    """Channels each device holds."""
    return max(self.split.sizes)


def layer_norm(x: jax.Array, params: dict, spec: NormSpec) -> jax.Array:
  """Inside shard_map: LayerNorm of this node's channels.

  Every node sends every other node its channels' mean and sum of squared
  deviations per token and combines the N pairs exactly (Chan et al.'s
  parallel variance), or, without `exchange_stats`, uses its own.

  Example (the same function as a dense LayerNorm):
    >>> import jax, numpy as np
    >>> from jax.sharding import Mesh, PartitionSpec as P
    >>> mesh = Mesh(np.array(jax.devices()[:2]), (AXIS,))
    >>> spec = NormSpec(Split((3, 3)), exchange_stats=True, epsilon=1e-6)
    >>> ones = {"scale": np.ones(3, np.float32), "bias": np.zeros(3)}
    >>> run = jax.shard_map(lambda x: layer_norm(x, ones, spec), mesh=mesh,
    ...                     in_specs=P(None, AXIS), out_specs=P(None, AXIS))
    >>> x = np.array([[1, 2, 3, 4, 5, 9]], np.float32)
    >>> dense = (x - x.mean()) / np.sqrt(x.var() + 1e-6)
    >>> bool(np.allclose(run(x), dense, atol=1e-6))
    True

  Args:
    x: this node's channels (..., spec.width); padding channels are zero.
    params: {"scale", "bias"} of this node's channels.
    spec: the norm's static part.
  """
  sizes = spec.split.sizes
  nodes = len(sizes)
  count = _per_node(sizes)
  mean = jnp.sum(x, axis=-1) / count
  deviation = x - mean[..., None]
  if len(set(sizes)) > 1:
    deviation = jnp.where(jnp.arange(spec.width) < count, deviation, 0.0)
  squares = jnp.sum(deviation * deviation, axis=-1)
  if spec.exchange_stats and nodes > 1:
    stats = jnp.stack([mean, squares], axis=-1)
    means, all_squares, counts = [mean], [squares], [count]
    for shift in range(1, nodes):
      pairs = [(i, (i + shift) % nodes) for i in range(nodes)]
      got = lax.ppermute(stats, AXIS, pairs)
      means.append(got[..., 0])
      all_squares.append(got[..., 1])
      counts.append(
        _per_node([sizes[(j - shift) % nodes] for j in range(nodes)])
      )
    total = sum(sizes)
    mean = sum(c * m for c, m in zip(counts, means, strict=True)) / total
    spread = sum(
      c * jnp.square(m - mean) for c, m in zip(counts, means, strict=True)
    )
    variance = (sum(all_squares) + spread) / total
  else:
    variance = squares / count
  normalised = (x - mean[..., None]) * lax.rsqrt(variance + spec.epsilon)[
    ..., None
  ]
  return normalised * params["scale"] + params["bias"]


@dataclasses.dataclass(frozen=True)
class ConvSpec:
  """The static part of a convolution.

  Example:
    >>> ConvSpec((1, 1), "SAME").dilation
    (1, 1)

  Args:
    strides: (height, width) strides.
    padding: "SAME" or "VALID".
    dilation: (height, width) kernel dilation (atrous convolution).
  """

  strides: tuple[int, int]
  padding: str
  dilation: tuple[int, int] = (1, 1)


def conv(x: jax.Array, params: dict, spec: ConvSpec) -> jax.Array:
  """NHWC convolution with this node's kernel rows and bias.

  Example:
    >>> import numpy as np
    >>> p = {"kernel": np.ones((1, 1, 2, 3), np.float32),
    ...      "bias": np.zeros(3, np.float32)}
    >>> x = np.ones((1, 4, 4, 2), np.float32)
    >>> conv(x, p, ConvSpec((1, 1), "SAME"))[0, 0, 0]
    Array([2., 2., 2.], dtype=float32)

  Args:
    x: the layer input (own | received | zeros).
    params: {"kernel", "bias"}.
    spec: strides and padding.
  """
  y = lax.conv_general_dilated(
    x,
    params["kernel"],
    window_strides=spec.strides,
    padding=spec.padding,
    rhs_dilation=spec.dilation,
    dimension_numbers=("NHWC", "HWIO", "NHWC"),
  )
  return y + params["bias"]


def dense(x: jax.Array, params: dict) -> jax.Array:
  """x @ kernel + bias with this node's kernel rows.

  Example:
    >>> import numpy as np
    >>> p = {"kernel": np.eye(2, dtype=np.float32),
    ...      "bias": np.ones(2, np.float32)}
    >>> dense(np.ones((1, 2), np.float32), p)
    array([[2., 2.]], dtype=float32)

  Args:
    x: the layer input (own | received | zeros).
    params: {"kernel", "bias"}.
  """
  return x @ params["kernel"] + params["bias"]
