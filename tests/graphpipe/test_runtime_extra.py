"""Runtime: multi-process, checkpoints, memory, bad input."""

import dataclasses
import json
import os
import sys

import numpy as np
import optax
import pytest

from graphpipe.core.stages import Plan, Stage
from graphpipe.errors import GraphpipeError
from graphpipe.runtime import Trainer, slots
from graphpipe.runtime.launch import launch
from tests.graphpipe import multiprocess_worker as mp_worker
from tests.graphpipe import runtime_cases as rc

WORKER = os.path.join(os.path.dirname(__file__), "multiprocess_worker.py")
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(__file__)))


def test_two_processes_reproduce_one_process(tmp_path):
  """Adam on a plan with a stage replicated across the two processes.

  Two launches of two processes: `train` (3 steps, saving after step 1,
  both processes writing one checkpoint) and `resume` (fresh processes,
  a fresh Trainer restoring that checkpoint, step 2). Losses and
  parameters are bit-equal to the same plan in one process, which equals
  plain single-device optax within 1e-6; the two-process
  checkpoint loads in one process at the state one process reaches.
  """
  out, ckpt = str(tmp_path), str(tmp_path / "ckpt")
  env = {"PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
  results = {}
  for mode in ("train", "resume"):
    outputs = launch([WORKER, mode, out, ckpt], 2, 4, env=env, timeout=300)
    results[mode] = []
    for out_text in outputs:
      line = [x for x in out_text.splitlines() if x.startswith("RESULT ")][-1]
      results[mode].append(json.loads(line[len("RESULT ") :]))
  # The same plan in this one process, and plain optax on one device.
  tr = mp_worker.trainer()
  state = tr.init(mp_worker.model())
  want = []
  for s in range(mp_worker.STEPS):
    state, metrics = tr.step(state, mp_worker.batch(s))
    want.append(metrics["loss"])
    if s + 1 == mp_worker.SAVE_AFTER:
      at_save = {k: np.array(v) for k, v in tr.params(state).items()}
  want_params = tr.params(state)
  plain_losses, plain_params = mp_worker.plain_training()
  np.testing.assert_allclose(want, plain_losses, rtol=1e-6)
  # (1.5e-7 measured; Adam can turn round-off in near-zero gradients into
  # full steps, which this model's gradients do not come near.)
  assert rc.max_rel_error(want_params, plain_params) < 1e-6
  for mode, first in (("train", 0), ("resume", mp_worker.SAVE_AFTER)):
    for process, result in enumerate(results[mode]):
      assert result["process"] == process and result["devices"] == 8
      assert result["cross_processes"] == [0, 1]  # replicas apart
      assert result["replicas_identical"], (mode, process)
      # A batch split over the processes' devices packs like a whole one.
      assert result["split_batch"] is (True if mode == "train" else None)
      train = mode == "train"
      assert result["committed_on_return"] is (True if train else None)
      assert result["refused_a_file"] is (True if train else None)
      assert result["losses"] == want[first:]  # bit for bit
    with np.load(os.path.join(out, f"params_{mode}.npz")) as got:
      assert sorted(got.files) == sorted(want_params)
      for k, v in want_params.items():
        np.testing.assert_array_equal(got[k], v, err_msg=f"{mode} {k}")
  # The checkpoint both processes wrote loads here, in one process.
  restored = tr.restore(ckpt)
  assert int(np.asarray(restored.step)) == mp_worker.SAVE_AFTER
  for k, v in tr.params(restored).items():
    np.testing.assert_array_equal(v, at_save[k], err_msg=k)


def test_checkpoint_resume_continues_exactly(tmp_path):
  plan = rc.pipeline_plan("two_branch", 4, "sequential")
  model, _ = rc.model_and_batch("two_branch")
  trainer = Trainer(plan, optax.adam(1e-2), graph=rc.tiny_graph("two_branch"))
  losses = rc.assert_resumes_exactly(trainer, model, str(tmp_path / "ckpt"))
  # Another plan of the graph takes the checkpoint over
  # (`graphpipe.runtime.relayout`, tests/graphpipe/test_zero.py).
  other = Trainer(
    rc.pipeline_plan("two_branch", 8, "graphpipe"),
    optax.adam(1e-2),
    graph=rc.tiny_graph("two_branch"),
  )
  moved = other.restore(str(tmp_path / "ckpt"))
  moved, metrics = other.step(moved, rc.model_and_batch("two_branch", 2)[1])
  assert metrics["loss"] == pytest.approx(losses[2], rel=1e-5)


def test_memory_report_and_parameter_placement():
  plan = rc.pipeline_plan("two_branch", 8, "graphpipe")
  graph = rc.tiny_graph("two_branch")
  model, batch = rc.model_and_batch("two_branch")
  trainer = Trainer(plan, optax.adam(1e-2), graph=graph)
  state = trainer.init(model)
  report = trainer.memory_report(state, batch)
  total = graph.totals()["param_bytes"]
  for own, held in zip(
    report["param_bytes_own"], report["param_bytes_held"], strict=True
  ):
    assert own < total / 2  # no device holds the whole model
    assert held <= 1.1 * own  # balanced stages: padding within 10%
  assert report["peak_memory_bytes"] > 0
  # Each device's slots hold its own stage's parameters.
  rows = [np.asarray(x) for x in state.params]
  values = graph.program.variable_values(model)
  for s in trainer.layout.stages:
    for d in s.devices:
      held_values = slots.host_values(
        trainer.buffers.params,
        s.id,
        [r[d] for r in rows],
        trainer.layout.param_shapes,
      )
      assert sorted(held_values) == sorted(s.params)
      for k, v in held_values.items():
        np.testing.assert_array_equal(v, np.asarray(values[k]))


def test_bad_inputs():
  plan = rc.pipeline_plan("two_branch", 4, "graphpipe")
  graph = rc.tiny_graph("two_branch")
  model, batch = rc.model_and_batch("two_branch")
  trainer = Trainer(plan, optax.sgd(0.1), graph=graph)
  state = trainer.init(model)
  wrong = dict(batch)
  key = next(iter(wrong))
  wrong[key] = wrong[key][:-1]
  with pytest.raises(GraphpipeError, match="the plan needs"):
    trainer.step(state, wrong)
  wrong = dict(batch)
  wrong[key] = wrong[key].astype(np.float16)  # (float64 is taken as JAX does)
  with pytest.raises(GraphpipeError, match="the plan needs"):
    trainer.step(state, wrong)
  with pytest.raises(GraphpipeError, match="another graph|cover"):
    Trainer(
      rc.pipeline_plan("mmt", 4, "graphpipe"), optax.sgd(0.1), graph=graph
    )
  big = Plan(
    "manual",
    (Stage(0, tuple(range(len(graph.nodes))), tuple(range(16)), 16),),
    (),
    16,
    16,
  )
  with pytest.raises(GraphpipeError, match="16 devices"):
    Trainer(big, optax.sgd(0.1), graph=graph)
  nan_batch = {k: v.copy() for k, v in batch.items()}
  for v in nan_batch.values():
    if v.dtype == np.float32:
      v[:] = np.nan
  _, metrics = trainer.step(state, nan_batch)
  assert not metrics["finite"]
  strict = Trainer(plan, optax.sgd(0.1), graph=graph, stop_on_nan=True)
  with pytest.raises(GraphpipeError, match="loss is nan"):
    strict.step(strict.init(model), nan_batch)


if __name__ == "__main__":
  sys.exit(pytest.main([__file__]))


def test_order_only_edge_is_a_real_transfer():
  """A sequential plan chaining two independent towers sends its token.

  Nothing reads a token's value: unless the runtime makes the receiving
  stage wait for it, XLA drops it with its collective-permute, and the
  chained stages run concurrently (a sequential plan as fast as the graph
  pipeline's, silently).
  """
  from flax import nnx

  from experiments.bench_runtime import tower_plans
  from graphpipe import capture
  from graphpipe.models import two_tower

  cfg = two_tower.Config(
    in_features=8, hidden=16, tower_layers=2, num_classes=4
  )
  model = two_tower.Model(cfg, rngs=nnx.Rngs(0))
  graph = capture(
    two_tower.loss_fn, model, two_tower.abstract_batch(cfg, 8), granularity=2
  )
  graphpipe_plan, sequential_plan = tower_plans(graph, 16, 4)
  batch = two_tower.make_batch(cfg, 16, seed=0)
  texts = {}
  for name, plan in (("graphpipe", graphpipe_plan), ("seq", sequential_plan)):
    trainer = Trainer(plan, optax.sgd(0.1), graph=graph)
    texts[name] = trainer.compiled(trainer.init(model), batch).as_text()
  assert "collective-permute" in texts["seq"]
  assert "collective-permute" not in texts["graphpipe"]


def test_values_that_interleave_samples_are_refused_where_chunks_change():
  """A value laid out time-major, (T, B, D) -> (T * B, D), holds sample j
  in rows j, B + j, ...: slicing it by rows for a data-parallel stage
  handed replicas other samples' rows (loss 9% off, gradients 136%,
  silently). Where the chunk does not change it is exact; where it does,
  the trainer refuses it, and the sample-major layout trains exactly."""
  import jax.numpy as jnp
  from flax import nnx

  from graphpipe import capture
  from graphpipe.core.stages import in_flight_counts

  steps = 3

  class Encode(nnx.Module):
    def __init__(self, time_major, rngs):
      self.lin, self.time_major = nnx.Linear(32, 4, rngs=rngs), time_major

    def __call__(self, x):  # (B, T, 32)
      # The probe's made-up weights were positive: 32 features saturated
      # this tanh, no row moved, and the interleaving went unseen.
      h = jnp.tanh(self.lin(x))
      if self.time_major:
        h = jnp.transpose(h, (1, 0, 2))
      return h.reshape(-1, 4)

  class Decode(nnx.Module):
    def __init__(self, time_major, rngs):
      self.lin, self.time_major = (
        nnx.Linear(4 * steps, 1, rngs=rngs),
        time_major,
      )

    def __call__(self, h):
      if self.time_major:
        h = h.reshape(steps, -1, 4).transpose(1, 0, 2)
      return self.lin(h.reshape(-1, 4 * steps))

  class Net(nnx.Module):
    def __init__(self, time_major, rngs):
      self.encode = Encode(time_major, rngs)
      self.mid = nnx.Linear(4, 4, rngs=rngs)
      self.decode = Decode(time_major, rngs)

    def __call__(self, x):
      return self.decode(jnp.tanh(self.mid(self.encode(x))))

  rng = np.random.default_rng(0)
  batch = {
    "x": rng.normal(size=(8, steps, 32)).astype(np.float32),
    "y": rng.normal(size=(8, 1)).astype(np.float32),
  }
  loss = lambda m, b: jnp.mean((m(b["x"]) - b["y"]) ** 2)

  def plan(devices):
    edges = ((0, 1), (1, 2))
    flight = in_flight_counts(3, edges)
    stages = tuple(
      Stage(i, (i,), d, 2, flight[i]) for i, d in enumerate(devices)
    )
    return Plan("manual", stages, edges, 8, 4)

  def trained_loss(model, devices):
    graph = capture(loss, model, batch)
    trainer = Trainer(plan(devices), optax.sgd(0.1), graph=graph)
    return trainer.loss_and_grads(trainer.init(model), batch)[0]

  interleaved, sample_major = Net(True, nnx.Rngs(0)), Net(False, nnx.Rngs(0))
  want = float(loss(interleaved, batch))
  assert want == pytest.approx(float(loss(sample_major, batch)), rel=1e-6)
  one_each = ((0,), (1,), (2,))
  assert trained_loss(interleaved, one_each) == pytest.approx(want, rel=1e-5)
  replicated = ((0,), (1, 2), (3,))
  with pytest.raises(GraphpipeError, match="each sample's rows together"):
    trained_loss(interleaved, replicated)
  assert trained_loss(sample_major, replicated) == pytest.approx(want, rel=1e-5)


def test_random_draws_in_the_batch_shape_from_a_fixed_key_are_refused():
  """bernoulli(key(0), p, h.shape) in a loss: each micro-batch drew its own
  mask from key 0, not its rows of the whole batch's (loss 33% off,
  silently); so did a fixed key split into one key per sample and one
  folded with the sample's position (1.8% off, silently, before the check
  followed where keys come from). Per-sample keys or ids carried in the
  batch, and a fixed key broadcast to every sample, draw the same bits
  however the batch is cut, and train exactly."""
  import jax
  import jax.numpy as jnp
  from flax import nnx

  from graphpipe import capture
  from graphpipe.core.stages import in_flight_counts

  class Net(nnx.Module):
    def __init__(self, rngs):
      self.a, self.b = nnx.Linear(6, 8, rngs=rngs), nnx.Linear(8, 1, rngs=rngs)

    def __call__(self, x):
      return self.b(jnp.tanh(self.a(x)))

  rng = np.random.default_rng(0)
  batch = {
    "x": rng.normal(size=(8, 6)).astype(np.float32),
    "y": rng.normal(size=(8, 1)).astype(np.float32),
    "seed": np.arange(8, dtype=np.uint32),
  }

  def fixed_key(m, b):
    h = m(b["x"])
    keep = jax.random.bernoulli(jax.random.key(0), 0.5, h.shape)
    return jnp.mean((jnp.where(keep, h, 0.0) - b["y"]) ** 2)

  def per_sample(m, b):
    h = m(b["x"])
    draw = lambda s, row: jax.random.bernoulli(
      jax.random.key(s), 0.5, row.shape
    )
    keep = jax.vmap(draw)(b["seed"], h)
    return jnp.mean((jnp.where(keep, h, 0.0) - b["y"]) ** 2)

  def masked(keys, h, b):
    keep = jax.vmap(lambda k, row: jax.random.bernoulli(k, 0.5, row.shape))(
      keys, h
    )
    return jnp.mean((jnp.where(keep, h, 0.0) - b["y"]) ** 2)

  def split_key(m, b):  # one key per sample, split from a fixed key
    h = m(b["x"])
    return masked(jax.random.split(jax.random.key(0), h.shape[0]), h, b)

  def folded_index(m, b):  # a fixed key folded with the sample's position
    h = m(b["x"])
    fold = lambda i: jax.random.fold_in(jax.random.key(0), i)
    return masked(jax.vmap(fold)(jnp.arange(h.shape[0])), h, b)

  def folded_seed(m, b):  # the same fold-in with ids carried in the batch
    h = m(b["x"])
    fold = lambda i: jax.random.fold_in(jax.random.key(0), i)
    return masked(jax.vmap(fold)(b["seed"]), h, b)

  def broadcast_key(m, b):  # every sample the same key: the same draw
    h = m(b["x"])
    return masked(jnp.broadcast_to(jax.random.key(0), h.shape[:1]), h, b)

  flight = in_flight_counts(2, ((0, 1),))
  stages = tuple(Stage(i, (i,), (i,), 4, flight[i]) for i in range(2))
  two_micro_batches = Plan("manual", stages, ((0, 1),), 8, 2)
  model = Net(nnx.Rngs(0))
  # split(key(0), B) and fold_in(key(0), arange(B)) were missed: each
  # micro-batch handed its samples the first b keys (loss 2-30% off).
  for loss, primitive in (
    (fixed_key, "random_bits"),
    (split_key, "random_split"),
    (folded_index, "random_fold_in"),
  ):
    graph = capture(loss, model, batch)
    with pytest.raises(GraphpipeError, match=f"node 'b' draws .*{primitive}"):
      Trainer(two_micro_batches, optax.sgd(0.1), graph=graph)
  for loss in (per_sample, folded_seed, broadcast_key):
    graph = capture(loss, model, batch)
    trainer = Trainer(two_micro_batches, optax.sgd(0.1), graph=graph)
    got = trainer.loss_and_grads(trainer.init(model), batch)[0]
    assert got == pytest.approx(float(loss(model, batch)), rel=1e-5)


def test_step_updates_the_optimizer_state_in_place():
  """The compiled step copies no optimizer-state buffer: the state is
  donated and updated in place (the update and the skip of a non-finite
  step are one cond; a select of the new and the old state made XLA copy
  every buffer of it first, 5x the update's time for Adam on one CPU
  core). Plans with replicated and ZeRO-1 stages."""
  import re

  import jax

  graph = rc.tiny_graph("two_branch")
  model, batch = rc.model_and_batch("two_branch")
  size = len(next(iter(batch.values())))
  nodes = [n.id for n in graph.nodes]
  half = len(nodes) // 2
  # Two stages, the first on two devices (replicated, then ZeRO-1).
  groups = [(nodes[:half], [0, 1]), (nodes[half:], [2])]
  base = rc.manual_plan(graph, groups, size // 2, size)
  zero = dataclasses.replace(
    base,
    stages=(
      dataclasses.replace(base.stages[0], sharding="zero1"),
      base.stages[1],
    ),
  )
  assert any(s.sharding == "zero1" for s in zero.stages)
  for plan in (base, zero):
    trainer = Trainer(plan, optax.adam(1e-2), graph=graph)
    state = trainer.init(model)
    fed = trainer.put_batch(batch)
    text = trainer._step.lower(state, fed.words, fed.statistics).compile()
    entry = text.as_text().split("\nENTRY ", 1)[1]
    # The entry's parameters in the flattened order of the arguments: the
    # state's parameters, variables, optimizer state, step, then the batch.
    first = len(jax.tree.leaves(state.params)) + len(
      jax.tree.leaves(state.state)
    )
    wanted = range(first, first + len(jax.tree.leaves(state.opt_state)))
    names = {
      m[1]
      for m in re.finditer(r"(%\S+) = \S+ parameter\((\d+)\)", entry)
      if int(m[2]) in wanted
    }
    assert len(names) == len(wanted)
    # (the same buffers seen through a bitcast)
    names |= {
      m[1]
      for m in re.finditer(r"(%\S+) = \S+ bitcast\((%[^)]+)\)", entry)
      if m[2] in names
    }
    copied = [
      m[0] for m in re.finditer(r"copy\((%[^)]+)\)", entry) if m[1] in names
    ]
    assert not copied, copied[:3]
    # ... and that step runs (its exactness: test_zero.py and the runtime
    # tests against plain JAX).
    state, metrics = trainer.step(state, batch)
    assert np.isfinite(metrics["loss"])
