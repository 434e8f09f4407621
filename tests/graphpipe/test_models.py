"""Tests of the paper model zoo (graphpipe.models)."""

import collections
import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from graphpipe import models
from graphpipe.errors import GraphpipeError
from graphpipe.frontend import scopes
from graphpipe.models import candle_uno, dlrm, mmt, transformer, two_tower

ROOT = "<root>"


@functools.cache
def _abstract_paper_model(name):
  """The paper config's model, built once per test session, shapes only."""
  return models.build(name, models.config(name, "paper"), abstract=True)


def _split_loss(name, model):
  """loss(params, batch) over the split model, as capture and grad see it."""
  graphdef, params = nnx.split(model)
  loss_fn = models.get(name).loss_fn
  return graphdef, params, lambda p, b: loss_fn(nnx.merge(graphdef, p), b)


def _depth2_nodes(name, config) -> collections.Counter:
  """Equations per operator node when equations are grouped at depth 2."""
  spec = models.get(name)
  graphdef, params = nnx.split(models.build(name, config))

  def traced(p, b):
    model = nnx.merge(graphdef, p)
    with scopes.nnx_module_scopes(model):
      return spec.loss_fn(model, b)

  jaxpr = jax.make_jaxpr(traced)(params, spec.make_batch(config, 2))
  nodes = collections.Counter()
  for eqn in jaxpr.jaxpr.eqns:
    chain = scopes.module_chain(eqn.source_info.name_stack, "nnx")
    nodes[chain[: spec.capture_depth][-1] if chain else ROOT] += 1
  return nodes


def _expected_nodes(name, config) -> set[str]:
  """One node per layer of every branch and head, plus root glue."""

  def layers(prefix, count):
    return {f"{prefix}.layers.{i}" for i in range(count)}

  if name in ("mmt", "two_branch"):
    nodes = {"classifier"}
    for b in range(config.num_branches):
      nodes |= layers(f"branches.{b}", config.num_layers)
  elif name == "transformer":
    nodes = {"classifier"} | layers("encoder", config.num_layers)
  elif name == "dlrm":
    nodes = layers("top", config.top_layers + 1)
    for b in range(config.num_dense):
      nodes |= layers(f"dense.{b}", config.dense_layers)
    nodes |= {f"sparse.{b}" for b in range(config.num_sparse)}
  elif name == "candle_uno":
    nodes = layers("head", config.head_layers + 1)
    for b in range(config.num_branches):
      nodes |= layers(f"branches.{b}", config.branch_layers)
  else:
    # Each tower's own loss is the tower's glue (its path, depth 1).
    nodes = {"regression", "classification"}
    nodes |= layers("regression", config.tower_layers + 1)
    nodes |= layers("classification", config.tower_layers + 1)
  return nodes | {ROOT}


def test_registry_lists_every_model():
  assert models.NAMES == (
    "mmt",
    "dlrm",
    "candle_uno",
    "two_branch",
    "transformer",
    "two_tower",
  )
  for name in models.NAMES:
    spec = models.get(name)
    assert spec.name == name
    assert spec.capture_depth == 2
    assert spec.default_batch_size in (
      (8,) if name == "two_branch" else (64, 128)
    )
    assert isinstance(models.config(name, "paper"), spec.config_cls)
    assert isinstance(models.config(name, "tiny"), spec.config_cls)


@pytest.mark.parametrize("name", models.NAMES)
def test_tiny_model_loss_and_grad(name):
  spec = models.get(name)
  config = models.config(name, "tiny")
  batch = spec.make_batch(config, 4)
  abstract = spec.abstract_batch(config, 4)
  assert batch.keys() == abstract.keys()
  for key, array in batch.items():
    assert isinstance(array, np.ndarray)
    assert array.shape == abstract[key].shape
    assert array.dtype == abstract[key].dtype
    assert array.dtype in (np.float32, np.int32)

  model = models.build(name, config)
  # Parameters are the whole state (no RNG streams, no batch statistics),
  # so the loss is a pure function of parameters and batch.
  assert len(jax.tree.leaves(nnx.state(model))) == len(
    jax.tree.leaves(nnx.state(model, nnx.Param))
  )
  _, params, loss = _split_loss(name, model)
  value, grads = jax.jit(jax.value_and_grad(loss))(params, batch)
  assert value.shape == () and value.dtype == jnp.float32
  assert np.isfinite(value)
  grad_leaves = jax.tree.leaves(grads)
  assert len(grad_leaves) == len(jax.tree.leaves(params))
  assert all(bool(jnp.all(jnp.isfinite(g))) for g in grad_leaves)
  assert any(bool(jnp.any(g != 0)) for g in grad_leaves)


