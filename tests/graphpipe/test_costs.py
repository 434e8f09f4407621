"""Tests of graphpipe.costs: presets, the analytic model, profiles, stages."""

import dataclasses
import json

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import graphpipe
from graphpipe import costs
from graphpipe.core.fingerprint import graph_fingerprint
from graphpipe.core.graph import Edge, Node, OpGraph
from graphpipe.core.memory import stage_memory_bytes
from graphpipe.costs.profiled import _interpolate
from graphpipe.errors import GraphpipeError
from graphpipe.planning.stage_costs import StageCosts

FF = 4096


def ff_node(i: int, width: int = FF) -> Node:
  """A width x width feed-forward layer, fp32, per-sample costs."""
  params = width * width * 4
  return Node(
    id=i,
    name=f"ff{i}",
    param_bytes=params,
    fwd_flops=2.0 * width * width,
    bwd_flops=4.0 * width * width,
    fwd_bytes=8.0 * width,
    bwd_bytes=16.0 * width,
    activation_bytes=4.0 * width,
    saved_bytes=8.0 * width,
    fixed={"fwd_bytes": float(params), "bwd_bytes": 2.0 * params},
  )


def block_node(i: int, seq: int = 256, hidden: int = 1024) -> Node:
  """A transformer layer (seq 256, hidden 1024, FFN 4096), fp32."""
  fwd = 2 * seq * 12 * hidden**2 + 4 * seq**2 * hidden
  return Node(
    id=i,
    name=f"block{i}",
    param_bytes=12 * hidden**2 * 4,
    fwd_flops=float(fwd),
    bwd_flops=2.0 * fwd,
    activation_bytes=4.0 * seq * hidden,
    saved_bytes=44.0 * seq * hidden,
  )


def chain_graph(nodes) -> OpGraph:
  nodes = [dataclasses.replace(n, id=i) for i, n in enumerate(nodes)]
  edges = [
    Edge(i, i + 1, nodes[i].activation_bytes) for i in range(len(nodes) - 1)
  ]
  return OpGraph(nodes, edges, model="chain")


@pytest.fixture(scope="module")
def v100():
  return costs.AnalyticCostModel(costs.device_spec("v100"))


@pytest.mark.parametrize("name", ["v100", "a100", "h100", "h200", "V100"])
def test_gpu_presets_have_datasheet_figures(name):
  spec = costs.device_spec(name)
  assert spec.peak_flops["float32"] > 1e13
  assert spec.memory_bytes > 15 * 2**30
  assert spec.intra_node_bandwidth > spec.inter_node_bandwidth
  assert spec.source


def test_v100_preset_is_the_papers_node():
  spec = costs.device_spec("v100")
  assert spec.devices_per_node == 4
  assert spec.peak_flops["float32"] == 15.7e12
  assert spec.inter_node_bandwidth == 100e9 / 8  # 100 Gb/s InfiniBand


def test_unknown_preset_lists_the_known_ones():
  with pytest.raises(GraphpipeError, match="v100, a100, h100, h200, cpu"):
    costs.device_spec("tpu-v9")


def test_cpu_preset_is_measured_once():
  spec = costs.device_spec("cpu")
  assert spec.peak_flops["float32"] > 1e8
  assert spec.memory_bandwidth > 1e8
  assert spec.half_efficiency_elements >= 0
  assert costs.device_spec("cpu") is spec  # cached: the machine is the same


def test_unknown_dtype_is_refused():
  with pytest.raises(GraphpipeError, match="bfloat16"):
    costs.AnalyticCostModel(costs.device_spec("v100"), dtype="bfloat16")


def test_per_sample_time_falls_with_the_micro_batch(v100):
  node = ff_node(0)
  per_sample = [v100.node_time(node, b, "fwd") / b for b in (1, 4, 32, 256)]
  assert all(a > b for a, b in zip(per_sample, per_sample[1:], strict=False))
  # Large batches approach max efficiency: 2 * 4096^2 FLOPs at 0.8 * peak.
  ideal = 2 * FF * FF / (15.7e12 * 0.8)
  assert per_sample[-1] < 1.2 * ideal


