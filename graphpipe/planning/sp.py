"""Series-parallel decomposition of an operator DAG.

The GraphPipe partitioner runs a dynamic program over a series-parallel (SP)
tree: a leaf is one node, a series node runs its children one after the
other (every node of a child is an ancestor of every node of the next), a
parallel node's children share no edge and may run concurrently.

  decompose(dag) -> SPTree

The decomposition works on reachability, so transitive edges (residual
connections, a loss that also reads an early output) never get in the way:
a node set splits in series at every position of a topological order where
each node before reaches each node after, and in parallel into its weakly
connected components.

Graphs that are not series-parallel (an 'N': a -> c, b -> c, b -> d) are
planned, not refused. Our conversion: a connected node set with no series
cut is cut anyway, at the down-set (a prefix of the id order or of the
level order) that misses the smallest share of the ancestor relations a
series cut needs (ties: the most balanced cut), as if dummy
dependencies ran from every node before the cut to every node after. The
two sides are decomposed again, so the branch structure on either side
survives. Stages stay convex in the real graph (a prefix of a topological
order is a down-set); the dummy dependencies only make the planner count
in-flight micro-batches conservatively. `SPTree.added_dependencies` counts
them (0 for an SP graph).

`contract` merges chosen nodes into a neighbour first (the planner merges
glue nodes that do no real work, so that they never need a device of their
own), keeping the contracted graph acyclic.
"""

from __future__ import annotations

import dataclasses
import heapq
from collections.abc import Callable, Iterable, Sequence

from graphpipe.core.graph import OpGraph
from graphpipe.errors import DecompositionError
from graphpipe.planning.bitsets import bits, mask_of


@dataclasses.dataclass(frozen=True)
class Dag:
  """A DAG whose vertices are groups of OpGraph nodes.

  Example:
    >>> graph = capture_zoo("two_branch", "tiny")  # branches 0-3, 4-7; 8
    >>> dag = Dag.of(graph)                 # one vertex per node
    >>> dag.groups[:2], dag.edges[:2]
    (((0,), (1,)), ((0, 1), (1, 2)))

  Args:
    groups: OpGraph node ids of each vertex; vertices are in a topological
      order.
    edges: (src, dst) vertex pairs, src < dst, no duplicates.
  """

  groups: tuple[tuple[int, ...], ...]
  edges: tuple[tuple[int, int], ...]

  @classmethod
  def of(cls, graph: OpGraph) -> Dag:
    """The DAG of `graph` itself, one vertex per node."""
    return cls(
      tuple((n.id,) for n in graph.nodes),
      tuple(sorted({(e.src, e.dst) for e in graph.edges})),
    )

  def __len__(self) -> int:
    return len(self.groups)


@dataclasses.dataclass(frozen=True)
class SPTree:
  """A node of a series-parallel decomposition.

  Attributes:
    kind: 'leaf', 'series' or 'parallel'.
    children: sub-trees (series: in execution order; parallel: any order).
    vertex: the Dag vertex of a leaf (None otherwise).
    vertices: every Dag vertex below, sorted.
    added_dependencies: dummy ancestor relations the conversion of a
      non-SP graph added below this node (0 for SP graphs).
  """

  kind: str
  children: tuple[SPTree, ...] = ()
  vertex: int | None = None
  vertices: tuple[int, ...] = ()
  added_dependencies: int = 0

  @property
  def depth(self) -> int:
    """Vertices on the longest chain of this sub-tree."""
    if self.kind == "leaf":
      return 1
    depths = [c.depth for c in self.children]
    return sum(depths) if self.kind == "series" else max(depths)

  def __str__(self) -> str:
    if self.kind == "leaf":
      return str(self.vertex)
    sep = " ; " if self.kind == "series" else " | "
    return "(" + sep.join(str(c) for c in self.children) + ")"


