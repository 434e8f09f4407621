"""Bad input to graphpipe's runtime: each row of docs/guide/bad_input.md's table
("Bad input, everywhere") for `graphpipe.Trainer` and its checkpoints is one
case here, plus the documented behaviour of NaN and inf in batches and of
corrupted checkpoint bytes (the other entry points: `test_bad_input.py`).
"""

import glob
import json
import os

import jax
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import Mesh

import graphpipe
from graphpipe import OpGraph
from graphpipe.errors import (
  CaptureError,
  PipelineRuntimeError,
  ScheduleError,
)
from tests.bad_input_table import table_tests
from tests.graphpipe.bad_input_context import (
  BATCH,
  Ctx,
  loss_fn,
  mlp,
  nan_weights,
  rewrite,
  truncate_file,
  with_leaf,
)


@pytest.fixture(scope="module")
def ctx(tmp_path_factory):
  return Ctx(tmp_path_factory.mktemp("bad_input"))


def _values(c):
  """The tiny model's values by key, as state_from_values takes them."""
  return c.graph.program.variable_values(mlp())


def _consumed(c):
  """A state a step has consumed (its buffers donated)."""
  state = c.state()
  c.trainer.step(state, BATCH)
  return state


def _other_trainer(c):
  """The same plan's trainer on the last devices."""
  mesh = Mesh(np.asarray(jax.devices()[-c.plan.num_devices :]), ("pipe",))
  return graphpipe.Trainer(c.plan, optax.sgd(0.1), mesh, graph=c.graph)


def _on_other_devices(c):
  """A state of the same plan on other devices."""
  return _other_trainer(c).init(mlp())


def _file(path: str) -> str:
  """`path`, made an ordinary file (where a checkpoint folder would go)."""
  with open(path, "w") as f:
    f.write("not a folder")
  return path


