"""`graphpipe.core.channels.color_pairs` against the first-fit colouring it
implements with bit masks."""

import random

from graphpipe.core.channels import color_pairs


def _first_fit(pairs):
  """Each pair into the first group where neither its sender nor its
  receiver is yet (a group per permutation)."""
  groups, used = [], []
  for pair in sorted(set(pairs)):
    for group, (senders, receivers) in zip(groups, used, strict=True):
      if pair[0] not in senders and pair[1] not in receivers:
        group.append(pair)
        senders.add(pair[0])
        receivers.add(pair[1])
        break
    else:
      groups.append([pair])
      used.append(({pair[0]}, {pair[1]}))
  return groups


def test_color_pairs_is_first_fit():
  rng = random.Random(0)
  for _ in range(300):
    devices = rng.randint(1, 40)
    pairs = [
      (rng.randrange(devices), rng.randrange(devices), rng.choice("FB"),
       rng.randrange(3))
      for _ in range(rng.randint(0, 200))
    ]  # fmt: skip
    groups = color_pairs(pairs)
    assert groups == _first_fit(pairs)
    for group in groups:  # permutations: one send and one receive each
      assert len({p[0] for p in group}) == len(group)
      assert len({p[1] for p in group}) == len(group)
