"""Checkpoints of a `Trainer`'s state that a crash cannot pass off as whole.

A checkpoint is a folder: `state/` (orbax, sharded arrays; every process
writes its shards) and `layout.json` (the plan's signature and the step),
written last, by process 0, with an atomic rename: it is the commit mark.
A folder without it is a save that did not finish (or no checkpoint) and
`restore` refuses it; `save` removes the mark before it overwrites
anything, so a crash while overwriting a checkpoint cannot leave an old
mark over new, partial arrays. `latest` finds the newest committed
checkpoint among the folders of a directory, skipping unfinished ones.

The mark also records the plan, so a checkpoint restores into a trainer
of another plan of the same graph (another partition, device count or
stage layouts, `graphpipe.runtime.relayout`): its arrays are read onto one
device, turned into values by key (parameters, non-trainable variables,
each part of the optimizer state that mirrors the parameters) and laid
out anew.
"""

from __future__ import annotations

import json
import os

import jax
import numpy as np

from graphpipe.errors import PipelineRuntimeError, ProcessLostError
from graphpipe.runtime import faults

MARK = "layout.json"
STATE = "state"


def save(trainer, state, directory: str) -> None:
  """Writes `state` to `directory`; see `Trainer.save`."""
  import orbax.checkpoint as ocp

  directory = os.path.abspath(directory)
  mark = os.path.join(directory, MARK)
  step = int(np.asarray(state.step.addressable_shards[0].data))
  # Every process checks the path (the processes of a run share the
  # folder), so all refuse a bad one alike instead of process 0 alone
  # while the others enter orbax's collectives.
  try:
    os.makedirs(directory, exist_ok=True)
  except OSError as err:  # a file of that name, no permission, ...
    raise PipelineRuntimeError(
      f"cannot save a checkpoint to {directory}: {err.strerror or err} "
      "(a checkpoint is a folder; pick a path where one can be made)"
    ) from None
  if jax.process_index() == 0 and os.path.lexists(mark):
    os.remove(mark)
  try:
    checkpointer = ocp.StandardCheckpointer()
    checkpointer.save(os.path.join(directory, STATE), state, force=True)
    if faults.armed("save") == step:
      faults.die()
    checkpointer.wait_until_finished()
    checkpointer.close()
  except Exception as err:  # orbax's barriers fail in several ways
    if jax.process_count() == 1:
      raise
    raise ProcessLostError(
      f"process {jax.process_index()} of {jax.process_count()}: the save "
      f"to {directory} did not finish ({type(err).__name__}: "
      f"{str(err)[:200]}), so another process of the run died or cannot be "
      "reached; the folder is left uncommitted"
    ) from None
  if jax.process_index() == 0:
    partial = mark + ".partial"
    with open(partial, "w") as f:
      json.dump(
        {
          "signature": trainer._signature(),
          "step": step,
          "optimizer": _optimizer_layout(trainer),
          "plan": trainer.plan.to_dict(),
        },
        f,
      )
      f.flush()
      os.fsync(f.fileno())
    os.replace(partial, mark)
  if jax.process_count() > 1:
    # No process returns before the mark is written: the others returned
    # at once, and `latest` or `restore` right after the save saw the
    # checkpoint incomplete on them (and the previous step as the latest).
    # (The name must be equal on every process: not the path, which each
    # may spell from its own working directory.)
    _barrier(f"graphpipe_save_{step}", directory)


def _barrier(name: str, directory: str) -> None:
  from jax.experimental import multihost_utils

  try:
    multihost_utils.sync_global_devices(name)
  except Exception as err:  # a peer died after writing its part
    raise ProcessLostError(
      f"process {jax.process_index()} of {jax.process_count()}: the save "
      f"to {directory} was written but a process did not reach its end "
      f"({type(err).__name__}: {str(err)[:200]})"
    ) from None


def read_mark(directory: str) -> dict | None:
  """The commit mark of a checkpoint folder; None if it has none."""
  try:
    with open(os.path.join(directory, MARK)) as f:
      mark = json.load(f)
  except FileNotFoundError:
    return None
  except (OSError, ValueError) as err:
    raise PipelineRuntimeError(
      f"{directory}/{MARK} is unreadable ({err}): the checkpoint is damaged"
    ) from None
  if (
    not isinstance(mark, dict)
    or not isinstance(mark.get("signature"), dict)
    or not isinstance(mark.get("step"), int)
  ):
    raise PipelineRuntimeError(
      f"{directory}/{MARK} is not a graphpipe checkpoint mark (edited, or "
      "written by another version)"
    )
  return mark