# (id, case(ctx), error class, message pattern)
ROWS = [
  # graphpipe.Trainer
  (
    "trainer-optimizer-not-optax",
    lambda c: graphpipe.Trainer(c.plan, "adam", graph=c.graph),
    PipelineRuntimeError,
    "optax GradientTransformation",
  ),
  (
    "trainer-loss-reduction-given",
    lambda c: graphpipe.Trainer(
      c.plan, optax.sgd(0.1), graph=c.graph, loss_reduction="sum"
    ),
    PipelineRuntimeError,
    "loss_reduction is no longer needed",
  ),
  (
    "trainer-schedule-unknown",
    lambda c: graphpipe.Trainer(
      c.plan, optax.sgd(0.1), graph=c.graph, schedule="zigzag"
    ),
    ScheduleError,
    "unknown schedule",
  ),
  (
    "trainer-graph-from-json",
    lambda c: graphpipe.Trainer(
      c.plan, optax.sgd(0.1), graph=OpGraph.load(c.graph_file)
    ),
    PipelineRuntimeError,
    "needs the captured graph",
  ),
  (
    "trainer-schedule-of-another-plan",  # a KeyError from the layout
    lambda c: graphpipe.Trainer(
      c.plan,
      optax.sgd(0.1),
      graph=c.graph,
      schedule=graphpipe.schedule_for(graphpipe.plan(c.graph, 1, 16)),
    ),
    PipelineRuntimeError,
    "built for another plan",
  ),
  (
    "trainer-more-devices-than-jax-has",
    lambda c: graphpipe.Trainer(
      graphpipe.Plan(
        "manual",
        (graphpipe.Stage(0, (0, 1, 2), tuple(range(16)), 16),),
        (),
        16,
        16,
      ),
      optax.sgd(0.1),
      graph=c.graph,
    ),
    PipelineRuntimeError,
    "JAX sees 8",
  ),
  (
    "trainer-graph-from-json-says-so",  # said only "needs the captured"
    lambda c: graphpipe.Trainer(
      c.plan, optax.sgd(0.1), graph=OpGraph.load(c.graph_file)
    ),
    PipelineRuntimeError,
    "a graph loaded from JSON holds costs only",
  ),
  (
    "trainer-plan-none",  # a raw AttributeError
    lambda c: graphpipe.Trainer(None, optax.sgd(0.1), graph=c.graph),
    PipelineRuntimeError,
    "the trainer takes a Plan",
  ),
  (
    "trainer-mesh-a-list",  # a raw AttributeError
    lambda c: graphpipe.Trainer(
      c.plan, optax.sgd(0.1), jax.devices()[:2], graph=c.graph
    ),
    PipelineRuntimeError,
    "mesh must be a jax.sharding.Mesh, got list",
  ),
  (
    # Accepted; init then failed inside JAX ("Number of processed shards").
    "trainer-mesh-device-twice",
    lambda c: graphpipe.Trainer(
      c.plan,
      optax.sgd(0.1),
      Mesh(np.asarray([jax.devices()[0]] * 2), ("pipe",)),
      graph=c.graph,
    ),
    PipelineRuntimeError,
    "names a device more than once",
  ),
  (
    # Wrote the trained shapes into a model of another width, silently.
    "update-model-other-shapes",
    lambda c: c.trainer.update_model(mlp(width=9), c.state()),
    PipelineRuntimeError,
    r"shape \[4, 9\], the captured model's has \[4, 8\]",
  ),
  (
    # "Received incompatible devices" from inside jit.
    "step-state-on-another-mesh",
    lambda c: c.trainer.step(_on_other_devices(c), BATCH),
    PipelineRuntimeError,
    "lives on other devices than this trainer's mesh",
  ),
  (
    "step-batch-put-on-another-mesh",
    lambda c: c.trainer.step(c.state(), _other_trainer(c).put_batch(BATCH)),
    PipelineRuntimeError,
    "put for another step's devices",
  ),
  (
    "memory-report-optimizer-a-string",  # a raw AttributeError
    lambda c: graphpipe.memory_report(c.plan, c.graph, "adam"),
    PipelineRuntimeError,
    "optax GradientTransformation",
  ),
  (
    "memory-report-plan-none",  # a raw AttributeError
    lambda c: graphpipe.memory_report(None, c.graph),
    PipelineRuntimeError,
    "memory_report takes a Plan",
  ),
  (
    "init-other-structure",
    lambda c: c.trainer.init(
      nnx.Sequential(
        nnx.Linear(4, 8, rngs=nnx.Rngs(0)), nnx.Linear(8, 1, rngs=nnx.Rngs(1))
      )
    ),
    CaptureError,
    "structure of the captured model",
  ),
  (
    "init-other-shapes",
    lambda c: c.trainer.init(mlp(width=9)),
    PipelineRuntimeError,
    r"shape \[4, 9\], the captured model's has \[4, 8\]",
  ),
  (
    "init-not-a-model",
    lambda c: c.trainer.init(42),
    PipelineRuntimeError,
    "init takes the NNX model",
  ),
  (
    "init-nan-weights",
    lambda c: c.trainer.init(nan_weights()),
    PipelineRuntimeError,
    "NaN or infinite",
  ),
  (
    "values-extra-key",  # ignored before
    lambda c: c.trainer.state_from_values(
      {**_values(c), "param:no.such.kernel": np.ones(3)}
    ),
    PipelineRuntimeError,
    "which the captured model does not have",
  ),
  (
    "values-strings",  # a TypeError from np.isfinite before
    lambda c: c.trainer.state_from_values(
      {k: np.full(np.shape(v), "x") for k, v in _values(c).items()}
    ),
    PipelineRuntimeError,
    "not numbers",
  ),
  (
    "values-step-negative",  # taken before
    lambda c: c.trainer.state_from_values(_values(c), step=-5),
    PipelineRuntimeError,
    r"step must be an int in \[0, 2\^31\)",
  ),
  (
    "values-step-too-large",  # an OverflowError before
    lambda c: c.trainer.state_from_values(_values(c), step=2**40),
    PipelineRuntimeError,
    "step must be an int",
  ),
  (
    "step-not-a-state",
    lambda c: c.trainer.step("state", BATCH),
    PipelineRuntimeError,
    "takes the TrainState",
  ),
  (
    "step-consumed-state",  # a segmentation fault in XLA before
    lambda c: c.trainer.step(_consumed(c), BATCH),
    PipelineRuntimeError,
    "consumed by a step",
  ),
  (
    "params-consumed-state",
    lambda c: c.trainer.params(_consumed(c)),
    PipelineRuntimeError,
    "consumed by a step",
  ),
  (
    "step-state-of-another-optimizer",  # an AttributeError in optax
    lambda c: graphpipe.Trainer(c.plan, optax.adam(0.1), graph=c.graph).step(
      c.state(), BATCH
    ),
    PipelineRuntimeError,
    "not one of this trainer's",
  ),
  (
    "save-state-of-another-plan",  # wrote a checkpoint no one could read
    lambda c: graphpipe.Trainer(
      graphpipe.plan(c.graph, 1, 16), optax.sgd(0.1), graph=c.graph
    ).save(c.state(), os.path.join(c.folder, "other-plan")),
    PipelineRuntimeError,
    "not one of this trainer's",
  ),
  (
    "step-missing-leaf",
    lambda c: c.trainer.step(c.state(), {"x": BATCH["x"]}),
    PipelineRuntimeError,
    "the graph expects",
  ),
  (
    "step-extra-leaf",
    lambda c: c.trainer.step(c.state(), with_leaf("z", BATCH["x"])),
    PipelineRuntimeError,
    "the graph expects",
  ),
  (
    "step-list-batch",
    lambda c: c.trainer.step(c.state(), [BATCH["x"], BATCH["y"]]),
    PipelineRuntimeError,
    "the graph expects",
  ),
  (
    "step-wrong-batch-size",
    lambda c: c.trainer.step(c.state(), with_leaf("x", BATCH["x"][:8])),
    PipelineRuntimeError,
    r"the plan needs float32\[16, 4\]",
  ),
  (
    "step-wrong-dtype",
    lambda c: c.trainer.step(
      c.state(), with_leaf("x", BATCH["x"].astype(np.int32))
    ),
    PipelineRuntimeError,
    "the plan needs float32",
  ),
  (
    "memory-report-wrong-batch",
    lambda c: c.trainer.memory_report(
      c.state(), with_leaf("x", BATCH["x"][:3])
    ),
    PipelineRuntimeError,
    "the plan needs",
  ),
  (
    "memory-report-plan-of-another-graph",  # reported for it before
    lambda c: graphpipe.memory_report(
      c.plan, graphpipe.capture(loss_fn, mlp(width=9), BATCH)
    ),
    PipelineRuntimeError,
    "made for another graph",
  ),
  # Trainer.save / restore (graphpipe.runtime.checkpoints)
  (
    "save-over-a-file",
    lambda c: c.trainer.save(
      c.state(), _file(os.path.join(c.folder, "a-file"))
    ),
    PipelineRuntimeError,
    "cannot save a checkpoint to .*a-file: File exists",
  ),
  (
    "restore-missing-folder",
    lambda c: c.trainer.restore(os.path.join(c.folder, "nothing-here")),
    PipelineRuntimeError,
    "no complete graphpipe checkpoint",
  ),
  (
    "restore-unfinished-save",
    lambda c: c.trainer.restore(
      os.remove(os.path.join(c.checkpoint("c1"), "layout.json"))
      or os.path.join(c.folder, "c1")
    ),
    PipelineRuntimeError,
    "its save did not finish",
  ),
  (
    "restore-truncated-mark",
    lambda c: c.trainer.restore(
      truncate_file(os.path.join(c.checkpoint("c2"), "layout.json"))
      or os.path.join(c.folder, "c2")
    ),
    PipelineRuntimeError,
    "unreadable .* the checkpoint is damaged",
  ),
  (
    "restore-edited-mark-step",
    lambda c: c.trainer.restore(
      rewrite(
        os.path.join(c.checkpoint("c3"), "layout.json"),
        lambda d: d.update(step=7),
      )
      or os.path.join(c.folder, "c3")
    ),
    PipelineRuntimeError,
    "the mark says 7",
  ),
  (
    "restore-edited-mark-format",
    lambda c: c.trainer.restore(
      rewrite(
        os.path.join(c.checkpoint("c4"), "layout.json"),
        lambda d: d.pop("signature"),
      )
      or os.path.join(c.folder, "c4")
    ),
    PipelineRuntimeError,
    "not a graphpipe checkpoint mark",
  ),
  (
    "restore-truncated-arrays",
    lambda c: c.trainer.restore(
      [
        truncate_file(f)
        for f in glob.glob(os.path.join(c.checkpoint("c5"), "state", "d", "*"))
      ]
      and os.path.join(c.folder, "c5")
    ),
    PipelineRuntimeError,
    "the saved arrays cannot be read",
  ),
  (
    # (a mark that records its plan restores into another plan of the
    # graph: tests/graphpipe/test_zero.py)
    "restore-other-plan-unrecorded",
    lambda c: graphpipe.Trainer(
      graphpipe.tightest_plan(c.graph, 3, 16), optax.sgd(0.1), graph=c.graph
    ).restore(_without_plan(c.checkpoint("c6"))),
    PipelineRuntimeError,
    "written for another plan or graph",
  ),
  (
    "restore-other-optimizer-state",
    lambda c: graphpipe.Trainer(c.plan, optax.adam(0.1), graph=c.graph).restore(
      c.checkpoint("c7")
    ),
    PipelineRuntimeError,
    # "the saved arrays cannot be read ...; the checkpoint is damaged"
    # before: it blamed a sound checkpoint.
    "written with another optimizer: its state is",
  ),
  (
    "restore-other-model",
    lambda c: graphpipe.Trainer(
      graphpipe.tightest_plan(
        g := graphpipe.capture(loss_fn, mlp(width=6), BATCH), 2, 16
      ),
      optax.sgd(0.1),
      graph=g,
    ).restore(c.checkpoint("c8")),
    PipelineRuntimeError,
    "written for another plan or graph",
  ),
]

