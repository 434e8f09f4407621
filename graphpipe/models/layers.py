"""Building blocks of the model zoo: configs, MLPs and transformer layers.

Every layer here is an NNX module whose `__call__` calls its child modules
one after another, so that `graphpipe.capture` (which groups equations by the
path of the module whose `__call__` produced them) sees one node per layer at
the depth the zoo registers. `ZooConfig` is the base of every zoo `Config`.
"""

import dataclasses
from collections.abc import Iterable, Sequence
from typing import Self

import jax
import jax.numpy as jnp
from flax import nnx

from graphpipe.errors import ModelConfigError
from graphpipe.models.attention import dot_product_attention


def check_sizes(config) -> None:
  """Raises unless every integer field of a config dataclass is positive.

  Called from each zoo `Config.__post_init__`, so that a zero branch count
  fails here with the field's name rather than deep inside JAX.

  Example:
    `mmt.Config(num_branches=0)` raises "mmt.Config.num_branches must be a
    positive int, got 0".

  Args:
    config: a frozen dataclass instance.
  """
  for field in dataclasses.fields(config):
    value = getattr(config, field.name)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
      owner = type(config).__module__.rsplit(".", 1)[-1]
      raise ModelConfigError(
        f"{owner}.{type(config).__name__}.{field.name} must be a positive "
        f"int, got {value!r}"
      )


class ZooConfig:
  """Base of the zoo's frozen `Config` dataclasses: checked sizes, `paper()`.

  Every field is a size and must be a positive int (`check_sizes`); the
  field defaults are the paper's configuration.

  Example:
    >>> @dataclasses.dataclass(frozen=True)
    ... class Config(ZooConfig):
    ...   num_layers: int = 4
    >>> Config.paper().num_layers
    4
  """

  def __post_init__(self):
    check_sizes(self)

  @classmethod
  def paper(cls) -> Self:
    """The evaluation configuration: every field at its default."""
    return cls()


class TransformerConfig(ZooConfig):
  """A `ZooConfig` with `hidden` and `num_heads`; the heads divide the width.

  Example:
    `mmt.Config(hidden=30, num_heads=4)` raises "hidden=30 is not divisible
    by num_heads=4; ...".
  """

  def __post_init__(self):
    super().__post_init__()
    if self.hidden % self.num_heads:
      raise ModelConfigError(
        f"hidden={self.hidden} is not divisible by num_heads="
        f"{self.num_heads}; pick a head count that divides the width"
      )


class FeedForwardLayer(nnx.Module):
  """One feed-forward layer: `relu(x @ W + b)`.

  Example:
    >>> layer = FeedForwardLayer(8, 16, rngs=nnx.Rngs(0))
    >>> layer(jnp.ones((2, 8))).shape
    (2, 16)

  Args:
    in_features: width of the input.
    out_features: width of the output.
    rngs: random state for the weight initialisation.
  """

  def __init__(self, in_features: int, out_features: int, *, rngs: nnx.Rngs):
    self.linear = nnx.Linear(in_features, out_features, rngs=rngs)

  def __call__(self, x: jax.Array) -> jax.Array:
    return jax.nn.relu(self.linear(x))


def feed_forward_layers(
  sizes: Sequence[int], *, activate_last: bool, rngs: nnx.Rngs
) -> nnx.List:
  """The layers of a feed-forward stack through the widths `sizes`.

  Example:
    >>> layers = feed_forward_layers([8, 16, 1], activate_last=False,
    ...                              rngs=nnx.Rngs(0))
    >>> [type(layer).__name__ for layer in layers]
    ['FeedForwardLayer', 'Linear']

  Args:
    sizes: input width followed by the output width of every layer, so
      `len(sizes) - 1` layers.
    activate_last: whether the last layer has a ReLU too; a stack that ends
      in logits or a regression output does not.
    rngs: random state for the weight initialisation.

  Returns:
    An `nnx.List` of `FeedForwardLayer` (and a final `nnx.Linear` when
    `activate_last` is false).
  """
  if len(sizes) < 2:
    raise ModelConfigError(
      f"a feed-forward stack needs at least one layer, got widths {sizes}"
    )
  pairs = list(zip(sizes[:-1], sizes[1:], strict=True))
  layers = [FeedForwardLayer(i, o, rngs=rngs) for i, o in pairs[:-1]]
  last_in, last_out = pairs[-1]
  if activate_last:
    layers.append(FeedForwardLayer(last_in, last_out, rngs=rngs))
  else:
    layers.append(nnx.Linear(last_in, last_out, rngs=rngs))
  return nnx.List(layers)


def apply_in_sequence(layers: Iterable[nnx.Module], x: jax.Array) -> jax.Array:
  """Calls every layer on the previous layer's output, first to last."""
  for layer in layers:
    x = layer(x)
  return x


def concat_branches(
  branches: Sequence[nnx.Module], inputs: Sequence[jax.Array], kind: str
) -> jax.Array:
  """Each branch on its own input, in order, concatenated along features.

  Example:
    >>> branches = [MLP([8, 16], rngs=nnx.Rngs(0)),
    ...             MLP([4, 32], rngs=nnx.Rngs(1))]
    >>> inputs = [jnp.ones((2, 8)), jnp.ones((2, 4))]
    >>> concat_branches(branches, inputs, "feature").shape   # 16 + 32
    (2, 48)

  Args:
    branches: the branch modules.
    inputs: one input per branch.
    kind: what the inputs are, for the error message ('modality', ...).

  Raises:
    ModelConfigError: the counts of branches and inputs differ.
  """
  if len(inputs) != len(branches):
    raise ModelConfigError(
      f"the model has {len(branches)} branches but got "
      f"{len(inputs)} {kind} inputs"
    )
  return jnp.concatenate(
    [branch(x) for branch, x in zip(branches, inputs, strict=True)],
    axis=-1,
  )