def restore(trainer, directory: str):
  """Reads a state written by `save`; see `Trainer.restore`."""
  import orbax.checkpoint as ocp

  directory = os.path.abspath(directory)
  mark = read_mark(directory)
  if mark is None:
    raise PipelineRuntimeError(
      f"{directory} holds no complete graphpipe checkpoint (no {MARK}: not "
      "a checkpoint, or its save did not finish); use "
      "graphpipe.runtime.checkpoints.latest to find the last complete one"
    )
  if mark["signature"] != trainer._signature():
    same_graph = mark["signature"].get("graph") == trainer._signature()["graph"]
    if same_graph and isinstance(mark.get("plan"), dict):
      return _restore_other_plan(trainer, directory, mark)
    raise PipelineRuntimeError(
      "this checkpoint was written for another plan or graph "
      f"(saved {mark['signature']}, this trainer {trainer._signature()})"
      + (
        ""
        if same_graph
        else "; a checkpoint moves between plans of one graph only"
      )
    )
  # Marks written before the optimizer was recorded have no entry.
  saved = mark.get("optimizer", _optimizer_layout(trainer))
  if saved != _optimizer_layout(trainer):
    tree = saved.get("tree") if isinstance(saved, dict) else saved
    raise PipelineRuntimeError(
      "this checkpoint was written with another optimizer: its state is "
      f"{_short(str(tree))}, this trainer's "
      f"{_short(_optimizer_layout(trainer)['tree'])}; build the Trainer "
      "with the optimizer the run was saved with"
    )
  try:
    # Closed on the way out, failed reads included: an unclosed checkpointer
    # leaves its background event loop to the garbage collector.
    with ocp.StandardCheckpointer() as checkpointer:
      state = checkpointer.restore(
        os.path.join(directory, STATE), trainer._abstract_state()
      )
  except Exception as err:  # orbax and tensorstore raise many kinds
    raise PipelineRuntimeError(
      f"{directory}: the saved arrays cannot be read ({type(err).__name__}: "
      f"{str(err)[:300]}); the checkpoint is damaged"
    ) from None
  if int(np.asarray(state.step.addressable_shards[0].data)) != mark["step"]:
    raise PipelineRuntimeError(
      f"{directory}: the arrays are of step "
      f"{int(np.asarray(state.step.addressable_shards[0].data))}, the mark "
      f"says {mark['step']}: the checkpoint is damaged"
    )
  return state


def _optimizer_layout(trainer) -> dict:
  """The structure and shapes of the trainer's optimizer state (what a
  checkpoint's arrays must match; the hyperparameters may differ)."""
  opt_state = trainer._expected_state.opt_state
  return {
    "tree": str(jax.tree.structure(opt_state)),
    "shapes": [list(x.shape) for x in jax.tree.leaves(opt_state)],
  }


def _short(text: str) -> str:
  return text if len(text) <= 160 else text[:157] + "..."


def latest(root: str) -> str | None:
  """The committed checkpoint of highest step among the folders of `root`.

  Folders without a commit mark (saves that did not finish, other files)
  are skipped; None when there is none (or `root` does not exist or is
  a file).

  Example:
    >>> latest("/nonexistent") is None
    True
  """
  best, best_step = None, -1
  try:
    names = sorted(os.listdir(root))
  except (FileNotFoundError, NotADirectoryError):
    return None
  for name in names:
    path = os.path.join(root, name)
    if not os.path.isdir(path):
      continue
    try:
      mark = read_mark(path)
    except PipelineRuntimeError:
      continue
    if mark is not None and mark["step"] > best_step:
      best, best_step = path, mark["step"]
  return best


def _restore_other_plan(trainer, directory: str, mark: dict):
  """A checkpoint of another plan of this graph, laid out for `trainer`
  (read whole onto one device: one process only)."""
  import jax.numpy as jnp
  import orbax.checkpoint as ocp
  from jax.sharding import SingleDeviceSharding

  from graphpipe.core.stages import Plan
  from graphpipe.runtime import relayout

  if jax.process_count() > 1:
    raise PipelineRuntimeError(
      f"{directory} was written for another plan: moving a checkpoint "
      "between plans runs in one process (restore it there, save it with "
      "the new plan's trainer, and restore that in the multi-process run)"
    )
  saved = Plan.from_dict(mark["plan"])
  view = relayout.view_of_plan(trainer.graph, saved)
  one = SingleDeviceSharding(jax.devices()[0])
  num = saved.num_devices

  def rows(shape, dtype=jnp.float32):
    return jax.ShapeDtypeStruct((num, *shape), dtype, sharding=one)

  opt = jax.tree.map(
    lambda x: rows(x.shape, x.dtype),
    jax.eval_shape(trainer.optimizer.init, view.optimizer_input()),
  )
  layout = {
    "tree": str(jax.tree.structure(opt)),
    "shapes": [list(x.shape) for x in jax.tree.leaves(opt)],
  }
  if mark.get("optimizer", layout) != layout:
    raise PipelineRuntimeError(
      "this checkpoint was written with another optimizer: build the "
      "Trainer with the optimizer the run was saved with"
    )
  target = trainer._expected_state._replace(
    params=tuple(rows((n,)) for n in view.params.sizes),
    state=tuple(rows((n,)) for n in view.state.sizes),
    opt_state=opt,
    step=jax.ShapeDtypeStruct((), jnp.int32, sharding=one),
  )
  try:
    with ocp.StandardCheckpointer() as checkpointer:
      state = checkpointer.restore(os.path.join(directory, STATE), target)
  except Exception as err:  # orbax and tensorstore raise many kinds
    raise PipelineRuntimeError(
      f"{directory}: the saved arrays cannot be read ({type(err).__name__}: "
      f"{str(err)[:300]}); the checkpoint is damaged"
    ) from None
  form = relayout.layout_free(
    view,
    state.params,
    state.state,
    state.opt_state,
    trainer.optimizer,
    mark["step"],
  )
  new = trainer.state_from_values({**form.params, **form.state}, form.step)
  leaves = relayout.optimizer_rows(
    relayout.view_of_trainer(trainer), form, trainer.optimizer
  )
  return new._replace(
    opt_state=jax.tree.unflatten(
      jax.tree.structure(new.opt_state), list(trainer._to_rows(leaves))
    )
  )