test_bad_input_is_refused_clearly, test_row_ids_are_unique = table_tests(ROWS)


def _without_plan(folder):
  """The checkpoint as saves before plans were recorded wrote it."""
  path = os.path.join(folder, "layout.json")
  with open(path) as f:
    mark = json.load(f)
  del mark["plan"]
  with open(path, "w") as f:
    json.dump(mark, f)
  return folder


def test_nan_and_inf_in_batches_propagate_as_documented(ctx):
  """Non-finite batches are not refused (checking every step would cost a
  pass over the batch): the loss is non-finite, metrics say so, and
  `stop_on_nan=True` raises instead."""
  for value in (np.nan, np.inf):
    bad = with_leaf("x", np.full((16, 4), value, np.float32))
    _, metrics = ctx.trainer.step(ctx.state(), bad)
    assert not metrics["finite"] and not np.isfinite(metrics["loss"])
  strict = graphpipe.Trainer(
    ctx.plan, optax.sgd(0.1), graph=ctx.graph, stop_on_nan=True
  )
  skipped = "the loss is nan at step 0; the step was skipped"
  with pytest.raises(PipelineRuntimeError, match=skipped):
    strict.step(strict.init(mlp()), with_leaf("y", BATCH["y"] * np.nan))


def test_corrupted_checkpoint_bytes_are_never_silently_restored(ctx):
  """A flipped byte in the saved arrays either fails to read (tensorstore's
  checksums) or, in a file the restore does not read, changes nothing."""
  folder = ctx.checkpoint("flips")
  want = ctx.trainer.params(ctx.trainer.restore(folder))
  files = glob.glob(
    os.path.join(folder, "state", "**", "d", "*"), recursive=True
  )
  refused = 0
  for path in files:
    with open(path, "rb") as f:
      raw = f.read()
    flipped = bytearray(raw)
    flipped[len(raw) // 2] ^= 0x10
    with open(path, "wb") as f:
      f.write(bytes(flipped))
    try:
      got = ctx.trainer.params(ctx.trainer.restore(folder))
      for key, value in want.items():
        np.testing.assert_array_equal(got[key], value)
    except PipelineRuntimeError as err:
      assert "the saved arrays cannot be read" in str(err)
      refused += 1
    with open(path, "wb") as f:
      f.write(raw)
  assert refused >= 1  # the file that holds the arrays is checked


def test_64_bit_numpy_batches_are_taken_as_jax_takes_them(ctx):
  # capture took float64 / int64 numpy leaves as JAX does (32-bit without
  # x64 mode); step refused the very batch capture had taken.
  wide = {k: v.astype(np.float64) for k, v in BATCH.items()}
  _, got = ctx.trainer.step(ctx.state(), wide)
  _, want = ctx.trainer.step(ctx.state(), BATCH)
  assert got["loss"] == want["loss"]


def test_numpy_integers_are_counts(ctx):
  # plan(num_devices=np.int64(4)) was refused as "must be a positive int".
  got = graphpipe.plan(ctx.graph, np.int64(2), np.int32(16))
  assert got.stages == graphpipe.plan(ctx.graph, 2, 16).stages
  assert isinstance(got.num_devices, int) and isinstance(got.batch_size, int)
