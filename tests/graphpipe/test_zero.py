"""ZeRO-1 stages: the optimizer state sharded over a stage's devices trains
exactly like plain JAX, and every device holds only what it owns."""

import dataclasses
import functools
import json

import jax
import numpy as np
import optax
import pytest

import graphpipe
from graphpipe import Trainer
from graphpipe.core.memory import plan_memory
from graphpipe.core.stages import Plan, Stage, in_flight_counts
from graphpipe.core.zero import owned_elements
from graphpipe.costs import AnalyticCostModel, device_spec
from graphpipe.errors import GraphpipeError, PipelineRuntimeError, PlanError
from graphpipe.models import capture_zoo
from graphpipe.planning.validate import check_plan
from tests.graphpipe import runtime_cases as rc

SGD = optax.sgd(0.1, momentum=0.9)  # linear in the gradients: exact steps
V100 = AnalyticCostModel(device_spec("v100"))


def _plan(name, groups, sizes=None, batch_size=rc.BATCH):
  """A 1F1B plan of the zoo model `name`'s stages (nodes, devices,
  sharding), micro-batch sizes `sizes` (default 4 for every stage)."""
  return _plan_of(rc.tiny_graph(name), groups, sizes, batch_size)


def _plan_of(graph, groups, sizes=None, batch_size=rc.BATCH):
  """`_plan` of a captured graph."""
  owner = {n: i for i, (nodes, _, _) in enumerate(groups) for n in nodes}
  edges = tuple(
    sorted(
      {
        (owner[e.src], owner[e.dst])
        for e in graph.edges
        if owner[e.src] != owner[e.dst]
      }
    )
  )
  sizes = sizes or [4] * len(groups)
  flight = in_flight_counts(len(groups), edges, sizes)
  stages = tuple(
    Stage(i, tuple(nodes), tuple(devices), sizes[i], flight[i], sharding)
    for i, (nodes, devices, sharding) in enumerate(groups)
  )
  used = sum(len(d) for _, d, _ in groups)
  return Plan("manual", stages, edges, batch_size, used)


# two_branch tiny: nodes 0-3 one branch, 4-7 the other, 8 the classifier.
MIXED = [
  ((0, 1, 2, 3), (0, 1, 2, 3), "zero1"),
  ((4, 5), (4, 5), "replicated"),
  ((6, 7, 8), (6, 7), "zero1"),
]
# Two ZeRO stages of one size and different parameter counts share a ring
# and a chunk length; a one-device stage owns its whole stage.
SHARED_RING = [
  ((0, 1, 2, 3), (0, 1), "zero1"),
  ((4, 5), (2, 3), "zero1"),
  ((6, 7), (4,), "replicated"),
  ((8,), (5, 6), "zero1"),
]


@pytest.mark.parametrize(
  "groups,sizes,recompute",
  [
    pytest.param(MIXED, None, False, id="mixed"),
    pytest.param(SHARED_RING, None, True, id="shared-ring-recompute"),
    pytest.param(MIXED, [4, 4, 8], False, id="unequal-micro-batches"),
  ],
)
def test_zero_stages_train_like_plain_jax(groups, sizes, recompute):
  plan = _plan("two_branch", groups, sizes)
  graph = rc.tiny_graph("two_branch")
  check_plan(plan, graph, memory_bytes=2**34)
  model, batch = rc.model_and_batch("two_branch")
  trainer = Trainer(plan, SGD, graph=graph, recompute=recompute)
  assert trainer.zero.active
  batches = [batch] + [
    rc.model_and_batch("two_branch", seed=s)[1] for s in (1, 2)
  ]
  rc.assert_trains_exactly("two_branch", trainer, model, batches, SGD)


def test_a_planned_data_parallel_model_trains_exactly_with_zero_stages():
  plan = rc.pipeline_plan("dlrm", 8, "graphpipe", 2)
  assert max(len(s.devices) for s in plan.stages) > 1
  model, batch = rc.model_and_batch("dlrm")
  trainer = Trainer(_sharded(plan), SGD, graph=rc.tiny_graph("dlrm"))
  batches = [batch] + [rc.model_and_batch("dlrm", seed=s)[1] for s in (1, 2)]
  rc.assert_trains_exactly("dlrm", trainer, model, batches, SGD)


@pytest.fixture(scope="module")
def mixed_adam():
  """The mixed plan's trainer with Adam (compiled once for the tests)."""
  return Trainer(
    _plan("two_branch", MIXED),
    optax.adam(1e-2),
    graph=rc.tiny_graph("two_branch"),
  )


