"""Child of test_two_processes_reproduce_one_process: Adam, replicas apart.

  python multiprocess_worker.py train OUT CKPT    # steps 0-2, saves CKPT
  python multiprocess_worker.py resume OUT CKPT   # restores CKPT, step 2

The plan (`plan()`) has a data-parallel stage whose two replicas sit in
different processes (device 3 in process 0, device 4 in process 1 when
each has 4 devices). `train` saves the state after step 1 to CKPT (every
process writing its shards of one checkpoint); `resume`, a fresh run of
fresh processes, restores it into a fresh Trainer and takes step 2. Each
prints `RESULT {json}` (losses, which process holds each replica, whether
the replicas' parameter and Adam rows are bit-identical) and process 0
writes the parameters, gathered to the host, to OUT/params_MODE.npz.
"""

import functools
import json
import os
import sys

from graphpipe.runtime.launch import initialize_from_env

initialize_from_env()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402
from jax.experimental import multihost_utils  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import graphpipe  # noqa: E402
from graphpipe.core.stages import Plan, Stage, in_flight_counts  # noqa: E402
from graphpipe.runtime import Trainer, checkpoints  # noqa: E402

STEPS = 3
SAVE_AFTER = 2  # steps taken when the checkpoint is written
BATCH = 16
# (nodes, devices) of the nodes left.a, left.b, right.a, right.b, head:
# the left tower in two stages (the first on 2 devices of process 0), the
# right tower on devices 3 and 4 (one per process), the head on devices
# 5 and 6 (process 1).
GROUPS = (
  ((0,), (0, 1)),
  ((1,), (2,)),
  ((2, 3), (3, 4)),
  ((4,), (5, 6)),
)
CROSS = 2  # the stage whose replicas are in different processes


class Tower(nnx.Module):
  def __init__(self, rngs):
    self.a = nnx.Linear(6, 8, rngs=rngs)
    self.b = nnx.Linear(8, 8, rngs=rngs)

  def __call__(self, x):
    return jnp.tanh(self.b(jnp.tanh(self.a(x))))


class TwoTowers(nnx.Module):
  """Small enough that each process compiles its step in seconds."""

  def __init__(self, rngs):
    self.left, self.right = Tower(rngs), Tower(rngs)
    self.head = nnx.Linear(16, 1, rngs=rngs)

  def __call__(self, x):
    return self.head(jnp.concatenate([self.left(x), self.right(x)], -1))


def loss_fn(model, b):
  return jnp.mean((model(b["x"])[:, 0] - b["y"]) ** 2)


def batch(step):
  rng = np.random.default_rng(step)
  return {
    "x": rng.standard_normal((BATCH, 6), np.float32),
    "y": rng.standard_normal((BATCH,), np.float32),
  }


def model():
  return TwoTowers(nnx.Rngs(0))


@functools.cache
def graph():
  g = graphpipe.capture(loss_fn, model(), batch(0), granularity=2)
  names = [v.name for v in g.nodes]
  assert names == ["left.a", "left.b", "right.a", "right.b", "head"], names
  return g


def plan() -> Plan:
  owner = {v: i for i, (nodes, _) in enumerate(GROUPS) for v in nodes}
  edges = tuple(
    sorted(
      {
        (owner[e.src], owner[e.dst])
        for e in graph().edges
        if owner[e.src] != owner[e.dst]
      }
    )
  )
  flight = in_flight_counts(len(GROUPS), edges)
  stages = tuple(
    Stage(i, nodes, devices, 4, flight[i])
    for i, (nodes, devices) in enumerate(GROUPS)
  )
  used = sum(len(d) for _, d in GROUPS)
  return Plan("manual", stages, edges, BATCH, used)


def trainer() -> Trainer:
  return Trainer(plan(), optax.adam(1e-2), graph=graph())


