"""Parameter slots: placement rules, and reading / writing them."""

import jax.numpy as jnp
import numpy as np
import pytest

from graphpipe.runtime import slots


def check_layout(stages, layout):
  """Every variable placed once, inside its slot, without overlaps."""
  largest = max(sum(n for _, n in variables) for variables in stages)
  assert layout.total() <= max(largest, 1)
  for stage, variables in enumerate(stages):
    assert sorted(layout.places[stage]) == sorted(k for k, _ in variables)
    used = {}
    for key, n in variables:
      slot, offset = layout.places[stage][key]
      assert 0 <= offset and offset + n <= layout.sizes[slot]
      for other, (lo, hi) in used.items():
        if other[0] == slot:
          assert offset + n <= lo or hi <= offset, (key, other)
      used[(slot, key)] = (offset, offset + n)


def test_equal_stages_get_one_slot_per_variable():
  stages = [
    [(f"s{s}_{i}", n) for i, n in enumerate([64, 8, 64, 8])] for s in range(3)
  ]
  layout = slots.plan_slots(stages)
  check_layout(stages, layout)
  assert sorted(layout.sizes) == [8, 8, 64, 64]
  for stage, variables in enumerate(stages):
    assert all(layout.whole(stage, k) for k, _ in variables)


def test_smaller_stage_packs_into_unused_slots():
  stages = [[("a", 6), ("b", 2)], [("c", 6), ("d", 1)], [("e", 3), ("f", 3)]]
  layout = slots.plan_slots(stages)
  check_layout(stages, layout)
  assert layout.sizes == (6, 2)
  assert layout.whole(1, "c") and not layout.whole(1, "d")
  assert layout.places[2]["e"][0] == layout.places[2]["f"][0] == 0


def test_slots_merge_when_a_variable_fits_nowhere():
  # Stage 1's variable of 9 fits no slot cut for stage 0 until slots merge.
  stages = [[("a", 4), ("b", 3), ("c", 3)], [("d", 9)]]
  layout = slots.plan_slots(stages)
  check_layout(stages, layout)
  assert max(layout.sizes) >= 9
  assert layout.total() == 10


def test_no_variables_gives_one_tiny_slot():
  layout = slots.plan_slots([[], []])
  assert layout.sizes == (1,)
  assert layout.places == ({}, {})


@pytest.mark.parametrize("seed", range(20))
def test_random_stages_always_fit_in_the_largest_stage(seed):
  rng = np.random.default_rng(seed)
  stages = [
    [(f"s{s}v{i}", int(rng.integers(0, 40))) for i in range(rng.integers(1, 6))]
    for s in range(rng.integers(1, 5))
  ]
  check_layout(stages, slots.plan_slots(stages))


def test_read_and_scatter_round_trip():
  stages = [[("a", 6), ("b", 2)], [("c", 6), ("d", 1), ("e", 1)]]
  shapes = {
    "a": ((2, 3), "float32"),
    "b": ((2,), "float32"),
    "c": ((3, 2), "float32"),
    "d": ((1,), "float32"),
    "e": ((), "float32"),
  }
  layout = slots.plan_slots(stages)
  values = {
    k: np.arange(np.prod(s), dtype=np.float32) + 1
    for k, (s, _) in shapes.items()
  }
  values = {k: v.reshape(shapes[k][0]) for k, v in values.items()}
  for stage, variables in enumerate(stages):
    keys = [k for k, _ in variables]
    host = slots.host_slots(layout, stage, values)
    read = slots.read(
      [jnp.asarray(x) for x in host], layout, stage, keys, shapes
    )
    for k in keys:
      np.testing.assert_array_equal(read[k], values[k])
    acc = slots.scatter(layout, stage, {k: 2 * read[k] for k in keys})
    back = slots.host_values(
      layout, stage, [np.asarray(x) for x in acc], shapes
    )
    for k in keys:
      np.testing.assert_array_equal(back[k], 2 * values[k])