def test_efficiency_curve_matches_the_case_study_calibration(v100):
  # Module docstring: a transformer block is ~10% faster per sample at
  # micro-batch 4 than at 2 on a V100.
  node = block_node(0)
  ratio = (v100.node_time(node, 2, "fwd") / 2) / (
    v100.node_time(node, 4, "fwd") / 4
  )
  assert ratio == pytest.approx(1.099, abs=0.005)


def test_memory_bound_nodes_follow_bandwidth(v100):
  node = Node(id=0, name="copy", fwd_bytes=1e9)
  assert v100.node_time(node, 1, "fwd") == pytest.approx(1e9 / (900e9 * 0.8))
  with pytest.raises(GraphpipeError, match="'fwd' or 'bwd'"):
    v100.node_time(node, 1, "sideways")


def test_transfers_use_the_link_between_the_devices(v100):
  assert v100.transfer_time(1e6, 2, 2) == 0.0
  intra = v100.transfer_time(1e6, 0, 3)
  inter = v100.transfer_time(1e6, 3, 4)
  assert intra == pytest.approx(5e-6 + 1e6 / 50e9)
  assert inter == pytest.approx(10e-6 + 1e6 / 12.5e9)


def test_allreduce_is_the_ring_formula(v100):
  assert v100.allreduce_time(1e9, [3]) == 0.0
  expected = 2 * 3 * (5e-6 + 1e9 / 4 / 50e9)
  assert v100.allreduce_time(1e9, range(4)) == pytest.approx(expected)
  spanning = v100.allreduce_time(1e9, range(8))
  assert spanning == pytest.approx(2 * 7 * (10e-6 + 1e9 / 8 / 12.5e9))


def test_optimizer_time_is_seven_passes(v100):
  assert v100.optimizer_time(1e9) == pytest.approx(7e9 / (900e9 * 0.8))


def test_fingerprint_tracks_structure_and_costs():
  graph = chain_graph([ff_node(0), ff_node(1)])
  same = OpGraph.from_dict(graph.to_dict())
  assert graph_fingerprint(graph) == graph_fingerprint(same)
  heavier = chain_graph([ff_node(0), ff_node(1, width=2 * FF)])
  assert graph_fingerprint(graph) != graph_fingerprint(heavier)


def test_stage_costs_follow_the_memory_rule(v100):
  graph = chain_graph([block_node(i) for i in range(4)])
  table = StageCosts(graph, v100, 64, 8, 16 * 2**30)
  nodes = (0, 1)
  cap = table.in_flight_capacity(nodes, 8, 2)
  assert stage_memory_bytes(graph, nodes, 4, cap) <= 16 * 2**30
  assert stage_memory_bytes(graph, nodes, 4, cap + 1) > 16 * 2**30
  assert table.share(8, 3) == pytest.approx(8 / 3)
  # Two replicas halve the compute per sample but add an all-reduce.
  one = table.time_per_sample(nodes, 8, 1)
  two = table.time_per_sample(nodes, 8, 2)
  assert two < one
  fwd, bwd = table.compute_time(nodes, 8, 1)
  sync = table.sync_time(nodes, 1)
  assert one == pytest.approx((8 * (fwd + bwd) + sync) / 64)


def test_stage_costs_without_memory_limit(v100):
  graph = chain_graph([block_node(0)])
  table = StageCosts(graph, v100, 8, 1, float("inf"))
  assert table.in_flight_capacity((0,), 8, 1) > 1000


@pytest.fixture(scope="module")
def tiny_graph():
  model = nnx.Sequential(
    nnx.Linear(8, 16, rngs=nnx.Rngs(0)),
    nnx.Linear(16, 4, rngs=nnx.Rngs(1)),
  )
  batch = {"x": jnp.ones((4, 8)), "y": jnp.ones((4, 4))}

  def loss_fn(m, b):
    return jnp.mean((m(b["x"]) - b["y"]) ** 2)

  return graphpipe.capture(loss_fn, model, batch)


