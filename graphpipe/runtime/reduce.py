"""Gradient sums over each data-parallel stage's devices: a ring all-reduce.

  sums = ring_sum(slots, groups, num_devices, axis)   # inside shard_map

For a group of n devices (positions 0..n-1, the stage's device order) each
flat slot is padded to n chunks of C elements and summed the way the cost
model prices an all-reduce (`AnalyticCostModel.allreduce_time`: 2 (n - 1)
sends of C elements per device, not n - 1 whole copies):

  reduce-scatter, steps t = 0 .. n-2: position i sends its partial sum of
    chunk (i - t) mod n to position i + 1, which adds its own values of
    that chunk; position i then holds the whole sum of chunk (i + 1) mod n
    (added in position order, starting at the chunk's own index);
  all-gather, steps t = 0 .. n-2: position i sends the whole chunk
    (i + 1 - t) mod n to position i + 1, which keeps it.

Every chunk is summed once, on one device, and copied to the others, so
the replicas hold the same bits (their parameters and optimizer states
stay identical). One SPMD program serves groups of several sizes: the ring
of each size runs on every device (its `ppermute`s move data only between
the devices of groups of that size) and each device keeps its own group's
result. A device alone in its stage keeps its gradients as they are.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax.numpy as jnp
import numpy as np
from jax import lax


def ring_sum(
  values: tuple,
  groups: Sequence[Sequence[int]],
  num_devices: int,
  axis: str,
) -> tuple:
  """Each flat array of `values` summed over this device's group (traced).

  Args:
    values: this device's flat arrays (the same shapes on every device).
    groups: per stage, its devices (positions in this order).
    num_devices: devices of the mesh axis.
    axis: the mesh axis name.
  """
  sizes = sorted({len(g) for g in groups if len(g) > 1})
  if not sizes:
    return values
  position, size = places(groups, num_devices)
  me = lax.axis_index(axis)
  pos, mine = jnp.asarray(position)[me], jnp.asarray(size)[me]
  out = values
  for n in sizes:
    ring = ring_pairs(groups, n)
    # Devices of other groups run this ring on their own values too (one
    # program); what they compute is dropped below.
    at = jnp.mod(pos, n)
    summed = tuple(_ring(v, n, at, ring, axis) for v in values)
    out = tuple(
      jnp.where(mine == n, s, o) for s, o in zip(summed, out, strict=True)
    )
  return out


def _ring(value, n: int, at, ring, axis: str):
  """`value` summed over a ring of n devices; `at` is this device's place."""
  length = value.shape[0]
  return all_gather(
    reduce_scatter(value, n, at, ring, axis), n, at, ring, axis
  )[:length]


def reduce_scatter(value, n: int, at, ring, axis: str):
  """The first half of the ring: `value` padded to n chunks, and the whole
  sum of chunk `owned_chunk(at, n)` over the ring (traced; [chunk])."""
  length = value.shape[0]
  chunk = -(-length // n)
  own = jnp.pad(value, (0, n * chunk - length)).reshape(n, chunk)
  partial = own
  for t in range(n - 1):
    sent = lax.ppermute(partial[jnp.mod(at - t, n)], axis, ring)
    c = jnp.mod(at - 1 - t, n)
    partial = partial.at[c].set(sent + own[c])
  return partial[owned_chunk(at, n)]


def all_gather(chunk, n: int, at, ring, axis: str):
  """The second half: every device's `chunk` (chunk `owned_chunk(at, n)`
  of the whole) sent round the ring; the n chunks in order, flat."""
  partial = jnp.zeros((n, chunk.shape[0]), chunk.dtype)
  partial = partial.at[owned_chunk(at, n)].set(chunk)
  for t in range(n - 1):
    sent = lax.ppermute(partial[jnp.mod(at + 1 - t, n)], axis, ring)
    partial = partial.at[jnp.mod(at - t, n)].set(sent)
  return partial.reshape(-1)


def owned_chunk(at, n: int):
  """The chunk the device at place `at` of a ring of n sums."""
  return jnp.mod(at + 1, n)


def places(groups: Sequence[Sequence[int]], num_devices: int):
  """Per device, its place in its group and its group's size (numpy)."""
  position = np.zeros(num_devices, np.int32)
  size = np.ones(num_devices, np.int32)
  for g in groups:
    for i, d in enumerate(g):
      position[d], size[d] = i, len(g)
  return position, size


def ring_pairs(groups: Sequence[Sequence[int]], n: int) -> list:
  """The ppermute pairs of the rings of the groups of size n."""
  return [
    (g[i], g[(i + 1) % n]) for g in groups if len(g) == n for i in range(n)
  ]