class MLP(nnx.Module):
  """A chain of feed-forward layers, each its own module (and graph node).

  Example:
    >>> mlp = MLP([8, 32, 32], rngs=nnx.Rngs(0))
    >>> mlp(jnp.ones((2, 8))).shape
    (2, 32)

  Args:
    sizes: input width followed by the output width of every layer.
    activate_last: whether the last layer has a ReLU (see
      `feed_forward_layers`).
    rngs: random state for the weight initialisation.
  """

  def __init__(
    self,
    sizes: Sequence[int],
    *,
    activate_last: bool = True,
    rngs: nnx.Rngs,
  ):
    self.layers = feed_forward_layers(
      sizes, activate_last=activate_last, rngs=rngs
    )

  def __call__(self, x: jax.Array) -> jax.Array:
    return apply_in_sequence(self.layers, x)


class SelfAttention(nnx.Module):
  """Bidirectional multi-head self-attention over (batch, seq, hidden).

  Written out with einsums rather than `nnx.MultiHeadAttention` or
  `jax.nn.dot_product_attention` so the traced jaxpr holds plain matmuls and
  a softmax that any backend can run and any cost model can count.

  Example:
    >>> attention = SelfAttention(16, 2, rngs=nnx.Rngs(0))
    >>> attention(jnp.ones((2, 8, 16))).shape
    (2, 8, 16)

  Args:
    hidden: model width; must be divisible by `num_heads`.
    num_heads: number of attention heads.
    rngs: random state for the weight initialisation.
  """

  def __init__(self, hidden: int, num_heads: int, *, rngs: nnx.Rngs):
    if hidden % num_heads:
      raise ModelConfigError(
        f"hidden width {hidden} is not divisible by {num_heads} heads"
      )
    self.num_heads = num_heads
    self.qkv = nnx.Linear(hidden, 3 * hidden, rngs=rngs)
    self.out = nnx.Linear(hidden, hidden, rngs=rngs)

  def __call__(self, x: jax.Array) -> jax.Array:
    batch, seq, hidden = x.shape
    head_dim = hidden // self.num_heads
    qkv = self.qkv(x).reshape(batch, seq, 3, self.num_heads, head_dim)
    query, key, value = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]
    context = dot_product_attention(query, key, value)
    return self.out(context.reshape(batch, seq, hidden))


class TransformerFFN(nnx.Module):
  """The position-wise feed-forward block: `gelu(x @ W1 + b1) @ W2 + b2`.

  Example:
    >>> ffn = TransformerFFN(16, 32, rngs=nnx.Rngs(0))
    >>> ffn(jnp.ones((2, 8, 16))).shape
    (2, 8, 16)

  Args:
    hidden: model width (input and output).
    ffn: width of the inner layer.
    rngs: random state for the weight initialisation.
  """

  def __init__(self, hidden: int, ffn: int, *, rngs: nnx.Rngs):
    self.up = nnx.Linear(hidden, ffn, rngs=rngs)
    self.down = nnx.Linear(ffn, hidden, rngs=rngs)

  def __call__(self, x: jax.Array) -> jax.Array:
    return self.down(jax.nn.gelu(self.up(x)))


class TransformerLayer(nnx.Module):
  """A pre-LN transformer layer: attention and FFN, each with a residual.

  `x + attention(ln1(x))`, then `h + ffn(ln2(h))`. This is the paper's
  "[multi-head attention + 2 linear]" block.

  Example:
    >>> layer = TransformerLayer(16, 2, 32, rngs=nnx.Rngs(0))
    >>> layer(jnp.ones((2, 8, 16))).shape
    (2, 8, 16)

  Args:
    hidden: model width.
    num_heads: number of attention heads (divides `hidden`).
    ffn: width of the FFN's inner layer.
    rngs: random state for the weight initialisation.
  """

  def __init__(self, hidden: int, num_heads: int, ffn: int, *, rngs: nnx.Rngs):
    self.ln1 = nnx.LayerNorm(hidden, rngs=rngs)
    self.attention = SelfAttention(hidden, num_heads, rngs=rngs)
    self.ln2 = nnx.LayerNorm(hidden, rngs=rngs)
    self.ffn = TransformerFFN(hidden, ffn, rngs=rngs)

  def __call__(self, x: jax.Array) -> jax.Array:
    x = x + self.attention(self.ln1(x))
    return x + self.ffn(self.ln2(x))


class TransformerStack(nnx.Module):
  """`num_layers` transformer layers applied one after another.

  No input projection and no final norm, so a stack is exactly its layers:
  one branch of the multi-branch transformers, or the whole body of the
  sequential one.

  Example:
    >>> stack = TransformerStack(2, 16, 2, 32, rngs=nnx.Rngs(0))
    >>> stack(jnp.ones((2, 8, 16))).shape
    (2, 8, 16)

  Args:
    num_layers: number of transformer layers.
    hidden: model width.
    num_heads: number of attention heads.
    ffn: width of each FFN's inner layer.
    rngs: random state for the weight initialisation.
  """

  def __init__(
    self,
    num_layers: int,
    hidden: int,
    num_heads: int,
    ffn: int,
    *,
    rngs: nnx.Rngs,
  ):
    self.layers = nnx.List(
      [
        TransformerLayer(hidden, num_heads, ffn, rngs=rngs)
        for _ in range(num_layers)
      ]
    )

  def __call__(self, x: jax.Array) -> jax.Array:
    return apply_in_sequence(self.layers, x)
