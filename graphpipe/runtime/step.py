"""The pipelined training step: one SPMD program over a 1-D device mesh.

    for tick in schedule:                        # lax.scan over ticks
      write what arrived last tick into the activation / gradient stashes
      F = forward[tick, my_device]               # e.g. 2F0, or skip
      lax.switch(F):                             # each device its own code
        inputs <- activation stash, batch rows
        outputs, loss <- the stage's node jaxprs; residuals -> residual stash
        sends <- rows of each output edge matrix, for the successors
      B = backward[tick, my_device]              # e.g. 2B0, or skip
      lax.switch(B):
        cotangents <- gradient stash (sent by successors' B)
        grads of params (accumulated) and of inputs <- VJP of the stage
        sends <- rows of the input gradients, for the predecessors
      for channel in channels:                   # fixed permutations
        inbox[channel] = lax.ppermute(sends[channel])   # fan-out / fan-in
    gradients: sum over each data-parallel stage's devices (fixed order)
    loss: psum; optimizer: optax on each device's parameter slots

Every per-device difference lives in static tables indexed by tick and
device, so the scan body is one program. What a device computes at tick t
is readable by its receivers from tick t + 1.

The loop's shape is dictated by how XLA keeps the big buffers (stashes,
gradient accumulators) in place: it copies a buffer that is read and then
updated in one iteration, and one that a conditional's branches update in
different combinations (one branch the residuals, another the gradients).
So the stashes are written at the start of a tick, before anything reads
them, and forward and backward are two conditionals, each of which updates
one thing. Parameters live in slots (`graphpipe.runtime.slots`) because a
slice of a flat buffer is a copy on XLA:CPU.
"""

from __future__ import annotations

import dataclasses
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from graphpipe.program import Program
from graphpipe.runtime import packing, slots
from graphpipe.runtime.layout import Layout, PipelineRuntimeError
from graphpipe.runtime.slots import SlotLayout
from graphpipe.runtime.tables import build_tables, make_channels
from graphpipe.schedule import Schedule

AXIS = "pipe"


class Operands(NamedTuple):
  """What every branch of the tick's two `lax.switch`es receives."""

  params: tuple  # this device's parameter slots
  state: tuple  # its non-trainable variable slots
  batch: dict  # the whole batch, replicated
  act: jax.Array  # activation stash (all slots, flat)
  grad: jax.Array  # gradient stash
  res: jax.Array  # residual stash
  gacc: tuple  # accumulated parameter gradients, slots like `params`
  loss: jax.Array  # accumulated loss
  microbatch: jax.Array  # the action's micro-batch
  act_slot: jax.Array  # its slots in the three stashes
  grad_slot: jax.Array
  res_slot: jax.Array


@dataclasses.dataclass(frozen=True)
class Buffers:
  """Sizes (float32 elements) of the per-device buffers; all devices alike.

  `params` and `state` are the slot layouts of the trainable and the
  non-trainable variables (`graphpipe.runtime.slots`).
  """

  params: SlotLayout
  state: SlotLayout
  act_slot: int
  act_slots: int
  grad_slot: int
  grad_slots: int
  res_slot: int
  res_slots: int
  channel: int
  channels: int

  def stash_bytes(self) -> int:
    return 4 * (
      self.act_slot * self.act_slots
      + self.grad_slot * self.grad_slots
      + self.res_slot * self.res_slots
    )


