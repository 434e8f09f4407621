"""Checks of what the trainer is given, and of what its peers did."""

from __future__ import annotations

import contextlib

import jax
import numpy as np

from graphpipe.errors import PipelineRuntimeError, ProcessLostError


def check_values(values: dict, shapes: dict) -> None:
  """Values by key of the captured model's shapes, and finite."""
  for key, (shape, _) in shapes.items():
    if key not in values:
      raise PipelineRuntimeError(f"no value for {key}: not the captured model")
    value = np.asarray(values[key])
    if value.shape != tuple(shape):
      raise PipelineRuntimeError(
        f"{key} has shape {list(value.shape)}, the captured model's has "
        f"{list(shape)}: pass the model the graph was captured from"
      )
    if not np.all(np.isfinite(value)):
      raise PipelineRuntimeError(
        f"{key} holds NaN or infinite values: training would only "
        "propagate them (fix the initialisation or the checkpoint)"
      )


@contextlib.contextmanager
def peers_checked():
  """Turns a collective that fails because a process died into an error
  that says so (multi-process runs only)."""
  try:
    yield
  except jax.errors.JaxRuntimeError as err:
    text = str(err)
    lost = ("Gloo", "collective", "Connection", "UNAVAILABLE", "heartbeat")
    if jax.process_count() == 1 or not any(w in text for w in lost):
      raise
    raise ProcessLostError(
      f"process {jax.process_index()} of {jax.process_count()}: the "
      "training step's collectives failed, so another process of the run "
      f"died or cannot be reached ({text.splitlines()[0][:200]}); restart "
      "the run from its last complete checkpoint "
      "(graphpipe.runtime.checkpoints.latest)"
    ) from None
