"""A training state moved between plans: the layout-free form of a state.

A `Trainer`'s state lives in its plan's layout: each device's parameter
slots (`graphpipe.core.slots`), and an optimizer state over those slots or,
with ZeRO-1 stages, over each device's owned elements
(`graphpipe.runtime.zero`). Between plans (another partition, another
device count, other stage layouts) what carries over is the layout-free
form: every variable's value by key, and the same for every part of the
optimizer's state that mirrors the parameters (Adam's two moments, a
momentum trace); the optimizer's other leaves (a step count) are the same
on every device.

Which optimizer leaves mirror the parameters is read from the optimizer
itself: its state is traced (`jax.eval_shape`, nothing allocated) on an
input whose leaves have sizes no real buffer has, and a leaf of the same
size mirrors that input leaf.

  form = layout_free(view, params_rows, state_rows, opt_rows, optimizer)
  new_opt = optimizer_rows(other_view, form, optimizer, num_devices)
"""

from __future__ import annotations

import dataclasses
import math

import jax
import numpy as np

from graphpipe.core.slots import SlotLayout, plan_slots
from graphpipe.errors import PipelineRuntimeError
from graphpipe.runtime import slots
from graphpipe.runtime.zero import ZeroOne

# Sizes of the probe's input leaves (`mirrors`): far above any buffer.
_PROBE = 1_000_000_007


@dataclasses.dataclass(frozen=True)
class View:
  """What converting a state of one plan needs: its layout, slot layouts
  and owned elements (a `Trainer` has them; `view_of_plan` builds them
  for a plan without a trainer)."""

  layout: object
  params: SlotLayout
  state: SlotLayout
  zero: ZeroOne

  def optimizer_input(self):
    """One device's optimizer input, abstract (`ZeroOne.optimizer_input`)."""
    return self.zero.optimizer_input()


def view_of_trainer(trainer) -> View:
  return View(
    trainer.layout, trainer.buffers.params, trainer.buffers.state, trainer.zero
  )


def view_of_plan(graph, plan) -> View:
  """The layout `graphpipe.Trainer(plan, ..., graph=graph)` would build
  (sizes only: the stage programs are traced on abstract values)."""
  from graphpipe.runtime.layout import build_layout
  from graphpipe.schedules.builders import schedule_for

  layout = build_layout(graph, plan, schedule_for(plan), probe=False)
  shapes = layout.param_shapes

  def variables(kind):
    return [
      [(k, math.prod(shapes[k][0])) for k in getattr(s, kind)]
      for s in layout.stages
    ]

  params = plan_slots(variables("params"))
  return View(
    layout, params, plan_slots(variables("state")), ZeroOne(layout, params)
  )


def mirrors(optimizer, view: View) -> list[int | None]:
  """Per leaf of the optimizer's state (flattened), the input leaf it
  mirrors, or None (a count, a scale)."""
  real = view.optimizer_input()
  probe = jax.tree.map(
    lambda x, i: jax.ShapeDtypeStruct((_PROBE + i,), x.dtype),
    real,
    _indices(real),
  )
  traced = jax.tree.leaves(jax.eval_shape(optimizer.init, probe))
  found = []
  for leaf in traced:
    size = leaf.shape[0] - _PROBE if leaf.ndim == 1 else -1
    found.append(size if 0 <= size < len(jax.tree.leaves(real)) else None)
  return found


def _indices(tree):
  leaves, treedef = jax.tree.flatten(tree)
  return jax.tree.unflatten(treedef, list(range(len(leaves))))


def _roles(found: list[int | None], inputs: int) -> list[list[int]]:
  """The optimizer leaves grouped into whole copies of the input (each a
  run of mirrors of input leaves 0 .. inputs - 1, in order)."""
  roles, run = [], []
  for i, j in enumerate(found):
    if j is None:
      continue
    if j == 0:
      run = [i]
      roles.append(run)
    elif run and j == len(run):
      run.append(i)
    else:
      raise PipelineRuntimeError(
        "this optimizer's state does not mirror the parameters leaf by "
        "leaf, in order; it cannot be moved to another layout"
      )
  if any(len(r) != inputs for r in roles):
    raise PipelineRuntimeError(
      "this optimizer's state mirrors only part of the parameters; it "
      "cannot be moved to another layout"
    )
  return roles


