"""Embedding tables split by rows (`capture(..., split_layers=...)`,
`graphpipe.frontend.split_rows`): each part's lookup its own node, the
lookups summed, planned as branches and trained like the unsplit model."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import graphpipe
from graphpipe.core.memory import KINDS, plan_memory
from graphpipe.errors import CaptureError, PlanError
from graphpipe.models import dlrm
from graphpipe.planning.no_plan import memory_floor
from tests.graphpipe import test_scanned_stacks as lm
from tests.graphpipe.test_split_layers import check_training

BATCH = 8
ROWS = 11


class Lookups(nnx.Module):
  """Two tables looked up three ways: `nnx.Embed` (a "fill" gather inside
  a jit), plain indexing (a "promise_in_bounds" gather) and `jnp.take`
  with mode "clip"."""

  def __init__(self, rngs, rows=ROWS):
    self.embed = nnx.Embed(rows, 6, rngs=rngs)
    self.table = nnx.Param(jax.random.normal(rngs.params(), (9, 6)))
    self.clipped = nnx.Param(jax.random.normal(rngs.params(), (7, 6)))
    self.out = nnx.Linear(6, 1, rngs=rngs)

  def __call__(self, tokens, other):
    x = self.embed(tokens).sum(1)
    x = x + self.table[...][other].mean(1)
    x = x + jnp.take(self.clipped[...], other, axis=0, mode="clip").sum(1)
    return self.out(jax.nn.relu(x))


def loss(model, batch):
  return jnp.mean((model(batch["t"], batch["o"]) - batch["y"]) ** 2)


def tokens(seed=0, low=0, batch=BATCH):
  rng = np.random.default_rng(seed)
  return {
    "t": rng.integers(0, ROWS, (batch, 3)).astype(np.int32),
    "o": rng.integers(low, 9, (batch, 4)).astype(np.int32),
    "y": rng.standard_normal((batch, 1)).astype(np.float32),
  }


SPLIT = {"embed": 3, "table": 2, "clipped": 4}


def test_a_split_table_is_one_lookup_node_per_part_and_the_same_loss():
  model, batch = Lookups(nnx.Rngs(0)), tokens()
  graph = graphpipe.capture(loss, model, batch, split_layers=SPLIT)
  names = [n.name for n in graph.nodes]
  # (The sum, parameter-free, joins the code after it: `grouping`.)
  assert names[:3] == ["embed#0of3", "embed#1of3", "embed#2of3"]
  parts = [graph.nodes[names.index(f"embed#{i}of3")] for i in range(3)]
  assert [list(p.params) for p in parts] == [
    [f"embed.embedding#{i}of3"] for i in range(3)
  ]
  values = graph.program.variable_values(model)
  assert [values[f"param:embed.embedding#{i}of3"].shape for i in range(3)] == [
    (4, 6),
    (4, 6),
    (3, 6),
  ]
  assert graph.meta["split_layers"] == {
    "embed.embedding": 3,
    "table": 2,
    "clipped": 4,
  }
  assert float(graph.evaluate(model, batch)) == pytest.approx(
    float(loss(model, batch)), rel=1e-6
  )
  joined = graph.program.unflatten_params(values)
  np.testing.assert_array_equal(
    np.asarray(joined["embed"]["embedding"][...]),
    np.asarray(model.embed.embedding[...]),
  )


@pytest.mark.parametrize("planner", ["graphpipe", "sequential"])
def test_split_tables_train_exactly(planner):
  model, batch = Lookups(nnx.Rngs(1)), tokens(1)
  graph = graphpipe.capture(loss, model, batch, split_layers=SPLIT)
  plan = graphpipe.tightest_plan(graph, 8, BATCH, planner=planner)
  assert len(plan.stages) >= 3
  check_training(model, batch, graph, plan, loss=loss)


def test_indices_outside_the_table_keep_the_lookups_rule():
  """Negative indices wrap (indexing and take normalise them); beyond the
  table, indexing and "clip" clamp to the last row and `nnx.Embed`'s
  "fill" gather gives NaN, split or not."""
  model = Lookups(nnx.Rngs(2))
  batch = tokens(2, low=-9)
  batch["o"][0, :2] = [9, 40]  # past the tables' 9 and 7 rows
  graph = graphpipe.capture(loss, model, batch, split_layers=SPLIT)
  plan = graphpipe.tightest_plan(graph, 4, BATCH)
  check_training(model, batch, graph, plan, loss=loss)
  batch["t"][1, 0] = ROWS + 2  # nnx.Embed: NaN
  assert np.isnan(float(loss(model, batch)))
  assert np.isnan(float(graph.evaluate(model, batch)))


def test_a_table_larger_than_a_device_plans_once_split():
  """The table alone needs twice the per-device budget: unsplit no plan
  fits; in 4 row ranges it plans, no device holding the whole table, and
  trains like the unsplit model."""
  model, batch = Lookups(nnx.Rngs(3), rows=4000), tokens(3)
  whole = graphpipe.capture(loss, model, batch)
  floor, heaviest = memory_floor(whole)
  assert heaviest == "embed"
  with pytest.raises(PlanError, match="node 'embed' alone"):
    graphpipe.plan(whole, 8, BATCH, memory_bytes=floor / 2)
  split = graphpipe.capture(loss, model, batch, split_layers={"embed": 4})
  plan = graphpipe.plan(split, 8, BATCH, memory_bytes=floor / 2)
  table = [n for n in whole.nodes if n.name == "embed"][0]
  assert plan_memory(split, plan).largest_of(KINDS) <= floor / 2
  assert plan_memory(split, plan).largest_of(("parameters",)) < (
    table.param_bytes / 2
  )
  check_training(model, batch, split, plan, loss=loss)


def test_dlrm_tables_split_train_exactly():
  """Each part sums its rows of the bag (`split_rows.summed_after`): it
  sends a row per sample, not the bag's rows."""
  config = dlrm.Config.tiny()
  model = dlrm.Model(config, rngs=nnx.Rngs(4))
  batch = dlrm.make_batch(config, batch_size=BATCH)
  graph = graphpipe.capture(
    dlrm.loss_fn,
    model,
    batch,
    split_layers={f"sparse.{j}": 2 for j in range(config.num_sparse)},
  )
  parts = [n for n in graph.nodes if "#" in n.name]
  assert len(parts) == 2 * config.num_sparse
  sent = {e.bytes for e in graph.edges if graph.nodes[e.src] in parts}
  assert sent == {4 * config.embedding_dim}  # a float32 row per sample
  plan = graphpipe.tightest_plan(graph, 8, BATCH)
  check_training(model, batch, graph, plan, loss=dlrm.loss_fn)


