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

NNX models (`build`) also draw quirks where a planner may not cut freely
(`graphpipe.core.runnable`), from a generator of their own so the DAGs
stay those of `draw_spec`: a layer whose code refuses odd batch sizes
('even'), a layer whose output is laid out time-major for its readers
('time_major': samples apart along the batch axis), and a loss with a max
over the batch (`whole_batch`: exact only on the whole batch at once).
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
  quirks: tuple[str, ...] = ()  # per node: '', 'even' or 'time_major'
  whole_batch: bool = False

  @property
  def sinks(self) -> list[int]:
    read = {v for r in self.reads for v in r}
    return [i for i in range(len(self.reads)) if i not in read]

  @property
  def sources(self) -> list[int]:
    return [i for i, r in enumerate(self.reads) if not r]


def draw_spec(
  seed: int, min_nodes: int = 3, max_nodes: int = 7, quirks: bool = False
) -> Spec:
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
  spec = Spec(
    reads=tuple(tuple(sorted(r)) for r in reads),
    kinds=tuple(rng.choice(["params", "activations"]) for _ in range(n)),
    widths=tuple(rng.choice([4, 8, 16]) for _ in range(n)),
    in_features=rng.choice([3, 6]),
  )
  if not quirks:
    return spec
  odd = random.Random(seed + 7919)
  read = {v for r in spec.reads for v in r}
  drawn = tuple(
    odd.choice(["", "", "even", "time_major"] if i in read else ["", "even"])
    for i in range(n)
  )
  return dataclasses.replace(spec, quirks=drawn, whole_batch=odd.random() < 0.2)


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
    quirks = self.spec.quirks or ("",) * len(self.spec.reads)
    for i, reads in enumerate(self.spec.reads):
      if reads:
        x = jnp.concatenate([unlaid(values[v]) for v in reads], axis=-1)
      else:
        x = batch[f"x{i}"]
      if quirks[i] == "even" and x.shape[0] % 2:
        raise ValueError("this layer takes pairs of samples")
      out = self.layers[i](x)
      if quirks[i] == "time_major":
        out = TimeMajor(out.T.reshape(-1), out.shape[1])
      values.append(out)
    return {i: unlaid(values[i]) for i in self.spec.sinks}


@jax.tree_util.register_pytree_node_class
class TimeMajor:
  """A (B, W) value laid out as W runs of B: its samples apart."""

  def __init__(self, flat, width):
    self.flat, self.width = flat, width

  def tree_flatten(self):
    return (self.flat,), self.width

  @classmethod
  def tree_unflatten(cls, width, children):
    return cls(children[0], width)


def unlaid(value):
  if isinstance(value, TimeMajor):
    return value.flat.reshape(value.width, -1).T
  return value


def loss_fn(model: RandomModel, batch) -> jax.Array:
  """Sum over the loss heads of the mean squared error (in float32); with
  `whole_batch`, plus the batch's largest error of the first head."""
  heads = model(batch)
  errors = {
    i: (heads[i].astype(jnp.float32) - batch[f"y{i}"]) ** 2 for i in heads
  }
  loss = sum(jnp.mean(errors[i], dtype=jnp.float32) for i in sorted(heads))
  if getattr(model.spec, "whole_batch", False):
    loss = loss + 0.1 * jnp.max(errors[min(heads)])
  return loss


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


def draw_split(spec: Spec, seed: int) -> dict[str, int] | None:
  """`capture`'s split_layers for every third model (seeds 1, 4, 7, ...):
  its widest parameter-heavy layer in 2 or 3 parts, None otherwise."""
  dense = [i for i, k in enumerate(spec.kinds) if k == "params"]
  if seed % 3 != 1 or not dense:
    return None
  widest = max(dense, key=lambda i: spec.widths[i])
  parts = min(2 + seed % 2, spec.widths[widest])
  return {f"layers.{widest}.linear": parts} if parts >= 2 else None


def build(seed: int, quirks: bool = False, **kwargs) -> RandomModel:
  spec = draw_spec(seed, quirks=quirks)
  return RandomModel(spec, rngs=nnx.Rngs(seed), **kwargs)


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
    shared=graph.shared,
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