def plain_training(steps=STEPS) -> tuple[list[float], dict]:
  """Losses and final parameters (by 'param:' key) of plain JAX."""
  graphdef, params, rest = nnx.split(model(), nnx.Param, ...)
  optimizer = optax.adam(1e-2)
  opt_state = optimizer.init(params)
  losses = []
  for s in range(steps):
    loss, grads = jax.value_and_grad(
      lambda p, s=s: loss_fn(nnx.merge(graphdef, p, rest), batch(s))
    )(params)
    updates, opt_state = optimizer.update(grads, opt_state, params)
    params = optax.apply_updates(params, updates)
    losses.append(float(loss))
  values = graph().program.variable_values(nnx.merge(graphdef, params, rest))
  return losses, {k: v for k, v in values.items() if k.startswith("param:")}


def replicas_identical(tr, state) -> bool:
  """Every replica's parameter and Adam rows equal its stage's first's."""
  rows = [
    np.asarray(
      multihost_utils.process_allgather(x, tiled=True)
      if jax.process_count() > 1
      else x
    )
    for x in jax.tree.leaves((state.params, state.opt_state))
  ]
  rows = [x for x in rows if x.ndim and x.shape[0] == tr.plan.num_devices]
  assert rows
  return all(
    np.array_equal(x[s.devices[0]], x[d])
    for s in tr.plan.stages
    for d in s.devices[1:]
    for x in rows
  )


def split_batch_packs_the_same() -> bool:
  """A batch split by samples over both processes' devices (each holding
  its rows only, as a loader gives it) is packed on the devices into the
  same words as the whole batch on every process's host."""
  groups = (((0, 1), (0, 1, 2, 3)), ((2, 3), (4, 5)), ((4,), (6, 7)))
  edges = ((0, 2), (1, 2))
  flight = in_flight_counts(len(groups), edges)
  stages = tuple(
    Stage(i, nodes, devices, 4, flight[i])
    for i, (nodes, devices) in enumerate(groups)
  )
  tr = Trainer(
    Plan("manual", stages, edges, BATCH, 8), optax.sgd(0.1), graph=graph()
  )
  host = batch(0)
  by_samples = NamedSharding(tr.mesh, P(tr.mesh.axis_names[0]))
  split = {
    k: jax.make_array_from_callback(v.shape, by_samples, lambda i, v=v: v[i])
    for k, v in host.items()
  }
  assert not split["x"].is_fully_addressable
  words = [
    np.asarray(multihost_utils.process_allgather(w, tiled=True))
    for w in (tr.put_batch(split).words, tr.put_batch(host).words)
  ]
  return bool(np.array_equal(*words))


def refuses_a_file(tr, state, out) -> bool:
  """Whether saving to a file's path fails clearly on this process (only
  process 0 checked the path; the others went on into orbax's
  collectives)."""
  path = os.path.join(out, "not_a_folder")
  with open(path, "w") as f:  # every process writes the same file
    f.write("x")
  try:
    tr.save(state, path)
  except graphpipe.errors.PipelineRuntimeError as err:
    return "cannot save a checkpoint" in str(err)
  return False


def run(mode, out, ckpt):
  tr = trainer()
  if mode == "train":
    state, first = tr.init(model()), 0
  else:
    state, first = tr.restore(ckpt), SAVE_AFTER
  mesh = tr.mesh.devices.ravel()
  losses, committed, refused = [], None, None
  for s in range(first, STEPS):
    state, metrics = tr.step(state, batch(s))
    losses.append(metrics["loss"])
    if mode == "train" and s + 1 == SAVE_AFTER:
      refused = refuses_a_file(tr, state, out)
      tr.save(state, ckpt)
      # Committed when save returns, on every process (process 1 returned
      # before process 0 had written the mark).
      committed = checkpoints.read_mark(ckpt) is not None
  params = tr.params(state)  # gathered from every process
  if jax.process_index() == 0:
    np.savez(os.path.join(out, f"params_{mode}.npz"), **params)
  return {
    "process": jax.process_index(),
    "devices": jax.device_count(),
    "losses": losses,
    "cross_processes": [int(mesh[d].process_index) for d in GROUPS[CROSS][1]],
    "replicas_identical": replicas_identical(tr, state),
    "split_batch": split_batch_packs_the_same() if mode == "train" else None,
    "committed_on_return": committed,
    "refused_a_file": refused,
  }


if __name__ == "__main__":
  result = run(*sys.argv[1:4])
  print("RESULT " + json.dumps(result), flush=True)
