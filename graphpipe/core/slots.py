"""Where each device keeps its stage's variables: a tuple of flat slots.

Plain Python (the planner's memory rule sizes the same slots; the runtime
reads and writes them in `graphpipe.runtime.slots`).

SPMD needs one set of array shapes on every device, but stages hold
different variables. Each device therefore stores a tuple of flat float32
*slots* whose sizes are the same on all devices; each stage places its
variables in them. A variable that fills a slot alone is read as a free
reshape of it; variables that share a slot are slices of it, and XLA:CPU
copies a slice before a dot reads it, once per tick. So the slots are cut to
fit the variables of the stage with the most elements exactly (its
variables are all free, and the slots hold no more elements than that
stage), and every other stage puts each variable whose size matches a slot
it has not used yet into that slot, and packs the rest into the free space
left. When some stage cannot pack, the smallest slots merge (their
variables become slices) until it can; in the end, one slot is the plain
flat buffer of the largest stage.

Example:
  >>> layout = plan_slots([[("a", 6), ("b", 2)], [("c", 6), ("d", 1)]])
  >>> layout.sizes, layout.places[1]
  ((6, 2), {'c': (0, 0), 'd': (1, 0)})
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence


@dataclasses.dataclass(frozen=True)
class SlotLayout:
  """Slot sizes and, per stage, each variable's (slot, offset).

  Attributes:
    sizes: float32 elements of every slot (the same on all devices).
    places: per stage, variable key -> (slot index, element offset).
    lengths: variable key -> its number of elements.
  """

  sizes: tuple[int, ...]
  places: tuple[dict[str, tuple[int, int]], ...]
  lengths: dict[str, int]

  def total(self) -> int:
    """Elements held per device, padding included."""
    return sum(self.sizes)

  def whole(self, stage: int, key: str) -> bool:
    """Whether `key` fills its slot alone (read without a copy)."""
    slot, _ = self.places[stage][key]
    return self.lengths[key] == self.sizes[slot]

  def slot_contents(self, stage: int) -> dict[int, list[tuple[int, str]]]:
    """Slot -> [(offset, key)] in offset order, for the slots `stage` uses."""
    out: dict[int, list[tuple[int, str]]] = {}
    for key, (slot, offset) in self.places[stage].items():
      out.setdefault(slot, []).append((offset, key))
    return {s: sorted(v) for s, v in sorted(out.items())}


def plan_slots(stages: Sequence[Sequence[tuple[str, int]]]) -> SlotLayout:
  """The slots of `stages` (per stage, its variables as (key, elements)).

  The slots hold as many elements as the largest stage (see the module
  docstring); a layout without variables gets one slot of one element, so
  that every device still holds an array.
  """
  lengths = {k: n for variables in stages for k, n in variables}
  totals = [sum(n for _, n in variables) for variables in stages]
  if not any(totals):
    return SlotLayout((1,), tuple({} for _ in stages), lengths)
  largest = max(range(len(stages)), key=lambda s: totals[s])
  sizes = [n for _, n in stages[largest] if n > 0]
  while True:
    places, missing = _pack_all(stages, sizes)
    if missing is None:
      return SlotLayout(tuple(sizes), tuple(places), lengths)
    sizes = _merge_smallest(sizes, missing)


def _pack_all(stages, sizes):
  """(places, None), or (None, size of a variable that found no room)."""
  places = []
  for variables in stages:
    place, missing = _pack(variables, sizes)
    if missing is not None:
      return None, missing
    places.append(place)
  return places, None


def _pack(variables, sizes):
  """One stage: exact fits first, then best fit, largest variables first."""
  free = {}  # slot -> first free offset
  place = {}
  rest = []
  for key, n in variables:
    exact = [s for s, size in enumerate(sizes) if size == n and s not in free]
    if exact:
      place[key] = (exact[0], 0)
      free[exact[0]] = n
    else:
      rest.append((key, n))
  for key, n in sorted(rest, key=lambda kn: -kn[1]):
    fits = [
      (sizes[s] - free.get(s, 0), s)
      for s in range(len(sizes))
      if sizes[s] - free.get(s, 0) >= n
    ]
    if not fits:
      return None, n
    _, slot = min(fits)
    place[key] = (slot, free.get(slot, 0))
    free[slot] = free.get(slot, 0) + n
  return place, None


def _merge_smallest(sizes, needed):
  """Merges the smallest slots into one of at least `needed` elements."""
  order = sorted(range(len(sizes)), key=lambda s: (sizes[s], s))
  merged, taken = 0, []
  for s in order:
    taken.append(s)
    merged += sizes[s]
    if merged >= needed and len(taken) > 1:
      break
  kept = [size for s, size in enumerate(sizes) if s not in taken]
  return kept + [merged]
