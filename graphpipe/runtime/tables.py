"""The static tables a pipelined step reads, tick by tick.

Everything here is plain Python over the layout and the schedule: which
branch each device runs at each tick, which stash slots its action uses,
and, for every ppermute channel, where the rows a device receives go. Stash
slots come from interval colouring of each buffered value's lifetime, so a
device holds only the micro-batches the schedule keeps in flight.

Stages with different micro-batch sizes: each stage counts its own
micro-batches. A stage k times larger than a predecessor collects that
predecessor's k forwards in one activation slot (piece p at its rows of
the micro-batch, `graphpipe.runtime.layout`), the slot living from the
first piece's arrival to the forward; its backward sends the k gradient
pieces at once, each on a channel of its own, into k gradient slots of the
predecessor (one per predecessor micro-batch).
"""

from __future__ import annotations

import dataclasses

import numpy as np

from graphpipe.core.channels import channel_items, color_pairs
from graphpipe.errors import PipelineRuntimeError
from graphpipe.runtime.layout import Layout
from graphpipe.schedules.grid import Schedule


@dataclasses.dataclass(frozen=True)
class Channels:
  """Device pairs grouped into permutations: one ppermute call each.

  Attributes:
    groups: per channel, its (source, destination) device pairs.
    channel_of: (source, destination, direction, piece) -> channel;
      direction 'F' (activations) or 'B' (gradients), piece the
      transfer's piece (`layout.Transfer.piece`). The pieces of one
      device pair travel on channels of their own: a backward returns
      them at once.
    size: float32 elements of the largest single transfer.
  """

  groups: tuple[tuple[tuple[int, int], ...], ...]
  channel_of: dict
  size: int


def make_channels(layout: Layout) -> Channels:
  """The channels of every transfer of `layout`, both directions."""
  # Activations forward, gradients back (`graphpipe.core.channels`).
  colored = color_pairs(
    channel_items(
      (t.edge, t.src_device, t.dst_device, t.piece) for t in layout.transfers
    )
  )
  return Channels(
    groups=tuple(tuple(item[:2] for item in g) for g in colored),
    channel_of={item: c for c, group in enumerate(colored) for item in group},
    size=max(
      [1] + [t.rows * layout.edges[t.edge].width for t in layout.transfers]
    ),
  )


FUSED = 2  # kind of a forward and its backward run as one action
RECV_KEYS = ("recv_valid", "recv_grad", "recv_slot", "recv_offset", "recv_len")


@dataclasses.dataclass(frozen=True)
class TickTables:
  """[ticks, devices(, channels)] int32 arrays and the slot counts.

  Attributes:
    arrays: 'forward' (0 none, 1 + i the forward of the i-th device of
      `forward_devices`), 'backward' (0 none, 1 + i the backward of the
      i-th of `backward_devices`, 1 + len(backward_devices) + j the fused
      forward and backward of the j-th of `fused_devices`), 'mb',
      'act_slot', 'grad_slot', 'res_slot', 'exchange' (1 where anything is
      sent at the end of the tick, alike on every device), and per channel
      'recv_valid', 'recv_grad', 'recv_slot', 'recv_offset', 'recv_len':
      where the rows that arrived at the end of the *previous* tick go
      (the step writes them before it reads any stash).
    forward_devices, backward_devices, fused_devices: the devices that
      run such actions, in branch order.
    act_slots, grad_slots, res_slots: slots needed on any device.
  """

  arrays: dict
  forward_devices: tuple[int, ...]
  backward_devices: tuple[int, ...]
  fused_devices: tuple[int, ...]
  act_slots: int
  grad_slots: int
  res_slots: int


