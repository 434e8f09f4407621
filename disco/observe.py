"""A hook through which `disco.metrics` sees what each costly module does.

Costs per inference (FLOPs, bytes between nodes) depend on the input shape
each layer sees, which only a forward pass knows. Modules that have a cost
derive from `Observed`, call `self.observe(inputs, outputs)` at the end of
`__call__`, and say in `cost` what one call costs each node. The hook is off
(`observer is None`) in normal use; `disco.metrics` turns it on only on a
throwaway copy of the model that it traces abstractly with `jax.eval_shape`,
so nothing is computed or stored.
"""

import dataclasses
import math

import numpy as np
from flax import nnx


@dataclasses.dataclass(frozen=True, eq=False)
class OpCost:
  """What one call of an observed module costs, per node, for one input.

  Example:
    >>> OpCost(flops=(8, 8), params=(4, 4), inputs=(2, 2), outputs=(2, 2))
    OpCost(flops=(8, 8), params=(4, 4), inputs=(2, 2), outputs=(2, 2), ...)

  Args:
    flops: multiply-adds x 2 each node performs.
    params: parameters each node holds for this module.
    inputs: input values each node holds for the call (own + received).
    outputs: output values each node writes.
    receives: boolean (nodes, in_channels): node j receives input channel c
      over a link. None when no channel crosses.
    in_owner: the node owning each input channel (with `receives`).
    in_positions: values per input channel (pixels or tokens).
    extra_traffic: (nodes, nodes) values sent source -> destination that no
      mask governs (e.g. LayerNorm statistics); None when there are none.
  """

  flops: tuple[int, ...]
  params: tuple[int, ...]
  inputs: tuple[int, ...]
  outputs: tuple[int, ...]
  receives: np.ndarray | None = None
  in_owner: np.ndarray | None = None
  in_positions: int = 0
  extra_traffic: np.ndarray | None = None

  def __repr__(self):
    return (
      f"OpCost(flops={self.flops}, params={self.params}, "
      f"inputs={self.inputs}, outputs={self.outputs}, ...)"
    )


def positions(shape) -> int:
  """Values per channel of a (1, ..., channels) array: pixels or tokens."""
  return math.prod(shape[:-1])


class Observed(nnx.Module):
  """Base class of modules whose per-inference cost disco.metrics counts.

  Example:
    >>> import jax.numpy as jnp
    >>> class Double(Observed):
    ...   def __call__(self, x):
    ...     y = 2 * x
    ...     self.observe(x, y)
    ...     return y
    >>> seen = []
    >>> layer = Double()
    >>> layer.observer = lambda module, x, y: seen.append(x.shape)
    >>> _ = layer(jnp.ones((1, 3)))
    >>> seen
    [(1, 3)]
  """

  observer = None

  def observe(self, inputs, outputs) -> None:
    """Reports one call to the observer, if one is set.

    Args:
      inputs: the array the module read (the one whose channels may cross
        nodes).
      outputs: the array it produced.
    """
    if self.observer is not None:
      self.observer(self, inputs, outputs)

  def cost(self, input_shape, output_shape) -> OpCost:
    """What one call on one input (batch 1) costs each node.

    Args:
      input_shape: shape of the input the call saw, batch first.
      output_shape: shape of its output.
    """
    raise NotImplementedError(f"{type(self).__name__} does not define cost")