def test_each_device_keeps_the_optimizer_state_of_its_share_only(mixed_adam):
  trainer = mixed_adam
  sizes = [trainer.layout.param_size(s.id) for s in trainer.layout.stages]
  slot_sizes = trainer.buffers.params.sizes
  chunks = lambda n: sum(-(-s // n) for s in slot_sizes)
  # A ZeRO device owns its chunk of every slot (stage 0, the largest, on 4
  # devices: a quarter); the replicated stage 1 owns its whole stage, which
  # sets the owned length; stage 2's devices own half of every slot, of
  # which they need half their stage.
  owned = trainer.zero.owned
  assert owned.per_stage == (chunks(4), sizes[1], chunks(2))
  assert owned.needed == (-(-sizes[0] // 4), sizes[1], -(-sizes[2] // 2))
  assert owned.length == max(owned.per_stage) < sum(slot_sizes)
  state = trainer.init(rc.model_and_batch("two_branch")[0])
  mu = state.opt_state[0].mu
  assert mu.shape == (8, owned.length)


def test_memory_rule_counts_the_owned_optimizer_state(mixed_adam):
  trainer, plan, graph = mixed_adam, mixed_adam.plan, mixed_adam.graph
  model, batch = rc.model_and_batch("two_branch")
  report = trainer.memory_report(trainer.init(model), batch)
  compiled = report["compiled_bytes"]
  for total in report["total_bytes_per_device"]:
    assert compiled <= total <= compiled + max(0.1 * compiled, 2**20)
  alone = graphpipe.memory_report(plan, graph, optax.adam(1e-2))
  bound = plan_memory(graph, plan)
  owned = trainer.zero.owned.length
  for mine, theirs in zip(alone.per_device, bound.per_device, strict=True):
    assert mine["optimizer"] == 2 * 4 * owned + 4  # two moments, a count
    assert mine["optimizer"] <= theirs["optimizer"]
    assert sum(mine.values()) <= sum(theirs.values())
  # The planner bounds the chunks without the slot sizes (by the largest
  # stage's elements and its variable count), and counts 64 bytes of
  # optimizer scalars where Adam keeps 4.
  assert alone.padding_fraction == pytest.approx(
    bound.padding_fraction, rel=2e-2
  )
  # Sharding lowers the padding bytes (not their share of what is held):
  # the replicated plan holds Adam's moments over the largest stage's
  # slots on every device.
  full = plan_memory(graph, _replicated(plan))
  assert sum(bound.padding_bytes) < sum(full.padding_bytes)
  assert bound.largest_of(["optimizer"]) < full.largest_of(["optimizer"])
  assert bound.largest < full.largest


def test_checkpoints_of_zero_stages_resume_exactly(tmp_path, mixed_adam):
  model, _ = rc.model_and_batch("two_branch")
  rc.assert_resumes_exactly(mixed_adam, model, str(tmp_path / "ckpt"))


def test_a_non_finite_step_leaves_zero_stages_unchanged(mixed_adam):
  trainer = mixed_adam
  model, batch = rc.model_and_batch("two_branch")
  state, _ = trainer.step(trainer.init(model), batch)
  before = jax.tree.map(np.asarray, state)
  bad = {k: np.array(v) for k, v in batch.items()}
  bad["modality_0"][3, 2] = np.nan
  state, metrics = trainer.step(state, bad)
  assert not metrics["finite"]
  after = jax.tree.map(np.asarray, state)
  for a, b in zip(jax.tree.leaves(before), jax.tree.leaves(after), strict=True):
    np.testing.assert_array_equal(a, b)


@pytest.fixture(scope="module")
def saved_run(tmp_path_factory):
  """The mixed plan trained with momentum SGD: saved after two steps, then
  two more. (folder, parameters when saved, losses of the two steps after,
  parameters after them)."""
  folder = str(tmp_path_factory.mktemp("zero") / "ckpt")
  trainer = Trainer(
    _plan("two_branch", MIXED), SGD, graph=rc.tiny_graph("two_branch")
  )
  state = trainer.init(rc.model_and_batch("two_branch")[0])
  for b in _batches()[:2]:
    state, _ = trainer.step(state, b)
  trainer.save(state, folder)
  saved = trainer.params(state)
  losses = []
  for b in _batches()[2:]:
    state, metrics = trainer.step(state, b)
    losses.append(metrics["loss"])
  return folder, saved, losses, trainer.params(state)


@functools.cache
def _batches():
  return [rc.model_and_batch("two_branch", s)[1] for s in range(4)]


@pytest.mark.parametrize(
  "target",
  [
    pytest.param(
      lambda: _replicated(_plan("two_branch", MIXED)), id="replicated"
    ),
    pytest.param(
      lambda: rc.pipeline_plan("two_branch", 4, "sequential"),
      id="4-device-chain",
    ),
    pytest.param(
      lambda: _plan("two_branch", [(tuple(range(9)), (0, 1), "zero1")]),
      id="one-zero-stage",
    ),
  ],
)
def test_a_checkpoint_restores_into_another_plan_and_trains_on(
  saved_run, target
):
  folder, saved, losses, trained = saved_run
  other = Trainer(target(), SGD, graph=rc.tiny_graph("two_branch"))
  moved = other.restore(folder)
  assert int(np.asarray(moved.step)) == 2
  # Pure data movement: the parameters are the saved bits.
  got = other.params(moved)
  for key in saved:
    np.testing.assert_array_equal(got[key], saved[key])
  # The momentum moved too: the next steps are the original run's.
  again = []
  for b in _batches()[2:]:
    moved, metrics = other.step(moved, b)
    again.append(metrics["loss"])
  np.testing.assert_allclose(again, losses, rtol=1e-5)
  assert rc.max_rel_error(other.params(moved), trained) < 1e-5


def test_a_checkpoint_does_not_restore_into_another_graph(saved_run):
  folder = saved_run[0]
  other = Trainer(
    rc.pipeline_plan("dlrm", 4, "sequential"), SGD, graph=rc.tiny_graph("dlrm")
  )
  with pytest.raises(GraphpipeError, match="another plan or graph"):
    other.restore(folder)
  adam = Trainer(
    _replicated(_plan("two_branch", MIXED)),
    optax.adam(1e-2),
    graph=rc.tiny_graph("two_branch"),
  )
  with pytest.raises(GraphpipeError, match="another optimizer"):
    adam.restore(folder)


def _replicated(plan):
  return dataclasses.replace(
    plan,
    stages=tuple(
      dataclasses.replace(s, sharding="replicated") for s in plan.stages
    ),
  )


def test_sharding_survives_json_and_bad_shardings_are_refused(tmp_path):
  plan = _plan("two_branch", MIXED)
  plan.save(str(tmp_path / "plan.json"))
  loaded = Plan.load(str(tmp_path / "plan.json"))
  assert [s.sharding for s in loaded.stages] == ["zero1", "replicated", "zero1"]
  assert "ZeRO-1" in str(plan)
  # A plan saved before stages could shard loads as replicated.
  old = json.loads((tmp_path / "plan.json").read_text())
  for s in old["stages"]:
    del s["sharding"]
  assert all(s.sharding == "replicated" for s in Plan.from_dict(old).stages)
  graph = rc.tiny_graph("two_branch")
  lonely = _plan(
    "two_branch",
    [((0, 1, 2, 3), (0,), "zero1"), ((4, 5, 6, 7, 8), (1,), "replicated")],
  )
  with pytest.raises(PlanError, match="ZeRO-1 .* has one"):
    check_plan(lonely, graph, memory_bytes=2**34)
  with pytest.raises(PipelineRuntimeError, match="ZeRO-1 .* has one"):
    Trainer(lonely, SGD, graph=graph)
  odd = dataclasses.replace(
    plan,
    stages=(dataclasses.replace(plan.stages[0], sharding="zero3"),)
    + plan.stages[1:],
  )
  with pytest.raises(PipelineRuntimeError, match="'zero3' is not one of"):
    Trainer(odd, SGD, graph=graph)


def test_owned_elements_take_the_most_any_device_owns():
  stages = [(10, 4, True), (7, 4, True), (5, 2, True), (3, 1, False)]
  owned = owned_elements(stages, slots=(6, 4))
  # ceil(6 / n) + ceil(4 / n) elements of the slots, whatever the stage's
  # own size; a stage that does not shard owns its whole stage.
  assert owned.chunks == {2: 5, 4: 3}
  assert owned.per_stage == (3, 3, 5, 3)
  assert owned.needed == (3, 2, 3, 3)
  assert owned.length == 5
  # The planner's bound without the slot sizes, from a count of slots.
  bound = owned_elements(stages, slot_count=2)
  assert bound.chunks == {2: 6, 4: 4} and bound.length == 6
  assert not owned_elements([(10, 4, False)]).sharded
  assert owned_elements([(10, 4, False)]).length == 10


# Planning with ZeRO-1 stages.

ZERO = ("replicated", "zero1")


@pytest.mark.parametrize("planner", ["graphpipe", "sequential", "gpipe"])
def test_planners_shard_data_parallel_stages_and_plan_faster_under_a_budget(
  planner,
):
  graph = capture_zoo("two_branch", "paper")
  plan = graphpipe.plan(graph, 8, 8, planner=planner, stage_shardings=ZERO)
  check_plan(plan, graph, memory_bytes=V100.memory_bytes)
  assert any(len(s.devices) > 1 for s in plan.stages)
  for s in plan.stages:
    assert s.sharding == ("zero1" if len(s.devices) > 1 else "replicated")
  # The same options for every planner. Under the memory of the default
  # plan with its data-parallel stages sharded, that plan (replicated)
  # no longer fits, and the search with ZeRO-1 finds a faster plan than
  # the search without.
  default = graphpipe.plan(graph, 8, 8, planner=planner)
  budget = plan_memory(graph, _sharded(default)).largest
  assert plan_memory(graph, default).largest > budget
  time = lambda p: graphpipe.simulate(p, graph).iteration_time_s
  with_zero = graphpipe.plan(
    graph, 8, 8, planner=planner, stage_shardings=ZERO, memory_bytes=budget
  )
  without = graphpipe.plan(graph, 8, 8, planner=planner, memory_bytes=budget)
  assert plan_memory(graph, with_zero).largest <= budget
  assert time(with_zero) < 0.99 * time(without)


def _sharded(plan):
  return dataclasses.replace(
    plan,
    stages=tuple(
      dataclasses.replace(s, sharding="zero1") if len(s.devices) > 1 else s
      for s in plan.stages
    ),
  )


def test_the_simulator_splits_a_zero_stage_update_over_its_devices():
  graph = capture_zoo("two_branch", "paper")
  plan = graphpipe.plan(graph, 8, 8, stage_shardings=ZERO)
  replicated = dataclasses.replace(
    plan,
    stages=tuple(
      dataclasses.replace(s, sharding="replicated") for s in plan.stages
    ),
  )
  fast = graphpipe.simulate(plan, graph)
  slow = graphpipe.simulate(replicated, graph)
  assert fast.iteration_time_s <= slow.iteration_time_s
  for s in plan.stages:
    params = graph.variable_bytes(s.nodes)
    want = V100.optimizer_time(params / len(s.devices))
    got = [
      e.duration_s
      for e in fast.events
      if e.category == "optimizer" and e.device == s.devices[0]
    ]
    assert got == [pytest.approx(want)]


def test_bad_stage_shardings_are_refused():
  graph = capture_zoo("two_branch", "tiny")
  for bad in [("zero1",), ("replicated", "zero3"), (), 3]:
    with pytest.raises(PlanError, match="stage_shardings must list"):
      graphpipe.plan(graph, 2, 8, stage_shardings=bad)


def test_a_tied_embedding_held_by_two_zero_stages_trains_exactly():
  from flax import nnx

  from tests.graphpipe.test_shared_params import (
    TiedLM,
    check_trains_exactly,
    lm_batch,
    lm_loss,
  )

  model, batch = TiedLM(nnx.Rngs(0)), lm_batch()
  graph = graphpipe.capture(lm_loss, model, batch)
  n = len(graph.nodes)
  # The embedding's two readers in the first and last stages, both ZeRO:
  # its gradient parts are summed across the stages, then reduce-scattered.
  plan = _plan_of(
    graph,
    [
      ([0, 1, 2], [0, 1], "zero1"),
      (list(range(3, n - 2)), [2, 3], "replicated"),
      ([n - 2, n - 1], [4, 5], "zero1"),
    ],
    batch_size=len(batch["tokens"]),
  )
  trainer, state = check_trains_exactly(model, lm_loss, batch, graph, plan, SGD)
  # Both copies of the table stay bit-identical.
  key = "param:embed.embedding"
  rows = [np.asarray(x) for x in state.params]
  copies = []
  for s in (plan.stages[0], plan.stages[2]):
    slot, offset = trainer.buffers.params.places[s.id][key]
    size = trainer.buffers.params.lengths[key]
    copies.append(rows[slot][s.devices[1], offset : offset + size])
  np.testing.assert_array_equal(copies[0], copies[1])


def test_a_slot_chunk_is_the_padded_slot_cut_in_n():
  import jax.numpy as jnp

  from graphpipe.runtime.zero import _chunk

  for size in (1, 2, 3, 5, 7, 8, 9, 17):
    for n in (1, 2, 3, 4, 5):
      slot = np.arange(1, size + 1, dtype=np.float32)
      c = -(-size // n)
      want = np.pad(slot, (0, n * c - size)).reshape(n, c)
      for k in range(n):
        got = _chunk(jnp.asarray(slot), jnp.int32(k), n)
        np.testing.assert_array_equal(np.asarray(got), want[k])
