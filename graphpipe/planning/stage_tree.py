"""The candidate stages of a series-parallel tree, flattened for the DP.

  tree = StageTree.build(sp.decompose(dag), dag, work)
  tree.base_nodes[i]          # the operator nodes of candidate stage i

Tree vertices are numbered in pre-order; `kind`, `children`, `depth` and
`nodes` are indexed by vertex. Candidate stages ("bases") are numbered in
`base_nodes`:

- a leaf (`leaf_base[x]`);
- a range s..j of a series vertex's children, or of two or more
  neighbouring branches of a parallel vertex (`range_base[(x, s, j)]`);
- after a parallel child p of a series vertex x, children p+1..j together
  with the tail of one branch i of p, from its child c on
  (`absorb_base[(x, p + 1, j)]` lists (i, c, base)): how a join shares a
  stage with the last layers of one branch instead of needing a device of
  its own.

Parallel branches are ordered by work (heaviest first), so that grouping
neighbours groups similar branches.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from graphpipe.planning import sp


@dataclasses.dataclass
class StageTree:
  """A flattened series-parallel tree and its numbered candidate stages.

  Attributes:
    root: the root vertex.
    kind: per vertex, 'leaf', 'series' or 'parallel'.
    children: per vertex, its children (parallel ones heaviest first).
    depth: per vertex, the most stages on a path through it.
    nodes: per vertex, the operator nodes below it (sorted).
    base_nodes: per candidate stage, its operator nodes (sorted).
    leaf_base: leaf vertex -> its candidate stage.
    range_base: (vertex, first child, last child) -> candidate stage.
    absorb_base: (series vertex, first child, last child) -> [(branch,
      first child of the branch's tail, candidate stage)], longest tails
      last.
    prefix_depth: series vertex -> running sums of its children's depths.
  """

  root: int = 0
  kind: list[str] = dataclasses.field(default_factory=list)
  children: list[list[int]] = dataclasses.field(default_factory=list)
  depth: list[int] = dataclasses.field(default_factory=list)
  nodes: list[tuple[int, ...]] = dataclasses.field(default_factory=list)
  base_nodes: list[tuple[int, ...]] = dataclasses.field(default_factory=list)
  leaf_base: dict[int, int] = dataclasses.field(default_factory=dict)
  range_base: dict[tuple[int, int, int], int] = dataclasses.field(
    default_factory=dict
  )
  absorb_base: dict[tuple[int, int, int], list] = dataclasses.field(
    default_factory=dict
  )
  prefix_depth: dict[int, list[int]] = dataclasses.field(default_factory=dict)

  @classmethod
  def build(
    cls, tree: sp.SPTree, dag: sp.Dag, work: Sequence[float]
  ) -> StageTree:
    """Flattens `tree` (over `dag`'s groups) and numbers its candidates.

    Example:
      >>> graph = capture_zoo("two_branch", "tiny")  # branches 0-3, 4-7; 8
      >>> dag = sp.Dag.of(graph)
      >>> flat = StageTree.build(sp.decompose(dag), dag, [1.0] * len(graph))
      >>> root = flat.root
      >>> flat.kind[root], [flat.kind[c] for c in flat.children[root]]
      ('series', ['parallel', 'leaf'])
      >>> flat.depth[root], len(flat.base_nodes)   # longest path, candidates
      (5, 41)

    Args:
      tree: the series-parallel decomposition.
      dag: the DAG it decomposes (its groups map vertices to nodes).
      work: per operator node, the work that orders parallel branches.
    """
    out = cls()

    def add(vertex: sp.SPTree) -> int:
      x = len(out.kind)
      out.kind.append(vertex.kind)
      out.children.append([])
      out.depth.append(vertex.depth)
      out.nodes.append(
        tuple(sorted(n for v in vertex.vertices for n in dag.groups[v]))
      )
      ids = [add(c) for c in vertex.children]
      if vertex.kind == "parallel":
        ids.sort(key=lambda c: -sum(work[n] for n in out.nodes[c]))
      out.children[x] = ids
      if vertex.kind == "leaf":
        out.leaf_base[x] = out._new_base(out.nodes[x])
        return x
      for j in range(len(ids)):
        for s in range(j + 1):
          if vertex.kind == "parallel" and s == j:
            continue  # a lone branch is covered by its own sub-problem
          out.range_base[(x, s, j)] = out._new_base(out._union(ids[s : j + 1]))
      if vertex.kind == "series":
        out.prefix_depth[x] = list(_running_sum([out.depth[c] for c in ids]))
        out._absorbing_stages(x, ids)
      return x

    out.root = add(tree)
    return out

  def _absorbing_stages(self, x: int, ids: list[int]) -> None:
    for p, par in enumerate(ids[:-1]):
      if self.kind[par] != "parallel":
        continue
      for j in range(p + 1, len(ids)):
        after = self._union(ids[p + 1 : j + 1])
        options = []
        for i, branch in enumerate(self.children[par]):
          parts = (
            self.children[branch] if self.kind[branch] == "series" else [branch]
          )
          # Longest tails last, so the DP can stop at the first misfit.
          for c in reversed(range(len(parts))):
            nodes = tuple(sorted(after + self._union(parts[c:])))
            options.append((i, c, self._new_base(nodes)))
        self.absorb_base[(x, p + 1, j)] = options

  def _union(self, ids) -> tuple[int, ...]:
    return tuple(sorted(n for c in ids for n in self.nodes[c]))

  def _new_base(self, nodes: tuple[int, ...]) -> int:
    self.base_nodes.append(nodes)
    return len(self.base_nodes) - 1


def _running_sum(values):
  total = 0
  for v in values:
    total += v
    yield total
