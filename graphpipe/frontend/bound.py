"""How capture calls the user's loss: one framework's model as inputs.

`Bound` splits a model into the inputs of the traced loss, in the order
of its value keys: trainable parameters ('param:'), other variables
('state:'), the keys of its random streams ('rng:', `streams`) and the
batch. An NNX model carries its streams (`nnx.Rngs`: its `RngKey`
variables; their counts are state the loss may advance); a linen module's
are named at capture (`rngs=`) and bound with `module.bind`.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import numpy as np
from flax import nnx
from flax.core import unfreeze

from graphpipe.errors import CaptureError
from graphpipe.frontend import streams as stream_rules
from graphpipe.frontend.scopes import nnx_module_scopes, path_to_str


def _key_name(key) -> str:
  for attr in ("key", "idx", "name"):
    if hasattr(key, attr):
      return str(getattr(key, attr))
  return str(key)


def leaf_names(tree, drop_value=False) -> list[str]:
  names = []
  for path, _ in jax.tree_util.tree_flatten_with_path(tree)[0]:
    parts = [_key_name(k) for k in path]
    if drop_value and parts and parts[-1] == "value":
      parts = parts[:-1]
    names.append(path_to_str(parts))
  return names


# Linen errors of layers that change state or draw random numbers while
# training: the batch's shapes are not the cause (the hint said they were).
STATEFUL_HINTS = {
  "InvalidRngError": "name the module's random streams at capture "
  "(capture(..., rngs=('dropout',))), or run it deterministically",
}


class Bound:
  """How to call the user's loss on its inputs for one framework.

  Args:
    model: an `nnx.Module`, or a `flax.linen.Module` with `variables`.
    variables: the linen module's variables.
    rngs: names of a linen module's random streams (`make_rng` names).
  """

  def __init__(self, model, variables, rngs=()):
    if isinstance(model, nnx.Module):
      if variables is not None:
        raise CaptureError(
          "variables= is for linen modules; an NNX model carries its own"
        )
      if rngs:
        raise CaptureError(
          "rngs= names a linen module's random streams; an NNX model "
          "carries its own (nnx.Rngs)"
        )
      self.framework = "nnx"
      self.graphdef, self.params, self.streams, self.state = nnx.split(
        model, nnx.Param, nnx.RngKey, ...
      )
      self.param_names = leaf_names(self.params, drop_value=True)
      self.state_names = leaf_names(self.state, drop_value=True)
      self.stream_names = leaf_names(self.streams, drop_value=True)
      # Each draw advances its stream's count: not an update to train
      # (graphpipe's keys are given per step).
      self.counts = set(
        leaf_names(nnx.state(model, nnx.RngCount), drop_value=True)
      )
      self.root = type(model).__name__
    elif isinstance(model, nn.Module):
      if variables is None:
        raise CaptureError(
          "a linen module needs its variables: capture(loss_fn, module, "
          "batch, variables=module.init(...))"
        )
      if isinstance(rngs, str) or not all(isinstance(r, str) for r in rngs):
        raise CaptureError(
          f"rngs= takes the names of the module's random streams, got {rngs!r}"
        )
      self.framework = "linen"
      self.module = model
      variables = unfreeze(variables)  # a FrozenDict as a dict
      self.params = variables.pop("params", {})
      self.state = variables
      self.param_names = leaf_names(self.params)
      self.state_names = leaf_names(self.state)
      self.stream_names = list(rngs)
      self.streams = {n: stream_rules.per_sample_key(0) for n in rngs}
      self.counts = set()
      self.root = type(model).__name__
    else:
      raise CaptureError(
        f"model must be a flax.nnx.Module or a flax.linen.Module, got "
        f"{type(model).__name__}"
      )
    if not jax.tree.leaves(self.params):
      raise CaptureError(
        f"the model {self.root} has no trainable parameters (nnx.Param / "
        "linen 'params'): there is nothing to train or to place on stages"
      )

  def abstract_streams(self):
    """The streams' keys as traced inputs: per-sample keys
    (`graphpipe.frontend.streams`), whatever the model was given."""
    return jax.tree.map(
      lambda x: jax.ShapeDtypeStruct(np.shape(x), stream_rules.DTYPE),
      self.streams,
    )

  def call(self, loss_fn, params, state, streams, batch):
    """(loss, parameter leaves, state leaves) after `loss_fn` ran: a
    variable the loss left as it was comes back as its input (the tracer
    tells updates, BatchNorm's running statistics, from inputs)."""
    if self.framework == "nnx":
      model = nnx.merge(self.graphdef, params, streams, state)
      with nnx_module_scopes(model):
        loss = loss_fn(model, batch)
      _, params_after, _, state_after = nnx.split(
        model, nnx.Param, nnx.RngKey, ...
      )
      if jax.tree.structure(state_after) != jax.tree.structure(state):
        raise CaptureError(
          "loss_fn added or removed model variables while computing the "
          "loss (e.g. nnx.sow of intermediates): graphpipe needs the "
          "model's variables to keep their structure"
        )
      return loss, jax.tree.leaves(params_after), jax.tree.leaves(state_after)
    bound = self.module.bind(
      {"params": params, **state},
      rngs=streams,
      mutable=list(self.state),
    )
    loss = loss_fn(bound, batch)
    after = unfreeze(bound.variables)
    after.pop("params", None)
    if jax.tree.structure(after) != jax.tree.structure(state):
      raise CaptureError(
        "loss_fn added variables while computing the loss (e.g. sow into "
        f"a collection): collections {sorted(after)} after the call, "
        f"{sorted(state)} before"
      )
    return loss, jax.tree.leaves(params), jax.tree.leaves(after)

  def split(self, variables):
    """User variables (an NNX state/model or linen dict) -> (params,
    state, streams): streams None for linen (its keys are not variables)."""
    if self.framework == "nnx":
      if not isinstance(variables, nnx.Module):
        variables = nnx.merge(self.graphdef, variables)
      _, params, streams, state = nnx.split(
        variables, nnx.Param, nnx.RngKey, ...
      )
      return params, state, streams
    variables = unfreeze(variables)
    return variables.pop("params", {}), variables, None


def make_unflatten(bound: Bound):
  """f(leaves, kind) -> the user's parameters ('param') or other
  variables ('state') from their leaves."""
  treedefs = {
    "param": jax.tree.structure(bound.params),
    "state": jax.tree.structure(bound.state),
  }

  def unflatten(leaves, kind="param"):
    return jax.tree.unflatten(treedefs[kind], leaves)

  return unflatten


def make_flatten(bound: Bound):
  """f(variables, batch, streams) -> the traced loss's input leaves
  (value-key order); `streams` None takes an NNX model's own keys (as
  per-sample keys), [] leaves the streams out."""
  reference = jax.tree.structure((bound.params, bound.state))

  def flatten(variables, batch, streams=None):
    params, state, own = bound.split(variables)
    structure = jax.tree.structure((params, state))
    if structure != reference:
      raise CaptureError(
        "these variables do not have the structure of the captured "
        "model's: pass the variables (or model) the graph was captured from"
      )
    if streams is None:
      if own is None and bound.stream_names:
        raise CaptureError(
          "this model draws random numbers: pass rng= (a JAX key) to give "
          f"its streams {bound.stream_names} their keys"
        )
      streams = [
        stream_rules.per_sample_key(k) for k in jax.tree.leaves(own or {})
      ]
    return (
      jax.tree.leaves((params, state)) + list(streams) + jax.tree.leaves(batch)
    )

  return flatten