@dataclasses.dataclass
class LayoutFree:
  """A state without its layout.

  Attributes:
    params: parameter values by key.
    state: non-trainable values by key.
    moments: per optimizer leaf group that mirrors the parameters, its
      values by key.
    scalars: the optimizer's other leaves (device 0's), in order.
    step: the step count.
  """

  params: dict
  state: dict
  moments: list[dict]
  scalars: list[np.ndarray]
  step: int


def _values(view: View, rows: list[np.ndarray], layout: SlotLayout, bits=False):
  """Values by key from per-device rows of slots (the first device of each
  stage)."""
  out = {}
  for s in view.layout.stages:
    out.update(
      slots.host_values(
        layout,
        s.id,
        [x[s.devices[0]] for x in rows],
        view.layout.param_shapes,
        bits,
      )
    )
  return out


def _param_values(view: View, rows: list[np.ndarray]) -> dict:
  """Values by key of the optimizer's input form (slots or owned)."""
  if view.zero.active:
    (owned,) = rows
    return view.zero.assemble(owned, view.layout.param_shapes)
  return _values(view, rows, view.params)


def layout_free(view, params, state, opt_state, optimizer, step) -> LayoutFree:
  """The layout-free form of a state of `view`'s plan (host arrays:
  [devices, ...] rows)."""
  inputs = len(jax.tree.leaves(view.optimizer_input()))
  found = mirrors(optimizer, view)
  leaves = [np.asarray(x) for x in jax.tree.leaves(opt_state)]
  if len(leaves) != len(found):
    raise PipelineRuntimeError(
      "the saved optimizer state does not have this optimizer's leaves"
    )
  moments = [
    _param_values(view, [leaves[i] for i in role])
    for role in _roles(found, inputs)
  ]
  scalars = [leaves[i][0] for i, j in enumerate(found) if j is None]
  return LayoutFree(
    _values(view, [np.asarray(x) for x in params], view.params),
    _values(view, [np.asarray(x) for x in state], view.state, bits=True),
    moments,
    scalars,
    int(step),
  )


def _rows(view: View, values: dict) -> list[np.ndarray]:
  """The optimizer's input form of values by key, every device's row."""
  if view.zero.active:
    return [view.zero.host_owned(values)]
  num = view.layout.num_devices
  rows = [np.zeros((num, n), np.float32) for n in view.params.sizes]
  for s in view.layout.stages:
    stage_slots = slots.host_slots(view.params, s.id, values)
    for d in s.devices:
      for row, value in zip(rows, stage_slots, strict=True):
        row[d] = value
  return rows


def optimizer_rows(view: View, form: LayoutFree, optimizer) -> list:
  """The optimizer state's leaves for `view`'s plan ([devices, ...] host
  arrays, in the flattened order), from the layout-free form."""
  inputs = len(jax.tree.leaves(view.optimizer_input()))
  found = mirrors(optimizer, view)
  roles = _roles(found, inputs)
  if len(roles) != len(form.moments) or sum(j is None for j in found) != len(
    form.scalars
  ):
    raise PipelineRuntimeError(
      "the checkpoint's optimizer state has other parts than this "
      "optimizer's: build the Trainer with the optimizer the run was saved "
      "with"
    )
  leaves = [None] * len(found)
  for role, values in zip(roles, form.moments, strict=True):
    for i, row in zip(role, _rows(view, values), strict=True):
      leaves[i] = row
  scalars = iter(form.scalars)
  num = view.layout.num_devices
  for i, j in enumerate(found):
    if j is None:
      value = np.asarray(next(scalars))
      leaves[i] = np.broadcast_to(value, (num, *value.shape)).copy()
  return leaves
