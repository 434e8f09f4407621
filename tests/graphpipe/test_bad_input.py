"""Bad input to every public graphpipe entry point: each row of BUILD.md's
table ("Bad input, everywhere") is one case here.

Every case asserts the library's own error class and a message that says
what to fix, or (NaN and inf in batches and weights) the documented
behaviour. Tiny three-layer MLP, so every case runs in well under a second
once the module's graph, plan and trainer exist.
"""

import glob
import json
import os

import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import graphpipe
from graphpipe import OpGraph, Plan
from graphpipe.errors import (
  CaptureError,
  CostModelError,
  GraphCutError,
  GraphError,
  GraphFormatError,
  PipelineRuntimeError,
  PlanError,
  ScheduleError,
  SimulationError,
)

BATCH = {"x": np.ones((16, 4), np.float32), "y": np.zeros((16, 1), np.float32)}


def mlp(width=8, dtype=jnp.float32):
  return nnx.Sequential(
    nnx.Linear(4, width, param_dtype=dtype, rngs=nnx.Rngs(0)),
    nnx.Linear(width, 8, rngs=nnx.Rngs(1)),
    nnx.Linear(8, 1, rngs=nnx.Rngs(2)),
  )


def loss_fn(m, b):
  return jnp.mean((m(b["x"]) - b["y"]) ** 2)


