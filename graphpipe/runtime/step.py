"""The pipelined training step: one SPMD program over a 1-D device mesh.

    penalties, seeds <- parameters, the batch's data statistics
    for tick in tables:                          # lax.scan over ticks
      write what arrived last tick into the activation / gradient stashes
      if forward[tick, my_device]:               # e.g. 2F0
        switch to my device's forward:           # each device its own code
          inputs <- activation stash, batch rows
          outputs, sums <- the stage's node jaxprs
          sends <- rows of each output edge matrix, for the successors
        residuals (outputs of matrix products) -> residual stash
        state slots <- the running values it updated (`runtime.running`)
      if backward[tick, my_device]:              # e.g. 2B0, or 2F0+2B0 fused
        switch to my device's backward:
          cotangents <- gradient stash (sent by successors' B), seeds
          grads of params and of inputs <- VJP of the stage
          sends <- rows of the input gradients, for the predecessors
        gradient slots += grads of params
      if anything is sent at this tick:          # the same on all devices
        for channel in channels:                 # fixed permutations
          inbox[channel] = lax.ppermute(sends[channel])  # fan-out / fan-in
    sums: psum; loss = head(sums, data statistics, penalties)
    gradients: (scaled by d loss / d sums where the head is not affine)
      + the penalties' gradients; shared parameters' parts summed across
      their holder stages (`graphpipe.runtime.shared`); ring all-reduce
      over each data-parallel stage's devices; optimizer: optax on slots

Before the loop, each stage's first device computes the loss's
parameter-only terms (penalties) it owns, and every device the seed of
the backward, d loss / d sums (`graphpipe.frontend.loss_form`): where the
head is affine in the sums it does not depend on them; a single sum under
another function is seeded with 1 and the gradients scaled at the end.

Every per-device difference lives in static tables indexed by tick and
device, so the scan body is one program. What a device computes at tick t
is readable by its receivers from tick t + 1. A sink stage's forward and
the backward at the next tick run as one action where nothing else runs
(`tables.fuse_ticks`): a one-stage 1F1B step is a scan of value-and-grad.
Stages with different micro-batch sizes need nothing else here: the tables
put the k pieces a larger stage collects at their rows of one activation
slot, and route the k gradient pieces it returns, each on its own channel.

The loop's shape is dictated by what XLA:CPU keeps in place. It copies a
whole buffer (stash, gradient slots) that is read and then updated in one
iteration, and one that two branches of a conditional update (two devices'
forwards, or forward and backward): so stashes are written at the start of
a tick, before anything reads them, and each update sits in a two-way
conditional (skip, or compute and update) around a switch whose branches
return new values only. Parameters live in slots (`graphpipe.runtime.slots`)
because a slice of a flat buffer is a copy on XLA:CPU.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import jax
import jax.numpy as jnp
from jax import lax

from graphpipe.core.feed import device_feeds, feed_words
from graphpipe.core.graph import InputSpec
from graphpipe.errors import PipelineRuntimeError
from graphpipe.frontend.program import Program
from graphpipe.runtime import feed, packing, reduce, slots
from graphpipe.runtime.buffers import Buffers, Operands
from graphpipe.runtime.layout import Layout
from graphpipe.runtime.running import RunningValues
from graphpipe.runtime.shared import SharedGradients
from graphpipe.runtime.stage_code import StageCode
from graphpipe.runtime.tables import build_tables, make_channels
from graphpipe.schedules.grid import Schedule

AXIS = "pipe"


def _dispatch(index, branches, ops):
  """`branches[index](ops)`; a switch only when there is a choice."""
  if len(branches) == 1:
    return branches[0](ops)
  return lax.switch(index, branches, ops)


def _unless_idle(active, run, skip, branches):
  """f(ops): `run` where `active(ops)`, else `skip`; `skip` if no branches."""
  if not branches:
    return skip
  return lambda ops: lax.cond(active(ops), run, skip, ops)


class StepBuilder(StageCode):
  """Builds the tables and the shard_map body of a pipelined step.

  Args:
    layout: the static layout (stages, edges, transfers).
    schedule: the schedule to run (its grid is the tick table).
    program: the captured program (node jaxprs), re-traced per chunk size.
    recompute: recompute each stage's forward in its backward (stash only
      the stage inputs) instead of stashing the forward's residuals.
    batch_size: samples of the mini-batch.
    inputs: the graph's batch leaves (`OpGraph.inputs`), for the feeds.
  """

  def __init__(
    self,
    layout: Layout,
    schedule: Schedule,
    program: Program,
    *,
    recompute: bool = False,
    batch_size: int,
    inputs: Sequence[InputSpec],
  ):
    why = program.form.unsplittable
    if why and any(
      s.chunk < batch_size or s.size < batch_size for s in layout.stages
    ):
      raise PipelineRuntimeError(
        "the plan splits the batch (micro-batches or data-parallel "
        "replicas), but the loss is exact only on the whole batch at once: "
        f"{why}. Use a plan with one micro-batch of the whole batch on one "
        "device per stage, or compute such terms per sample"
      )
    self.schedule = schedule
    self.recompute = recompute
    self.batch_size = batch_size
    super().__init__(layout, program, batch_size)
    self.device_stage = layout.stage_of_device()
    self.feeds = device_feeds(
      inputs,
      [
        ([k[len("batch:") :] for k in s.batch], s.devices, s.size)
        for s in layout.stages
      ],
      layout.num_devices,
      layout.batch_size,
    )
    self._channels = make_channels(layout)
    self.channels = self._channels.groups
    self.channel_of = self._channels.channel_of
    self._make_tables()
    self.running = RunningValues(layout, self.buffers.state)

  def _make_tables(self):
    lay = self.layout
    ticks = build_tables(lay, self.schedule, self._channels, self.recompute)
    self.tables = ticks.arrays
    self.forward_devices = ticks.forward_devices
    self.backward_devices = ticks.backward_devices
    self.fused_devices = ticks.fused_devices
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
      feed=feed_words(self.feeds),
    )

  def _variables(self, kind):
    """Per stage, (key, elements) of its `kind` ('params' or 'state')."""
    shapes = self.layout.param_shapes
    return [
      [(k, math.prod(shapes[k][0])) for k in getattr(s, kind)]
      for s in self.layout.stages
    ]

  # The per-device branches.

  def _stage_variables(self, params, state, stage):
    s, shapes = self.layout.stages[stage], self.layout.param_shapes
    return (
      slots.read(params, self.buffers.params, stage, s.params, shapes),
      slots.read(state, self.buffers.state, stage, s.state, shapes, bits=True),
    )

  def _batch_rows(self, stage, device, batch, mb):
    return feed.read(self.feeds[device], batch, mb)

  def _sends(self, device, vector=None, offsets=None, *, forward=True):
    """[channels, channel size]: what `device` sends after an action.

    Forward: rows of its output edge matrices (`vector`, blocks at
    `offsets`) to the successors' devices; backward: rows of the gradients
    of its input edge matrices to the predecessors' devices, every piece
    on its own channel. A forward sends its rows on the channels of every
    piece it may be: the receivers' tables take only the piece that this
    micro-batch is (`tables.build_tables`).
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
      channel = self.channel_of[(device, other, "FB"[not forward], tr.piece)]
      sends = sends.at[channel].set(packing.pad_to(piece, self.buffers.channel))
    return sends

  def _stage_inputs(self, ops, stage, device):
    """A stage's trainable and frozen variables and its batch rows (with
    the batch's data statistics)."""
    trainable, frozen = self._stage_variables(ops.params, ops.state, stage)
    rows = self._batch_rows(stage, device, ops.batch, ops.microbatch)
    keys = self.chunk_streams(stage, device, ops.microbatch, ops.statistics)
    statistics = {
      k: v for k, v in ops.statistics.items() if not k.startswith("rng:")
    }
    return trainable, frozen, {**rows, **statistics, **keys}

  def _stage_acts(self, ops, stage):
    """A stage's input activations, read from this tick's stash slot."""
    return lax.dynamic_slice_in_dim(
      ops.act, ops.act_slot * self.buffers.act_slot, self.layout.in_size(stage)
    )

  def _forward_branch(self, device):
    stage = self.device_stage[device]
    buf = self.buffers
    out_offsets = self.layout.out_offsets(stage)
    f = self.stage_function(stage)

    def branch(ops):
      trainable, frozen, rows = self._stage_inputs(ops, stage, device)
      acts = self._stage_acts(ops, stage)
      if self.recompute:
        (out, stage_loss), updates = f({**trainable, **frozen}, acts, rows)
        kept = None
      else:
        (out, stage_loss), leaves, _, keep, _, updates = self._vjp_parts(
          stage, {**trainable, **frozen}, acts, rows
        )
        kept = packing.pad_to(
          packing.pack_leaves([leaves[i] for i in keep]), buf.res_slot
        )
      sends = self._sends(device, out, out_offsets, forward=True)
      state = self.running.write(ops.state, stage, updates)
      return kept, stage_loss, sends, state

    return branch

  def _backward_branch(self, device):
    stage = self.device_stage[device]
    lay, buf = self.layout, self.buffers
    in_size, out_size = lay.in_size(stage), lay.out_size(stage)
    in_offsets = lay.in_offsets(stage)
    f = self.stage_function(stage)

    def branch(ops):
      trainable, frozen, rows = self._stage_inputs(ops, stage, device)
      if self.recompute:
        acts = self._stage_acts(ops, stage)
        _, vjp = jax.vjp(
          lambda p, a: f({**p, **frozen}, a, rows)[0], trainable, acts
        )
      else:
        blank = jnp.zeros((in_size,), jnp.float32)
        _, leaves, treedef, keep, *_ = self._vjp_parts(
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
      grad_params, grad_acts = vjp((cotangent, ops.seeds))
      updates = slots.scatter(buf.params, stage, grad_params)
      sends = self._sends(device, grad_acts, in_offsets, forward=False)
      return updates, jnp.zeros_like(ops.loss), sends, ops.state

    return branch

  def _fused_branch(self, device):
    """A sink stage's forward and backward at once (`tables.fuse_ticks`)."""
    stage = self.device_stage[device]
    buf = self.buffers
    in_offsets = self.layout.in_offsets(stage)
    f = self.stage_function(stage)

    def branch(ops):
      trainable, frozen, rows = self._stage_inputs(ops, stage, device)
      acts = self._stage_acts(ops, stage)
      (out, stage_loss), vjp, changed = jax.vjp(
        lambda p, a: f({**p, **frozen}, a, rows),
        trainable,
        acts,
        has_aux=True,
      )
      grad_params, grad_acts = vjp((jnp.zeros_like(out), ops.seeds))
      updates = slots.scatter(buf.params, stage, grad_params)
      sends = self._sends(device, grad_acts, in_offsets, forward=False)
      state = self.running.write(ops.state, stage, changed)
      return updates, stage_loss, sends, state

    return branch

  def forward_step(self):
    """f(ops) -> (res, loss, sends) of a tick's forward, if any.

    XLA:CPU keeps a buffer in place through a conditional only if one of
    its branches updates it and the others pass it through; with two or
    more branches updating it (the forwards of different devices) it
    copies the buffer. So a two-way conditional (skip, or forward and
    update) holds a switch over the devices' forwards, which return new
    values only; on one device there is no switch.
    """
    buf = self.buffers
    branches = [self._forward_branch(d) for d in self.forward_devices]

    def run(ops):
      kept, loss, sends, state = _dispatch(ops.forward - 1, branches, ops)
      res = ops.res
      if kept is not None:
        res = lax.dynamic_update_slice_in_dim(
          res, kept, ops.res_slot * buf.res_slot, 0
        )
      return res, ops.loss + loss, sends, state

    def skip(ops):
      return ops.res, ops.loss, self._sends(None), ops.state

    return _unless_idle(lambda ops: ops.forward > 0, run, skip, branches)

  def backward_step(self):
    """f(ops) -> (gacc, loss, sends) of a tick's backward or fused action."""
    branches = [self._backward_branch(d) for d in self.backward_devices] + [
      self._fused_branch(d) for d in self.fused_devices
    ]

    def run(ops):
      updates, loss, sends, state = _dispatch(ops.backward - 1, branches, ops)
      gacc = tuple(g + u for g, u in zip(ops.gacc, updates, strict=True))
      return gacc, ops.loss + loss, sends, state

    def skip(ops):
      return ops.gacc, ops.loss, self._sends(None), ops.state

    return _unless_idle(lambda ops: ops.backward > 0, run, skip, branches)

  # The body.

  def gradients_and_loss(self, params, state, batch, statistics):
    """Inside shard_map: this device's reduced gradients, the loss and its
    state slots after the step (running statistics updated by each
    micro-batch in order; a data-parallel stage's replicas averaged).

    Args:
      params, state: this device's variable slots.
      batch: its batch words (`graphpipe.runtime.feed`).
      statistics: the batch's data statistics ('global:k' keys, the same
        on every device).
    """
    buf = self.buffers
    me = lax.axis_index(AXIS)
    forward, backward = self.forward_step(), self.backward_step()
    tables = {k: jnp.asarray(v) for k, v in self.tables.items()}
    terms = self.terms

    def variables(stage):
      return self._stage_variables(params, state, stage)

    penalties = lax.psum(
      terms.penalties(self.device_stage, me, variables), AXIS
    )
    head = terms.head_function(statistics)
    seeds = terms.seeds(head, penalties)

    def write(buffer, data, start, length, enable):
      window = lax.dynamic_slice_in_dim(buffer, start, buf.channel)
      keep = (jnp.arange(buf.channel) < length) & enable
      return lax.dynamic_update_slice_in_dim(
        buffer, jnp.where(keep, data, window), start, 0
      )

    def exchange(sends):
      return jnp.stack(
        [
          lax.ppermute(sends[c], AXIS, perm)
          for c, perm in enumerate(self.channels)
        ]
      )

    def tick(carry, row):
      act, grad, res, gacc, loss, inbox, *held = carry
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
        held[0] if held else state,
        batch,
        act,
        grad,
        res,
        gacc,
        loss,
        mine["forward"],
        mine["backward"],
        mine["mb"],
        mine["act_slot"],
        mine["grad_slot"],
        mine["res_slot"],
        seeds,
        statistics,
      )
      res, loss, forward_sends, new = forward(ops)
      gacc, loss, backward_sends, new = backward(
        ops._replace(res=res, loss=loss, state=new)
      )
      # A device runs at most one action a tick; `where` keeps the bits of
      # bit-cast integers that an add could change.
      sends = jnp.where(mine["forward"] > 0, forward_sends, backward_sends)
      if self.channels:
        # Ticks where nothing is sent skip the collectives, and with them
        # the wait for the other devices. The inbox is read only where a
        # transfer arrived, so a skipped tick may leave anything in it.
        inbox = lax.cond(
          mine["exchange"] == 1, exchange, lambda sends: sends, sends
        )
      return (act, grad, res, gacc, loss, inbox, *[new][: len(held)]), None

    zeros = lambda n: jnp.zeros((n,), jnp.float32)
    carry = (
      zeros(buf.act_slot * buf.act_slots + buf.channel),
      zeros(buf.grad_slot * buf.grad_slots + buf.channel),
      zeros(buf.res_slot * buf.res_slots),
      tuple(zeros(n) for n in buf.params.sizes),
      zeros(self.terms.sums.size),
      jnp.zeros((buf.channels, buf.channel), jnp.float32),
    ) + ((state,) if self.running.updates else ())  # (carried if updated)
    (_, _, _, gacc, sums, _, *held), _ = lax.scan(tick, carry, tables)
    new_state = self.running.average_replicas(
      held[0] if held else state, me, AXIS
    )
    loss, head_vjp = jax.vjp(head, lax.psum(sums, AXIS), penalties)
    grad_sums, grad_penalties = head_vjp(jnp.ones((), jnp.float32))
    if terms.mode == "scaled":
      gacc = tuple(g * grad_sums[0] for g in gacc)
    penalty_grads = terms.penalty_grads(
      self.device_stage,
      me,
      variables,
      grad_penalties,
      lambda stage, grads: slots.scatter(buf.params, stage, grads),
      tuple(jnp.zeros((n,), jnp.float32) for n in buf.params.sizes),
    )
    gacc = tuple(g + p for g, p in zip(gacc, penalty_grads, strict=True))
    gacc = SharedGradients(self.layout, buf.params).exchange(gacc, me, AXIS)
    # The replicas' sum (ZeRO-1 stages reduce-scatter instead, after the
    # step: `graphpipe.runtime.zero`).
    groups = [s.devices for s in self.layout.stages if s.sharding != "zero1"]
    gacc = reduce.ring_sum(gacc, groups, self.layout.num_devices, AXIS)
    return gacc, loss, new_state
