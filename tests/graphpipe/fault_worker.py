"""Child of tests/graphpipe/test_faults.py: trains a tiny pipeline.

  python fault_worker.py STEPS CHECKPOINT_ROOT

Trains a three-layer MLP on a 2-stage plan (one device per stage, so one
or two processes) with Adam, printing `LOSS step value` after each step.
With a CHECKPOINT_ROOT it resumes from the latest complete checkpoint
there and saves after every step to ROOT/step_N. Deaths come from the
runtime's own hook (GRAPHPIPE_FAULT, `graphpipe.runtime.faults`). A run
that fails prints the error and leaves at once (`launch.leave`).
"""

import functools
import sys

from graphpipe.runtime.launch import initialize_from_env, leave

initialize_from_env()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402

import graphpipe  # noqa: E402
from graphpipe.runtime import checkpoints  # noqa: E402

BATCH = 16


def model():
  return nnx.Sequential(
    nnx.Linear(4, 8, rngs=nnx.Rngs(0)),
    nnx.Linear(8, 8, rngs=nnx.Rngs(1)),
    nnx.Linear(8, 1, rngs=nnx.Rngs(2)),
  )


def loss_fn(m, b):
  return jnp.mean((m(b["x"]) - b["y"]) ** 2)


def batch(step):
  rng = np.random.default_rng(step)
  return {
    "x": rng.standard_normal((BATCH, 4)).astype(np.float32),
    "y": rng.standard_normal((BATCH, 1)).astype(np.float32),
  }


@functools.cache
def trainer():
  m = model()
  graph = graphpipe.capture(loss_fn, m, batch(0))
  plan = graphpipe.tightest_plan(graph, num_devices=2, batch_size=BATCH)
  assert plan.num_stages == 2, plan
  return graphpipe.Trainer(plan, optax.adam(1e-2), graph=graph), m


def train(steps, root=None, out=print):
  """Losses of steps [first, steps), resuming from root's latest."""
  tr, m = trainer()
  found = checkpoints.latest(root) if root else None
  state = tr.restore(found) if found else tr.init(m)
  first = int(np.asarray(state.step.addressable_shards[0].data))
  losses = []
  for s in range(first, steps):
    state, metrics = tr.step(state, batch(s))
    losses.append(metrics["loss"])
    out(f"LOSS {s} {metrics['loss']!r}")
    if root:
      tr.save(state, f"{root}/step_{s + 1}")
  return losses


if __name__ == "__main__":
  try:
    train(
      int(sys.argv[1]),
      sys.argv[2] if len(sys.argv) > 2 else None,
      out=lambda line: print(line, flush=True),
    )
  except graphpipe.GraphpipeError as err:
    if jax.process_count() > 1:
      leave(f"error: {type(err).__name__}: {err}")
    raise
  print("DONE", flush=True)
