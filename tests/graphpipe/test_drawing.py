"""Drawing a DAG (`graphpipe.draw_graph`) and a timeline (`draw_gantt`)."""

import dataclasses

import pytest

import graphpipe
from graphpipe.core.drawing import layout
from graphpipe.errors import GraphError
from graphpipe.models import capture_zoo
from tests.graphpipe.test_planner import candle_like, two_branch

Figure = pytest.importorskip("matplotlib.figure").Figure


def test_layout_points_every_edge_right_and_keeps_branches_on_rows():
  graph = candle_like(3)  # 3 chains of 4, join, head of 3
  pos = layout(graph)
  assert all(pos[e.src][0] < pos[e.dst][0] for e in graph.edges)
  chains = [range(4 * b, 4 * b + 4) for b in range(3)]
  rows = [{pos[v][1] for v in chain} for chain in chains]
  assert all(len(r) == 1 for r in rows)  # a chain stays on its row
  assert len(set.union(*rows)) == 3  # and no two chains share one
  # Nodes of one column never overlap.
  by_column = {}
  for x, y in pos.values():
    by_column.setdefault(x, []).append(y)
  for ys in by_column.values():
    ys.sort()
    assert all(b - a >= 1 for a, b in zip(ys, ys[1:], strict=False))


def test_draw_graph_colours_nodes_by_stage():
  graph = two_branch()
  plan = graphpipe.plan(graph, num_devices=4, batch_size=8)
  axes = Figure().add_subplot()
  graphpipe.draw_graph(graph, axes, plan)
  boxes = {
    int(t.get_text().split()[0]): t.get_bbox_patch().get_facecolor()
    for t in axes.texts
    if t.get_text()
  }
  assert sorted(boxes) == list(range(len(graph.nodes)))
  for stage in plan.stages:
    assert len({boxes[v] for v in stage.nodes}) == 1
  colours = {boxes[s.nodes[0]] for s in plan.stages}
  assert len(colours) == plan.num_stages
  arrows = [t for t in axes.texts if not t.get_text()]
  assert len(arrows) == len(graph.edges)


def test_draw_graph_refuses_a_plan_of_another_graph():
  plan = graphpipe.plan(two_branch(), num_devices=2, batch_size=8)
  with pytest.raises(GraphError, match="made for another graph"):
    graphpipe.draw_graph(candle_like(2), Figure().add_subplot(), plan)
  # A plan of another graph with as many nodes was drawn, coloured by
  # stages it never had (simulate refused the same pair).
  tiny = capture_zoo("two_branch", "tiny")
  other = capture_zoo("mmt", "tiny")
  assert len(tiny.nodes) == len(other.nodes)
  with pytest.raises(GraphError, match="made for another graph"):
    graphpipe.draw_graph(tiny, Figure().add_subplot(), plan_of(other))
  # A plan without a fingerprint (written by hand) that leaves nodes out.
  unsigned = dataclasses.replace(plan, graph_fingerprint="")
  with pytest.raises(GraphError, match="not made for this graph"):
    graphpipe.draw_graph(candle_like(2), Figure().add_subplot(), unsigned)


def plan_of(graph):
  return graphpipe.plan(graph, num_devices=4, batch_size=16)


def test_draw_gantt_shares_a_time_scale():
  graph = two_branch()
  reports = [
    graphpipe.simulate(graphpipe.plan(graph, 4, 8, planner=p), graph)
    for p in ("graphpipe", "sequential")
  ]
  end = max(r.iteration_time_s for r in reports)
  figure = Figure()
  axes = [figure.add_subplot(2, 1, i + 1) for i in range(2)]
  for a, r in zip(axes, reports, strict=True):
    r.draw_gantt(a, end_s=end)
  assert axes[0].get_xlim() == axes[1].get_xlim()
  for a, r in zip(axes, reports, strict=True):
    compute = [e for e in r.events if e.category != "transfer"]
    bars = sum(
      len(c.get_paths()) for c in a.collections if c.get_alpha() != 0.6
    )
    assert bars == len(compute)
    assert r.planner in a.get_title()
