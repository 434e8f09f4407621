"""What the pinned two-process benchmarks share.

`experiments.bench_runtime`, `experiments.bench_zero` and
`experiments.bench_split` each measure two plans of one model on two
processes with one CPU device each, every process pinned to its own core
(`graphpipe.runtime.launch`; BUILD.md says why XLA flags alone do not
give two quiet devices), stepping the two plans in turns so that both see
the same machine, and compare the medians with the simulator's steps
under a profiled cost model whose link latency is measured on the same
two devices. A benchmark's `main` reads:

  if pinned.relaunch("experiments.bench_x"):
    return                      # the launcher printed the leader's output
  leader, say = pinned.start()
  trainers, states = pinned.warm(plans, graphs, optimizer, model, batch, say)
  times = pinned.timed_pairs(trainers, states, batch, pairs, order, say)
  latency = pinned.link_latency()   # every process: a collective
  if not leader:
    return
  spec = pinned.cpu_spec(latency)
"""

from __future__ import annotations

import dataclasses
import os
import statistics
import sys
import time

from experiments import common


def relaunch(module: str) -> bool:
  """Inside a launched worker: False (go on). Otherwise runs `module`
  with this command line's flags as two pinned processes, prints the
  leader's output and returns True (the caller returns)."""
  from graphpipe.runtime.launch import initialize_from_env, launch

  if initialize_from_env():
    return False
  outputs = launch(["-m", module, *sys.argv[1:]], 2, 1, timeout=1800)
  print(outputs[0], end="")
  return True


def start():
  """(whether this process leads, its `say`: `common.log` on the leader,
  silent elsewhere), after saying which devices and cores it has."""
  import jax

  leader = jax.process_index() == 0
  say = common.log if leader else (lambda *a, **k: None)
  say(f"devices: {jax.devices()}, process affinity {os.sched_getaffinity(0)}")
  return leader, say


def warm(plans: dict, graphs: dict, optimizer, model, batch, say, steps=3):
  """A `Trainer` and state per plan (`graphs[name]`: its graph), each
  stepped `steps` times on `batch` to compile and warm up."""
  from graphpipe.runtime import Trainer

  trainers, states = {}, {}
  for name, plan in plans.items():
    say(str(plan))
    trainers[name] = Trainer(plan, optimizer, graph=graphs[name])
    states[name] = trainers[name].init(model)
    for _ in range(steps):
      states[name], _ = trainers[name].step(states[name], batch)
  return trainers, states


def timed_pairs(trainers, states, batch, pairs, order, say) -> dict:
  """Seconds of each step, per plan: `pairs` rounds, each stepping the
  plans once in `order` (states are updated in place)."""
  times = {name: [] for name in order}
  progress = common.Progress(pairs, "pair", every=5, say=say)
  for _ in range(pairs):
    for name in order:
      begin = time.perf_counter()
      states[name], _ = trainers[name].step(states[name], batch)
      times[name].append(time.perf_counter() - begin)
    progress.step(
      ", ".join(f"{name} {times[name][-1] * 1e3:.1f} ms" for name in order)
    )
  return times


def medians(times: dict) -> dict:
  """The median step time per plan."""
  return {name: statistics.median(t) for name, t in times.items()}


def link_latency(repeats: int = 50) -> float:
  """Median seconds of one tiny ppermute between the two devices (every
  process must call it: it is a collective)."""
  import jax
  import numpy as np
  from jax.sharding import Mesh, NamedSharding
  from jax.sharding import PartitionSpec as P

  mesh = Mesh(np.asarray(jax.devices()[:2]), ("pipe",))
  swap = jax.jit(
    jax.shard_map(
      lambda x: jax.lax.ppermute(x, "pipe", [(0, 1), (1, 0)]),
      mesh=mesh,
      in_specs=P("pipe"),
      out_specs=P("pipe"),
      check_vma=False,
    )
  )
  host = np.zeros((2, 16), np.float32)
  x = jax.make_array_from_callback(
    host.shape, NamedSharding(mesh, P("pipe")), lambda i: host[i]
  )
  return _median_seconds(swap, (x,), repeats)


def ring_time(slot_sizes, repeats: int = 11) -> float:
  """Median seconds of the runtime's gradient all-reduce
  (`graphpipe.runtime.reduce.ring_sum`) over float32 slots of
  `slot_sizes` elements between the two devices, jitted alone (every
  process must call it: it is a collective)."""
  import jax
  import numpy as np
  from jax.sharding import Mesh, NamedSharding
  from jax.sharding import PartitionSpec as P

  from graphpipe.runtime.reduce import ring_sum

  mesh = Mesh(np.asarray(jax.devices()[:2]), ("pipe",))
  spec = (P("pipe"),) * len(slot_sizes)

  def body(*rows):
    summed = ring_sum(tuple(r[0] for r in rows), [(0, 1)], 2, "pipe")
    return tuple(x[None] for x in summed)

  ring = jax.jit(
    jax.shard_map(
      body, mesh=mesh, in_specs=spec, out_specs=spec, check_vma=False
    )
  )
  slots = []
  for size in slot_sizes:
    host = np.ones((2, size), np.float32)
    slots.append(
      jax.make_array_from_callback(
        host.shape, NamedSharding(mesh, P("pipe")), lambda i, h=host: h[i]
      )
    )
  return _median_seconds(ring, slots, repeats)


def _median_seconds(fn, args, repeats: int) -> float:
  """Median seconds of `repeats` calls of `fn(*args)` after one untimed."""
  import jax

  jax.block_until_ready(fn(*args))
  times = []
  for _ in range(repeats):
    begin = time.perf_counter()
    jax.block_until_ready(fn(*args))
    times.append(time.perf_counter() - begin)
  return statistics.median(times)


class MeasuredRing:
  """A cost model whose all-reduce between two devices is the runtime's
  ring measured on them (`ring_time`: `seconds` for `num_bytes`, scaled
  by the bytes), the rest from `base`."""

  def __init__(self, base, num_bytes: float, seconds: float):
    self.base, self.num_bytes, self.seconds = base, num_bytes, seconds

  def __getattr__(self, name):
    return getattr(self.base, name)

  def allreduce_time(self, num_bytes: float, devices) -> float:
    if len(devices) <= 1 or num_bytes <= 0:
      return 0.0
    return self.seconds * num_bytes / self.num_bytes


def cpu_spec(latency: float):
  """This CPU's measured spec (`measure_cpu`) with `latency` on every
  link."""
  from graphpipe.costs import measure_cpu

  return dataclasses.replace(
    measure_cpu(), intra_node_latency=latency, inter_node_latency=latency
  )


def cost_model(graph, spec, batch_sizes, **options):
  """The profiled cost model the benchmarks predict with: `graph`'s nodes
  timed at `batch_sizes` on this CPU, the rest from `spec`; `options` go
  to `ProfiledCostModel` (e.g. `repeats`)."""
  from graphpipe.costs import AnalyticCostModel, ProfiledCostModel

  return ProfiledCostModel(
    graph,
    AnalyticCostModel(spec),
    batch_sizes=batch_sizes,
    cache_dir=None,
    **options,
  )
