"""Bad input to graphpipe's capture, graph and plan files, planners and
simulator: each row of docs/guide/bad_input.md's table ("Bad input, everywhere")
for those entry points is one case here (the runtime's rows:
`test_bad_input_runtime.py`).

Every case asserts the library's own error class and a message that says
what to fix. Tiny three-layer MLP (`bad_input_context`), so every case
runs in well under a second once the module's graph and plan exist.
"""

import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import graphpipe
from graphpipe import OpGraph, Plan
from graphpipe.costs import AnalyticCostModel, device_spec
from graphpipe.errors import (
  CaptureError,
  CostModelError,
  GraphCutError,
  GraphError,
  GraphFormatError,
  PlanError,
  ScheduleError,
  SimulationError,
)
from tests.bad_input_table import table_tests
from tests.graphpipe.bad_input_context import (
  BATCH,
  Ctx,
  add_edge,
  loss_fn,
  mlp,
  set_node,
  with_leaf,
)


def _custom_device_plan(c) -> Plan:
  v100 = device_spec("v100")
  spec = dataclasses.replace(v100, memory_bytes=2 * v100.memory_bytes)
  return graphpipe.plan(c.graph, 2, 16, device=spec)


def _heavier(graph: OpGraph) -> OpGraph:
  """`graph` with every node's forward twice as costly (same structure)."""
  nodes = [
    dataclasses.replace(n, fwd_flops=2 * n.fwd_flops + 1) for n in graph.nodes
  ]
  return OpGraph(nodes, graph.edges, loss_nodes=graph.loss_nodes)


def _uneven(c) -> Plan:
  """One stage on 2 devices with micro-batches of 5 (not divisible)."""
  nodes = tuple(range(len(c.graph.nodes)))
  return Plan("manual", (graphpipe.Stage(0, nodes, (0, 1), 5),), (), 10, 2)


@pytest.fixture(scope="module")
def ctx(tmp_path_factory):
  return Ctx(tmp_path_factory.mktemp("bad_input"))


class _Looping(nnx.Module):
  """A layer applied in a while_loop (traced bounds), then a head."""

  def __init__(self):
    self.layer = nnx.Linear(4, 4, rngs=nnx.Rngs(0))
    self.head = nnx.Linear(4, 1, rngs=nnx.Rngs(1))

  def __call__(self, x):
    step = lambda v: (v[0] + 1, jnp.sin(self.layer(v[1])))
    return self.head(jax.lax.while_loop(lambda v: v[0] < 3, step, (0, x))[1])


class _ReplicaIndex(nn.Module):
  """Adds its replica's index along the axis 'batch' (lax.axis_index)."""

  @nn.compact
  def __call__(self, x):
    if self.is_initializing():  # as BatchNorm skips its pmean
      return x
    return x + jax.lax.axis_index("batch")