class Ctx:
  """The graph, plan, trainer and files the cases share (built once)."""

  def __init__(self, folder):
    self.folder = str(folder)
    self.graph = graphpipe.capture(loss_fn, mlp(), BATCH)
    self.plan = graphpipe.tightest_plan(self.graph, 2, 16)
    self.trainer = graphpipe.Trainer(
      self.plan, optax.sgd(0.1), graph=self.graph
    )
    self.graph_file = os.path.join(self.folder, "graph.json")
    self.graph.save(self.graph_file)
    self.plan_file = os.path.join(self.folder, "plan.json")
    self.plan.save(self.plan_file)

  def state(self, model=None):
    return self.trainer.init(model or mlp())

  def edited(self, path, edit, name):
    """A copy of JSON file `path` with `edit(data)` applied."""
    with open(path) as f:
      data = json.load(f)
    data = edit(data) or data
    out = os.path.join(self.folder, name)
    with open(out, "w") as f:
      json.dump(data, f)
    return out

  def truncated(self, path, name):
    with open(path) as f:
      text = f.read()
    out = os.path.join(self.folder, name)
    with open(out, "w") as f:
      f.write(text[: len(text) // 2])
    return out

  def checkpoint(self, name):
    folder = os.path.join(self.folder, name)
    self.trainer.save(self.state(), folder)
    return folder


@pytest.fixture(scope="module")
def ctx(tmp_path_factory):
  return Ctx(tmp_path_factory.mktemp("bad_input"))


def set_node(field, value):
  def edit(data):
    data["nodes"][0][field] = value

  return edit


def add_edge(src, dst):
  def edit(data):
    data["edges"].append(
      {"src": src, "dst": dst, "bytes": 4, "fixed_bytes": 0, "num_values": 1}
    )

  return edit


def nan_weights():
  model = mlp()
  kernel = model.layers[0].kernel
  kernel[...] = kernel[...].at[0, 0].set(jnp.nan)
  return model


def with_leaf(name, value):
  return dict(BATCH, **{name: value})


def rewrite(path, edit):
  with open(path) as f:
    data = json.load(f)
  edit(data)
  with open(path, "w") as f:
    json.dump(data, f)


def truncate_file(path):
  with open(path, "rb") as f:
    raw = f.read()
  with open(path, "wb") as f:
    f.write(raw[: len(raw) // 2])


# (id, case(ctx), error class, message pattern)
ROWS = [
  # graphpipe.capture
  (
    "capture-granularity-unknown",
    lambda c: graphpipe.capture(loss_fn, mlp(), BATCH, granularity="bogus"),
    CaptureError,
    "granularity must be",
  ),
  (
    "capture-granularity-0",
    lambda c: graphpipe.capture(loss_fn, mlp(), BATCH, granularity=0),
    CaptureError,
    "depth >= 1",
  ),
  (
    "capture-loss-not-scalar",
    lambda c: graphpipe.capture(lambda m, b: m(b["x"]), mlp(), BATCH),
    CaptureError,
    "one floating-point scalar",
  ),
  (
    "capture-loss-int",
    lambda c: graphpipe.capture(
      lambda m, b: jnp.sum(b["x"]).astype(jnp.int32), mlp(), BATCH
    ),
    CaptureError,
    "floating-point scalar",
  ),
  (
    "capture-batch-wrong-shape",
    lambda c: graphpipe.capture(
      loss_fn, mlp(), with_leaf("x", np.ones((16, 5), np.float32))
    ),
    CaptureError,
    "shapes and dtypes fit the model",
  ),
  (
    "capture-batch-missing-key",
    lambda c: graphpipe.capture(loss_fn, mlp(), {"x": BATCH["x"]}),
    CaptureError,
    "KeyError",
  ),
  (
    "capture-batch-empty-dict",
    lambda c: graphpipe.capture(lambda m, b: jnp.float32(0), mlp(), {}),
    CaptureError,
    "no arrays",
  ),
  (
    "capture-batch-zero-samples",
    lambda c: graphpipe.capture(
      loss_fn,
      mlp(),
      {"x": np.ones((0, 4), np.float32), "y": np.ones((0, 1), np.float32)},
    ),
    CaptureError,
    "at least one sample",
  ),
  (
    "capture-batch-scalar-leaf",
    lambda c: graphpipe.capture(loss_fn, mlp(), with_leaf("x", np.float32(1))),
    CaptureError,
    "leading batch axis",
  ),
  (
    "capture-batch-sizes-disagree",
    lambda c: graphpipe.capture(
      loss_fn, mlp(), with_leaf("y", np.zeros((8, 1), np.float32))
    ),
    CaptureError,
    "disagree on the batch size",
  ),
  (
    "capture-not-a-model",
    lambda c: graphpipe.capture(loss_fn, "model", BATCH),
    CaptureError,
    "must be a flax.nnx.Module",
  ),
  (
    "capture-single-node-model",
    lambda c: graphpipe.capture(
      lambda m, b: jnp.mean(m(b["x"])),
      nnx.Sequential(nnx.Linear(4, 1, rngs=nnx.Rngs(0))),
      BATCH,
    ),
    GraphCutError,
    "only one module call was traced",
  ),
  (
    "capture-no-submodules",
    lambda c: graphpipe.capture(
      lambda m, b: jnp.mean(m(b["x"])),
      nnx.Linear(4, 1, rngs=nnx.Rngs(0)),
      BATCH,
    ),
    GraphCutError,
    "single node",
  ),
  # OpGraph.load / Plan.load
  (
    "graph-file-missing",
    lambda c: OpGraph.load(c.graph_file + ".missing"),
    GraphFormatError,
    "cannot read a graph",
  ),
  (
    "graph-file-truncated",
    lambda c: OpGraph.load(c.truncated(c.graph_file, "g-trunc.json")),
    GraphFormatError,
    "is not JSON",
  ),
  (
    "graph-file-not-an-object",
    lambda c: OpGraph.load(
      c.edited(c.graph_file, lambda d: [1], "g-list.json")
    ),
    GraphFormatError,
    "not an object",
  ),
  (
    "graph-file-missing-figure",
    lambda c: OpGraph.load(
      c.edited(
        c.graph_file, lambda d: d["nodes"][0].pop("fwd_flops") and None, "g1"
      )
    ),
    GraphFormatError,
    "fwd_flops",
  ),
  (
    "graph-file-string-figure",
    lambda c: OpGraph.load(
      c.edited(c.graph_file, set_node("fwd_flops", "lots"), "g2")
    ),
    GraphFormatError,
    "not a finite number",
  ),
  (
    "graph-file-negative-figure",
    lambda c: OpGraph.load(
      c.edited(c.graph_file, set_node("param_bytes", -5), "g3")
    ),
    GraphFormatError,
    "not a finite number >= 0",
  ),
  (
    "graph-file-nan-figure",
    lambda c: OpGraph.load(
      c.edited(c.graph_file, set_node("saved_bytes", float("nan")), "g4")
    ),
    GraphFormatError,
    "nan is not a finite number",
  ),
  (
    "graph-file-edge-to-missing-node",
    lambda c: OpGraph.load(c.edited(c.graph_file, add_edge(1, 99), "g5")),
    GraphError,
    "does not go forward",
  ),
  (
    "graph-file-cycle",
    lambda c: OpGraph.load(c.edited(c.graph_file, add_edge(2, 0), "g6")),
    GraphError,
    "does not go forward",
  ),
  (
    "graph-file-no-nodes",
    lambda c: OpGraph.load(
      c.edited(
        c.graph_file,
        lambda d: d.update(nodes=[], edges=[], loss_nodes=[]),
        "g7",
      )
    ),
    GraphFormatError,
    "no nodes",
  ),
  (
    "graph-file-other-version",
    lambda c: OpGraph.load(
      c.edited(c.graph_file, lambda d: d.update(format_version=99), "g8")
    ),
    GraphFormatError,
    "format version",
  ),
  (
    "plan-file-truncated",
    lambda c: Plan.load(c.truncated(c.plan_file, "p-trunc.json")),
    GraphFormatError,
    "is not JSON",
  ),
  (
    "plan-file-missing-key",
    lambda c: Plan.load(
      c.edited(c.plan_file, lambda d: d.pop("stages") and None, "p1")
    ),
    GraphFormatError,
    "not a graphpipe plan",
  ),
  (
    "plan-file-edited-nodes",
    lambda c: graphpipe.check_plan(
      Plan.load(
        c.edited(
          c.plan_file, lambda d: d["stages"][0].update(nodes=[0, 99]), "p2"
        )
      ),
      c.graph,
      1e9,
    ),
    PlanError,
    "cover every node exactly once",
  ),
  # graphpipe.plan / tightest_plan
  *[
    (
      f"plan-{name}",
      case,
      PlanError,
      pattern,
    )
    for name, case, pattern in [
      ("devices-0", lambda c: graphpipe.plan(c.graph, 0, 16), "num_devices"),
      ("devices-negative", lambda c: graphpipe.plan(c.graph, -1, 16), "num"),
      ("devices-float", lambda c: graphpipe.plan(c.graph, 2.5, 16), "int"),
      ("batch-0", lambda c: graphpipe.plan(c.graph, 2, 0), "batch_size"),
      ("batch-float", lambda c: graphpipe.plan(c.graph, 2, 16.5), "int"),
      (
        "memory-0",
        lambda c: graphpipe.plan(c.graph, 2, 16, memory_bytes=0),
        "memory_bytes must be a number > 0",
      ),
      (
        "memory-negative",
        lambda c: graphpipe.plan(c.graph, 2, 16, memory_bytes=-1),
        "memory_bytes",
      ),
      (
        "memory-nan",
        lambda c: graphpipe.plan(c.graph, 2, 16, memory_bytes=float("nan")),
        "memory_bytes",
      ),
      (
        "memory-too-small",
        lambda c: graphpipe.plan(c.graph, 2, 16, memory_bytes=64),
        "smallest per-device memory that fits",
      ),
      (
        "planner-unknown",
        lambda c: graphpipe.plan(c.graph, 2, 16, planner="magic"),
        "unknown planner",
      ),
      (
        "micro-batch-not-dividing",
        lambda c: graphpipe.plan(c.graph, 2, 16, micro_batch_sizes=[3]),
        "not divisible",
      ),
      (
        "micro-batch-0",
        lambda c: graphpipe.plan(c.graph, 2, 16, micro_batch_sizes=[0]),
        "not divisible",
      ),
      (
        "tightest-devices-0",
        lambda c: graphpipe.tightest_plan(c.graph, 0, 16),
        "num_devices",
      ),
    ]
  ],
  (
    "plan-device-unknown",
    lambda c: graphpipe.plan(c.graph, 2, 16, device="tpu9"),
    CostModelError,
    "unknown device preset",
  ),
  # graphpipe.simulate
  (
    "simulate-plan-of-another-graph",
    lambda c: graphpipe.simulate(
      graphpipe.plan(
        graphpipe.capture(loss_fn, mlp(), BATCH, granularity=1), 1, 16
      ),
      OpGraph([graphpipe.Node(0, "a"), graphpipe.Node(1, "b")], []),
    ),
    SimulationError,
    "every node must be in exactly one stage",
  ),
  (
    "simulate-not-a-plan",
    lambda c: graphpipe.simulate("plan", c.graph),
    SimulationError,
    "takes a Plan and an OpGraph",
  ),
  (
    "simulate-schedule-a-string",
    lambda c: graphpipe.simulate(c.plan, c.graph, schedule="1f1b"),
    SimulationError,
    "schedule must be a Schedule",
  ),
  # graphpipe.Trainer
  (
    "trainer-optimizer-not-optax",
    lambda c: graphpipe.Trainer(c.plan, "adam", graph=c.graph),
    PipelineRuntimeError,
    "optax GradientTransformation",
  ),
  (
    "trainer-loss-reduction-unknown",
    lambda c: graphpipe.Trainer(
      c.plan, optax.sgd(0.1), graph=c.graph, loss_reduction="avg"
    ),
    PipelineRuntimeError,
    "'mean' or 'sum'",
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
    "step-not-a-state",
    lambda c: c.trainer.step("state", BATCH),
    PipelineRuntimeError,
    "takes the TrainState",
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
      c.state(), with_leaf("x", BATCH["x"].astype(np.float64))
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
  # Trainer.save / restore (graphpipe.runtime.checkpoints)
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
    "restore-other-plan",
    lambda c: graphpipe.Trainer(
      graphpipe.tightest_plan(c.graph, 3, 16), optax.sgd(0.1), graph=c.graph
    ).restore(c.checkpoint("c6")),
    PipelineRuntimeError,
    "written for another plan or graph",
  ),
  (
    "restore-other-optimizer-state",
    lambda c: graphpipe.Trainer(c.plan, optax.adam(0.1), graph=c.graph).restore(
      c.checkpoint("c7")
    ),
    PipelineRuntimeError,
    "the saved arrays cannot be read",
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


@pytest.mark.parametrize(
  "case, error, pattern", [r[1:] for r in ROWS], ids=[r[0] for r in ROWS]
)
def test_bad_input_is_refused_clearly(ctx, case, error, pattern):
  with pytest.raises(error, match=pattern):
    case(ctx)


def test_row_ids_are_unique():
  ids = [r[0] for r in ROWS]
  assert len(ids) == len(set(ids))


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


def test_more_devices_than_nodes_and_single_node_graphs_plan(ctx):
  """Not errors: spare devices replicate stages; one node is one stage."""
  p = graphpipe.plan(ctx.graph, 32, 64, memory_bytes=float("inf"))
  graphpipe.check_plan(p, ctx.graph, float("inf"))
  assert p.num_devices <= 32 and len(ctx.graph.nodes) == 3
  single = OpGraph(
    [graphpipe.Node(0, "only", fwd_flops=1e6, bwd_flops=2e6)], []
  )
  p = graphpipe.plan(single, 4, 16)
  assert p.num_stages == 1 and p.stages[0].nodes == (0,)
  graphpipe.check_plan(p, single, float("inf"))


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
