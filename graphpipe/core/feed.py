"""What each device of the step is fed: its own rows of its own leaves.

The SPMD step takes the mini-batch as one vector of 32-bit words per
device (one shape on every device: the longest device's length). A device
is fed only the batch leaves its stage reads (`Node.batch_inputs`), and of
those only its replica's rows of each of its stage's micro-batches:

  device d, replica r of the k devices of stage s, whose micro-batches
  take `size` samples (chunk = size / k on each device), M_s of them:
    for each leaf the stage reads, by name:
      a block of M_s pieces; piece j = rows [j size + r chunk,
      j size + (r + 1) chunk) of the leaf, chunk x (bytes per sample)
      padded to whole words

so a device holds B / k rows of what its stage reads instead of the whole
mini-batch on every device. The memory rule (`graphpipe.core.memory`) and
the runtime (`graphpipe.runtime.feed` packs the words on the host and
reads them back in the step) both use these blocks, so their figures are
the same.

Example:
  >>> from graphpipe.core.graph import InputSpec
  >>> inputs = [InputSpec("x", (3,), "float32"), InputSpec("y", (), "int8")]
  >>> feeds = device_feeds(inputs, [(("x",), (0, 1), 4), (("y",), (2,), 8)],
  ...                      num_devices=3, batch_size=8)
  >>> feeds[1].rows(1)        # replica 1 of stage 0, its micro-batch 1
  (6, 8)
  >>> feeds[1].blocks         # 2 samples x 3 floats a piece, 2 pieces
  (Block(name='x', shape=(3,), dtype='float32', offset=0, words=6),)
  >>> feeds[2].blocks[0].words, feeds[2].words   # 8 int8 labels: 2 words
  (2, 2)
  >>> feed_words(feeds)
  12
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

from graphpipe.core.graph import InputSpec, OpGraph
from graphpipe.core.stages import Plan

ITEMSIZE = {
  "float64": 8,
  "int64": 8,
  "uint64": 8,
  "float32": 4,
  "int32": 4,
  "uint32": 4,
  "float16": 2,
  "bfloat16": 2,
  "int16": 2,
  "uint16": 2,
  "int8": 1,
  "uint8": 1,
  "bool": 1,
}


def itemsize(dtype: str) -> int:
  """Bytes of one element of `dtype` (8 for dtypes this table lacks)."""
  return ITEMSIZE.get(dtype, 8)


@dataclasses.dataclass(frozen=True)
class Block:
  """One leaf in a device's feed: `words` per piece, from `offset` on."""

  name: str
  shape: tuple[int, ...]  # per sample
  dtype: str
  offset: int  # first word of piece 0
  words: int  # per piece (chunk samples, padded to a word)


@dataclasses.dataclass(frozen=True)
class DeviceFeed:
  """What one device is fed (no blocks: a device without a stage)."""

  replica: int
  chunk: int  # samples a piece
  size: int  # samples of its stage's micro-batch
  microbatches: int  # pieces per block
  blocks: tuple[Block, ...]

  @property
  def words(self) -> int:
    return sum(b.words for b in self.blocks) * self.microbatches

  def rows(self, microbatch: int) -> tuple[int, int]:
    """The mini-batch rows [start, stop) of piece `microbatch`."""
    start = microbatch * self.size + self.replica * self.chunk
    return start, start + self.chunk


def device_feeds(
  inputs: Sequence[InputSpec],
  stages: Sequence[tuple[Sequence[str], Sequence[int], int]],
  num_devices: int,
  batch_size: int,
) -> tuple[DeviceFeed, ...]:
  """Per device, its feed (module docstring).

  Args:
    inputs: the batch leaves (per-sample shapes).
    stages: per stage, (leaves it reads, its devices, its micro-batch size).
    num_devices: devices of the step.
    batch_size: samples of the mini-batch.
  """
  specs = {i.name: i for i in inputs}
  feeds = [DeviceFeed(0, 0, 0, 0, ())] * num_devices
  for names, devices, size in stages:
    chunk = size // len(devices)
    for replica, device in enumerate(devices):
      blocks, offset = [], 0
      for name in sorted(set(names)):
        spec = specs[name]
        words = _piece_words(spec, chunk)
        blocks.append(Block(name, tuple(spec.shape), spec.dtype, offset, words))
        offset += words * (batch_size // size)
      feeds[device] = DeviceFeed(
        replica, chunk, size, batch_size // size, tuple(blocks)
      )
  return tuple(feeds)


def feed_words(feeds: Sequence[DeviceFeed]) -> int:
  """Words of the step's per-device batch vector (the longest feed)."""
  return max([1] + [f.words for f in feeds])


def plan_feeds(graph: OpGraph, plan: Plan) -> tuple[DeviceFeed, ...]:
  """The feeds of `plan`'s step, from the leaves its nodes read."""
  stages = [
    (
      {k for n in s.nodes for k in graph.nodes[n].batch_inputs},
      s.devices,
      s.micro_batch_size,
    )
    for s in plan.stages
  ]
  return device_feeds(graph.inputs, stages, plan.num_devices, plan.batch_size)


def plan_feed_words(graph: OpGraph, plan: Plan) -> int:
  """`feed_words(plan_feeds(graph, plan))`, without building the feeds
  (the planners price thousands of plans)."""
  specs = {i.name: i for i in graph.inputs}
  words = 1
  for s in plan.stages:
    names = {k for n in s.nodes for k in graph.nodes[n].batch_inputs}
    chunk = s.micro_batch_size // len(s.devices)
    per = sum(_piece_words(specs[name], chunk) for name in names)
    words = max(words, per * (plan.batch_size // s.micro_batch_size))
  return words


def _piece_words(spec: InputSpec, chunk: int) -> int:
  """32-bit words of `chunk` samples of leaf `spec` (padded to a word)."""
  return -(-chunk * math.prod(spec.shape) * itemsize(spec.dtype) // 4)
