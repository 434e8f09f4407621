"""The memoised DP of the GraphPipe partitioner, for one target time.

For a target bottleneck time per sample t, `DPSolver.min_devices(X, D, d)`
is the fewest devices that split sub-tree X into stages within t, with at
most D stages on any path and d stages after X (the recurrence is written
out in `graphpipe.planning.graphpipe_dp`'s docstring); `feasible` and
`solve` are what `graphpipe.planning.candidates.frontier` searches with.
"""

from __future__ import annotations

from graphpipe.planning.stage_tree import StageTree

_INF = 1 << 40


class DPSolver:
  """feasible(t) of `graphpipe.planning.graphpipe_dp`, with the stages it chose.

  Memo tables hold for one target; asking for another target clears them.

  Example:
    Every candidate stage of the tiny two-branch model here fits one
    device (in-flight capacity 8) and takes 1 s per sample per node:

    >>> from graphpipe.planning import sp
    >>> dag = sp.Dag.of(capture_zoo("two_branch", "tiny"))
    >>> tree = StageTree.build(sp.decompose(dag), dag, [1.0] * len(dag))
    >>> options = [[(1, len(nodes), 8)] for nodes in tree.base_nodes]
    >>> solver = DPSolver(tree, options, num_devices=4)
    >>> solver.feasible(2.0, max_depth=8)   # 9 nodes, <= 2 a stage: 5 stages
    False
    >>> solver.feasible(4.0, max_depth=8)
    True
    >>> solver.solve(4.0, max_depth=8)      # (depth, [stages]): one plan
    (2, [[((0, 1, 2, 3), 1), ((4, 5, 6, 7), 1), ((8,), 1)]])

    Among plans needing as few devices, `fill="back"` keeps the one whose
    stages are filled from the back (the join takes most of a branch):

    >>> DPSolver(tree, options, 4, fill="back").solve(4.0, max_depth=8)
    (2, [[((0, 1, 2, 3), 1), ((4,), 1), ((5, 6, 7, 8), 1)]])

  Args:
    tree: the flattened series-parallel tree and its candidate stages.
    options: per candidate stage (`tree.base_nodes`), the (device count,
      time per sample, in-flight capacity) triples that fit memory, device
      counts rising.
    num_devices: devices available.
    fill: 'front' or 'back': which of the plans needing equally few
      devices the DP keeps (see `_better`).
  """

  def __init__(
    self, tree: StageTree, options, num_devices: int, fill: str = "front"
  ):
    self.tree = tree
    self.options = options
    self.num_devices = num_devices
    self.fill = fill
    self.target = None

  def _better(self, devices: int, best: int) -> bool:
    """Whether a choice needing `devices` replaces the best so far: among
    equal counts the first choice tried (the shortest last stage: stages
    filled from the front) or the last (filled from the back)."""
    if self.fill == "front":
      return devices < best
    return devices <= best and devices < _INF

  def _retarget(self, target: float) -> None:
    if target != self.target:
      self.target = target
      self.base_memo: dict[tuple[int, int], int] = {}
      self.memo: dict[tuple, tuple[int, tuple]] = {}

  def feasible(self, target: float, max_depth: int) -> bool:
    """Whether stages within t and max_depth fit the devices."""
    self._retarget(target)
    return self.min_devices(self.tree.root, max_depth, 0)[0] <= self.num_devices

  def solve(self, target: float, max_depth: int, shallowest: bool = True):
    """(depth, [stages]): the shallowest feasible plan within max_depth
    (or the DP's plan under max_depth itself when not `shallowest`)."""
    self._retarget(target)
    root = self.tree.root
    low, high = (1, max_depth) if shallowest else (max_depth, max_depth)
    while low < high:
      middle = (low + high) // 2
      if self.min_devices(root, middle, 0)[0] <= self.num_devices:
        high = middle
      else:
        low = middle + 1
    stages = []
    self._collect(root, low, 0, stages)
    return low, [stages]

  def base(self, base_id: int, in_flight: int) -> int:
    """Fewest devices for one stage (time and memory), or _INF."""
    key = (base_id, in_flight)
    found = self.base_memo.get(key)
    if found is None:
      found = _INF
      for k, tps, cap in self.options[base_id]:
        if tps <= self.target and cap >= in_flight:
          found = k
          break
      self.base_memo[key] = found
    return found

  def min_devices(self, x: int, depth: int, after: int) -> tuple[int, tuple]:
    """(fewest devices, choice) for vertex x, depth bound, d stages after."""
    depth = min(depth, self.tree.depth[x])
    kind = self.tree.kind[x]
    if kind == "leaf":
      k = self.base(self.tree.leaf_base[x], after + 1)
      return k, ("base", self.tree.leaf_base[x], k)
    if kind == "series":
      return self.series(x, len(self.tree.children[x]) - 1, depth, after)
    return self.parallel(x, depth, after)

  def series(self, x: int, j: int, depth: int, after: int):
    """Children 0..j of series node x (the DP runs from the sink back)."""
    if j < 0:
      return 0, None
    prefix = self.tree.prefix_depth[x]
    depth = min(depth, prefix[j])
    key = ("s", x, j, depth, after)
    memo = self.memo
    found = memo.get(key)
    if found is not None:
      return found
    # The loop below is the partitioner's hot path: memo hits are read
    # inline (same keys as `series` and `base` build) to skip a call each.
    base_memo, base = self.base_memo, self.base
    ranges, absorbs = self.tree.range_base, self.tree.absorb_base
    better = self._better
    flight = after + 1
    best, choice = _INF, None
    for s in range(j, -1, -1):
      base_id = ranges[(x, s, j)]
      k = base_memo.get((base_id, flight))
      if k is None:
        k = base(base_id, flight)
      if k >= _INF:
        if base(base_id, 1) >= _INF:
          break  # longer ranges only get slower and larger
        continue
      if s == 0:
        total = k
      elif depth >= 2:
        rest = memo.get(("s", x, s - 1, min(depth - 1, prefix[s - 1]), flight))
        if rest is None:
          rest = self.series(x, s - 1, depth - 1, flight)
        total = k + rest[0]
      else:
        continue
      if better(total, best):
        best, choice = total, ("stage", s, base_id, k)
      if depth >= 2 and (x, s, j) in absorbs:
        for i, c, absorb_id, k2 in self._absorbing(x, s, j, after):
          rest = self.trimmed(x, s - 1, i, c, depth - 1, flight)[0]
          if better(k2 + rest, best):
            best, choice = k2 + rest, ("absorb", s, i, c, absorb_id, k2)
    child = self.tree.children[x][j]
    if self.tree.kind[child] != "leaf":
      top = min(depth, self.tree.depth[child])
      for inner in range(top, 0, -1) if j > 0 else (top,):
        own = self.min_devices(child, inner, after)[0]
        if own >= _INF:
          break  # less depth for the child cannot help
        if j == 0:
          total = own
        elif depth - inner >= 1:
          total = own + self.series(x, j - 1, depth - inner, after + inner)[0]
        else:
          continue
        if better(total, best):
          best, choice = total, ("child", inner)
    memo[key] = (best, choice)
    return best, choice

  def _absorbing(self, x: int, s: int, j: int, after: int):
    """Feasible stages of children s..j plus one branch tail before s."""
    options = self.tree.absorb_base.get((x, s, j), ())
    last_branch, skip = None, False
    for i, c, absorb_id in options:
      if i != last_branch:
        last_branch, skip = i, False
      if skip:
        continue
      k = self.base(absorb_id, after + 1)
      if k >= _INF:
        skip = self.base(absorb_id, 1) >= _INF  # longer tails: no better
        continue
      yield i, c, absorb_id, k

  def trimmed(self, x, p, i, c, depth, after):
    """Children 0..p of series x, child p (parallel) cut to branch i's
    first c children (the rest of branch i sits in the next stage)."""
    key = ("t", x, p, i, c, depth, after)
    if key in self.memo:
      return self.memo[key]
    par = self.tree.children[x][p]
    best, choice = _INF, None
    for inner in range(min(depth, self.tree.depth[par]), 0, -1):
      own = self.parallel(par, inner, after, (i, c))[0]
      if own >= _INF:
        break
      if p == 0:
        best, choice = own, inner
        break
      if depth - inner >= 1:
        total = own + self.series(x, p - 1, depth - inner, after + inner)[0]
        if self._better(total, best):
          best, choice = total, inner
    self.memo[key] = (best, choice)
    return best, choice

  def parallel(self, x: int, depth: int, after: int, trim=None):
    """Branches of parallel node x, neighbours possibly sharing a stage:
    (fewest devices, back pointers).

    trim = (i, c): branch i keeps only its first c children, and no stage
    holds it with a neighbour, so the cover splits at it: the untrimmed
    cover of the branches before i, plus the head, plus the cover of the
    branches after i on their own (`_suffix_covers`): the same minimum as
    covering with the trim, without a pass over the branches per (i, c).
    Back pointers are then None (`_cover` gives them).
    """
    if trim is None:
      return self._cover(x, depth, after)
    i, c = trim
    before = self.memo.get(("pc", x, depth, after))
    if before is None:
      self._cover(x, depth, after)
      before = self.memo[("pc", x, depth, after)]
    head = self._head(self.tree.children[x][i], c, depth, after)
    suffix = self._suffix_covers(x, depth, after)[i + 1]
    total = before[i] + head + suffix
    return (total if total < _INF else _INF), None

  def _cover(self, x: int, depth: int, after: int, trim=None):
    """`parallel` by a pass over the branches, with back pointers."""
    key = ("p", x, depth, after, trim)
    if key in self.memo:
      return self.memo[key]
    kids = self.tree.children[x]
    cover = [0] + [_INF] * len(kids)
    back: list[tuple | None] = [None] * (len(kids) + 1)
    # A hot path like `series`: memo hits of `base` are read inline.
    base_memo, base, better = self.base_memo, self.base, self._better
    ranges, flight = self.tree.range_base, after + 1
    for i, kid in enumerate(kids):
      if trim is not None and trim[0] == i:
        own = self._head(kid, trim[1], depth, after)
      else:
        own = self.min_devices(kid, depth, after)[0]
      if better(cover[i] + own, cover[i + 1]):
        cover[i + 1], back[i + 1] = cover[i] + own, ("branch", i)
      for s in range(i - 1, -1, -1):
        if trim is not None and s <= trim[0] <= i:
          break  # a cut branch cannot share a stage with its neighbours
        base_id = ranges[(x, s, i)]
        k = base_memo.get((base_id, flight))
        if k is None:
          k = base(base_id, flight)
        if k >= _INF:
          if base(base_id, 1) >= _INF:
            break
          continue
        if better(cover[s] + k, cover[i + 1]):
          cover[i + 1], back[i + 1] = cover[s] + k, ("group", s, base_id, k)
    result = (cover[-1], tuple(back))
    self.memo[key] = result
    if trim is None:
      self.memo[("pc", x, depth, after)] = cover
    return result

  def _suffix_covers(self, x: int, depth: int, after: int) -> list[int]:
    """Per branch j of parallel node x, the fewest devices covering
    branches j.. on their own (index len: 0).

    The pieces are `_cover`'s: a branch alone, or a group of branches s..e
    reached before the pass from e down stops (a group too large at one
    micro-batch in flight stops it: longer groups only grow), so each
    minimum equals `_cover`'s over the same branches.
    """
    key = ("sc", x, depth, after)
    found = self.memo.get(key)
    if found is not None:
      return found
    kids = self.tree.children[x]
    n = len(kids)
    base, ranges, flight = self.base, self.tree.range_base, after + 1
    # stop[e]: the pass over groups ending at e stops at this start.
    stop = [-1] * n
    for e in range(n):
      for s in range(e - 1, -1, -1):
        if base(ranges[(x, s, e)], 1) >= _INF:
          stop[e] = s
          break
    suffix = [_INF] * n + [0]
    for j in range(n - 1, -1, -1):
      best = self.min_devices(kids[j], depth, after)[0] + suffix[j + 1]
      for e in range(j + 1, n):
        if j <= stop[e] or suffix[e + 1] >= _INF:
          continue
        k = base(ranges[(x, j, e)], flight)
        if k < _INF:
          best = min(best, k + suffix[e + 1])
      suffix[j] = best if best < _INF else _INF
    self.memo[key] = suffix
    return suffix

  def _head(self, branch: int, cut: int, depth: int, after: int) -> int:
    """Devices for the first `cut` children of a branch (0 if none)."""
    if cut == 0:
      return 0
    return self.series(branch, cut - 1, depth, after)[0]

  def _collect(self, x: int, depth: int, after: int, out: list) -> None:
    """Appends the stages of g(x, depth, after) to `out` (tree order)."""
    depth = min(depth, self.tree.depth[x])
    kind = self.tree.kind[x]
    if kind == "leaf":
      _, (_, base_id, k) = self.min_devices(x, depth, after)
      out.append((self.tree.base_nodes[base_id], k))
    elif kind == "series":
      self._collect_series(x, len(self.tree.children[x]) - 1, depth, after, out)
    else:
      self._collect_parallel(x, depth, after, None, out)

  def _collect_parallel(self, x, depth, after, trim, out) -> None:
    _, back = self._cover(x, depth, after, trim)
    kids = self.tree.children[x]
    parts = []
    i = len(kids)
    while i > 0:
      step = back[i]
      if step[0] == "branch":
        parts.append(("branch", i - 1))
        i -= 1
      else:
        parts.append(("group", step[2], step[3]))
        i = step[1]
    for part in reversed(parts):
      if part[0] == "group":
        out.append((self.tree.base_nodes[part[1]], part[2]))
      elif trim is not None and part[1] == trim[0]:
        if trim[1] > 0:
          self._collect_series(kids[part[1]], trim[1] - 1, depth, after, out)
      else:
        self._collect(kids[part[1]], depth, after, out)

  def _collect_series(self, x, j, depth, after, out) -> None:
    depth = min(depth, self.tree.prefix_depth[x][j])
    _, choice = self.series(x, j, depth, after)
    if choice[0] == "stage":
      _, s, base_id, k = choice
      if s > 0:
        self._collect_series(x, s - 1, depth - 1, after + 1, out)
      out.append((self.tree.base_nodes[base_id], k))
    elif choice[0] == "absorb":
      _, s, i, c, absorb_id, k = choice
      self._collect_trimmed(x, s - 1, i, c, depth - 1, after + 1, out)
      out.append((self.tree.base_nodes[absorb_id], k))
    else:
      inner = choice[1]
      if j > 0:
        self._collect_series(x, j - 1, depth - inner, after + inner, out)
      self._collect(self.tree.children[x][j], inner, after, out)

  def _collect_trimmed(self, x, p, i, c, depth, after, out) -> None:
    _, inner = self.trimmed(x, p, i, c, depth, after)
    if p > 0:
      self._collect_series(x, p - 1, depth - inner, after + inner, out)
    par = self.tree.children[x][p]
    self._collect_parallel(par, inner, after, (i, c), out)
