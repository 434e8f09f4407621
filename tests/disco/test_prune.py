"""Channel selection: exact ratios, masks only shrink, dropped is dropped."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from disco import metrics, prune
from disco.errors import DiscoError, PruneError
from disco.layers import DiscoConv, DiscoDense
from disco.models import ResNet, ResNetConfig
from tests.disco.util import normal


class TwoLayers(nnx.Module):
  """Two dense layers over 2 nodes: 10 + 12 channel groups."""

  def __init__(self, seed=0):
    rngs = nnx.Rngs(seed)
    self.first = DiscoDense(10, 12, num_nodes=2, rngs=rngs)
    self.second = DiscoDense(12, 4, num_nodes=2, rngs=rngs)

  def __call__(self, x):
    return self.second(jax.nn.relu(self.first(x)))


def _kept(model):
  return [group.kept().copy() for group in prune.mask_groups(model)]


@pytest.mark.parametrize("selection", ["magnitude", "random"])
def test_layer_budget_reaches_the_ratio_exactly(selection):
  model = TwoLayers()
  prune.to_ratio(model, 0.5, selection=selection)
  # half of 10 and of 12 groups
  assert [int(k.sum()) for k in _kept(model)] == [5, 6]
  assert prune.comm_ratio(model) == 0.5


def test_global_budget_reaches_the_ratio_exactly():
  model = TwoLayers()
  # Three strong cross columns in the first layer (channels 5-7 into node
  # 0), the second layer's columns all alike: scores are relative to each
  # layer's RMS, so the three win and two of the second layer follow.
  first = np.full((10, 12), 0.01, np.float32)
  first[5:8, :6] = 10.0
  model.first.kernel[...] = jnp.asarray(first)
  model.second.kernel[...] = jnp.ones((12, 4))
  prune.to_ratio(model, 0.25, budget="global")
  assert [int(k.sum()) for k in _kept(model)] == [3, 2]  # floor(0.25 x 22)
  assert np.asarray(model.first.mask[...])[0, 5:8].all()


def test_ratio_is_floored_so_bytes_never_exceed_it():
  model = ResNet(ResNetConfig(num_nodes=2), rngs=nnx.Rngs(0))
  prune.to_ratio(model, 0.2)
  costs = metrics.compare(model)
  assert costs["disco"]["bytes_sent"] <= 0.2 * costs["dense"]["bytes_sent"]
  assert prune.comm_ratio(model) <= 0.2


def test_magnitude_keeps_the_largest_columns():
  layer = DiscoDense(4, 2, num_nodes=2, rngs=nnx.Rngs(0))
  kernel = np.full((4, 2), 0.1, np.float32)
  kernel[3, 0] = 5.0  # column of channel 3 (node 1's) into node 0
  kernel[0, 1] = 3.0  # column of channel 0 (node 0's) into node 1
  layer.kernel[...] = jnp.asarray(kernel)
  prune.to_ratio(layer, 0.5)
  np.testing.assert_array_equal(
    np.asarray(layer.mask[...]), [[1, 1, 0, 1], [1, 0, 1, 1]]
  )


def test_masks_only_shrink_and_dropped_columns_stay_dropped():
  model = TwoLayers()
  schedule = prune.GradualSchedule(0.2, steps=40, every=5)
  before = _kept(model)
  for step in range(1, 41):
    # Training changes the weights between prunings; a dropped column that
    # grows large must still not come back.
    for group in prune.mask_groups(model):
      for layer in group.layers:
        noise = normal(step, layer.kernel.shape)
        layer.kernel[...] = layer.kernel[...] + 0.5 * noise
    if schedule.due(step):
      schedule.apply(model, step)
      after = _kept(model)
      for old, new in zip(before, after, strict=True):
        assert not (new & ~old).any()
      before = after
  assert [int(k.sum()) for k in before] == [2, 2]


def test_output_ignores_weights_of_dropped_columns():
  layer = DiscoConv(6, 4, 3, num_nodes=2, rngs=nnx.Rngs(0))
  prune.to_ratio(layer, 1 / 3)
  x = normal(1, (1, 5, 5, 6))
  y = layer(x)
  dropped = ~np.asarray(layer.reads())[layer.out_split.owner()].T  # (in, out)
  assert dropped.any()
  noise = normal(2, layer.kernel.shape)
  layer.kernel[...] = layer.kernel[...] + 100 * noise * dropped
  np.testing.assert_allclose(layer(x), y, rtol=1e-6)


def test_cubic_schedule():
  schedule = prune.GradualSchedule(0.2, steps=10, every=4)
  assert schedule.ratio_at(0) == 1.0
  assert schedule.ratio_at(10) == pytest.approx(0.2)
  assert schedule.ratio_at(5) == pytest.approx(0.2 + 0.8 * 0.125)
  assert [s for s in range(15) if schedule.due(s)] == [4, 8, 10]


def test_random_selection_depends_on_the_seed_only():
  a, b, c = TwoLayers(), TwoLayers(), TwoLayers()
  prune.to_ratio(a, 0.3, selection="random", seed=1)
  prune.to_ratio(b, 0.3, selection="random", seed=1)
  prune.to_ratio(c, 0.3, selection="random", seed=2)
  assert all((x == y).all() for x, y in zip(_kept(a), _kept(b), strict=True))
  assert any((x != y).any() for x, y in zip(_kept(a), _kept(c), strict=True))


@pytest.mark.parametrize("ratio", [-0.1, 1.5, float("nan"), "0.2"])
def test_ratio_outside_0_1_is_refused(ratio):
  with pytest.raises(PruneError, match=r"\[0, 1\]"):
    prune.to_ratio(TwoLayers(), ratio)
  with pytest.raises(DiscoError):
    prune.GradualSchedule(ratio, steps=10)


def test_growing_masks_and_unknown_options_are_refused():
  model = TwoLayers()
  prune.to_ratio(model, 0.2)
  with pytest.raises(PruneError, match="only shrink"):
    prune.to_ratio(model, 0.5)
  with pytest.raises(PruneError, match="selection"):
    prune.to_ratio(model, 0.1, selection="learned")


def _group_bytes_sent(model):
  """Bytes the channel groups send (all traffic minus what no mask can
  remove: the outputs gathered to node 0, LayerNorm statistics)."""
  fixed = metrics.count(metrics.with_masks(model, False)).bytes_sent
  return metrics.count(model).bytes_sent - fixed


def _zoo(name, nodes):
  from disco.models.deeplab import DeepLab, SegConfig
  from disco.models.esrgan import SRConfig, SRNet
  from disco.models.ssd import SSD, SSDConfig
  from disco.models.vit import ViT, ViTConfig

  build, config = {
    "resnet": (ResNet, ResNetConfig),
    "vit": (ViT, ViTConfig),
    "deeplab": (DeepLab, SegConfig),
    "ssd": (SSD, SSDConfig),
    "srnet": (SRNet, SRConfig),
  }[name]
  return build(config(num_nodes=nodes), rngs=nnx.Rngs(0))


@pytest.mark.parametrize(
  "name, nodes",
  [("resnet", 4), ("vit", 2), ("deeplab", 2), ("ssd", 4), ("srnet", 2)],
)
def test_group_bytes_are_what_the_masks_send(name, nodes):
  # Each group's bytes summed are the traffic the masks control, and the
  # groups one mask keeps send their bytes (shared tensors counted once).
  model = _zoo(name, nodes)
  costs = metrics.group_bytes(model)
  assert sum(int(c.sum()) for c in costs) == _group_bytes_sent(model)
  prune.to_ratio(model, 0.3, budget="bytes", group_bytes=costs)
  kept = sum(
    int(c[g.kept()].sum())
    for c, g in zip(costs, prune.mask_groups(model), strict=True)
  )
  assert kept == _group_bytes_sent(model)


@pytest.mark.parametrize("selection", ["magnitude", "random"])
def test_bytes_budget_spends_the_ratio_of_the_bytes_as_ratios_fall(selection):
  model = ResNet(ResNetConfig(num_nodes=2), rngs=nnx.Rngs(0))
  costs = metrics.group_bytes(model)
  total = sum(int(c.sum()) for c in costs)
  largest = max(int(c.max()) for c in costs)

  def sent():
    groups = prune.mask_groups(model)
    return sum(
      int(c[g.kept()].sum()) for c, g in zip(costs, groups, strict=True)
    )

  # A falling sequence, as a gradual schedule prunes: never refused, never
  # over the ratio, and short of it by less than one group.
  for ratio in np.linspace(1.0, 0.02, 25):
    prune.to_ratio(
      model,
      ratio,
      budget="bytes",
      selection=selection,
      seed=3,
      group_bytes=costs,
    )
    assert ratio * total - largest < sent() <= ratio * total
  assert sent() == _group_bytes_sent(model)  # what metrics.count counts
  with pytest.raises(PruneError, match="only shrink"):
    prune.to_ratio(model, 0.5, budget="bytes", selection=selection)


def test_bytes_budget_ranks_by_score_per_byte():
  model = TwoLayers()
  # Groups of the first mask cost 10 bytes and score 5, the second's cost
  # 1 and score 1: per byte the second's win. r = 0.25 of 112 bytes: the
  # 12 cheap groups, then one of the first (22 bytes; a second would
  # make 32).
  crosses = [g.cross for g in prune.mask_groups(model)]
  costs = [np.where(crosses[0], 10, 0), np.where(crosses[1], 1, 0)]
  scores = [5.0 * crosses[0], 1.0 * crosses[1]]
  prune.to_ratio(
    model,
    0.25,
    budget="bytes",
    selection="saliency",
    saliency=scores,
    group_bytes=costs,
  )
  assert [int(k.sum()) for k in _kept(model)] == [1, 12]
  # The global budget counts groups: 5 of 22, the highest scores, all in
  # the first mask (50 bytes, twice the ratio's).
  other = TwoLayers()
  prune.to_ratio(
    other, 0.25, budget="global", selection="saliency", saliency=scores
  )
  assert [int(k.sum()) for k in _kept(other)] == [5, 0]
  # Random selection draws the groups regardless of their bytes, within
  # them; the same seed draws the same.
  draws = []
  for _ in range(2):
    model = TwoLayers()
    prune.to_ratio(
      model, 0.25, budget="bytes", selection="random", seed=5, group_bytes=costs
    )
    kept = _kept(model)
    assert 10 * kept[0].sum() + kept[1].sum() <= 28
    draws.append(kept)
  for first, second in zip(*draws, strict=True):
    np.testing.assert_array_equal(first, second)


def _schedule_random(seed, anchored, final=0.15, steps=12):
  """TwoLayers pruned by random selection under the bytes budget along a
  gradual schedule (first mask's groups 10 bytes, the second's 1: 112 in
  all); `anchored`: as `GradualSchedule.apply` prunes (the final choice
  first), else each pruning choosing afresh. (bytes kept, masks)."""
  model = TwoLayers()
  crosses = [g.cross for g in prune.mask_groups(model)]
  costs = [np.where(crosses[0], 10, 0), np.where(crosses[1], 1, 0)]
  schedule = prune.GradualSchedule(
    target_ratio=final,
    steps=steps,
    every=1,
    budget="bytes",
    selection="random",
    seed=seed,
  )
  for step in range(1, steps + 1):
    if anchored:
      schedule.apply(model, step, group_bytes=costs)
    else:
      prune.to_ratio(
        model,
        schedule.ratio_at(step),
        budget="bytes",
        selection="random",
        seed=seed,
        group_bytes=costs,
      )
    kept = _kept(model)
    assert 10 * kept[0].sum() + kept[1].sum() <= schedule.ratio_at(step) * 112
  return int(10 * kept[0].sum() + kept[1].sum()), kept


@pytest.mark.parametrize("seed", range(4))
def test_random_bytes_budget_ends_with_the_random_choice_at_its_ratio(seed):
  # The random arm of a comparison must send the bytes the selection it
  # is compared with sends: a schedule's random pruning ends with exactly
  # the random choice made at the final ratio from every group, which
  # fills 0.15 x 112 = 16.8 bytes to 16 (within one group).
  sent, kept = _schedule_random(seed, anchored=True)
  once = TwoLayers()
  crosses = [g.cross for g in prune.mask_groups(once)]
  costs = [np.where(crosses[0], 10, 0), np.where(crosses[1], 1, 0)]
  prune.to_ratio(
    once, 0.15, budget="bytes", selection="random", seed=seed, group_bytes=costs
  )
  for gradual, direct in zip(kept, _kept(once), strict=True):
    np.testing.assert_array_equal(gradual, direct)
  assert sent == 16


def test_random_choices_made_afresh_at_each_pruning_fall_short():
  # Why the final choice comes first: chosen afresh at each pruning, the
  # random order keeps large groups that the last budgets cannot hold
  # after the small ones were dropped (7 of 8 seeds end at 10-13 bytes).
  short = [_schedule_random(seed, anchored=False)[0] for seed in range(8)]
  assert sum(sent < 16 for sent in short) >= 6


def test_final_ratio_is_refused_where_it_is_not_read():
  model = TwoLayers()
  with pytest.raises(PruneError, match="random selection under the bytes"):
    prune.to_ratio(model, 0.5, selection="random", final_ratio=0.2)
  crosses = [g.cross for g in prune.mask_groups(model)]
  costs = [np.where(c, 4, 0) for c in crosses]
  options = {"budget": "bytes", "group_bytes": costs}
  with pytest.raises(PruneError, match="random selection under the bytes"):
    prune.to_ratio(model, 0.5, final_ratio=0.2, **options)
  with pytest.raises(PruneError, match="ends below where it is"):
    prune.to_ratio(model, 0.2, selection="random", final_ratio=0.5, **options)
  with pytest.raises(PruneError, match="in \\[0, 1\\]|real number"):
    prune.to_ratio(
      model, 0.2, selection="random", final_ratio=float("nan"), **options
    )


def test_bytes_budget_refuses_bytes_it_cannot_use():
  model = TwoLayers()
  crosses = [g.cross for g in prune.mask_groups(model)]
  good = [np.where(c, 4, 0) for c in crosses]
  with pytest.raises(PruneError, match="budget='bytes'"):
    prune.to_ratio(model, 0.5, group_bytes=good)
  with pytest.raises(PruneError, match="another model"):
    prune.to_ratio(model, 0.5, budget="bytes", group_bytes=good[:1])
  negative = [c.astype(float) for c in good]
  negative[1][0, 6] = -1.0
  with pytest.raises(PruneError, match="at least 0"):
    prune.to_ratio(model, 0.5, budget="bytes", group_bytes=negative)
  # Two layers without a config: no input shape to count the bytes at.
  with pytest.raises(PruneError, match="input_shape"):
    prune.to_ratio(model, 0.5, budget="bytes")
  with pytest.raises(PruneError, match="bytes budget only"):
    prune.GradualSchedule(0.5, steps=4, input_shape=(1, 10))
  with pytest.raises(PruneError, match="tuple of ints >= 1"):
    prune.GradualSchedule(0.5, steps=4, budget="bytes", input_shape=10)
  # One node: no groups, nothing to choose (it raised on an empty list).
  single = DiscoDense(4, 4, num_nodes=1, rngs=nnx.Rngs(0))
  for budget in prune.BUDGETS:
    prune.to_ratio(single, 0.5, budget=budget, group_bytes=None)
  # With the input shape, a schedule counts them itself.
  schedule = prune.GradualSchedule(
    0.5, steps=4, every=2, budget="bytes", input_shape=(1, 10)
  )
  schedule.apply(model, 4)
  # 4 B per group (one position) in both layers: half of the 22 groups.
  assert sum(int(k.sum()) for k in _kept(model)) == 11


def _gated_loss(parts, x, group, node, channel, gate):
  """The squared output of the model split into `parts` with one channel
  group's weight columns (input `channel` into `node`'s outputs, in every
  layer of mask `group`) scaled by `gate`."""
  scaled = nnx.merge(*parts, copy=True)
  for layer in prune.mask_groups(scaled)[group].layers:
    columns = layer.out_split.indices(node)
    kernel = layer.kernel[...]
    scale = jnp.ones(kernel.shape).at[..., channel, columns].set(gate)
    layer.kernel[...] = kernel * scale
  return jnp.sum(scaled(x) ** 2)


def test_gate_gradients_are_the_derivative_of_a_gate_on_each_group():
  # Every group of both masks of two layers, against jax.grad of the loss
  # by a scalar gate on that group's columns.
  model = TwoLayers(seed=3)
  prune.to_ratio(model, 0.5)  # dropped groups: derivative 0, masked
  x = normal(1, (5, 10))
  graphdef, params, rest = nnx.split(model, nnx.Param, ...)
  grads = nnx.grad(lambda m: jnp.sum(m(x) ** 2))(model)
  gates = prune.gate_gradients(model, nnx.merge(graphdef, grads, rest))
  for index, group in enumerate(prune.mask_groups(model)):
    assert gates[index].shape == group.cross.shape
    for node, channel in zip(*np.nonzero(group.cross), strict=True):
      want = jax.grad(
        lambda g, i=index, n=node, c=channel: _gated_loss(
          (graphdef, params, rest), x, i, n, c, g
        )
      )(1.0)
      assert float(gates[index][node, channel]) == pytest.approx(
        float(want), rel=1e-4, abs=1e-5
      )


def test_saliency_selection_keeps_the_groups_of_highest_score():
  model = TwoLayers()
  scores = [
    g.cross * np.arange(g.cross.size).reshape(g.cross.shape)
    for g in prune.mask_groups(model)
  ]
  prune.to_ratio(model, 0.5, selection="saliency", saliency=scores)
  for group, score in zip(prune.mask_groups(model), scores, strict=True):
    kept = group.kept()
    # every kept group outscores every dropped one of its mask
    assert score[kept].min() > score[group.cross & ~kept].max()


def test_saliency_without_scores_of_the_model_is_refused():
  model = TwoLayers()
  with pytest.raises(PruneError, match="train.fit"):
    prune.to_ratio(model, 0.5, selection="saliency")
  with pytest.raises(PruneError, match="another model"):
    prune.to_ratio(
      model, 0.5, selection="saliency", saliency=[np.ones((2, 10))]
    )
  bad = [np.ones(g.cross.shape) for g in prune.mask_groups(model)]
  bad[1][0, 6] = np.nan  # a channel group of the second mask
  with pytest.raises(PruneError, match="NaN"):
    prune.to_ratio(model, 0.5, selection="saliency", saliency=bad)
  with pytest.raises(PruneError, match="does not read them"):
    prune.to_ratio(model, 0.5, saliency=bad)


def test_saliency_meter_averages_squares_over_its_horizon():
  meter = prune.SaliencyMeter(horizon=4)
  state = meter.zeros([np.ones((1, 2))])
  for value in (1.0, 3.0):
    state = meter.update(state, [jnp.full((1, 2), value)])
  # 0.75 * (0.25 * 1) + 0.25 * 9, halved
  assert prune.SaliencyMeter.scores(state)[0][0, 0] == pytest.approx(
    0.5 * (0.75 * 0.25 + 0.25 * 9)
  )
  with pytest.raises(PruneError, match="horizon"):
    prune.SaliencyMeter(horizon=0)


def test_group_norm_penalty_sums_kept_cross_columns():
  layer = DiscoDense(2, 2, num_nodes=2, rngs=nnx.Rngs(0))
  layer.kernel[...] = jnp.array([[1.0, 3.0], [4.0, 2.0]])
  # cross columns: channel 1 into node 0 (4.0), channel 0 into node 1 (3.0)
  assert float(prune.group_norm_penalty(layer)) == pytest.approx(7.0)
  prune.to_ratio(layer, 0.5)
  assert float(prune.group_norm_penalty(layer)) == pytest.approx(4.0)


def test_gates_scale_the_columns_gate_gradients_differentiate_by():
  # d loss / d gate of the model gated by HardConcreteGates.gated, at all
  # gates one, is what gate_gradients says: both scale the same columns.
  model = TwoLayers(seed=4)
  prune.to_ratio(model, 0.5)
  x = normal(2, (6, 10))
  groups = prune.mask_groups(model)
  ones = [jnp.ones(g.cross.shape) for g in groups]

  def loss(gates):
    gated = nnx.clone(model)
    prune.HardConcreteGates.gated(gated, gates)
    return jnp.sum(gated(x) ** 2)

  by_gate = jax.grad(loss)(ones)
  graphdef, _, rest = nnx.split(model, nnx.Param, ...)
  grads = nnx.grad(lambda m: jnp.sum(m(x) ** 2))(model)
  want = prune.gate_gradients(model, nnx.merge(graphdef, grads, rest))
  for group, got, expected in zip(groups, by_gate, want, strict=True):
    np.testing.assert_allclose(
      np.asarray(got)[group.cross],
      np.asarray(expected)[group.cross],
      rtol=1e-4,
      atol=1e-5,
    )
    # the bits that are not groups are not gated
    np.testing.assert_array_equal(np.asarray(got)[~group.cross], 0.0)


def test_hard_concrete_gates_are_exactly_zero_with_the_stated_probability():
  gates = prune.HardConcreteGates
  log_alpha = jnp.asarray([-2.0, 0.0, 1.0, 3.0])
  draws = jnp.stack(
    [gates.sample([log_alpha], jax.random.key(k))[0] for k in range(2000)]
  )
  assert float(draws.min()) == 0.0 and float(draws.max()) == 1.0
  opened = np.mean(np.asarray(draws) > 0, axis=0)
  # 2000 draws: the standard error of a frequency is at most 0.011
  np.testing.assert_allclose(
    opened, np.asarray(gates.open_probability(log_alpha)), atol=0.04
  )
  # the median draw is the stretched sigmoid(log_alpha / beta), clipped
  median = jax.nn.sigmoid(log_alpha / gates.BETA) * 1.2 - 0.1
  np.testing.assert_allclose(
    np.median(np.asarray(draws), axis=0),
    np.clip(np.asarray(median), 0, 1),
    atol=0.03,
  )


def test_folding_gates_leaves_the_gated_models_function_in_its_weights():
  model = TwoLayers(seed=5)
  prune.to_ratio(model, 0.5)
  x = normal(3, (4, 10))
  groups = prune.mask_groups(model)
  log_alphas = [
    jnp.asarray(normal(7 + i, g.cross.shape) * 3) for i, g in enumerate(groups)
  ]
  gated = nnx.clone(model)
  prune.HardConcreteGates.gated(
    gated, [prune.HardConcreteGates.deterministic(a) for a in log_alphas]
  )
  prune.HardConcreteGates.fold(model, log_alphas)
  np.testing.assert_allclose(
    np.asarray(model(x)), np.asarray(gated(x)), rtol=1e-6
  )
  # the model holds only weights and masks: nothing else changed
  assert prune.comm_ratio(model) == 0.5


def test_gates_selection_keeps_the_largest_log_alpha_and_needs_them():
  model = TwoLayers()
  log_alphas = [
    np.arange(g.cross.size, dtype=float).reshape(g.cross.shape)
    for g in prune.mask_groups(model)
  ]
  prune.to_ratio(model, 0.5, selection="gates", gates=log_alphas)
  for group, score in zip(prune.mask_groups(model), log_alphas, strict=True):
    kept = group.kept()
    assert score[kept].min() > score[group.cross & ~kept].max()
  with pytest.raises(PruneError, match="gates learned"):
    prune.to_ratio(TwoLayers(), 0.5, selection="gates")
  with pytest.raises(PruneError, match="does not read them"):
    prune.to_ratio(TwoLayers(), 0.5, selection="saliency", gates=log_alphas)
  with pytest.raises(PruneError, match="gate_learning_rate"):
    prune.GradualSchedule(0.5, steps=4, selection="gates", gate_learning_rate=0)


def test_gate_penalty_counts_bytes_with_the_bytes_budget():
  # Unweighted, the penalty is the expected fraction of open groups; with
  # the groups' bytes it is the expected fraction of their bytes, so a gate
  # on a tensor of 4x the positions costs 4x as much.
  model = TwoLayers()
  groups = prune.mask_groups(model)
  log_alphas = [jnp.full(g.cross.shape, 40.0) for g in groups]  # all open
  costs = [
    np.where(g.cross, 1.0 + 3.0 * (i == 0), 0.0) for i, g in enumerate(groups)
  ]
  gates = prune.HardConcreteGates
  assert float(gates.open_fraction(model, log_alphas)) == pytest.approx(1.0)
  assert float(gates.open_fraction(model, log_alphas, costs)) == pytest.approx(
    1.0
  )
  # the first mask's gates closed: its share of the groups, of the bytes
  first = [jnp.full_like(log_alphas[0], -40.0), *log_alphas[1:]]
  counts = [int(g.cross.sum()) for g in groups]
  weights = [4 * counts[0], *counts[1:]]
  assert float(gates.open_fraction(model, first)) == pytest.approx(
    1 - counts[0] / sum(counts), abs=1e-6
  )
  assert float(gates.open_fraction(model, first, costs)) == pytest.approx(
    1 - weights[0] / sum(weights), abs=1e-6
  )
  # the gradient at equal log_alpha: a gate of 4x the bytes, 4x the push
  at_zero = [jnp.zeros(g.cross.shape) for g in groups]
  grads = jax.grad(lambda a: gates.open_fraction(model, a, costs))(at_zero)
  first_group = float(grads[0][groups[0].cross][0])
  other_group = float(grads[1][groups[1].cross][0])
  assert first_group == pytest.approx(4 * other_group)
  # traced bytes (as train.fit passes them into its jitted step)
  step = jax.jit(lambda a, c: gates.open_fraction(model, a, c))
  assert float(step(first, costs)) == pytest.approx(
    1 - weights[0] / sum(weights), abs=1e-6
  )