@pytest.mark.parametrize("name", models.NAMES)
def test_make_batch_is_deterministic_and_in_range(name):
  spec = models.get(name)
  config = models.config(name, "tiny")
  first, again = spec.make_batch(config, 3), spec.make_batch(config, 3)
  other = spec.make_batch(config, 3, seed=1)
  for key in first:
    np.testing.assert_array_equal(first[key], again[key])
  assert any(not np.array_equal(first[k], other[k]) for k in first)
  for array in first.values():
    assert array.shape[0] == 3
    if array.dtype == np.int32:
      assert array.min() >= 0
  for key in [k for k in first if k.startswith("sparse_")]:
    assert first[key].max() < config.table_rows
  if "labels" in first:
    bound = 2 if name == "dlrm" else config.num_classes
    assert first["labels"].max() < bound


@pytest.mark.parametrize("name", models.NAMES)
def test_paper_config_builds_abstractly(name):
  spec = models.get(name)
  config = models.config(name, "paper")
  model = _abstract_paper_model(name)
  leaves = jax.tree.leaves(nnx.state(model))
  assert leaves and all(isinstance(x, jax.ShapeDtypeStruct) for x in leaves)
  graphdef, state = nnx.split(model)
  out = jax.eval_shape(
    lambda s, b: spec.loss_fn(nnx.merge(graphdef, s), b),
    state,
    spec.abstract_batch(config, spec.default_batch_size),
  )
  assert out.shape == () and out.dtype == jnp.float32


def _linear(fan_in, fan_out):
  return fan_in * fan_out + fan_out


def _transformer_layer(hidden, ffn):
  norms = 2 * 2 * hidden
  attention = _linear(hidden, 3 * hidden) + _linear(hidden, hidden)
  return norms + attention + _linear(hidden, ffn) + _linear(ffn, hidden)


def test_paper_param_counts_match_hand_formulas():
  def count(name):
    return models.num_params(_abstract_paper_model(name))

  width = 4096
  branch = _linear(1024, width) + 3 * _linear(width, width)
  head = _linear(7 * width, width) + 2 * _linear(width, width)
  assert count("candle_uno") == 7 * branch + head + _linear(width, 1)
  assert count("candle_uno") == 532_807_681

  interaction = 7 * width + 7 * 64
  top = _linear(interaction, width) + 2 * _linear(width, width)
  tables = 7 * 1_000_000 * 64
  assert count("dlrm") == 7 * branch + tables + top + _linear(width, 1)
  assert count("dlrm") == 982_642_689

  layer = _transformer_layer(1024, 4096)
  assert layer == 12_596_224
  assert count("mmt") == 32 * layer + _linear(4 * 1024, 1000)
  assert count("two_branch") == 8 * layer + _linear(2 * 1024, 1000)
  assert count("transformer") == 16 * layer + _linear(1024, 1000)
  tower = _linear(1024, width) + 3 * _linear(width, width)
  assert count("two_tower") == (
    2 * tower + _linear(width, 1) + _linear(width, 1000)
  )


@pytest.mark.parametrize("name", models.NAMES)
def test_each_layer_is_one_node_at_capture_depth(name):
  config = models.config(name, "tiny")
  nodes = _depth2_nodes(name, config)
  assert set(nodes) == _expected_nodes(name, config)


def test_transformer_is_one_chain():
  nodes = list(_depth2_nodes("transformer", transformer.Config.tiny()))
  layers = [n for n in nodes if n.startswith("encoder.")]
  assert layers == [f"encoder.layers.{i}" for i in range(4)]


def test_branch_counts_are_honoured():
  cfg = dataclasses.replace(mmt.Config.tiny(), num_branches=3, num_layers=1)
  model = models.build("mmt", cfg, abstract=True)
  assert len(model.branches) == 3
  assert all(len(b.layers) == 1 for b in model.branches)
  batch = mmt.abstract_batch(cfg, 2)
  assert sorted(k for k in batch if k.startswith("modality_")) == [
    "modality_0",
    "modality_1",
    "modality_2",
  ]
  assert jax.eval_shape(mmt.loss_fn, model, batch).shape == ()

  cfg = dataclasses.replace(candle_uno.Config.tiny(), num_branches=16)
  model = models.build("candle_uno", cfg, abstract=True)
  assert len(model.branches) == 16
  batch = candle_uno.abstract_batch(cfg, 2)
  assert jax.eval_shape(candle_uno.loss_fn, model, batch).shape == ()

  cfg = dataclasses.replace(dlrm.Config.tiny(), num_dense=2, num_sparse=5)
  model = models.build("dlrm", cfg, abstract=True)
  assert (len(model.dense), len(model.sparse)) == (2, 5)
  assert model.top.layers[0].linear.kernel.shape[0] == 2 * 32 + 5 * 8
  batch = dlrm.abstract_batch(cfg, 2)
  assert jax.eval_shape(dlrm.loss_fn, model, batch).shape == ()

  cfg = dataclasses.replace(two_tower.Config.tiny(), tower_layers=2)
  model = models.build("two_tower", cfg, abstract=True)
  assert len(model.regression.layers) == len(model.classification.layers) == 3


