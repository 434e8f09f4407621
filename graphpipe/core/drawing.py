"""`draw_graph`: an operator DAG drawn on matplotlib axes, without graphviz.

`OpGraph.to_dot` gives Graphviz text; where Graphviz is not installed (a
notebook on a laptop, CI) `draw_graph` lays the DAG out itself and draws it
on axes the caller made, so this module imports no plotting library. Nodes
sit in columns by their longest path from a source (so every edge points
right) and, inside a column, near the mean height of their predecessors
(so branches stay on their own rows). Given a plan, each node is coloured
by its stage.
"""

from __future__ import annotations

from graphpipe.core.fingerprint import made_for
from graphpipe.core.graph import OpGraph
from graphpipe.core.stages import Plan
from graphpipe.errors import GraphError

# matplotlib's tab10 then tab10's light shades: stage colours.
_PALETTE = (
  "#1f77b4",
  "#ff7f0e",
  "#2ca02c",
  "#d62728",
  "#9467bd",
  "#8c564b",
  "#e377c2",
  "#7f7f7f",
  "#bcbd22",
  "#17becf",
  "#aec7e8",
  "#ffbb78",
  "#98df8a",
  "#ff9896",
  "#c5b0d5",
  "#c49c94",
)
_PLAIN = "#dbe9f6"


def layout(graph: OpGraph) -> dict[int, tuple[float, float]]:
  """A position (column, row) per node: edges point to later columns.

  Example:
    >>> graph = capture_zoo("two_branch", "tiny")
    >>> pos = layout(graph)
    >>> all(pos[e.src][0] < pos[e.dst][0] for e in graph.edges)
    True

  Args:
    graph: the graph to lay out.
  """
  order = [n.id for n in graph.nodes]  # ids are topological (src < dst)
  column = {}
  for v in order:
    preds = graph.predecessors(v)
    column[v] = 1 + max((column[p] for p in preds), default=-1)
  rows: dict[int, float] = {}
  by_column: dict[int, list[int]] = {}
  for v in order:
    by_column.setdefault(column[v], []).append(v)
  for c in sorted(by_column):
    nodes = by_column[c]
    wanted = {
      v: (
        sum(rows[p] for p in graph.predecessors(v)) / len(graph.predecessors(v))
        if graph.predecessors(v)
        else float(i)
      )
      for i, v in enumerate(nodes)
    }
    # Keep the wanted order, at least one row apart, centred on the wish.
    placed = sorted(nodes, key=lambda v: (wanted[v], v))
    for i, v in enumerate(placed):
      rows[v] = wanted[v] if i == 0 else max(wanted[v], rows[placed[i - 1]] + 1)
    shift = sum(wanted.values()) / len(nodes) - sum(
      rows[v] for v in nodes
    ) / len(nodes)
    if c > 0:
      for v in nodes:
        rows[v] += shift
  return {v: (float(column[v]), rows[v]) for v in order}


def draw_graph(
  graph: OpGraph, axes, plan: Plan | None = None, title: str = ""
) -> dict[int, tuple[float, float]]:
  """Draws the DAG on matplotlib `axes`; returns each node's position.

  One labelled box per node (id and name; the loss node(s) outlined in
  red), one arrow per edge. With `plan`, boxes take their stage's colour
  and the legend names the stages.

  Example:
    >>> from matplotlib.figure import Figure
    >>> graph = capture_zoo("two_branch", "tiny")
    >>> plan = graphpipe.plan(graph, num_devices=4, batch_size=8)
    >>> axes = Figure(figsize=(10, 3)).add_subplot()
    >>> pos = graphpipe.draw_graph(graph, axes, plan)
    >>> labels = [t.get_text() for t in axes.texts if t.get_text()]
    >>> len(labels), labels[-1].split(), pos[8]   # the classifier, last
    (9, ['8', 'classifier'], (4.0, 0.5))

  Args:
    graph: the graph.
    axes: a matplotlib `Axes` to draw on.
    plan: colour the nodes by this plan's stages (a plan of `graph`).
    title: the axes title.
  """
  stage_of = {}
  if plan is not None:
    if not made_for(plan, graph):
      raise GraphError(
        "the plan was made for another graph (fingerprints differ): draw "
        "it on the graph it plans"
      )
    for stage in plan.stages:
      for v in stage.nodes:
        stage_of[v] = stage.id
    missing = sorted(set(range(len(graph.nodes))) - set(stage_of))
    if missing:
      raise GraphError(
        f"the plan places no stage on nodes {missing}: it was not made for "
        "this graph"
      )
  pos = layout(graph)
  loss = set(graph.loss_nodes)
  boxes = {}
  for node in graph.nodes:
    stage = stage_of.get(node.id)
    colour = _PLAIN if stage is None else _PALETTE[stage % len(_PALETTE)]
    boxes[node.id] = axes.text(
      *pos[node.id],
      f"{node.id}\n{node.name}",
      ha="center",
      va="center",
      fontsize=7,
      color="black" if stage is None else "white",
      bbox={
        "boxstyle": "round,pad=0.3",
        "facecolor": colour,
        "edgecolor": "#d62728" if node.id in loss else "#333333",
        "linewidth": 1.5 if node.id in loss else 0.6,
      },
    )
  for e in graph.edges:
    # From the right side of one box to the left side of the next.
    axes.annotate(
      "",
      xy=(0.0, 0.5),
      xycoords=boxes[e.dst],
      xytext=(1.0, 0.5),
      textcoords=boxes[e.src],
      arrowprops={
        "arrowstyle": "-|>",
        "color": "#555555",
        "shrinkA": 3,
        "shrinkB": 3,
        "linewidth": 0.8,
      },
    )
  if plan is not None:
    for stage in plan.stages:
      axes.plot(
        [],
        [],
        "s",
        color=_PALETTE[stage.id % len(_PALETTE)],
        label=f"stage {stage.id}: devices {list(stage.devices)}",
      )
    axes.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=7)
  xs = [p[0] for p in pos.values()]
  ys = [p[1] for p in pos.values()]
  axes.set_xlim(min(xs) - 0.6, max(xs) + 0.6)
  axes.set_ylim(max(ys) + 0.7, min(ys) - 0.7)  # first row on top
  axes.set_axis_off()
  axes.set_title(title or f"{graph.model or 'graph'}: {len(graph.nodes)} nodes")
  return pos
