"""How the channels of one tensor are split over the nodes.

DISCO gives every node a contiguous block of the channels of every tensor
(any sizes, at least one channel each). Contiguous blocks lose nothing: any
other assignment is the same network with its channels relabelled.
"""

import dataclasses
import numbers

import numpy as np

from disco.errors import PartitionError


@dataclasses.dataclass(frozen=True)
class Split:
  """Contiguous blocks of channels, one per node.

  Example:
    >>> split = Split((3, 2))
    >>> split.indices(1)
    array([3, 4])
    >>> split.owner()
    array([0, 0, 0, 1, 1])

  Args:
    sizes: number of channels of each node, in node order.
  """

  sizes: tuple[int, ...]

  def __post_init__(self):
    sizes = tuple(int(s) for s in self.sizes)
    if not sizes or min(sizes) < 1:
      raise PartitionError(
        f"split sizes {self.sizes} must be at least 1 for every node"
      )
    object.__setattr__(self, "sizes", sizes)

  @property
  def num_nodes(self) -> int:
    """Number of nodes the channels are split over."""
    return len(self.sizes)

  @property
  def channels(self) -> int:
    """Total number of channels."""
    return sum(self.sizes)

  def start(self, node: int) -> int:
    """First channel of `node`."""
    return sum(self.sizes[:node])

  def indices(self, node: int) -> np.ndarray:
    """The channels `node` owns, ascending."""
    start = self.start(node)
    return np.arange(start, start + self.sizes[node])

  def owner(self) -> np.ndarray:
    """For every channel, the node that owns it."""
    return np.repeat(np.arange(self.num_nodes), self.sizes)

  def owns(self) -> np.ndarray:
    """Boolean (num_nodes, channels): [j, c] is true when node j owns c."""
    return self.owner()[None, :] == np.arange(self.num_nodes)[:, None]


def split_channels(
  channels: int, num_nodes: int, sizes=None, *, what: str = "channels"
) -> Split:
  """An even split of `channels` over `num_nodes`, or a given one checked.

  An even split gives the first `channels % num_nodes` nodes one channel
  more than the others.

  Example:
    >>> split_channels(10, 4).sizes
    (3, 3, 2, 2)

  Args:
    channels: number of channels of the tensor.
    num_nodes: number of nodes.
    sizes: optional explicit sizes (any split), which must sum to `channels`.
    what: names the tensor in error messages.

  Raises:
    PartitionError: fewer channels than nodes, or sizes that do not match.
  """
  if isinstance(num_nodes, bool) or not isinstance(num_nodes, numbers.Integral):
    raise PartitionError(f"num_nodes must be an int, got {num_nodes!r}")
  if num_nodes < 1:
    raise PartitionError(f"num_nodes must be at least 1, got {num_nodes}")
  if sizes is not None:
    split = sizes if isinstance(sizes, Split) else Split(tuple(sizes))
    if split.num_nodes != num_nodes or split.channels != channels:
      raise PartitionError(
        f"split {split.sizes} of the {what} does not cover {channels} "
        f"channels over {num_nodes} nodes"
      )
    return split
  if channels < num_nodes:
    raise PartitionError(
      f"cannot split {channels} {what} over {num_nodes} nodes: every node "
      "needs at least one channel of every layer; use fewer nodes or a "
      "wider layer"
    )
  base, extra = divmod(channels, num_nodes)
  return Split(tuple(base + (n < extra) for n in range(num_nodes)))


def concatenated(splits) -> Split:
  """The split of tensors concatenated node by node (see `disco.ops`).

  Node j holds its block of every tensor, one after another, so the
  concatenation's block j is as wide as node j's blocks together.

  Example:
    >>> concatenated([Split((2, 2)), Split((3, 1))]).sizes
    (5, 3)

  Args:
    splits: the `Split` of each tensor, all over the same nodes.

  Raises:
    PartitionError: splits over different numbers of nodes.
  """
  splits = list(splits)
  if not splits or len({s.num_nodes for s in splits}) != 1:
    raise PartitionError(
      "tensors concatenated by channels must be split over the same nodes, "
      f"got {[s.sizes for s in splits]}"
    )
  return Split(
    tuple(sum(s.sizes[j] for s in splits) for j in range(splits[0].num_nodes))
  )
