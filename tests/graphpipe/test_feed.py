"""The per-device batch feed: each device gets its own rows of its leaves.

Packing on the host and reading back in the step must give every stage
exactly the rows the unpipelined batch has (any dtype, replicas, stages of
different micro-batch sizes); devices hold far less than the batch; a
batch put once can be stepped on again.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import graphpipe
from graphpipe import PipelineRuntimeError, Trainer
from graphpipe.core.channels import channel_count, plan_channels
from graphpipe.core.feed import (
  device_feeds,
  feed_words,
  plan_feed_words,
  plan_feeds,
)
from graphpipe.core.graph import InputSpec
from graphpipe.runtime import feed
from tests.graphpipe import runtime_cases as rc

DTYPES = ["float32", "int32", "bool", "int8", "uint8", "float16", "bfloat16"]


def _leaf(rng, spec, batch_size):
  shape = (batch_size, *spec.shape)
  if spec.dtype == "bool":
    return rng.random(shape) < 0.5
  if spec.dtype in ("int8", "uint8", "int32"):
    return rng.integers(0, 100, shape).astype(spec.dtype)
  return rng.standard_normal(shape).astype(jnp.dtype(spec.dtype))


def test_every_device_reads_back_its_own_rows_of_every_leaf():
  rng = np.random.default_rng(0)
  # Odd per-sample sizes, so that pieces of 1- and 2-byte leaves pad.
  inputs = [
    InputSpec(f"x{i}", shape, dtype)
    for i, (shape, dtype) in enumerate(
      zip([(3,), (), (5, 1), (7,), (), (3, 3), (1,)], DTYPES, strict=True)
    )
  ]
  batch_size = 24
  stages = [
    (["x0", "x2", "x3"], (0, 1, 2), 6),  # 3 replicas, 2 rows each
    (["x1", "x4"], (3,), 2),
    (["x5", "x6", "x1"], (4, 5), 12),  # larger micro-batches
    ([], (6,), 4),  # reads nothing
  ]
  feeds = device_feeds(inputs, stages, num_devices=8, batch_size=batch_size)
  words = feed_words(feeds)
  batch = {s.name: _leaf(rng, s, batch_size) for s in inputs}
  for names, devices, size in stages:
    for replica, device in enumerate(devices):
      f = feeds[device]
      packed = jnp.asarray(feed.pack(f, batch, words))
      chunk = size // len(devices)
      for j in range(batch_size // size):
        got = feed.read(f, packed, jnp.int32(j))
        assert sorted(got) == sorted(f"batch:{n}" for n in set(names))
        start = j * size + replica * chunk
        for n in names:
          want = batch[n][start : start + chunk]
          assert got[f"batch:{n}"].dtype == want.dtype
          np.testing.assert_array_equal(np.asarray(got[f"batch:{n}"]), want)
  assert feeds[7].blocks == () and feeds[6].words == 0
  # Leaves already on the devices are packed there, into the same bits.
  mesh = Mesh(np.asarray(jax.devices()[:8]), ("pipe",))
  on_mesh = {
    k: jax.device_put(v, NamedSharding(mesh, P())) for k, v in batch.items()
  }
  packed = feed.device_packer(feeds, words, NamedSharding(mesh, P("pipe")))
  got = np.asarray(packed(on_mesh))
  for d in range(8):
    np.testing.assert_array_equal(got[d], feed.pack(feeds[d], batch, words))
  # So are leaves split over the devices by samples (as a loader spreads
  # a global batch over processes), and any mix of the two.
  split = {
    k: jax.device_put(v, NamedSharding(mesh, P("pipe" if i % 2 else None)))
    for i, (k, v) in enumerate(batch.items())
  }
  assert not all(v.sharding.is_fully_replicated for v in split.values())
  np.testing.assert_array_equal(np.asarray(packed(split)), got)
  # A device holds its share of what its stage reads, never the batch.
  whole = sum(b.nbytes for b in batch.values())
  assert 4 * words < whole / 2


def test_devices_are_fed_their_own_rows_of_what_their_stage_reads():
  graph = rc.tiny_graph("dlrm")  # many leaves, each read by one branch
  plan = rc.pipeline_plan("dlrm", 8, "graphpipe", room=2)  # replicas too
  assert max(len(s.devices) for s in plan.stages) > 1
  sample = {
    i.name: np.prod(i.shape, dtype=int) * jnp.dtype(i.dtype).itemsize
    for i in graph.inputs
  }
  feeds = plan_feeds(graph, plan)
  for s in plan.stages:
    read = {k for n in s.nodes for k in graph.nodes[n].batch_inputs}
    rows = plan.batch_size // len(s.devices)  # its replica's share
    pieces = plan.batch_size // s.micro_batch_size
    for d in s.devices:
      need = rows * sum(sample[k] for k in read)
      # Exactly its rows, each piece padded to a whole word at most.
      assert need <= 4 * feeds[d].words <= need + 3 * pieces * len(read)
  whole = plan.batch_size * sum(sample.values())
  assert 0 < 4 * feed_words(feeds) < whole
  report = graphpipe.memory_report(plan, graph, optax.sgd(0.1))
  assert max(d["batch"] for d in report.per_device) == 4 * feed_words(feeds)


def test_a_batch_put_once_steps_like_the_batch_itself():
  name = "two_branch"
  plan = rc.pipeline_plan(name, 8, "graphpipe")
  graph = rc.tiny_graph(name)
  model, batch = rc.model_and_batch(name)
  trainer = Trainer(plan, optax.sgd(0.1), graph=graph)
  state = trainer.init(model)
  put = trainer.put_batch(batch)
  assert trainer.put_batch(put) is put
  # A batch already replicated on the trainer's devices packs the same.
  axis = trainer.mesh.axis_names[0]
  for spec in (P(), P(axis)):  # replicated, or split by samples
    on_mesh = jax.device_put(batch, NamedSharding(trainer.mesh, spec))
    np.testing.assert_array_equal(
      np.asarray(trainer.put_batch(on_mesh).words), np.asarray(put.words)
    )
  # The trainer's devices in another order (jit refused it: "incompatible
  # devices for jitted computation").
  reversed_mesh = Mesh(trainer.mesh.devices[::-1], (axis,))
  on_reversed = jax.device_put(batch, NamedSharding(reversed_mesh, P(axis)))
  np.testing.assert_array_equal(
    np.asarray(trainer.put_batch(on_reversed).words), np.asarray(put.words)
  )
  loss, grads = trainer.loss_and_grads(state, batch)
  loss_put, grads_put = trainer.loss_and_grads(state, put)
  assert loss == loss_put
  for k in grads:
    np.testing.assert_array_equal(grads[k], grads_put[k])
  want, _ = rc.reference_loss_and_grads(name, model, batch)
  assert loss == pytest.approx(float(want), rel=1e-5)
  other = Trainer(
    rc.pipeline_plan(name, 2, "sequential"), optax.sgd(0.1), graph=graph
  )
  with pytest.raises(PipelineRuntimeError, match="put it with this trainer"):
    other.put_batch(put)


@pytest.mark.parametrize("name", ["two_branch", "dlrm", "mmt"])
def test_planner_figures_equal_the_runtime_builders(name):
  # The memory rule counts batch words and channels with shortcuts (no
  # feeds built, channels memoised): they must equal what the runtime's
  # builders give, on plans of every shape the planners make.
  graph = rc.tiny_graph(name)
  for num_devices in (1, 3, 8):
    for planner in ("graphpipe", "sequential", "gpipe"):
      p = graphpipe.plan(graph, num_devices, 16, planner=planner)
      assert plan_feed_words(graph, p) == feed_words(plan_feeds(graph, p))
      assert channel_count(p) == len(plan_channels(p))
