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
    if (size == n).all():  # every device's own sum: nothing to keep
      return summed
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
  sum of chunk `owned_chunk(at, n)` over the ring (traced; [chunk]).

  One chunk travels: at step t a device sends the partial sum it holds
  (its own chunk at - t to begin with) and adds its own values of chunk
  at - 1 - t to what it receives. Nothing the size of `value` is written
  (a partial-sum array updated in place made XLA copy the input).
  """
  length = value.shape[0]
  chunk = -(-length // n)
  own = (
    value if length == n * chunk else jnp.pad(value, (0, n * chunk - length))
  )
  own = own.reshape(n, chunk)
  carry = lax.dynamic_index_in_dim(own, jnp.mod(at, n), keepdims=False)
  for t in range(n - 1):
    mine = lax.dynamic_index_in_dim(own, jnp.mod(at - 1 - t, n), keepdims=False)
    carry = lax.ppermute(carry, axis, ring) + mine
  return carry


def all_gather(chunk, n: int, at, ring, axis: str):
  """The second half: every device's `chunk` (chunk `owned_chunk(at, n)`
  of the whole) sent round the ring; the n chunks in order, flat.

  At step t a device receives chunk at - t and passes it on at step t + 1;
  the result is written once, each of its n chunks selected from what
  arrived (an array filled in place by the arrivals made XLA copy it into
  the output).
  """
  arrived = []  # arrived[t]: chunk (at - t) mod n
  carry = chunk
  for _ in range(n - 1):
    carry = lax.ppermute(carry, axis, ring)
    arrived.append(carry)
  arrived.append(chunk)  # chunk (at + 1) mod n = (at - (n - 1)) mod n
  return jnp.concatenate(
    [lax.select_n(jnp.mod(at - j, n), *arrived) for j in range(n)]
  )


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