def build_tables(
  layout: Layout, schedule: Schedule, channels: Channels, recompute: bool
) -> TickTables:
  """The tick tables of `schedule` over `layout` (see the module docstring).

  Args:
    layout: stages, edges and transfers.
    schedule: the checked schedule.
    channels: from `make_channels(layout)`.
    recompute: activations stay stashed until the backward (recompute) or
      only until the forward (residuals stashed instead).
  """
  lay = layout
  table = fuse_ticks(schedule_table(schedule))
  num_ticks, num_devices = table.shape[:2]
  # (stage, kind, mb) -> tick, for all stages; a fused action is both.
  when = {}
  for t, d in zip(*np.nonzero(table[:, :, 0] >= 0), strict=True):
    stage, kind, mb = (int(x) for x in table[t, d])
    for k in ("F", "B") if kind == FUSED else ("FB"[kind],):
      when[(stage, k, mb)] = int(t)
  act_life, grad_life, res_life = {}, {}, {}
  for s in lay.stages:
    for d in s.devices:
      for mb in range(lay.microbatches(s.id)):
        f_tick, b_tick = when[(s.id, "F", mb)], when[(s.id, "B", mb)]
        # Piece p of micro-batch mb is the source's micro-batch
        # mb * k + p (k = 1 when both ends take the same size).
        arrivals = [
          when[(lay.edges[t.edge].src, "F", mb * lay.pieces(t.edge) + t.piece)]
          for t in lay.transfers
          if t.dst_device == d
        ]
        if arrivals:
          if max(arrivals) >= f_tick:
            raise PipelineRuntimeError(
              f"schedule runs {s.id}F{mb} before its inputs arrive"
            )
          end = b_tick if recompute else f_tick
          act_life[(d, mb)] = (min(arrivals), end)
        grads = [
          when[(lay.edges[t.edge].dst, "B", mb // lay.pieces(t.edge))]
          for t in lay.transfers
          if t.src_device == d and t.piece == mb % lay.pieces(t.edge)
        ]
        if grads:
          if max(grads) >= b_tick:
            raise PipelineRuntimeError(
              f"schedule runs {s.id}B{mb} before its gradients arrive"
            )
          grad_life[(d, mb)] = (min(grads), b_tick)
        if not recompute and f_tick < b_tick:
          res_life[(d, mb)] = (f_tick, b_tick)
  act_slot, n_act = allocate_slots(act_life)
  grad_slot, n_grad = allocate_slots(grad_life)
  res_slot, n_res = allocate_slots(res_life)
  num_channels = len(channels.groups)
  shape = (num_ticks, num_devices)
  arrays = {
    "forward": np.zeros(shape, np.int32),
    "backward": np.zeros(shape, np.int32),
    "mb": np.zeros(shape, np.int32),
    "act_slot": np.zeros(shape, np.int32),
    "grad_slot": np.zeros(shape, np.int32),
    "res_slot": np.zeros(shape, np.int32),
    "exchange": np.zeros(shape, np.int32),
    "recv_valid": np.zeros(shape + (num_channels,), np.int32),
    "recv_grad": np.zeros(shape + (num_channels,), np.int32),
    "recv_slot": np.zeros(shape + (num_channels,), np.int32),
    "recv_offset": np.zeros(shape + (num_channels,), np.int32),
    "recv_len": np.zeros(shape + (num_channels,), np.int32),
  }
  tb = arrays
  runs = [
    tuple(sorted(set(np.nonzero((table[:, :, 1] == kind).any(axis=0))[0])))
    for kind in (0, 1, FUSED)
  ]
  forward_devices, backward_devices, fused_devices = (
    tuple(int(d) for d in r) for r in runs
  )
  branch = {
    0: ("forward", {d: 1 + i for i, d in enumerate(forward_devices)}),
    1: ("backward", {d: 1 + i for i, d in enumerate(backward_devices)}),
    FUSED: (
      "backward",
      {d: 1 + len(backward_devices) + i for i, d in enumerate(fused_devices)},
    ),
  }
  for t in range(num_ticks):
    for d in range(num_devices):
      stage, kind, mb = table[t, d]
      if stage < 0:
        continue
      key, ids = branch[int(kind)]
      tb[key][t, d] = ids[d]
      tb["mb"][t, d] = mb
      tb["act_slot"][t, d] = act_slot.get((d, mb), 0)
      tb["grad_slot"][t, d] = grad_slot.get((d, mb), 0)
      tb["res_slot"][t, d] = res_slot.get((d, mb), 0)
  for tr in lay.transfers:
    edge = lay.edges[tr.edge]
    width = edge.width
    src_stage, dst_stage = edge.src, edge.dst
    k = lay.pieces(tr.edge)
    for mb in range(lay.microbatches(dst_stage)):
      src_mb = mb * k + tr.piece
      # Activations: sent at the source's F tick, into the receiver's
      # activation stash (the slot of the micro-batch the piece is in).
      t = when[(src_stage, "F", src_mb)]
      c = channels.channel_of[(tr.src_device, tr.dst_device, "F", tr.piece)]
      _set_recv(
        arrays,
        t,
        tr.dst_device,
        c,
        grad=False,
        slot=act_slot[(tr.dst_device, mb)],
        offset=lay.in_offsets(dst_stage)[tr.edge] + tr.dst_row * width,
        length=tr.rows * width,
      )
      # Gradients: sent at the receiver's B tick, into the sender's
      # gradient stash (the slot of the piece's own micro-batch).
      t = when[(dst_stage, "B", mb)]
      c = channels.channel_of[(tr.dst_device, tr.src_device, "B", tr.piece)]
      _set_recv(
        arrays,
        t,
        tr.src_device,
        c,
        grad=True,
        slot=grad_slot[(tr.src_device, src_mb)],
        offset=lay.out_offsets(src_stage)[tr.edge] + tr.src_row * width,
        length=tr.rows * width,
      )
  # A transfer at tick t is written into its stash at the start of t + 1;
  # nothing is sent at the last tick (its receiver would have no tick left
  # to use it).
  if arrays["recv_valid"][-1].any():
    raise PipelineRuntimeError("the schedule sends at its last tick")
  # The same on every device: all take part in a tick's ppermutes or none.
  arrays["exchange"][:] = arrays["recv_valid"].any(axis=(1, 2))[:, None]
  for key in RECV_KEYS:
    arrays[key] = np.roll(arrays[key], 1, axis=0)
  return TickTables(
    arrays=arrays,
    forward_devices=forward_devices,
    backward_devices=backward_devices,
    fused_devices=fused_devices,
    act_slots=n_act,
    grad_slots=n_grad,
    res_slots=n_res,
  )


def _set_recv(arrays, t, device, channel, *, grad, slot, offset, length):
  if arrays["recv_valid"][t, device, channel]:
    raise PipelineRuntimeError(
      f"two transfers to device {device} on channel {channel} at tick {t}"
    )
  arrays["recv_valid"][t, device, channel] = 1
  arrays["recv_grad"][t, device, channel] = int(grad)
  arrays["recv_slot"][t, device, channel] = slot
  arrays["recv_offset"][t, device, channel] = offset
  arrays["recv_len"][t, device, channel] = length


def allocate_slots(
  intervals: dict[tuple[int, int], tuple[int, int]],
) -> tuple[dict[tuple[int, int], int], int]:
  """Slots for buffered values with lifetimes [start, end] (ticks).

  A slot read at tick t may take a new value written at the end of tick t.

  Args:
    intervals: (device, micro-batch) -> (first tick written, last tick read).

  Returns:
    ((device, micro-batch) -> slot, number of slots needed on any device).
  """
  by_device: dict[int, list] = {}
  for (device, mb), (start, end) in intervals.items():
    by_device.setdefault(device, []).append((start, end, mb))
  slots, most = {}, 0
  for device, items in by_device.items():
    free_at: list[int] = []  # per slot, the tick after which it is free
    for start, end, mb in sorted(items):
      for slot, free in enumerate(free_at):
        if free <= start:
          free_at[slot] = end
          break
      else:
        slot = len(free_at)
        free_at.append(end)
      slots[(device, mb)] = slot
    most = max(most, len(free_at))
  return slots, most


def fuse_ticks(table: np.ndarray) -> np.ndarray:
  """Runs a forward and the backward right after it as one action.

  Where every device that works at tick t runs a forward of some micro-
  batch and at t + 1 that micro-batch's backward of the same stage, and no
  other device works at either tick, the two ticks become one whose cells
  have kind `FUSED`. Such a stage is a sink (a stage with successors waits
  for their backwards), so nothing travels between the two ticks, and the
  fused action computes forward and backward in one go, stashing no
  residuals, as plain JAX does: a one-stage 1F1B plan becomes a scan of
  value-and-grad over the micro-batches. Lock-step time cannot grow: the
  merged tick lasts the longest forward + backward, no more than the two
  ticks did.

  Args:
    table: [ticks, devices, (stage, kind, micro-batch)], as from
      `schedule_table`.
  """
  out, t = [], 0
  while t < len(table):
    now = table[t]
    active = now[:, 0] >= 0
    if (
      t + 1 < len(table)
      and active.any()
      and ((table[t + 1][:, 0] >= 0) == active).all()
      and (now[active, 1] == 0).all()
      and (table[t + 1][active, 1] == 1).all()
      and (table[t + 1][active, 0] == now[active, 0]).all()
      and (table[t + 1][active, 2] == now[active, 2]).all()
    ):
      merged = now.copy()
      merged[active, 1] = FUSED
      out.append(merged)
      t += 2
    else:
      out.append(now)
      t += 1
  return np.stack(out)


def schedule_table(schedule: Schedule) -> np.ndarray:
  """[ticks, devices] of (stage, kind 0=F 1=B, micro-batch), -1 if idle."""
  table = -np.ones((schedule.num_ticks, schedule.num_devices, 3), np.int32)
  for d, row in enumerate(schedule.grid):
    for t, action in enumerate(row):
      if action is not None:
        table[t, d] = (
          action.stage,
          0 if action.kind == "F" else 1,
          action.microbatch,
        )
  return table
