"""Transformer pieces split over nodes: LayerNorm, self-attention, MLP.

The embedding dimension is split over the nodes along head boundaries: node
j owns whole heads, and the channels of its heads in every embedding-sized
tensor. Attention is then local to a node: its queries, keys and values for
its heads are its own outputs of the Q, K and V projections. The three
projections read the same tensor, so they share one `CommMask`.

LayerNorm normalises over all channels, which live on all nodes. Our choice
(`exchange_stats=True`, the default): every node sends every other node two
floats per token about its channels (the distributed runtime sends their
mean and sum of squared deviations, which combine exactly and stably), and
each node normalises its own channels with the global mean and variance;
this is exact (the same function as a dense LayerNorm) and costs
2 * tokens * 4 bytes per ordered node pair, counted by `disco.metrics`.
With `exchange_stats=False` each node normalises its channels with its own
statistics (a GroupNorm with one group per node): nothing crosses, but the
network is no longer the dense one.

Attention and the MLP write their forward pass once, as `forward(x, ops)`
(`disco.ops`), for one device and for a node of `disco.distributed`.
"""

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from disco.layers import DiscoDense
from disco.observe import Observed, OpCost, positions
from disco.ops import ONE_DEVICE, Ops
from disco.splits import Split, split_channels
from graphpipe.models.attention import dot_product_attention


