"""Random operator DAGs for property tests (hypothesis strategies).

`op_graphs()` draws graphs of the shapes real models have and the planners
must handle: chains, fan-out (one value read by several branches), fan-in
(joins of two or three branches), skip edges across levels, crossings that
are not series-parallel (two joins that each read two of three branches),
several sources (batch inputs) and several sinks (loss nodes, summed), with
branches of unequal widths and costs, and nodes heavy in parameters (wide
weight matrices on small activations) next to nodes heavy in activations
(few weights, large saved tensors).
"""

from __future__ import annotations

from hypothesis import strategies as st

from graphpipe.core.graph import Edge, Node, OpGraph

# What a new node reads: one previous node, a node that already has a
# reader (a second branch out of it), two or three earlier nodes (a join),
# the previous node and one at least two levels back (a skip), or nothing
# (a new batch input).
SHAPES = ("chain", "fan_out", "fan_in", "skip", "cross", "source")


def node_of(i: int, kind: str, width: int, scale: float) -> Node:
  """A layer of `width` (scaled by its branch): param- or activation-heavy."""
  w = width * scale
  if kind == "params":  # a wide weight matrix on a narrow activation
    params, act, saved = 16.0 * w * w, 4.0 * w / 8, 8.0 * w / 8
    flops = 2.0 * w * w / 4
  else:  # few weights, large activations kept for the backward
    params, act, saved = 4.0 * w, 64.0 * w, 256.0 * w
    flops = 40.0 * w
  return Node(
    id=i,
    name=f"{kind[0]}{i}",
    param_bytes=int(params),
    fwd_flops=flops,
    bwd_flops=2.0 * flops,
    fwd_bytes=act + saved,
    bwd_bytes=2.0 * (act + saved),
    activation_bytes=act,
    saved_bytes=saved,
    fixed={"fwd_bytes": params, "bwd_bytes": 2.0 * params},
  )


@st.composite
def op_graphs(draw, min_nodes: int = 1, max_nodes: int = 8) -> OpGraph:
  """A random DAG of `min_nodes`..`max_nodes` nodes (see the module doc)."""
  n = draw(st.integers(min_nodes, max_nodes))
  preds: list[set[int]] = [set()]
  level = [0]
  for i in range(1, n):
    shape = draw(st.sampled_from(SHAPES))
    read = {i - 1}
    if shape == "fan_out":
      read_before = [v for v in range(i) if any(v in p for p in preds)]
      read = {draw(st.sampled_from(read_before or [i - 1]))}
    elif shape in ("fan_in", "cross") and i >= 2:
      k = 3 if shape == "fan_in" and i >= 3 and draw(st.booleans()) else 2
      read = set(draw(st.lists(st.integers(0, i - 1), min_size=k, max_size=k)))
      if shape == "cross" and i >= 3:
        # Two joins over overlapping pairs of earlier nodes: reading (a, b)
        # here after (b, c) before is the N shape no series-parallel
        # decomposition has.
        earlier = [p for p in preds if len(p) >= 2]
        if earlier:
          pair = sorted(draw(st.sampled_from(earlier)))
          read = {pair[-1], draw(st.integers(0, i - 1))}
    elif shape == "skip":
      far = [v for v in range(i) if level[v] <= level[i - 1] - 1]
      if far:
        read = {i - 1, draw(st.sampled_from(far))}
    elif shape == "source":
      read = set()
    preds.append(read)
    level.append(1 + max((level[v] for v in read), default=-1))
  # Branch scales: a node inherits the scale of its first predecessor, so
  # branches differ in width as a whole; each node may still differ.
  scale = []
  nodes = []
  for i in range(n):
    parent = min(preds[i], default=None)
    s = (
      draw(st.sampled_from([0.5, 1.0, 2.0, 4.0]))
      if parent is None or draw(st.booleans())
      else scale[parent]
    )
    scale.append(s)
    kind = draw(st.sampled_from(["params", "activations"]))
    width = draw(st.sampled_from([64, 256, 1024]))
    nodes.append(node_of(i, kind, width, s))
  edges = [
    Edge(a, b, nodes[a].activation_bytes)
    for b in range(n)
    for a in sorted(preds[b])
  ]
  sinks = [v for v in range(n) if not any(v in p for p in preds)]
  return OpGraph(nodes, edges, loss_nodes=sinks, model="random")