def test_paper_sizes_are_the_papers():
  cfg = models.config("mmt", "paper")
  assert (cfg.num_branches, cfg.num_layers, cfg.seq_len) == (4, 8, 256)
  assert (cfg.hidden, cfg.num_heads, cfg.ffn) == (1024, 16, 4096)
  cfg = models.config("two_branch", "paper")
  assert (cfg.num_branches, cfg.num_layers, cfg.hidden) == (2, 4, 1024)
  cfg = models.config("dlrm", "paper")
  assert (cfg.num_dense, cfg.dense_layers, cfg.hidden) == (7, 4, 4096)
  assert (cfg.num_sparse, cfg.table_rows) == (7, 1_000_000)
  assert (cfg.embedding_dim, cfg.bag_size) == (64, 100)
  cfg = models.config("candle_uno", "paper")
  assert (cfg.num_branches, cfg.branch_layers, cfg.hidden) == (7, 4, 4096)


def test_unknown_names_and_bad_configs_raise():
  with pytest.raises(GraphpipeError, match="known models: mmt, dlrm"):
    models.get("resnet")
  with pytest.raises(GraphpipeError, match="unknown model"):
    models.config("resnet", "tiny")
  with pytest.raises(GraphpipeError, match="paper"):
    models.config("mmt", "huge")
  with pytest.raises(GraphpipeError, match="needs a"):
    models.build("dlrm", candle_uno.Config.tiny())
  with pytest.raises(GraphpipeError, match="num_branches"):
    mmt.Config(num_branches=0)
  with pytest.raises(GraphpipeError, match="num_heads"):
    transformer.Config(hidden=30, num_heads=4)
  model = models.build("mmt", mmt.Config.tiny())
  with pytest.raises(GraphpipeError, match="4 branches"):
    model([jnp.zeros((1, 8, 16))])
  # 0 is refused, not taken for the default (batch 8, the model's depth).
  with pytest.raises(GraphpipeError, match="batch_size must be >= 1"):
    models.capture_zoo("two_branch", "tiny", batch_size=0)
  with pytest.raises(GraphpipeError, match="batch_size must be an int"):
    models.capture_zoo("two_branch", "tiny", batch_size=2.5)
  with pytest.raises(GraphpipeError, match="depth >= 1, got 0"):
    models.capture_zoo("two_branch", "tiny", granularity=0)


def test_same_seed_same_weights():
  config = models.config("candle_uno", "tiny")
  first = nnx.state(models.build("candle_uno", config, seed=3), nnx.Param)
  again = nnx.state(models.build("candle_uno", config, seed=3), nnx.Param)
  other = nnx.state(models.build("candle_uno", config, seed=4), nnx.Param)
  leaves = zip(jax.tree.leaves(first), jax.tree.leaves(again), strict=True)
  assert all(np.array_equal(a, b) for a, b in leaves)
  assert not all(
    np.array_equal(a, b)
    for a, b in zip(jax.tree.leaves(first), jax.tree.leaves(other), strict=True)
  )


def test_abstract_builds_leave_tracer_errors_as_they_were(monkeypatch):
  # `models.build(abstract=True)` drops JAX's note from the AttributeError
  # of a traced value's `.sharding` while it builds (the note scans every
  # equation traced so far: quadratic); afterwards, and after a failing
  # build, the property is JAX's own again.
  original = jax.core.Tracer.__dict__["sharding"]
  models.build("two_branch", models.config("two_branch"), abstract=True)
  assert jax.core.Tracer.__dict__["sharding"] is original

  def fails(self, config, rngs):
    raise RuntimeError("the constructor failed")

  monkeypatch.setattr(models.get("two_branch").model_cls, "__init__", fails)
  with pytest.raises(RuntimeError, match="constructor failed"):
    models.build("two_branch", models.config("two_branch"), abstract=True)
  monkeypatch.undo()
  assert jax.core.Tracer.__dict__["sharding"] is original

  def probe(x):
    assert not hasattr(x, "sharding")
    with pytest.raises(AttributeError, match="not available on traced"):
      x.sharding  # noqa: B018
    return x

  jax.eval_shape(probe, jax.ShapeDtypeStruct((2,), jnp.float32))