def contract(graph: OpGraph, merge: Iterable[int]) -> Dag:
  """The DAG of `graph` with each node of `merge` folded into a neighbour.

  A node with predecessors joins the one whose upstream is lightest (fewest
  ancestors), a source joins a successor, provided no other path links the
  two (so the result stays acyclic and every group convex). Nodes that
  cannot be merged safely stay on their own.

  Example:
    >>> graph = capture_zoo("two_branch", "tiny")  # branches 0-3, 4-7; 8
    >>> dag = contract(graph, [8])   # the join of the two branches
    >>> [g for g in dag.groups if len(g) > 1]
    [(3, 8)]

  Args:
    graph: the operator graph.
    merge: node ids to fold away.
  """
  n = len(graph.nodes)
  parent = list(range(n))

  def find(v):
    while parent[v] != v:
      parent[v] = parent[parent[v]]
      v = parent[v]
    return v

  for node in sorted(set(merge)):
    edges = _group_edges(graph, find)
    root = find(node)
    preds = sorted({a for a, b in edges if b == root})
    succs = sorted({b for a, b in edges if a == root})
    ancestors = _reachability(n, edges, reverse=True)
    if preds:
      options = sorted(preds, key=lambda p: (bin(ancestors[p]).count("1"), p))
    else:
      options = succs
    descendants = _reachability(n, edges, reverse=False)
    for other in options:
      a, b = (other, root) if preds else (root, other)
      # Another path a -> ... -> b would close a cycle once a and b merge.
      middle = [
        v for v in range(n) if (descendants[a] >> v) & 1 and v not in (a, b)
      ]
      if not any((descendants[v] >> b) & 1 for v in middle):
        parent[root] = find(other)
        break
  return _quotient(graph, find)


def _group_edges(graph: OpGraph, find) -> set[tuple[int, int]]:
  return {
    (find(e.src), find(e.dst))
    for e in graph.edges
    if find(e.src) != find(e.dst)
  }


def _reachability(
  n: int, edges: Iterable[tuple[int, int]], reverse: bool
) -> list[int]:
  """Bitsets: for each vertex, the vertices it reaches (or reaching it)."""
  adj = [[] for _ in range(n)]
  indeg = [0] * n
  for a, b in edges:
    src, dst = (b, a) if reverse else (a, b)
    adj[src].append(dst)
    indeg[dst] += 1
  order = [v for v in range(n) if indeg[v] == 0]
  for v in order:
    for w in adj[v]:
      indeg[w] -= 1
      if indeg[w] == 0:
        order.append(w)
  reach = [0] * n
  for v in reversed(order):
    for w in adj[v]:
      reach[v] |= reach[w] | (1 << w)
  return reach


def _quotient(graph: OpGraph, find) -> Dag:
  """Groups of `find` in a topological order (ties by smallest node id)."""
  members: dict[int, list[int]] = {}
  for v in range(len(graph.nodes)):
    members.setdefault(find(v), []).append(v)
  edges = _group_edges(graph, find)
  order = topological_order(members, edges, lambda g: min(members[g]))
  index = {g: i for i, g in enumerate(order)}
  return Dag(
    tuple(tuple(members[g]) for g in order),
    tuple(sorted((index[a], index[b]) for a, b in edges)),
  )


def topological_order(
  vertices: Iterable[int],
  edges: Iterable[tuple[int, int]],
  priority: Callable[[int], int],
) -> list[int]:
  """Kahn's order of `vertices`: among the ready ones, lowest priority first.

  Shorter than `vertices` when the edges hold a cycle (the vertices on or
  after it never become ready).

  Example:
    >>> topological_order(range(3), [(2, 0)], priority=lambda v: v)
    [1, 2, 0]

  Args:
    vertices: the vertex ids.
    edges: (src, dst) pairs of vertex ids.
    priority: breaks ties between ready vertices (then the id does).
  """
  vertices = list(vertices)
  indeg = {v: 0 for v in vertices}
  succ: dict[int, list[int]] = {v: [] for v in vertices}
  for a, b in edges:
    succ[a].append(b)
    indeg[b] += 1
  ready = sorted((priority(v), v) for v in vertices if indeg[v] == 0)
  order = []
  while ready:
    _, v = heapq.heappop(ready)
    order.append(v)
    for w in succ[v]:
      indeg[w] -= 1
      if indeg[w] == 0:
        heapq.heappush(ready, (priority(w), w))
  return order


def decompose(dag: Dag) -> SPTree:
  """The series-parallel tree of `dag` (non-SP parts converted, see above).

  Example:
    >>> tree = decompose(Dag.of(capture_zoo("two_branch", "tiny")))
    >>> print(tree)          # ';' in series, '|' in parallel
    (((0 ; 1 ; 2 ; 3) | (4 ; 5 ; 6 ; 7)) ; 8)
    >>> tree.added_dependencies
    0

  Args:
    dag: vertices in a topological order.
  """
  n = len(dag)
  if n == 0:
    raise DecompositionError("the graph has no nodes: nothing to plan")
  for a, b in dag.edges:
    if not 0 <= a < b < n:
      raise DecompositionError(
        f"edge {a}->{b} does not go forward: vertices must be in a "
        "topological order"
      )
  descendants = _reachability(n, dag.edges, reverse=False)
  ancestors = _reachability(n, dag.edges, reverse=True)
  neighbours = adjacency(n, dag.edges)
  return _Decomposer(ancestors, descendants, neighbours).split(list(range(n)))


