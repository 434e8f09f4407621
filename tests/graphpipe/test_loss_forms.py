"""Loss forms: each trains exactly under micro-batching or is refused,
naming the term (`graphpipe.frontend.loss_form`).

How a loss combines micro-batches is read from its program: sums over the
batch of per-sample terms (each micro-batch adds its part), data
statistics computed once over the whole batch (a token count), terms of
parameters alone (a penalty, added once), combined by a head run once per
step. Before 2026-12-03 the trainer weighted each micro-batch's loss by
its share of the batch: the usual token-weighted LM loss trained with
gradients 58-128% off, silently.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from hypothesis import given, settings
from hypothesis import strategies as st

import graphpipe
from graphpipe.errors import CaptureError, GraphpipeError, PipelineRuntimeError
from tests.graphpipe import runtime_cases as rc

BATCH = 8
CLASSES = 5


class Net(nnx.Module):
  def __init__(self, rngs):
    self.a = nnx.Linear(4, 8, rngs=rngs)
    self.b = nnx.Linear(8, 8, rngs=rngs)
    self.c = nnx.Linear(8, CLASSES, rngs=rngs)

  def __call__(self, x):
    return self.c(jnp.tanh(self.b(jnp.tanh(self.a(x)))))


class WithAux(nnx.Module):
  """A layer that returns a scalar auxiliary loss (a mixture-of-experts
  balance term) beside its output."""

  def __init__(self, rngs):
    self.a = nnx.Linear(4, 8, rngs=rngs)
    self.b = nnx.Linear(8, 8, rngs=rngs)
    self.c = nnx.Linear(8, CLASSES, rngs=rngs)

  def __call__(self, x):
    h = jnp.tanh(self.a(x))
    return self.c(jnp.tanh(self.b(h))), jnp.mean(h**2)


def make_batch(seed=0):
  rng = np.random.default_rng(seed)
  w = (rng.random(BATCH) > 0.3).astype(np.float32)
  w[:4] = 0.0  # the first micro-batch is all padding
  w[-1] = 1.0
  return {
    "x": rng.standard_normal((BATCH, 4)).astype(np.float32),
    "y": rng.integers(0, CLASSES, BATCH).astype(np.int32),
    "w": w,
    "t": rng.standard_normal(BATCH).astype(np.float32),
  }


def ce(m, b, h=None):
  h = m(b["x"]) if h is None else h
  return optax.softmax_cross_entropy_with_integer_labels(h, b["y"])


def with_h(loss):
  """A loss of the model's output `h` (the model runs once: two calls
  would read every parameter twice and merge all layers into one node)."""
  return lambda m, b: loss(m(b["x"]), m, b)


def params_of(m):
  return jax.tree.leaves(nnx.state(m, nnx.Param))


def plan_of(graph, groups, micro_batch):
  return rc.manual_plan(graph, groups, micro_batch, BATCH)


def rest(graph):
  return list(range(2, len(graph.nodes)))


def split_plan(graph):
  """Two micro-batches of 4; the middle stage data-parallel (chunks of 2):
  every way the runtime splits a batch."""
  return plan_of(graph, [([0], [0]), ([1], [1, 2]), (rest(graph), [3])], 4)


def whole_plan(graph):
  return plan_of(graph, [([0], [0]), ([1], [1]), (rest(graph), [2])], BATCH)


def reference(model, loss, batch):
  graphdef, params, rest = nnx.split(model, nnx.Param, ...)
  value, grads = jax.value_and_grad(
    lambda p: loss(nnx.merge(graphdef, p, rest), batch)
  )(params)
  return float(value), nnx.merge(graphdef, grads, rest)


def assert_exact(trainer, graph, model, loss, batch):
  got, grads = trainer.loss_and_grads(trainer.init(model), batch)
  want, want_model = reference(model, loss, batch)
  want_grads = graph.program.variable_values(want_model)
  assert got == pytest.approx(want, rel=1e-5, abs=1e-6)
  for key, value in grads.items():
    w = np.asarray(want_grads[key])
    err = np.max(np.abs(np.asarray(value) - w)) / (np.max(np.abs(w)) + 1e-12)
    assert err < 1e-5, (key, err)


# (name, model class, loss) of forms that micro-batch exactly.
EXACT = [
  ("mean", Net, lambda m, b: jnp.mean(ce(m, b))),
  ("sum", Net, lambda m, b: jnp.sum(ce(m, b))),
  (
    "token-weighted mean, a micro-batch all padding",
    Net,
    lambda m, b: jnp.sum(ce(m, b) * b["w"]) / jnp.sum(b["w"]),
  ),
  (
    "masked mean with a floor on the count",
    Net,
    lambda m, b: (
      jnp.sum(jnp.where(b["w"] > 0, ce(m, b), 0.0))
      / jnp.maximum(jnp.sum(b["w"] > 0), 1)
    ),
  ),
  (
    "mask derived from a float input",
    Net,
    lambda m, b: (
      jnp.sum(jnp.where(b["t"] > 0, ce(m, b), 0.0))
      / jnp.maximum(jnp.sum(b["t"] > 0), 1)
    ),
  ),
  (
    "mean plus a summed term (a VAE's KL)",
    Net,
    with_h(lambda h, m, b: jnp.mean(ce(m, b, h)) + 0.01 * jnp.sum(h**2)),
  ),
  (
    "L2 penalty over every parameter",
    Net,
    lambda m, b: (
      jnp.mean(ce(m, b)) + 1e-2 * sum(jnp.sum(p**2) for p in params_of(m))
    ),
  ),
  (
    "a global norm of the parameters",
    Net,
    lambda m, b: jnp.mean(ce(m, b)) + 0.1 * optax.global_norm(params_of(m)),
  ),
  ("a constant added", Net, lambda m, b: jnp.mean(ce(m, b)) + 1.0),
  (
    "per-sample weights normalised by a constant",
    Net,
    lambda m, b: jnp.mean(jnp.abs(b["t"]) * ce(m, b)),
  ),
  ("log of a mean (scaled)", Net, lambda m, b: jnp.log(jnp.mean(ce(m, b)))),
  (
    "two heads' losses summed",
    Net,
    with_h(
      lambda h, m, b: jnp.mean(ce(m, b, h)) + jnp.mean((h[:, 0] - b["t"]) ** 2)
    ),
  ),
  (
    "inputs normalised by the batch's statistics",
    Net,
    lambda m, b: jnp.mean(
      m((b["x"] - b["x"].mean(0)) / (b["x"].std(0) + 1e-3)) ** 2
    ),
  ),
  (
    "weights normalised by the batch's largest",
    Net,
    lambda m, b: jnp.sum(ce(m, b) * jnp.abs(b["t"]) / jnp.max(jnp.abs(b["t"]))),
  ),
  (
    "a time-major value summed",
    Net,
    lambda m, b: jnp.sum(jnp.tanh(m(b["x"]).T.reshape(-1))) / BATCH,
  ),
  (
    "the mean of per-position means",
    Net,
    lambda m, b: jnp.mean(jnp.mean(m(b["x"]) ** 2, axis=0)),
  ),
  (
    "an auxiliary loss a layer returns",
    WithAux,
    with_h(lambda h, m, b: jnp.mean((h[0][:, 0] - b["t"]) ** 2) + 0.1 * h[1]),
  ),
  (
    "a parameter scaling the loss",
    Net,
    lambda m, b: jnp.mean(ce(m, b)) * jnp.exp(jnp.sum(m.c.bias[...])),
  ),
]

# (name, loss, what the refusal names) of forms exact only on the whole
# batch at once: refused for plans that split it, exact for one that does
# not.
WHOLE_BATCH_ONLY = [
  ("max over the batch", lambda m, b: jnp.max(ce(m, b)), "reduce_max"),
  (
    "contrastive across samples",
    with_h(
      lambda h, m, b: -jnp.mean(jnp.diag(jax.nn.log_softmax(h @ h.T, axis=-1)))
    ),
    "every sample",
  ),
  (
    "outputs normalised by the batch's statistics",
    with_h(
      lambda h, m, b: jnp.mean(
        ((h - h.mean(0)) / (h.std(0) + 1e-3))[:, 0] * b["t"] + h[:, 1] ** 2
      )
    ),
    "batch statistic",
  ),
  (
    "the hardest half of the samples",
    lambda m, b: jnp.mean(jnp.sort(ce(m, b))[BATCH // 2 :]),
    "sort",
  ),
  (
    "a per-sample value divided by the batch size",
    lambda m, b: jnp.sum(ce(m, b) / b["x"].shape[0]),
    "batch size",
  ),
  (
    "indexing with the batch's positions",
    lambda m, b: (
      -jnp.mean(
        jax.nn.log_softmax(m(b["x"]))[jnp.arange(b["y"].shape[0]), b["y"]]
      )
    ),
    "take_along_axis",
  ),
]


@pytest.mark.parametrize("name, module, loss", EXACT, ids=[e[0] for e in EXACT])
def test_loss_forms_train_exactly_when_split(name, module, loss):
  model, batch = module(nnx.Rngs(0)), make_batch()
  graph = graphpipe.capture(loss, model, batch)
  assert [n.name for n in graph.nodes][:3] == ["a", "b", "c"]
  assert graph.program.form.unsplittable is None
  trainer = graphpipe.Trainer(split_plan(graph), optax.sgd(0.1), graph=graph)
  assert_exact(trainer, graph, model, loss, batch)


@pytest.mark.parametrize(
  "name, loss, term", WHOLE_BATCH_ONLY, ids=[e[0] for e in WHOLE_BATCH_ONLY]
)
def test_loss_forms_of_the_whole_batch_are_refused_when_split(name, loss, term):
  model, batch = Net(nnx.Rngs(0)), make_batch()
  graph = graphpipe.capture(loss, model, batch)
  assert term in graph.program.form.unsplittable
  with pytest.raises(PipelineRuntimeError, match="whole batch") as info:
    graphpipe.Trainer(split_plan(graph), optax.sgd(0.1), graph=graph)
  assert term in str(info.value)
  assert "test_loss_forms.py" in str(info.value)  # the line that wrote it
  trainer = graphpipe.Trainer(whole_plan(graph), optax.sgd(0.1), graph=graph)
  assert_exact(trainer, graph, model, loss, batch)


def test_two_views_stacked_along_the_batch_sum_exactly_per_micro_batch():
  # Each sample's two views sit B rows apart: summed, any micro-batch
  # adds its samples' part; cut into replicas' rows they are not one
  # block, which the layout refuses (values that cross stages re-chunked).
  def loss(m, b):
    return jnp.mean(m(jnp.concatenate([b["x"], 2 * b["x"] + 1])) ** 2)

  model, batch = Net(nnx.Rngs(0)), make_batch()
  graph = graphpipe.capture(loss, model, batch)
  assert graph.program.form.unsplittable is None
  micro = plan_of(graph, [([0], [0]), ([1], [1]), ([2], [2])], 2)
  trainer = graphpipe.Trainer(micro, optax.sgd(0.1), graph=graph)
  assert_exact(trainer, graph, model, loss, batch)
  with pytest.raises(PipelineRuntimeError, match="rows together"):
    graphpipe.Trainer(split_plan(graph), optax.sgd(0.1), graph=graph)


def test_several_sums_under_a_nonlinear_head_are_refused_at_capture():
  def loss(m, b):  # the batch's mean times its mean square: no seed first
    h = m(b["x"])
    return jnp.mean(h) * jnp.mean(h**2)

  with pytest.raises(CaptureError, match="non-linearly.*reduce_sum"):
    graphpipe.capture(loss, Net(nnx.Rngs(0)), make_batch())

  def ratio(m, b):  # a ratio of two parameter-dependent sums
    h = m(b["x"])
    return jnp.sum(h[:, 0] ** 2 * b["w"]) / jnp.sum(jnp.abs(h))

  with pytest.raises(CaptureError, match="non-linearly.*reduce_sum"):
    graphpipe.capture(ratio, Net(nnx.Rngs(0)), make_batch())


def test_the_form_is_printed_with_the_graph():
  loss = EXACT[2][2]
  graph = graphpipe.capture(loss, Net(nnx.Rngs(0)), make_batch())
  assert graph.loss_form == (
    "loss = head(1 sum over the batch, 1 data statistic), affine; "
    "micro-batches add their sums"
  )


# Random losses composed from these pieces: accepted means exact, refused
# means a clear error naming the term, never silently wrong.
PIECES = {
  "mean": lambda h, m, b: jnp.mean(ce(m, b, h)),
  "token_mean": lambda h, m, b: jnp.sum(ce(m, b, h) * b["w"]) / jnp.sum(b["w"]),
  "sum_sq": lambda h, m, b: jnp.sum(h**2),
  "penalty": lambda h, m, b: sum(jnp.sum(p**2) for p in params_of(m)),
  "constant": lambda h, m, b: jnp.float32(0.5),
  "log_mean": lambda h, m, b: jnp.log(jnp.mean(ce(m, b, h))),
  "max": lambda h, m, b: jnp.max(ce(m, b, h)),
  "contrastive": lambda h, m, b: jnp.mean(h @ h.T),
}
SUMS = {"mean", "token_mean", "sum_sq", "log_mean", "max", "contrastive"}


@settings(max_examples=8, deadline=None)
@given(
  pieces=st.lists(
    st.tuples(st.sampled_from(sorted(PIECES)), st.floats(0.1, 2.0)),
    min_size=1,
    max_size=3,
    unique_by=lambda t: t[0],
  ),
  split=st.booleans(),
)
def test_random_losses_are_exact_or_refused(pieces, split):
  def loss(m, b):
    h = m(b["x"])
    return sum(c * PIECES[name](h, m, b) for name, c in pieces)

  names = {name for name, _ in pieces}
  model, batch = Net(nnx.Rngs(0)), make_batch()
  if not names & SUMS:
    with pytest.raises(CaptureError, match="does not depend"):
      graphpipe.capture(loss, model, batch)
    return
  if "log_mean" in names and len(names & SUMS) > 1:
    with pytest.raises(CaptureError, match="non-linearly"):
      graphpipe.capture(loss, model, batch)
    return
  graph = graphpipe.capture(loss, model, batch)
  plan = (split_plan if split else whole_plan)(graph)
  if split and names & {"max", "contrastive"}:
    with pytest.raises(GraphpipeError, match="whole batch"):
      graphpipe.Trainer(plan, optax.sgd(0.1), graph=graph)
    return
  trainer = graphpipe.Trainer(plan, optax.sgd(0.1), graph=graph)
  assert_exact(trainer, graph, model, loss, batch)