class Columns(nnx.Module):
  def __init__(self, rngs):
    self.table = nnx.Param(jax.random.normal(rngs.params(), (5, 6)))

  def __call__(self, tokens, other):
    # Columns of the table, not rows; then rows of a computed table.
    x = self.table[...][:, other[:, 0] % 6].sum()
    return x + (2 * self.table[...])[tokens].sum()


@pytest.mark.parametrize(
  "split, message",
  [
    ({"table": 2}, "does not take whole rows|it is read by"),
    ({"embed": ROWS + 1}, f"only {ROWS} rows"),
  ],
)
def test_lookups_that_cannot_split_are_refused_with_the_reason(split, message):
  module = Columns(nnx.Rngs(0)) if "table" in split else Lookups(nnx.Rngs(0))
  with pytest.raises(CaptureError, match=message):
    graphpipe.capture(
      lambda m, b: jnp.mean(m(b["t"], b["o"])),
      module,
      tokens(),
      split_layers=split,
    )


class VocabParallelLM(lm.LLM):
  """The decoder LM of test_scanned_stacks (GQA, a scanned stack, the
  token-weighted loss with padding) with an untied output head: both ends
  split by the vocabulary (Megatron's vocabulary-parallel embedding and
  output layer)."""

  def __init__(self, layers, rngs):
    super().__init__(layers, rngs)
    self.head = nnx.Linear(lm.DIM, lm.VOCAB, use_bias=False, rngs=rngs)

  def __call__(self, tokens):
    x = self.embed(tokens)

    @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)
    def run(x, layer):
      return layer(x)

    return self.head(self.norm(run(x, self.layers)))


@pytest.mark.parametrize("planner", ["graphpipe", "sequential"])
def test_a_vocabulary_parallel_lm_trains_exactly(planner):
  model, batch = VocabParallelLM(3, nnx.Rngs(5)), lm.lm_batch()
  graph = graphpipe.capture(
    lm.lm_loss, model, batch, split_layers={"embed": 4, "head": 2}
  )
  names = [n.name for n in graph.nodes]
  assert {"embed#3of4", "head#1of2"} <= set(names)
  plan = graphpipe.tightest_plan(graph, 8, lm.BATCH, planner=planner)
  lm.check(model, lm.lm_loss, batch, graph, plan)


class TwiceRead(nnx.Module):
  """The lookup's rows read by a sum and by a slice: the sum cannot move
  into the parts (`split_rows.summed_after`), the rows are sent."""

  def __init__(self, rngs):
    self.embed = nnx.Embed(ROWS, 6, rngs=rngs)
    self.out = nnx.Linear(6, 1, rngs=rngs)

  def __call__(self, tokens, other):
    rows = self.embed(tokens)
    return self.out(jnp.tanh(rows.sum(1) + rows[:, 0]))


def test_a_lookup_read_twice_sends_its_rows():
  model, batch = TwiceRead(nnx.Rngs(7)), tokens(7)
  graph = graphpipe.capture(loss, model, batch, split_layers={"embed": 2})
  parts = [n for n in graph.nodes if "#" in n.name]
  sent = {e.bytes for e in graph.edges if graph.nodes[e.src] in parts}
  assert sent == {4 * 6 * batch["t"].shape[1]}  # every row of the bag
  plan = graphpipe.tightest_plan(graph, 4, BATCH)
  check_training(model, batch, graph, plan, loss=loss)
