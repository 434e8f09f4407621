"""The loss's pieces that run once per step (`graphpipe.frontend.loss_form`).

Every micro-batch adds its part of the loss's sums over the batch to one
float32 vector (`LossTerms.sums`); the parameter-only terms (penalties)
are computed once, each by the first device of the stage owning it
(replicas would count it again) and shared with a `psum`; the head turns
the sums' totals, the batch's data statistics and the penalties into the
loss on every device. The backward's seed, d loss / d sums, comes from
the head: before the loop where the head is affine in the sums, at the
end (a scale of the gradients) for a single sum under another function.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
from jax import lax

from graphpipe.frontend.program import Program


@dataclasses.dataclass(frozen=True)
class SumLayout:
  """Where values of one kind (the loss's sums, its penalties) sit in one
  float32 vector: key -> (offset, shape, dtype)."""

  places: dict
  size: int

  @classmethod
  def of(cls, keys, avals) -> SumLayout:
    places, at = {}, 0
    for key in keys:
      aval = avals[key]
      places[key] = (at, tuple(aval.shape), str(aval.dtype))
      at += math.prod(aval.shape)
    return cls(places, at)

  def pack(self, values: dict):
    """The vector holding `values` (keys it lacks are zeros)."""
    out = jnp.zeros((max(1, self.size),), jnp.float32)
    for key, value in values.items():
      at, shape, _ = self.places[key]
      n = math.prod(shape)
      out = out.at[at : at + n].set(value.astype(jnp.float32).reshape(-1))
    return out

  def unpack(self, vector) -> dict:
    return {
      key: vector[at : at + math.prod(shape)].reshape(shape).astype(dtype)
      for key, (at, shape, dtype) in self.places.items()
    }


class LossTerms:
  """The sums, penalties and head of a loss, at the mini-batch's size.

  Args:
    whole: the program at the mini-batch's size.
    layout: the step's layout (stages, their nodes and devices).
  """

  def __init__(self, whole: Program, layout):
    self.whole, self.layout = whole, layout
    self.consts = whole.consts
    self.mode = whole.form.mode
    avals = {}
    for piece in [*whole.nodes, *whole.penalties.values()]:
      avals.update(zip(piece.outputs, piece.output_avals(), strict=True))
    self.sums = SumLayout.of(whole.loss_keys, avals)
    penalty_keys = [
      k for piece in whole.penalties.values() for k in piece.outputs
    ]
    self.penalty_layout = SumLayout.of(sorted(penalty_keys, key=_number), avals)
    self.statistic_avals = dict(
      zip(whole.prepass.outputs, whole.prepass.output_avals(), strict=True)
    )

  def penalty_function(self, stage: int):
    """f(params) -> the penalty vector holding the terms the stage's nodes
    own (zeros elsewhere); None where they own none."""
    s = self.layout.stages[stage]
    pieces = [
      self.whole.penalties[n] for n in s.nodes if n in self.whole.penalties
    ]
    if not pieces:
      return None

    def f(params: dict):
      env = {**self.consts, **params}
      values = {}
      for piece in pieces:
        outs = piece(*[env[k] for k in piece.inputs])
        values.update(zip(piece.outputs, outs, strict=True))
      return self.penalty_layout.pack(values)

    return f

  def head_function(self, statistics: dict):
    """f(sums vector, penalty vector) -> the loss (float32), given the
    batch's data statistics."""
    head = self.whole.head

    def f(sums, penalties):
      env = {**self.consts, **statistics}
      env.update(self.sums.unpack(sums))
      env.update(self.penalty_layout.unpack(penalties))
      return head(*[env[k] for k in head.inputs])[0].astype(jnp.float32)

    return f

  def seeds(self, head, penalties):
    """d loss / d sums for the backward of every micro-batch: where the
    head is affine in the sums it does not depend on them (any value
    will do); otherwise (one sum) 1, the gradients scaled at the end."""
    if self.mode == "affine":
      return jax.grad(head)(jnp.zeros((self.sums.size,)), penalties)
    return jnp.ones((self.sums.size,), jnp.float32)

  # Inside the SPMD step: penalties on their owners' first devices.

  def owner_switch(self, device_stage, me, branch, zero):
    """`branch(stage)` on the first device of each stage that owns
    penalties (replicas would count them again), `zero` elsewhere."""
    owners = []
    for d in range(self.layout.num_devices):
      stage = device_stage.get(d)
      own = (
        stage is not None
        and self.layout.stages[stage].devices[0] == d
        and self.penalty_function(stage) is not None
      )
      owners.append(stage if own else None)
    stages = sorted({s for s in owners if s is not None})
    if not stages:
      return zero
    index = jnp.asarray(
      [0 if s is None else 1 + stages.index(s) for s in owners]
    )[me]
    branches = [lambda _: zero] + [(lambda _, s=s: branch(s)) for s in stages]
    return lax.switch(index, branches, None)

  def penalties(self, device_stage, me, variables):
    """This device's part of the penalty vector (zeros on most);
    `variables(stage)` -> (trainable, frozen) of the stage."""

    def branch(stage):
      trainable, frozen = variables(stage)
      return self.penalty_function(stage)({**trainable, **frozen})

    zero = jnp.zeros((max(1, self.penalty_layout.size),), jnp.float32)
    return self.owner_switch(device_stage, me, branch, zero)

  def penalty_grads(
    self, device_stage, me, variables, cotangent, scatter, zeros
  ):
    """The gradients of the penalties this device computed, for
    `cotangent` = d loss / d penalties, as `scatter(stage, grads)` makes
    them (`zeros` on the other devices)."""

    def branch(stage):
      trainable, frozen = variables(stage)
      f = self.penalty_function(stage)
      _, vjp = jax.vjp(lambda p: f({**p, **frozen}), trainable)
      (grads,) = vjp(cotangent)
      return scatter(stage, grads)

    return self.owner_switch(device_stage, me, branch, zeros)


def _number(key: str) -> int:
  return int(key.partition(":")[2])