class StepBuilder:
  """Builds the tables and the shard_map body of a pipelined step.

  Args:
    layout: the static layout (stages, edges, transfers).
    schedule: the schedule to run (its grid is the tick table).
    program: the captured program (node jaxprs), re-traced per chunk size.
    recompute: recompute each stage's forward in its backward (stash only
      the stage inputs) instead of stashing the forward's residuals.
    loss_reduction: 'mean' (the loss averages over samples) or 'sum'.
  """

  def __init__(
    self,
    layout: Layout,
    schedule: Schedule,
    program: Program,
    *,
    recompute: bool = False,
    loss_reduction: str = "mean",
    batch_size: int,
  ):
    if loss_reduction not in ("mean", "sum"):
      raise PipelineRuntimeError(
        f"loss_reduction must be 'mean' or 'sum', got {loss_reduction!r}"
      )
    self.layout = layout
    self.schedule = schedule
    self.recompute = recompute
    self.loss_reduction = loss_reduction
    self.batch_size = batch_size
    self.programs = {
      s.chunk: program.at_batch_size(s.chunk) for s in layout.stages
    }
    self.consts = program.consts
    self.device_stage = layout.stage_of_device()
    self._residual_avals = {}
    self._channels = make_channels(layout)
    self.channels = self._channels.groups
    self.channel_of = self._channels.channel_of
    self._make_tables()

  # Static structure.

  def stage_function(self, stage: int):
    """f(params, acts_block, batch_rows) -> (outputs block, loss)."""
    s = self.layout.stages[stage]
    program = self.programs[s.chunk]
    edges = self.layout.edges
    in_offsets = self.layout.in_offsets(stage)

    def f(params: dict, acts_block, batch: dict):
      env = dict(self.consts)
      env.update(params)
      env.update(batch)
      for e in s.in_edges:
        edge = edges[e]
        start = in_offsets[e]
        width = edge.width
        matrix = lax.dynamic_slice_in_dim(acts_block, start, s.chunk * width)
        matrix = matrix.reshape(s.chunk, width)
        col = 0
        for v in edge.values:
          env[v.key] = packing.from_rows(
            matrix[:, col : col + v.width], v, s.chunk
          )
          col += v.width
      for n in s.nodes:
        node = program.nodes[n]
        outs = node(*[env[k] for k in node.inputs])
        env.update(zip(node.outputs, outs, strict=True))
      blocks = []
      for e in s.out_edges:
        rows = [
          packing.to_rows(env[v.key], v, s.chunk) for v in edges[e].values
        ]
        if edges[e].token:
          rows = [jnp.zeros((s.chunk, 1), jnp.float32)]
        blocks.append(jnp.concatenate(rows, axis=1).reshape(-1))
      out = jnp.concatenate(blocks) if blocks else jnp.zeros((0,), jnp.float32)
      loss = sum(
        (env[k].astype(jnp.float32) for k in s.loss_keys),
        jnp.zeros((), jnp.float32),
      )
      return out, loss

    return f

  def _make_tables(self):
    lay = self.layout
    ticks = build_tables(lay, self.schedule, self._channels, self.recompute)
    self.tables = ticks.arrays
    self.branch_devices = ticks.branch_devices
    self.buffers = Buffers(
      params=slots.plan_slots(self._variables("params")),
      state=slots.plan_slots(self._variables("state")),
      act_slot=max(1, max(lay.in_size(s.id) for s in lay.stages)),
      act_slots=max(1, ticks.act_slots),
      grad_slot=max(1, max(lay.out_size(s.id) for s in lay.stages)),
      grad_slots=max(1, ticks.grad_slots),
      res_slot=max(
        [1]
        + (
          []
          if self.recompute
          else [self._residual_size(s.id) for s in lay.stages]
        )
      ),
      res_slots=max(1, ticks.res_slots),
      channel=self._channels.size,
      channels=max(1, len(self.channels)),
    )

  def _variables(self, kind):
    """Per stage, (key, elements) of its `kind` ('params' or 'state')."""
    shapes = self.layout.param_shapes
    return [
      [(k, math.prod(shapes[k][0])) for k in getattr(s, kind)]
      for s in self.layout.stages
    ]

  # Residuals (when not recomputing).

  def _abstract_inputs(self, stage):
    lay = self.layout
    s = lay.stages[stage]
    params = {
      k: jax.ShapeDtypeStruct(*lay.param_shapes[k]) for k in s.params + s.state
    }
    acts = jax.ShapeDtypeStruct((max(1, lay.in_size(stage)),), jnp.float32)
    program = self.programs[s.chunk]
    batch_avals = {}
    for node in program.nodes:
      for k, a in zip(node.inputs, node.input_avals(), strict=True):
        if k.startswith("batch:"):
          batch_avals[k] = jax.ShapeDtypeStruct(a.shape, a.dtype)
    batch = {k: batch_avals[k] for k in s.batch}
    return params, acts, batch

  def _vjp_parts(self, stage, params, acts, batch):
    """(outputs, loss), residual leaves, their treedef, param positions."""
    s = self.layout.stages[stage]
    f = self.stage_function(stage)
    trainable = {k: params[k] for k in s.params}
    frozen = {k: params[k] for k in s.state}

    def diff(p, a):
      return f({**p, **frozen}, a, batch)

    outs, vjp = jax.vjp(diff, trainable, acts)
    leaves, treedef = jax.tree.flatten(vjp)
    param_ids = {id(v): k for k, v in trainable.items()}
    keep = [i for i, x in enumerate(leaves) if id(x) not in param_ids]
    sources = {
      i: param_ids[id(x)] for i, x in enumerate(leaves) if id(x) in param_ids
    }
    return outs, leaves, treedef, keep, sources

  def _residual_size(self, stage):
    params, acts, batch = self._abstract_inputs(stage)
    info = {}

    def probe(params, acts, batch):
      _, leaves, _, keep, _ = self._vjp_parts(stage, params, acts, batch)
      info["avals"] = [
        jax.ShapeDtypeStruct(leaves[i].shape, leaves[i].dtype) for i in keep
      ]
      return 0

    jax.eval_shape(probe, params, acts, batch)
    self._residual_avals[stage] = info["avals"]
    return sum(math.prod(a.shape) for a in info["avals"])

  # The per-device branches.

  def _loss_weight(self, stage) -> float:
    s = self.layout.stages[stage]
    if self.loss_reduction == "sum":
      return 1.0
    return s.chunk / self.batch_size

  def _read_variables(self, ops, stage):
    """(trainable, frozen) values of `stage` from the device's slots."""
    s, shapes = self.layout.stages[stage], self.layout.param_shapes
    return (
      slots.read(ops.params, self.buffers.params, stage, s.params, shapes),
      slots.read(ops.state, self.buffers.state, stage, s.state, shapes),
    )

  def _batch_rows(self, stage, device, batch, mb):
    s = self.layout.stages[stage]
    replica = s.devices.index(device)
    start = mb * self.layout.micro_batch_size + replica * s.chunk
    return {
      k: lax.dynamic_slice_in_dim(batch[k[len("batch:") :]], start, s.chunk)
      for k in s.batch
    }

  def _sends(self, device, vector=None, offsets=None, *, forward=True):
    """[channels, channel size]: what `device` sends after an action.

    Forward: rows of its output edge matrices (`vector`, blocks at
    `offsets`) to the successors' devices; backward: rows of the gradients
    of its input edge matrices to the predecessors' devices.
    """
    sends = jnp.zeros(
      (self.buffers.channels, self.buffers.channel), jnp.float32
    )
    for tr in self.layout.transfers:
      mine, other, row = (
        (tr.src_device, tr.dst_device, tr.src_row)
        if forward
        else (tr.dst_device, tr.src_device, tr.dst_row)
      )
      if mine != device:
        continue
      width = self.layout.edges[tr.edge].width
      start = offsets[tr.edge] + row * width
      piece = vector[start : start + tr.rows * width]
      channel = self.channel_of[(device, other)]
      sends = sends.at[channel].set(packing.pad_to(piece, self.buffers.channel))
    return sends

  def _forward_branch(self, device):
    stage = self.device_stage[device]
    lay, buf = self.layout, self.buffers
    in_size, out_offsets = lay.in_size(stage), lay.out_offsets(stage)
    weight = self._loss_weight(stage)
    f = self.stage_function(stage)

    def branch(ops):
      trainable, frozen = self._read_variables(ops, stage)
      acts = lax.dynamic_slice_in_dim(
        ops.act, ops.act_slot * buf.act_slot, in_size
      )
      rows = self._batch_rows(stage, device, ops.batch, ops.microbatch)
      res = ops.res
      if self.recompute:
        out, stage_loss = f({**trainable, **frozen}, acts, rows)
      else:
        (out, stage_loss), leaves, _, keep, _ = self._vjp_parts(
          stage, {**trainable, **frozen}, acts, rows
        )
        kept = packing.pad_to(
          packing.pack_leaves([leaves[i] for i in keep]), buf.res_slot
        )
        res = lax.dynamic_update_slice_in_dim(
          res, kept, ops.res_slot * buf.res_slot, 0
        )
      sends = self._sends(device, out, out_offsets, forward=True)
      return res, ops.loss + weight * stage_loss, sends

    return branch

  def _backward_branch(self, device):
    stage = self.device_stage[device]
    lay, buf = self.layout, self.buffers
    s = lay.stages[stage]
    in_size, out_size = lay.in_size(stage), lay.out_size(stage)
    in_offsets = lay.in_offsets(stage)
    weight = self._loss_weight(stage) if s.loss_keys else 0.0
    f = self.stage_function(stage)

    def branch(ops):
      trainable, frozen = self._read_variables(ops, stage)
      rows = self._batch_rows(stage, device, ops.batch, ops.microbatch)
      if self.recompute:
        acts = lax.dynamic_slice_in_dim(
          ops.act, ops.act_slot * buf.act_slot, in_size
        )
        _, vjp = jax.vjp(
          lambda p, a: f({**p, **frozen}, a, rows), trainable, acts
        )
      else:
        blank = jnp.zeros((in_size,), jnp.float32)
        _, leaves, treedef, keep, _ = self._vjp_parts(
          stage, {**trainable, **frozen}, blank, rows
        )
        # Each residual is sliced straight from the stash: slicing the
        # whole slot first would copy it.
        at = ops.res_slot * buf.res_slot
        for i, aval in zip(keep, self._residual_avals[stage], strict=True):
          size = math.prod(aval.shape)
          stored = lax.dynamic_slice_in_dim(ops.res, at, size)
          leaves[i] = packing.from_f32(stored, str(aval.dtype)).reshape(
            aval.shape
          )
          at = at + size
        vjp = jax.tree.unflatten(treedef, leaves)
      cotangent = lax.dynamic_slice_in_dim(
        ops.grad, ops.grad_slot * buf.grad_slot, out_size
      )
      grad_params, grad_acts = vjp(
        (cotangent, jnp.asarray(weight, jnp.float32))
      )
      gacc = slots.accumulate(ops.gacc, buf.params, stage, grad_params)
      sends = self._sends(device, grad_acts, in_offsets, forward=False)
      return gacc, sends

    return branch

  def branches(self):
    """([skip, F of d0, F of d1, ...], [skip, B of d0, ...]) to switch on."""

    def skip_forward(ops):
      return ops.res, ops.loss, self._sends(None)

    def skip_backward(ops):
      return ops.gacc, self._sends(None)

    forward, backward = [skip_forward], [skip_backward]
    for d in self.branch_devices:
      forward.append(self._forward_branch(d))
      backward.append(self._backward_branch(d))
    return forward, backward

  # The body.

  def gradients_and_loss(self, params, state, batch):
    """Inside shard_map: this device's reduced gradients and the loss."""
    buf = self.buffers
    me = lax.axis_index(AXIS)
    forward, backward = self.branches()
    tables = {k: jnp.asarray(v) for k, v in self.tables.items()}

    def write(buffer, data, start, length, enable):
      window = lax.dynamic_slice_in_dim(buffer, start, buf.channel)
      keep = (jnp.arange(buf.channel) < length) & enable
      return lax.dynamic_update_slice_in_dim(
        buffer, jnp.where(keep, data, window), start, 0
      )

    def tick(carry, row):
      act, grad, res, gacc, loss, inbox = carry
      mine = {k: v[me] for k, v in row.items()}
      # What arrived at the end of the last tick goes into the stashes
      # first: written before they are read, they stay in place.
      for c in range(len(self.channels)):
        valid = mine["recv_valid"][c] == 1
        is_grad = mine["recv_grad"][c] == 1
        length = mine["recv_len"][c]
        slot, offset = mine["recv_slot"][c], mine["recv_offset"][c]
        act = write(
          act,
          inbox[c],
          slot * buf.act_slot + offset,
          length,
          valid & ~is_grad,
        )
        grad = write(
          grad,
          inbox[c],
          slot * buf.grad_slot + offset,
          length,
          valid & is_grad,
        )
      ops = Operands(
        params,
        state,
        batch,
        act,
        grad,
        res,
        gacc,
        loss,
        mine["mb"],
        mine["act_slot"],
        mine["grad_slot"],
        mine["res_slot"],
      )
      res, loss, forward_sends = lax.switch(mine["forward"], forward, ops)
      gacc, backward_sends = lax.switch(
        mine["backward"], backward, ops._replace(res=res)
      )
      # A device runs at most one action a tick; `where` keeps the bits of
      # bit-cast integers that an add could change.
      sends = jnp.where(mine["forward"] > 0, forward_sends, backward_sends)
      inbox = jnp.stack(
        [
          lax.ppermute(sends[c], AXIS, perm)
          for c, perm in enumerate(self.channels)
        ]
        or [jnp.zeros((buf.channel,), jnp.float32)]
      )
      return (act, grad, res, gacc, loss, inbox), None

    zeros = lambda n: jnp.zeros((n,), jnp.float32)
    carry = (
      zeros(buf.act_slot * buf.act_slots + buf.channel),
      zeros(buf.grad_slot * buf.grad_slots + buf.channel),
      zeros(buf.res_slot * buf.res_slots),
      tuple(zeros(n) for n in buf.params.sizes),
      jnp.zeros((), jnp.float32),
      jnp.zeros((buf.channels, buf.channel), jnp.float32),
    )
    (_, _, _, gacc, loss, _), _ = lax.scan(tick, carry, tables)
    return self._reduce_replicas(gacc), lax.psum(loss, AXIS)

  def _reduce_replicas(self, gacc):
    """Sums gradients over each data-parallel stage's devices, in order."""
    groups = [s.devices for s in self.layout.stages]
    largest = max(len(g) for g in groups)
    if largest == 1:
      return gacc
    num_devices = self.layout.num_devices
    position = np.zeros(num_devices, np.int32)
    size = np.ones(num_devices, np.int32)
    for g in groups:
      for i, d in enumerate(g):
        position[d], size[d] = i, len(g)
    me = lax.axis_index(AXIS)
    pos, n = jnp.asarray(position)[me], jnp.asarray(size)[me]
    # received[k] on the device at position i is the gradient of the
    # device at position (i + k) mod n of its group.
    received = [gacc]
    for k in range(1, largest):
      perm = [
        (g[(i + k) % len(g)], g[i])
        for g in groups
        if len(g) > k
        for i in range(len(g))
      ]
      received.append(lax.ppermute(gacc, AXIS, perm))

    def in_order(*copies):
      stacked = jnp.stack(copies)
      total = jnp.zeros_like(copies[0])
      for j in range(largest):
        k = jnp.mod(j - pos, n)
        total = total + jnp.where(j < n, stacked[k], 0.0)
      return total

    return jax.tree.map(in_order, *received)
