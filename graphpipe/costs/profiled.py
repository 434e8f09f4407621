"""`ProfiledCostModel`: node times measured on the device, interpolated.

  model = ProfiledCostModel(graph, AnalyticCostModel(device_spec("h200")))

Each node's jitted forward and backward run at a few micro-batch sizes; the
times are cached on disk and interpolated piecewise-linearly in the batch.
Communication, optimizer steps and memory come from the analytic model.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from graphpipe.core.fingerprint import graph_fingerprint
from graphpipe.core.graph import Node, OpGraph
from graphpipe.costs.analytic import (
  AnalyticCostModel,
  best_time,
  best_time_in_place,
)
from graphpipe.errors import CostModelError


def _random_inputs(avals, seed: int) -> list:
  """Arrays shaped like `avals`: normal floats, zero integers (indices)."""
  key = jax.random.key(seed)
  out = []
  for i, aval in enumerate(avals):
    if jnp.issubdtype(aval.dtype, jnp.inexact):
      out.append(
        jax.random.normal(jax.random.fold_in(key, i), aval.shape, aval.dtype)
      )
    else:
      out.append(jnp.zeros(aval.shape, aval.dtype))
  return out


def _fwd_bwd(node_fn, avals):
  """Jitted forward and forward+backward of a node program."""
  wrt = [jnp.issubdtype(a.dtype, jnp.inexact) for a in avals]

  def forward(*args):
    return node_fn(*args)

  def backward(*args):
    fixed = [a for a, w in zip(args, wrt, strict=True) if not w]
    diff = [a for a, w in zip(args, wrt, strict=True) if w]

    def differentiable(*diff_in):
      it_diff, it_fixed = iter(diff_in), iter(fixed)
      outs = node_fn(*[next(it_diff) if w else next(it_fixed) for w in wrt])
      return tuple(
        o for o in outs if jnp.issubdtype(jnp.result_type(o), jnp.inexact)
      )

    outs, vjp = jax.vjp(differentiable, *diff)
    return outs, vjp(tuple(jnp.ones_like(o) for o in outs))

  return jax.jit(forward), jax.jit(backward), any(wrt)


def time_node(node_fn, seed: int = 0, repeats: int = 3) -> tuple[float, float]:
  """(forward, backward) seconds of one node program on the default device.

  The fastest of `repeats` jitted calls on random inputs; the backward is
  the timed forward + VJP minus the forward (0 for a node with nothing to
  differentiate). What `ProfiledCostModel` records per node and size.

  Args:
    node_fn: a node program (`graph.program.at_batch_size(b).nodes[i]`).
    seed: seed of the random inputs.
    repeats: timed calls after the warm-up call.
  """
  avals = node_fn.input_avals()
  args = _random_inputs(avals, seed)
  forward, backward, differentiable = _fwd_bwd(node_fn, avals)
  fwd = best_time(forward, *args, repeats=repeats)
  both = best_time(backward, *args, repeats=repeats)
  return fwd, max(both - fwd, 0.0) * differentiable


def _interpolate(sizes: Sequence[float], times: Sequence[float], x: float):
  """Piecewise-linear in the batch, extrapolated from the nearest segment."""
  if len(sizes) == 1:
    return times[0] * x / sizes[0]
  i = int(np.clip(np.searchsorted(sizes, x), 1, len(sizes) - 1))
  x0, x1, y0, y1 = sizes[i - 1], sizes[i], times[i - 1], times[i]
  value = y0 + (x - x0) * (y1 - y0) / (x1 - x0)
  # No batch is faster than the smallest measured size, and below it time
  # falls at most with the batch: between the smallest time's proportional
  # share and the smallest time (tiny nodes' times can fall with the batch
  # by noise, which the nearest segment would extrapolate).
  if x < sizes[0]:
    return min(max(value, times[0] * x / sizes[0]), times[0])
  return max(value, times[0])


class ProfiledCostModel:
  """Node times measured on the actual device; the rest from `analytic`.

  Each node's jitted forward and backward run on random inputs at every
  size in `batch_sizes`; the fastest of a few runs counts (backward = the
  timed forward+backward minus the forward). Times are cached as JSON in
  `cache_dir`, keyed by graph fingerprint and device kind, and interpolated
  piecewise-linearly in the batch. Transfers, all-reduces, optimizer steps
  and memory capacity come from the analytic model.

  Needs a captured graph (`graph.program`); a graph loaded from JSON can
  still use a cache written earlier for the same graph and device.

  Example:
    >>> from graphpipe.costs import device_spec
    >>> model = nnx.Sequential(nnx.Linear(4, 8, rngs=nnx.Rngs(0)),
    ...                        nnx.Linear(8, 1, rngs=nnx.Rngs(1)))
    >>> loss_fn = lambda m, b: jnp.mean((m(b["x"]) - b["y"]) ** 2)
    >>> batch = {"x": jnp.ones((8, 4)), "y": jnp.ones((8, 1))}
    >>> graph = graphpipe.capture(loss_fn, model, batch)
    >>> cpu = AnalyticCostModel(device_spec("cpu"))   # this machine
    >>> profiled = ProfiledCostModel(graph, cpu, batch_sizes=(1, 4),
    ...                              cache_dir="profiles")
    >>> profiled.cache_path              # fingerprint, device, batch sizes
    'profiles/...-cpu_cpu-1_4.json'
    >>> profiled.node_time(graph.nodes[0], batch=2, kind="fwd") > 0
    True
    >>> again = ProfiledCostModel(graph, cpu, (1, 4), cache_dir="profiles")
    >>> again.times == profiled.times    # read from the cache, not re-timed
    True
    >>> plan = graphpipe.plan(graph, 2, 8, cost_model=profiled)

  Args:
    graph: the operator graph to profile.
    analytic: communication, optimizer and memory figures.
    batch_sizes: micro-batch sizes to time at (powers of two work best).
    cache_dir: folder of the JSON cache (None: no cache).
    repeats: timed runs per node and size.
  """

  def __init__(
    self,
    graph: OpGraph,
    analytic: AnalyticCostModel,
    batch_sizes: Sequence[int] = (1, 4, 16),
    cache_dir: str | None = "~/.cache/graphpipe/profiles",
    repeats: int = 3,
  ):
    self.analytic = analytic
    self.memory_bytes = analytic.memory_bytes
    self._adds: dict[int, float] = {}  # gradient_add_time, by elements
    self.name = f"profiled-{analytic.name}"
    self.fingerprint = graph_fingerprint(graph)
    self.batch_sizes = tuple(sorted(int(b) for b in batch_sizes))
    device = jax.devices()[0]
    self.device_kind = f"{device.platform}:{device.device_kind}"
    path = None
    if cache_dir is not None:
      slug = "".join(c if c.isalnum() else "_" for c in self.device_kind)
      name = f"{self.fingerprint}-{slug}-" + "_".join(
        map(str, self.batch_sizes)
      )
      path = os.path.join(os.path.expanduser(cache_dir), name + ".json")
    self.cache_path = path
    times = self._load(path)
    if times is None:
      times = self._profile(graph, repeats)
      self._store(path, times)
    self.times = times

  def _load(self, path):
    if path is None or not os.path.exists(path):
      return None
    with open(path) as f:
      data = json.load(f)
    if data.get("fingerprint") != self.fingerprint:
      return None
    return {int(k): v for k, v in data["times"].items()}

  def _store(self, path, times) -> None:
    if path is None:
      return
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
      json.dump(
        {
          "fingerprint": self.fingerprint,
          "device": self.device_kind,
          "batch_sizes": list(self.batch_sizes),
          "times": times,
        },
        f,
        indent=1,
      )

  def _profile(self, graph: OpGraph, repeats: int) -> dict:
    if graph.program is None:
      raise CostModelError(
        "profiling needs a captured graph (graph.program is None: it was "
        "loaded from JSON) and no cached profile was found: capture the "
        "model with graphpipe.capture, or use AnalyticCostModel"
      )
    times = {n.id: {"fwd": [], "bwd": []} for n in graph.nodes}
    for b in self.batch_sizes:
      program = graph.program.at_batch_size(b)
      for node_id, node_fn in enumerate(program.nodes):
        fwd, bwd = time_node(node_fn, seed=node_id, repeats=repeats)
        times[node_id]["fwd"].append(fwd)
        times[node_id]["bwd"].append(bwd)
    return times

  def node_time(self, node: Node, batch: float, kind: str) -> float:
    """Measured seconds of `node`'s pass at `batch` samples (interpolated)."""
    if kind not in ("fwd", "bwd"):
      raise CostModelError(f"kind must be 'fwd' or 'bwd', got {kind!r}")
    if node.id not in self.times:
      raise CostModelError(
        f"node {node.id} was not profiled: this profile is for graph "
        f"{self.fingerprint}; build the ProfiledCostModel for this graph"
      )
    return _interpolate(self.batch_sizes, self.times[node.id][kind], batch)

  def transfer_time(self, num_bytes: float, src: int, dst: int) -> float:
    """From the analytic model."""
    return self.analytic.transfer_time(num_bytes, src, dst)

  def allreduce_time(self, num_bytes: float, devices: Sequence[int]) -> float:
    """From the analytic model."""
    return self.analytic.allreduce_time(num_bytes, devices)

  def optimizer_time(self, param_bytes: float) -> float:
    """From the analytic model."""
    return self.analytic.optimizer_time(param_bytes)

  def gradient_add_time(self, num_bytes: float) -> float:
    """Measured on the device: the fastest of 5 jitted adds of two float32
    arrays of `num_bytes` into the first (3 of the runtime's 4 memory
    passes, `AnalyticCostModel.gradient_add_time`), times 4 / 3;
    memoised."""
    elements = max(1, int(num_bytes) // 4)
    if elements not in self._adds:
      # Into the first array, as into the runtime's accumulator (an add
      # into new memory also times the system mapping its pages).
      total, grad = jnp.zeros((elements,), jnp.float32), jnp.ones((elements,))
      seconds = best_time_in_place(jnp.add, total, grad, repeats=5)
      self._adds[elements] = seconds * 4 / 3
    return self._adds[elements]