def test_profiled_model_times_every_node_and_caches(tiny_graph, tmp_path):
  analytic = costs.AnalyticCostModel(costs.device_spec("v100"))
  model = costs.ProfiledCostModel(
    tiny_graph, analytic, batch_sizes=(1, 4), cache_dir=str(tmp_path)
  )
  assert len(model.times) == len(tiny_graph.nodes)
  node = tiny_graph.nodes[0]
  at_1, at_4 = model.times[0]["fwd"]
  assert model.node_time(node, 1, "fwd") == pytest.approx(at_1)
  # Midway between the sizes, never under the smallest size's time (timing
  # noise on a node this small can measure size 4 faster than size 1).
  midway = max((at_1 + at_4) / 2, at_1)
  assert model.node_time(node, 2.5, "fwd") == pytest.approx(midway)
  assert model.node_time(node, 0.5, "fwd") > 0
  assert model.transfer_time(1e6, 0, 5) == analytic.transfer_time(1e6, 0, 5)
  # Gradient adds are timed on the device, once per size.
  add = model.gradient_add_time(4e6)
  assert add > 0 and model.gradient_add_time(4e6) == add
  (cache,) = tmp_path.iterdir()
  assert json.loads(cache.read_text())["fingerprint"] == model.fingerprint
  # A graph loaded from JSON has no program but finds the cached profile.
  loaded = OpGraph.from_dict(tiny_graph.to_dict())
  again = costs.ProfiledCostModel(
    loaded, analytic, batch_sizes=(1, 4), cache_dir=str(tmp_path)
  )
  assert again.times == model.times


def test_profiling_needs_a_program(tiny_graph, tmp_path):
  loaded = OpGraph.from_dict(tiny_graph.to_dict())
  analytic = costs.AnalyticCostModel(costs.device_spec("v100"))
  with pytest.raises(GraphpipeError, match="graphpipe.capture"):
    costs.ProfiledCostModel(loaded, analytic, cache_dir=str(tmp_path))


def test_interpolation_is_piecewise_linear():
  sizes, times = (1, 4, 16), (1.0, 2.5, 7.0)
  values = [_interpolate(sizes, times, x) for x in (1, 2, 4, 10, 32)]
  np.testing.assert_allclose(values, [1.0, 1.5, 2.5, 4.75, 13.0])
  # Measured times that fall with the batch (noise): no batch is faster
  # than the smallest size, and none below it slower.
  sizes, times = (2, 8), (2.0, 1.0)
  values = [_interpolate(sizes, times, x) for x in (1, 2, 5, 8, 16)]
  np.testing.assert_allclose(values, [2.0, 2.0, 2.0, 2.0, 2.0])
  # Below the smallest size time falls at most with the batch.
  assert _interpolate((2, 8), (2.0, 8.0), 1) == 1.0


def test_device_spec_and_the_model_refuse_each_others_arguments():
  # plan_and_simulate(device=spec) failed with "'DeviceSpec' object has no
  # attribute 'lower'"; AnalyticCostModel("v100") with no 'peak_flops'.
  from graphpipe.costs import AnalyticCostModel, device_spec
  from graphpipe.errors import CostModelError
  from graphpipe.models import capture_zoo

  spec = dataclasses.replace(device_spec("v100"), memory_bytes=32 * 2**30)
  with pytest.raises(CostModelError, match="takes a preset name"):
    device_spec(spec)
  with pytest.raises(CostModelError, match="takes a DeviceSpec"):
    AnalyticCostModel("v100")
  with pytest.raises(graphpipe.PlanError, match="or a DeviceSpec, got a int"):
    graphpipe.plan(capture_zoo("two_branch", "tiny"), 2, 8, device=100)
  graph = capture_zoo("two_branch", "tiny")
  p, _, report = graphpipe.plan_and_simulate(
    graph, num_devices=2, batch_size=8, device=spec
  )
  assert p.device == "v100 (custom)" and report.memory_capacity_bytes == (
    spec.memory_bytes
  )
