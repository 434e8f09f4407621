"""Random small NNX models with the DAG shapes of `random_graphs` (seeded).

`random_model(seed)` draws a DAG of layers the same way `op_graphs` draws
operator graphs (chains, fan-out, fan-in joins, skips across levels,
crossings that are not series-parallel, several batch inputs, several loss
heads) and builds an NNX model of it: node i is a module that concatenates
what it reads (earlier nodes' outputs or its own batch input) and applies
either a wide Linear with a tanh (heavy in parameters) or a narrow Linear
followed by a widening elementwise expansion (heavy in activations). Every
node nobody reads is a loss head: a mean squared error against its own
target, and the loss is the sum of the heads (a multi-task model).
"""

from __future__ import annotations

import dataclasses
import random

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

SHAPES = ("chain", "fan_out", "fan_in", "skip", "cross", "source")


@dataclasses.dataclass(frozen=True)
class Spec:
  """A drawn model: what each node reads, its kind and its width."""

  reads: tuple[tuple[int, ...], ...]
  kinds: tuple[str, ...]
  widths: tuple[int, ...]
  in_features: int

  @property
  def sinks(self) -> list[int]:
    read = {v for r in self.reads for v in r}
    return [i for i in range(len(self.reads)) if i not in read]

  @property
  def sources(self) -> list[int]:
    return [i for i, r in enumerate(self.reads) if not r]


def draw_spec(seed: int, min_nodes: int = 3, max_nodes: int = 7) -> Spec:
  rng = random.Random(seed)
  n = rng.randint(min_nodes, max_nodes)
  reads: list[set[int]] = [set()]
  level = [0]
  for i in range(1, n):
    shape = rng.choice(SHAPES)
    read = {i - 1}
    if shape == "fan_out":
      used = [v for v in range(i) if any(v in r for r in reads)]
      read = {rng.choice(used or [i - 1])}
    elif shape in ("fan_in", "cross") and i >= 2:
      read = set(rng.sample(range(i), min(i, rng.choice([2, 3]))))
      earlier = [r for r in reads if len(r) >= 2]
      if shape == "cross" and earlier:
        read = {max(rng.choice(earlier)), rng.randrange(i)}
    elif shape == "skip":
      far = [v for v in range(i) if level[v] <= level[i - 1] - 1]
      if far:
        read = {i - 1, rng.choice(far)}
    elif shape == "source":
      read = set()
    reads.append(read)
    level.append(1 + max((level[v] for v in read), default=-1))
  return Spec(
    reads=tuple(tuple(sorted(r)) for r in reads),
    kinds=tuple(rng.choice(["params", "activations"]) for _ in range(n)),
    widths=tuple(rng.choice([4, 8, 16]) for _ in range(n)),
    in_features=rng.choice([3, 6]),
  )


class Dense(nnx.Module):
  """A wide Linear and a tanh: parameters dominate."""

  def __init__(self, fan_in, width, *, rngs, dtype=None, param_dtype=None):
    kw = {"dtype": dtype, "param_dtype": param_dtype or jnp.float32}
    self.linear = nnx.Linear(fan_in, width, rngs=rngs, **kw)

  def __call__(self, x):
    return jnp.tanh(self.linear(x))


