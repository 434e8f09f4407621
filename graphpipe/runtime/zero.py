"""ZeRO-1 stages: optimizer state sharded over a stage's devices.

A 'zero1' stage (`graphpipe.core.stages.Stage.sharding`) on n devices keeps
full parameters on every device (its forward and backward read them every
tick) but only 1/n of the optimizer state. After the micro-batches, in
place of the replicas' ring all-reduce of the gradient slots:

  g_own   <- reduce-scatter of each gradient slot over the stage's ring:
             this device's chunk of every slot, summed over the devices
  p_own   <- the same chunks of the parameter slots
  p_own   <- optimizer step on (g_own, p_own) with this device's state
  slots   <- all-gather of each slot's updated chunks over the ring

The reduce-scatter and the all-gather are the two halves of the ring
all-reduce the replicated layout runs (`graphpipe.runtime.reduce`): the
same bytes on the same links, so ZeRO-1 costs no extra communication; the
all-gather moves updated parameters where the all-reduce moved summed
gradients. ZeRO-2 (gradients sharded too) would save nothing here: the
stage accumulates full gradients over its micro-batches before any
reduction. ZeRO-3 (parameters sharded) would gather the parameters every
tick they are read.

The chunks are cut from the slots themselves, so the update holds no
packed copy of the parameters or gradients. Every other device owns its
whole stage (`graphpipe.core.zero`): its gradients (already summed by the
replicas' all-reduce) and parameters packed end to end, so one optimizer
call on one owned vector serves all devices of the SPMD program, and the
optimizer state is that vector's, not the parameter slots' (it is sized
by the most any device owns, not by the largest stage).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from graphpipe.core.zero import Owned, owned_elements
from graphpipe.runtime import reduce
from graphpipe.runtime.slots import host_slots, host_values


class ZeroOne:
  """The owned layout of a step and its exchange (traced inside
  shard_map).

  Args:
    layout: the step's layout.
    slots: the parameters' slot layout (`Buffers.params`).
  """

  def __init__(self, layout, slots):
    self.layout, self.slots = layout, slots
    self.sizes = {
      s.id: sum(math.prod(layout.param_shapes[k][0]) for k in s.params)
      for s in layout.stages
    }
    self.owned: Owned = owned_elements(
      [
        (self.sizes[s.id], len(s.devices), s.sharding == "zero1")
        for s in layout.stages
      ],
      slots.sizes,
    )
    zero = [s for s in layout.stages if s.sharding == "zero1"]
    self.groups = {
      n: [s.devices for s in zero if len(s.devices) == n]
      for n in self.owned.chunks
    }
    self.position, self.size = reduce.places(
      [s.devices for s in zero], layout.num_devices
    )
    self.stage_of = layout.stage_of_device()
    self.zero_device = np.asarray(
      [
        d in self.stage_of
        and layout.stages[self.stage_of[d]].sharding == "zero1"
        for d in range(layout.num_devices)
      ]
    )

  @property
  def active(self) -> bool:
    """Whether some stage is ZeRO-1."""
    return self.owned.sharded

  def optimizer_input(self):
    """One device's optimizer input, abstract: its parameter slots, or
    its owned vector where a stage is ZeRO-1."""
    if self.active:
      return jax.ShapeDtypeStruct((self.owned.length,), jnp.float32)
    return tuple(
      jax.ShapeDtypeStruct((n,), jnp.float32) for n in self.slots.sizes
    )

  # Traced.

  def _packing(self, me, make, default):
    """`make(stage)` on the devices of stages that are not zero1,
    `default` elsewhere (`lax.switch`)."""
    packed = [s for s in self.layout.stages if s.sharding != "zero1"]
    index = jnp.asarray(
      [
        1 + [s.id for s in packed].index(self.stage_of[d])
        if d in self.stage_of and not self.zero_device[d]
        else 0
        for d in range(self.layout.num_devices)
      ]
    )[me]
    return index, [default] + [make(s.id) for s in packed]

  def _pack(self, values: tuple, me):
    """A device of a stage that is not zero1: its stage's variables of
    its slots `values`, end to end, zero-padded to the owned length."""
    length = self.owned.length

    def make(stage):
      def run(v):
        pieces = []
        for key in self.layout.stages[stage].params:
          slot, offset = self.slots.places[stage][key]
          n = self.slots.lengths[key]
          pieces.append(v[slot][offset : offset + n])
        pieces.append(jnp.zeros((length - self.sizes[stage],), jnp.float32))
        return jnp.concatenate(pieces)

      return run

    index, branches = self._packing(
      me, make, lambda v: jnp.zeros((length,), jnp.float32)
    )
    return lax.switch(index, branches, values)

  def _unpack(self, owned, values: tuple, me) -> tuple:
    """`values` (slots) with a packing device's stage variables read from
    `owned` (`_pack`'s form); other devices' slots as they are."""

    def make(stage):
      def run(v):
        out = list(v)
        at = 0
        for key in self.layout.stages[stage].params:
          slot, offset = self.slots.places[stage][key]
          n = self.slots.lengths[key]
          out[slot] = lax.dynamic_update_slice_in_dim(
            out[slot], owned[at : at + n], offset, 0
          )
          at += n
        return tuple(out)

      return run

    index, branches = self._packing(me, make, lambda v: tuple(v))
    return lax.switch(index, branches, values)

  def _rings(self, me):
    """Per zero1 group size n: (whether this device is in such a group,
    its place in the ring, the ring's ppermute pairs)."""
    pos = jnp.asarray(self.position)[me]
    mine = jnp.asarray(self.size)[me]
    zero = jnp.asarray(self.zero_device)[me]
    for n in self.owned.chunks:
      yield (
        n,
        zero & (mine == n),
        jnp.mod(pos, n),
        reduce.ring_pairs(self.groups[n], n),
      )

  def _fit(self, x, length: int):
    return jnp.pad(x, (0, length - x.shape[0]))[:length]

  def own_gradients(self, grads: tuple, me, axis: str):
    """This device's owned gradient elements, summed over its stage's
    devices: a zero1 device's chunk of every slot (reduce-scattered); any
    other device its whole stage (`grads` already summed by its
    replicas)."""
    out = self._pack(grads, me)
    for n, here, at, ring in self._rings(me):
      chunks = [reduce.reduce_scatter(g, n, at, ring, axis) for g in grads]
      out = jnp.where(here, self._fit(jnp.concatenate(chunks), out.size), out)
    return out

  def own_params(self, params: tuple, me, axis: str):
    """This device's owned parameter elements (the chunks `own_gradients`
    gives it, or its whole stage)."""
    out = self._pack(params, me)
    for n, here, at, _ in self._rings(me):
      k = reduce.owned_chunk(at, n)
      chunks = [_chunk(p, k, n) for p in params]
      out = jnp.where(here, self._fit(jnp.concatenate(chunks), out.size), out)
    return out

  def gather_params(self, owned, params: tuple, me, axis: str) -> tuple:
    """The parameter slots `params` with this device's stage variables
    replaced by the updated owned elements of all its devices."""
    out = list(params)
    for n, here, at, ring in self._rings(me):
      start = 0
      for j, p in enumerate(params):
        c = -(-p.size // n)
        whole = reduce.all_gather(owned[start : start + c], n, at, ring, axis)
        # (where every device is in a ZeRO stage of n devices, the gathered
        # slot is the new one: no select, no copy)
        out[j] = (
          whole[: p.size]
          if self._everyone(n)
          else jnp.where(here, whole[: p.size], out[j])
        )
        start += c
    if self._everyone(None):
      return tuple(out)
    return self._unpack(owned, tuple(out), me)

  def _everyone(self, n: int | None) -> bool:
    """Whether every device is in a ZeRO-1 stage (of `n` devices)."""
    sizes = {
      len(self.layout.stages[self.stage_of[d]].devices)
      if self.zero_device[d]
      else 0
      for d in range(self.layout.num_devices)
    }
    return 0 not in sizes and (n is None or sizes == {n})

  # Host side.

  def assemble(self, rows: np.ndarray, shapes) -> dict:
    """Values by key from every device's owned elements ([devices,
    owned length]): each zero1 stage's slot chunks put back in order."""
    out = {}
    for s in self.layout.stages:
      if s.sharding == "zero1":
        n = len(s.devices)
        whole = [np.zeros(size, np.float32) for size in self.slots.sizes]
        for i, d in enumerate(s.devices):
          k, start = (i + 1) % n, 0
          for j, size in enumerate(self.slots.sizes):
            c = -(-size // n)
            piece = np.asarray(rows[d][start : start + c])
            end = min(size, (k + 1) * c)
            if k * c < size:
              whole[j][k * c : end] = piece[: end - k * c]
            start += c
        out.update(host_values(self.slots, s.id, whole, shapes))
        continue
      packed = np.asarray(rows[s.devices[0]])
      at = 0
      for key in s.params:
        shape, dtype = shapes[key]
        n = math.prod(shape)
        out[key] = packed[at : at + n].reshape(shape).astype(dtype)
        at += n
    return out

  def host_owned(self, values: dict) -> np.ndarray:
    """Inverse of `assemble`: every device's owned elements ([devices,
    owned length], numpy) of the values by key."""
    rows = np.zeros((self.layout.num_devices, self.owned.length), np.float32)
    for s in self.layout.stages:
      if s.sharding != "zero1":
        packed = np.concatenate(
          [np.asarray(values[k], np.float32).reshape(-1) for k in s.params]
          or [np.zeros(0, np.float32)]
        )
        for d in s.devices:
          rows[d, : packed.size] = packed
        continue
      n = len(s.devices)
      whole = host_slots(self.slots, s.id, values)
      for i, d in enumerate(s.devices):
        k = (i + 1) % n
        pieces = []
        for slot in whole:
          c = -(-slot.size // n)
          padded = np.pad(slot, (0, n * c - slot.size))
          pieces.append(padded[k * c : (k + 1) * c])
        owned = np.concatenate(pieces)
        rows[d, : owned.size] = owned
    return rows


def _chunk(p, k, n: int):
  """Chunk k (traced) of n of the flat slot `p`, ceil(size / n) elements,
  zero-padded past the slot's end: sliced in place, without a padded copy
  of the whole slot."""
  c = -(-p.size // n)
  full = p.size // c  # chunks wholly inside the slot (at least 1)
  if full == n:
    return p.reshape(n, c)[k]
  inside = lax.dynamic_slice_in_dim(p, jnp.minimum(k, full - 1) * c, c)
  rest = jnp.pad(p[full * c :], (0, c - (p.size - full * c)))
  return jnp.where(k < full, inside, jnp.where(k == full, rest, 0.0))