def _linen_training(layer):
  """Capture of a linen model whose middle layer runs in training mode."""

  class Net(nn.Module):
    @nn.compact
    def __call__(self, x):
      h = layer()(nn.Dense(8, name="a")(x))
      return nn.Dense(1, name="b")(h)

  variables = Net().init(
    {"params": jax.random.key(0), "dropout": jax.random.key(1)}, BATCH["x"]
  )
  return graphpipe.capture(
    lambda m, b: jnp.mean(m(b["x"])), Net(), BATCH, variables=variables
  )


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
    "capture-granularity-bool",
    lambda c: graphpipe.capture(loss_fn, mlp(), BATCH, granularity=True),
    CaptureError,
    "depth >= 1, got True",
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
  # Linen layers that draw random numbers in training: the message blamed
  # the batch's shapes. (BatchNorm in training trains since 2026-12-04:
  # tests/graphpipe/test_batch_stats.py.)
  (
    "capture-linen-dropout-training",
    lambda c: _linen_training(lambda: nn.Dropout(0.5, deterministic=False)),
    CaptureError,
    r"(?s)needs PRNG for \"dropout\".*capture\(\.\.\., rngs=\('dropout',\)\)",
  ),
  # BatchNorm(axis_name='batch') trains since 2026-12-05 (one device a
  # stage: tests/graphpipe/test_batch_stats.py); a layer whose values
  # differ by replica along the axis cannot run on one device.
  (
    "capture-replica-index",
    lambda c: _linen_training(lambda: _ReplicaIndex()),
    CaptureError,
    r"(?s)names the collective axis \['batch'\].*lax.axis_index",
  ),
  # A while_loop with traced bounds cannot be differentiated: a raw
  # ValueError from the cost measurement.
  (
    "capture-loss-not-differentiable",
    lambda c: graphpipe.capture(loss_fn, _Looping(), BATCH),
    CaptureError,
    "jax.grad of loss_fn must work",
  ),
  (
    # "Build the model from submodules" to a model built from them whose
    # whole forward ran under one jax.checkpoint in the loss.
    "capture-whole-model-under-checkpoint",
    lambda c: graphpipe.capture(
      lambda m, b: loss_fn(jax.checkpoint(lambda x: m(x)), b), mlp(), BATCH
    ),
    GraphCutError,
    "apply the transform inside each layer",
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
  (
    "check-plan-of-a-graph-with-other-costs",
    lambda c: graphpipe.check_plan(c.plan, _heavier(c.graph), 1e12),
    PlanError,
    "made for another graph",
  ),
  (
    "check-plan-batch-0",
    lambda c: graphpipe.check_plan(
      dataclasses.replace(c.plan, batch_size=0), c.graph, 1e12
    ),
    PlanError,
    "batch size 0 is not positive",
  ),
  (
    "check-plan-memory-negative",
    lambda c: graphpipe.check_plan(graphpipe.plan(c.graph, 2, 16), c.graph, -1),
    PlanError,
    "memory_bytes must be a number > 0",
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
      ("devices-bool", lambda c: graphpipe.plan(c.graph, True, 16), "int"),
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
        "smallest per-device memory under which it finds one",
      ),
      (
        "padding-tolerance-negative",
        lambda c: graphpipe.plan(c.graph, 2, 16, padding_tolerance=-0.1),
        "padding_tolerance must be a number >= 0",
      ),
      (
        "max-padding-negative",
        lambda c: graphpipe.plan(c.graph, 2, 16, max_padding=-0.1),
        r"max_padding must be None or a number in \[0, 1\]",
      ),
      (
        "max-padding-over-one",
        lambda c: graphpipe.plan(c.graph, 2, 16, max_padding=1.5),
        r"max_padding must be None or a number in \[0, 1\]",
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
        "memory-kinds-unknown",
        lambda c: graphpipe.plan(c.graph, 2, 16, memory_kinds=["weights"]),
        "memory_kinds must be a non-empty list of kinds",
      ),
      (
        "memory-kinds-empty",
        lambda c: graphpipe.plan(c.graph, 2, 16, memory_kinds=[]),
        "memory_kinds must be a non-empty list of kinds",
      ),
      (
        "piper-budget-0",
        lambda c: graphpipe.plan(c.graph, 2, 16, "piper", piper_budget=0),
        "piper_budget must be an int >= 1",
      ),
      (
        "tightest-devices-0",
        lambda c: graphpipe.tightest_plan(c.graph, 0, 16),
        "num_devices",
      ),
      (
        "tightest-piper-budget-0",
        lambda c: graphpipe.tightest_plan(c.graph, 2, 16, piper_budget=0),
        "piper_budget must be an int >= 1",
      ),
      # Found by probing on 2026-12-03.
      (
        "tightest-steps-0",  # returned the unconstrained plan
        lambda c: graphpipe.tightest_plan(c.graph, 2, 16, steps=0),
        "steps must be an int >= 1, got 0",
      ),
      (
        "graph-none",  # a raw AttributeError
        lambda c: graphpipe.plan(None, 2, 16),
        "plan takes an OpGraph",
      ),
      (
        "micro-batch-an-int",  # 'int' object is not iterable
        lambda c: graphpipe.plan(c.graph, 2, 16, micro_batch_sizes=4),
        "micro_batch_sizes takes a list of sizes, got 4",
      ),
      (
        "micro-batch-one-not-dividing",  # 3 dropped silently, 4 searched
        lambda c: graphpipe.plan(c.graph, 2, 16, micro_batch_sizes=[3, 4]),
        r"not divisible by the micro-batch sizes \[3\] of \[3, 4\]",
      ),
      (
        "micro-batch-fractional",  # 2.5 dropped silently
        lambda c: graphpipe.plan(c.graph, 2, 16, micro_batch_sizes=[2.5, 4]),
        r"sizes \[2.5\] of",
      ),
      (
        "micro-batch-bool",  # True searched as size 1
        lambda c: graphpipe.plan(c.graph, 2, 16, micro_batch_sizes=[True]),
        r"sizes \[True\] of",
      ),
      (
        "cost-model-a-name",  # a raw AttributeError (memory_bytes)
        lambda c: graphpipe.plan(c.graph, 2, 16, cost_model="v100"),
        "cost_model must be a cost model .* without memory_bytes",
      ),
      (
        "plan-and-simulate-cost-model",  # got multiple values (TypeError)
        lambda c: graphpipe.plan_and_simulate(
          c.graph,
          num_devices=2,
          batch_size=16,
          cost_model=AnalyticCostModel(device_spec("v100")),
        ),
        "builds its cost model from device= and profiled=",
      ),
    ]
  ],
  (
    "simulate-cost-model-a-name",  # a raw AttributeError (node_time)
    lambda c: graphpipe.simulate(c.plan, c.graph, "v100"),
    SimulationError,
    "cost_model must be a cost model",
  ),
  (
    "simulate-lockstep-a-string",  # taken as True
    lambda c: graphpipe.simulate(c.plan, c.graph, lockstep="yes"),
    SimulationError,
    "lockstep must be True or False, got 'yes'",
  ),
  (
    "plan-device-unknown",
    lambda c: graphpipe.plan(c.graph, 2, 16, device="tpu9"),
    CostModelError,
    "unknown device preset",
  ),
  (
    "plan-device-not-a-name",
    lambda c: graphpipe.plan(c.graph, 2, 16, device=100),
    PlanError,
    "or a DeviceSpec, got a int",
  ),
  # graphpipe.costs
  (
    # "'DeviceSpec' object has no attribute 'lower'" before (also through
    # plan_and_simulate, which now takes a spec as plan does).
    "costs-device-spec-of-a-spec",
    lambda c: device_spec(device_spec("v100")),
    CostModelError,
    "device_spec takes a preset name",
  ),
  (
    "costs-model-of-a-name",  # "'str' object has no attribute" before
    lambda c: AnalyticCostModel("v100"),
    CostModelError,
    "AnalyticCostModel takes a DeviceSpec",
  ),
  # graphpipe.simulate
  (
    # A plan made for a spec of its own, read back from JSON: simulated
    # against the preset of the same name before.
    "simulate-custom-device-plan-from-json",
    lambda c: graphpipe.simulate(
      Plan.from_dict(_custom_device_plan(c).to_dict()), c.graph
    ),
    SimulationError,
    "not a preset: pass the cost model",
  ),
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
    # Same nodes, other figures: taken without a word before.
    "simulate-plan-of-a-graph-with-other-costs",
    lambda c: graphpipe.simulate(c.plan, _heavier(c.graph)),
    SimulationError,
    "made for another graph",
  ),
  (
    "simulate-uneven-replicas",  # timed with 2.5 samples a device before
    lambda c: graphpipe.simulate(_uneven(c), c.graph),
    SimulationError,
    "does not split evenly",
  ),
  (
    "simulate-batch-0",  # '0 samples/s, bubble 48.8%' before
    lambda c: graphpipe.simulate(
      dataclasses.replace(c.plan, batch_size=0), c.graph
    ),
    ScheduleError,
    "not a positive multiple",
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
]

test_bad_input_is_refused_clearly, test_row_ids_are_unique = table_tests(ROWS)


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
