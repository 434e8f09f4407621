"""Tests of graphpipe.sp: series-parallel trees, the non-SP conversion."""

import itertools

from hypothesis import given, settings
from hypothesis import strategies as st

from graphpipe.core.graph import Edge, Node, OpGraph
from graphpipe.planning import sp


def dag(n, edges) -> sp.Dag:
  return sp.Dag(tuple((i,) for i in range(n)), tuple(sorted(set(edges))))


def graph(n, edges) -> OpGraph:
  return OpGraph(
    [Node(i, f"n{i}", fwd_flops=1.0) for i in range(n)],
    [Edge(a, b, 1.0) for a, b in sorted(set(edges))],
  )


def check_tree(tree: sp.SPTree, d: sp.Dag) -> None:
  """Every vertex once; series children in edge order; parallel ones apart."""
  assert tree.vertices == tuple(range(len(d)))
  position = {}

  def walk(node):
    if node.kind == "leaf":
      assert node.vertices == (node.vertex,)
      return
    assert len(node.children) >= 2
    assert sorted(v for c in node.children for v in c.vertices) == list(
      node.vertices
    )
    for i, child in enumerate(node.children):
      for v in child.vertices:
        position[(id(node), v)] = i
    for a, b in d.edges:
      if a in node.vertices and b in node.vertices:
        pa, pb = position[(id(node), a)], position[(id(node), b)]
        if node.kind == "series":
          assert pa <= pb, f"edge {a}->{b} goes back in {node}"
        else:
          assert pa == pb, f"edge {a}->{b} joins parallel branches"
    for child in node.children:
      walk(child)

  walk(tree)


def test_chain_is_one_series():
  tree = sp.decompose(dag(4, [(0, 1), (1, 2), (2, 3)]))
  assert str(tree) == "(0 ; 1 ; 2 ; 3)"
  assert tree.depth == 4 and tree.added_dependencies == 0


def test_two_branches_and_a_join():
  edges = [(0, 1), (1, 2), (3, 4), (4, 5), (2, 6), (5, 6)]
  tree = sp.decompose(dag(7, edges))
  assert str(tree) == "(((0 ; 1 ; 2) | (3 ; 4 ; 5)) ; 6)"
  assert tree.depth == 4


def test_transitive_edges_do_not_break_series():
  # A residual connection 0 -> 2 around 1.
  tree = sp.decompose(dag(3, [(0, 1), (1, 2), (0, 2)]))
  assert str(tree) == "(0 ; 1 ; 2)"


def test_fork_and_join():
  edges = [(0, 1), (0, 2), (1, 3), (2, 3)]
  assert str(sp.decompose(dag(4, edges))) == "(0 ; (1 | 2) ; 3)"


def test_n_graph_is_converted_not_refused():
  # 0 -> 2, 1 -> 2, 1 -> 3: the smallest graph that is not series-parallel.
  d = dag(4, [(0, 2), (1, 2), (1, 3)])
  tree = sp.decompose(d)
  check_tree(tree, d)
  assert tree.added_dependencies > 0


def test_cross_edge_keeps_branch_structure():
  # Two 4-chains with one cross edge 1 -> 6: cut between levels 1 and 2.
  edges = [(0, 1), (1, 2), (2, 3), (4, 5), (5, 6), (6, 7), (1, 6)]
  d = dag(8, edges)
  tree = sp.decompose(d)
  check_tree(tree, d)
  assert str(tree) == "(((0 ; 1) | (4 ; 5)) ; ((2 ; 3) | (6 ; 7)))"


def test_contract_folds_glue_into_a_neighbour():
  # Two branches join at light node 4, then 5 reads it.
  g = graph(6, [(0, 1), (2, 3), (1, 4), (3, 4), (4, 5)])
  d = sp.contract(g, [5])
  assert (4, 5) in d.groups
  d = sp.contract(g, [4])
  assert (1, 4) in d.groups  # the predecessor with the lightest upstream
  check_tree(sp.decompose(d), d)


def test_contract_never_closes_a_cycle():
  # Merging 2 into 0 would put 1 both after and before the group.
  g = graph(3, [(0, 1), (1, 2), (0, 2)])
  d = sp.contract(g, [2])
  assert (1, 2) in d.groups
  g = graph(3, [(0, 1), (0, 2), (1, 2)])
  groups = sp.contract(g, [0]).groups
  assert len(groups) == 2 and (0, 1) in groups


@st.composite
def sp_dags(draw, max_parts=10):
  """Series-parallel DAGs built by random series/parallel compositions."""
  count = draw(st.integers(1, max_parts))
  # (sources, sinks, edges) of each part.
  parts = [([i], [i], []) for i in range(count)]
  while len(parts) > 1:
    a = parts.pop(draw(st.integers(0, len(parts) - 1)))
    b = parts.pop(draw(st.integers(0, len(parts) - 1)))
    if draw(st.booleans()):
      edges = a[2] + b[2] + list(itertools.product(a[1], b[0]))
      parts.append((a[0], b[1], edges))
    else:
      parts.append((a[0] + b[0], a[1] + b[1], a[2] + b[2]))
  edges = parts[0][2]
  rename = {v: i for i, v in enumerate(_topological(count, edges))}
  return dag(count, [(rename[a], rename[b]) for a, b in edges])


def _topological(n, edges):
  indeg = [0] * n
  for _, b in edges:
    indeg[b] += 1
  ready = [v for v in range(n) if indeg[v] == 0]
  order = []
  while ready:
    v = ready.pop()
    order.append(v)
    for a, b in edges:
      if a == v:
        indeg[b] -= 1
        if indeg[b] == 0:
          ready.append(b)
  return order


@st.composite
def any_dags(draw, max_nodes=10):
  n = draw(st.integers(1, max_nodes))
  pairs = [(a, b) for a in range(n) for b in range(a + 1, n)]
  edges = (
    draw(st.lists(st.sampled_from(pairs), max_size=3 * n)) if pairs else []
  )
  return dag(n, edges)


@settings(max_examples=60, deadline=None)
@given(sp_dags())
def test_series_parallel_dags_need_no_conversion(d):
  tree = sp.decompose(d)
  check_tree(tree, d)
  assert tree.added_dependencies == 0


@settings(max_examples=60, deadline=None)
@given(any_dags())
def test_every_dag_decomposes(d):
  check_tree(sp.decompose(d), d)