class Expand(nnx.Module):
  """A narrow Linear, then a 4x widening by elementwise products with a
  learned scale: activations dominate (few weights, wide outputs)."""

  def __init__(self, fan_in, width, *, rngs, dtype=None, param_dtype=None):
    kw = {"dtype": dtype, "param_dtype": param_dtype or jnp.float32}
    self.linear = nnx.Linear(fan_in, width // 4 or 1, rngs=rngs, **kw)
    out = self.linear.out_features
    self.scale = nnx.Param(
      jax.random.normal(rngs.params(), (4, out), kw["param_dtype"])
    )

  def __call__(self, x):
    h = self.linear(x)
    return jnp.sin(h[:, None, :] * self.scale[...].astype(h.dtype)).reshape(
      h.shape[0], -1
    )


class RandomModel(nnx.Module):
  """The NNX model of a `Spec` (see the module docstring)."""

  def __init__(self, spec: Spec, *, rngs, dtype=None, param_dtype=None):
    self.spec = spec
    layers = []
    out = []
    for i, reads in enumerate(spec.reads):
      fan_in = sum(out[v] for v in reads) if reads else spec.in_features
      cls = Dense if spec.kinds[i] == "params" else Expand
      layer = cls(
        fan_in,
        spec.widths[i],
        rngs=rngs,
        dtype=dtype,
        param_dtype=param_dtype,
      )
      layers.append(layer)
      width = spec.widths[i] if cls is Dense else 4 * layer.linear.out_features
      out.append(width)
    self.layers = nnx.List(layers)
    self.out_widths = tuple(out)

  def __call__(self, batch):
    values = []
    for i, reads in enumerate(self.spec.reads):
      if reads:
        x = jnp.concatenate([values[v] for v in reads], axis=-1)
      else:
        x = batch[f"x{i}"]
      values.append(self.layers[i](x))
    return {i: values[i] for i in self.spec.sinks}


def loss_fn(model: RandomModel, batch) -> jax.Array:
  """Sum over the loss heads of the mean squared error (in float32)."""
  heads = model(batch)
  return sum(
    jnp.mean(
      (heads[i].astype(jnp.float32) - batch[f"y{i}"]) ** 2, dtype=jnp.float32
    )
    for i in sorted(heads)
  )


def make_batch(spec: Spec, batch_size: int, seed: int = 0, dtype=None):
  """Standard-normal inputs (of `dtype`, default float32) and targets."""
  rng = np.random.default_rng(seed)
  batch = {}
  for i in spec.sources:
    x = rng.standard_normal((batch_size, spec.in_features), np.float32)
    batch[f"x{i}"] = jnp.asarray(x, dtype or jnp.float32)
  widths = out_widths(spec)
  for i in spec.sinks:
    y = rng.standard_normal((batch_size, widths[i]), np.float32)
    batch[f"y{i}"] = jnp.asarray(y)
  return batch


def build(seed: int, **kwargs) -> RandomModel:
  return RandomModel(draw_spec(seed), rngs=nnx.Rngs(seed), **kwargs)


def with_shape_costs(graph):
  """The captured graph (program kept) with figures derived from shapes.

  `capture(..., costs=False)` skips XLA's per-node cost analysis (seconds
  per model) and leaves FLOPs and saved bytes zero; the planner then needs
  some figures: 2 FLOPs per weight and sample forward, twice that
  backward, and the node's input and output activations saved.
  """
  from graphpipe.core.graph import OpGraph

  into = {v.id: 0.0 for v in graph.nodes}
  out = {v.id: 0.0 for v in graph.nodes}
  for e in graph.edges:
    into[e.dst] += e.bytes
    out[e.src] = max(out[e.src], e.bytes)
  nodes = []
  for v in graph.nodes:
    flops = 2.0 * v.param_bytes / 4
    nodes.append(
      dataclasses.replace(
        v,
        fwd_flops=flops,
        bwd_flops=2 * flops,
        fwd_bytes=into[v.id] + out[v.id],
        bwd_bytes=2 * (into[v.id] + out[v.id]),
        activation_bytes=out[v.id],
        saved_bytes=into[v.id] + out[v.id] + 4.0,
      )
    )
  return OpGraph(
    nodes,
    graph.edges,
    inputs=graph.inputs,
    loss_nodes=graph.loss_nodes,
    batch_size=graph.batch_size,
    model=graph.model,
    program=graph.program,
    meta=graph.meta,
  )


class LinenDense(nn.Module):
  width: int

  @nn.compact
  def __call__(self, x):
    return jnp.tanh(nn.Dense(self.width)(x))


class LinenExpand(nn.Module):
  width: int

  @nn.compact
  def __call__(self, x):
    h = nn.Dense(max(1, self.width // 4))(x)
    scale = self.param("scale", nn.initializers.normal(1.0), (4, h.shape[-1]))
    return jnp.sin(h[:, None, :] * scale).reshape(h.shape[0], -1)


class LinenRandomModel(nn.Module):
  """The linen model of a `Spec`: node i is the submodule `node_i`."""

  spec: Spec

  @nn.compact
  def __call__(self, batch):
    values = []
    for i, reads in enumerate(self.spec.reads):
      if reads:
        x = jnp.concatenate([values[v] for v in reads], axis=-1)
      else:
        x = batch[f"x{i}"]
      cls = LinenDense if self.spec.kinds[i] == "params" else LinenExpand
      values.append(cls(self.spec.widths[i], name=f"node_{i}")(x))
    return {i: values[i] for i in self.spec.sinks}


def out_widths(spec: Spec) -> tuple[int, ...]:
  return tuple(
    w if kind == "params" else 4 * max(1, w // 4)
    for w, kind in zip(spec.widths, spec.kinds, strict=True)
  )


def build_linen(seed: int):
  """(module, variables) of the linen model of seed `seed`."""
  spec = draw_spec(seed)
  module = LinenRandomModel(spec)
  batch = make_batch(spec, 2)
  return module, module.init(jax.random.key(seed), batch)