def head_split(dim: int, num_heads: int, num_nodes: int) -> Split:
  """The split of an embedding of `dim` channels that keeps heads whole.

  Example:
    >>> head_split(192, 3, 2).sizes
    (128, 64)

  Args:
    dim: embedding channels (a multiple of `num_heads`).
    num_heads: attention heads, split evenly over nodes.
    num_nodes: number of nodes.
  """
  heads = split_channels(num_heads, num_nodes, what="attention heads")
  return Split(tuple(h * (dim // num_heads) for h in heads.sizes))


class DiscoLayerNorm(Observed):
  """LayerNorm over channels split across nodes (see the module docstring).

  Example:
    >>> import jax.numpy as jnp
    >>> from flax import nnx
    >>> norm = DiscoLayerNorm(Split((4, 4)), rngs=nnx.Rngs(0))
    >>> norm(jnp.arange(16.0).reshape(2, 8)).shape
    (2, 8)

  Args:
    split: how the channels are split over the nodes.
    exchange_stats: exact LayerNorm with a per-token exchange of statistics
      (True) or per-node statistics and no communication (False).
    epsilon: added to the variance.
    rngs: unused; kept for a uniform layer signature.
  """

  def __init__(
    self,
    split: Split,
    *,
    exchange_stats: bool = True,
    epsilon: float = 1e-6,
    rngs: nnx.Rngs,
  ):
    del rngs
    self.split = split
    self.exchange_stats = exchange_stats
    self.epsilon = epsilon
    self.scale = nnx.Param(jnp.ones((split.channels,), jnp.float32))
    self.bias = nnx.Param(jnp.zeros((split.channels,), jnp.float32))

  def __call__(self, x: jax.Array) -> jax.Array:
    if self.exchange_stats:
      groups = [x]
    else:
      groups = jnp.split(x, np.cumsum(self.split.sizes)[:-1], axis=-1)
    normalised = []
    for group in groups:
      mean = jnp.mean(group, axis=-1, keepdims=True)
      var = jnp.mean(jnp.square(group - mean), axis=-1, keepdims=True)
      normalised.append((group - mean) * jax.lax.rsqrt(var + self.epsilon))
    y = jnp.concatenate(normalised, axis=-1) * self.scale[...] + self.bias[...]
    self.observe(x, y)
    return y

  def cost(self, input_shape, output_shape) -> OpCost:
    """Per-node scale and shift; statistics exchange: see `Observed.cost`."""
    del output_shape
    tokens = positions(input_shape)
    nodes = self.split.num_nodes
    width = np.asarray(self.split.sizes)
    traffic = None
    if self.exchange_stats:
      traffic = 2 * tokens * (1 - np.eye(nodes, dtype=int))
    return OpCost(
      flops=(0,) * nodes,
      params=tuple(int(w) for w in 2 * width),
      inputs=tuple(int(w) for w in tokens * width),
      outputs=tuple(int(w) for w in tokens * width),
      extra_traffic=traffic,
    )


class DiscoSelfAttention(Observed):
  """Multi-head self-attention with heads split over nodes.

  Q, K and V are `DiscoDense` layers sharing one mask; each node attends
  with its own heads only, and `proj` mixes heads across nodes through its
  masked cross-node columns.

  Example:
    >>> import jax.numpy as jnp
    >>> from flax import nnx
    >>> attn = DiscoSelfAttention(16, 4, num_nodes=2, rngs=nnx.Rngs(0))
    >>> attn(jnp.ones((1, 5, 16))).shape
    (1, 5, 16)

  Args:
    dim: embedding channels.
    num_heads: attention heads (a divisor of `dim`).
    num_nodes: number of nodes.
    rngs: random number streams.
  """

  def __init__(self, dim: int, num_heads: int, *, num_nodes: int, rngs):
    self.num_heads = num_heads
    self.head_dim = dim // num_heads
    split = head_split(dim, num_heads, num_nodes)
    self.split = split
    dense = dict(num_nodes=num_nodes, in_split=split, out_split=split)
    self.query = DiscoDense(dim, dim, rngs=rngs, **dense)
    self.key = DiscoDense(dim, dim, mask=self.query.mask, rngs=rngs, **dense)
    self.value = DiscoDense(dim, dim, mask=self.query.mask, rngs=rngs, **dense)
    self.proj = DiscoDense(dim, dim, rngs=rngs, **dense)

  def __call__(self, x: jax.Array) -> jax.Array:
    return self.forward(x, ONE_DEVICE)

  def forward(self, x: jax.Array, ops: Ops) -> jax.Array:
    """Attention on one device, or with a node's own heads (`disco.ops`)."""

    def heads(y):
      # -1: a node holds its own heads (padding heads stay zero).
      return y.reshape(*y.shape[:-1], -1, self.head_dim)

    q, k, v = (
      heads(ops.layer(layer, x)) for layer in (self.query, self.key, self.value)
    )
    attended = dot_product_attention(q, k, v)
    y = ops.layer(self.proj, attended.reshape(attended.shape[:-2] + (-1,)))
    self.observe(x, y)
    return y

  def cost(self, input_shape, output_shape) -> OpCost:
    """The scores and weighted sums (the projections count themselves)."""
    del output_shape
    tokens = positions(input_shape)
    width = np.asarray(self.split.sizes)
    # q @ k^T and weights @ v: 2 matmuls of sequence x sequence x width per
    # input (the batch's inputs do not attend to each other; squaring the
    # batch's tokens counted 8x the FLOPs at batch 64).
    sequence = tokens // input_shape[0]
    flops = 2 * 2 * tokens * sequence * width
    return OpCost(
      flops=tuple(int(f) for f in flops),
      params=(0,) * len(width),
      inputs=tuple(int(w) for w in 3 * tokens * width),
      outputs=tuple(int(w) for w in tokens * width),
    )


class DiscoMLP(nnx.Module):
  """Two DiscoDense layers with a GELU between them.

  Example:
    >>> import jax.numpy as jnp
    >>> from flax import nnx
    >>> mlp = DiscoMLP(Split((4, 4)), 32, rngs=nnx.Rngs(0))
    >>> mlp(jnp.ones((1, 3, 8))).shape
    (1, 3, 8)

  Args:
    split: split of the embedding channels.
    hidden: hidden channels (split evenly).
    rngs: random number streams.
  """

  def __init__(self, split: Split, hidden: int, *, rngs: nnx.Rngs):
    nodes = split.num_nodes
    self.fc1 = DiscoDense(
      split.channels, hidden, num_nodes=nodes, in_split=split, rngs=rngs
    )
    self.fc2 = DiscoDense(
      hidden, split.channels, num_nodes=nodes, out_split=split, rngs=rngs
    )

  def __call__(self, x: jax.Array) -> jax.Array:
    return self.forward(x, ONE_DEVICE)

  def forward(self, x: jax.Array, ops: Ops) -> jax.Array:
    """The MLP on one device or on a node (`disco.ops`)."""
    return ops.layer(self.fc2, nnx.gelu(ops.layer(self.fc1, x)))