def adjacency(n: int, edges: Iterable[tuple[int, int]]) -> list[int]:
  """Per vertex of `n`, the bitmask of the vertices an edge joins it to
  (in either direction)."""
  neighbours = [0] * n
  for a, b in edges:
    neighbours[a] |= 1 << b
    neighbours[b] |= 1 << a
  return neighbours


def components(
  vertices: Sequence[int], neighbours: Sequence[int]
) -> list[list[int]]:
  """The weakly connected components of the subgraph `vertices` induce
  (`neighbours` from `adjacency`), each sorted, in order of their first
  vertex in `vertices`.

  Example:
    >>> components([0, 1, 2, 3], adjacency(4, [(0, 2), (1, 3)]))
    [[0, 2], [1, 3]]
  """
  inside = mask_of(vertices)
  seen = 0
  out = []
  for v in vertices:
    if (seen >> v) & 1:
      continue
    comp, frontier = 1 << v, 1 << v
    while frontier:
      nxt = 0
      for w in bits(frontier):
        nxt |= neighbours[w] & inside
      frontier = nxt & ~comp
      comp |= nxt
    seen |= comp
    out.append(sorted(bits(comp)))
  return out


class _Decomposer:
  """Recursive splitting of vertex sets (sorted lists, a topological order)."""

  def __init__(self, ancestors, descendants, neighbours):
    self.ancestors = ancestors
    self.descendants = descendants
    self.neighbours = neighbours

  def split(self, vertices: list[int]) -> SPTree:
    if len(vertices) == 1:
      return SPTree("leaf", vertex=vertices[0], vertices=tuple(vertices))
    parts = components(vertices, self.neighbours)
    if len(parts) > 1:
      return _make("parallel", [self.split(c) for c in parts])
    cuts = self._series_cuts(vertices)
    if cuts:
      bounds = [0, *cuts, len(vertices)]
      chunks = [vertices[a:b] for a, b in zip(bounds, bounds[1:], strict=False)]
      return _make("series", [self.split(c) for c in chunks])
    prefix, missing = self._best_forced_cut(vertices)
    rest = [v for v in vertices if v not in set(prefix)]
    return _make("series", [self.split(prefix), self.split(rest)], missing)

  def _missing(self, prefix_mask: int, suffix: Sequence[int]) -> int:
    """Ancestor relations prefix -> suffix that the graph does not have."""
    return sum(bin(prefix_mask & ~self.ancestors[v]).count("1") for v in suffix)

  def _series_cuts(self, vertices: list[int]) -> list[int]:
    cuts = []
    prefix = 0
    for i, v in enumerate(vertices[:-1]):
      prefix |= 1 << v
      if all(prefix & self.ancestors[w] == prefix for w in vertices[i + 1 :]):
        cuts.append(i + 1)
    return cuts

  def _best_forced_cut(self, vertices: list[int]) -> tuple[list[int], int]:
    """The down-set cut missing the smallest share of relations."""
    inside = mask_of(vertices)
    level = {}
    for v in vertices:
      preds = [u for u in bits(self.ancestors[v] & inside)]
      level[v] = 1 + max((level[u] for u in preds), default=-1)
    orders = [vertices, sorted(vertices, key=lambda v: (level[v], v))]
    best = None
    for order in orders:
      prefix = 0
      for i, v in enumerate(order[:-1]):
        prefix |= 1 << v
        suffix = order[i + 1 :]
        # The share of prefix -> suffix relations that are missing: a raw
        # count would favour peeling single nodes off the front.
        missing = self._missing(prefix, suffix)
        score = (
          missing / ((i + 1) * len(suffix)),
          abs(2 * (i + 1) - len(order)),
          missing,
        )
        if best is None or score < best[0]:
          best = (score, order[: i + 1])
    (_, _, missing), prefix_list = best
    return sorted(prefix_list), missing


def _make(kind: str, children: list[SPTree], added: int = 0) -> SPTree:
  """A series/parallel node, flattening children of the same kind."""
  flat = []
  for child in children:
    if child.kind == kind:
      flat.extend(child.children)
    else:
      flat.append(child)
  return SPTree(
    kind,
    children=tuple(flat),
    vertices=tuple(sorted(v for c in flat for v in c.vertices)),
    added_dependencies=added + sum(c.added_dependencies for c in children),
  )
