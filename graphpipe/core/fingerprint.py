"""`graph_fingerprint`: a short hash that ties plans and profiles to a graph."""

from __future__ import annotations

import dataclasses
import hashlib
import json

from graphpipe.core.graph import OpGraph


def graph_fingerprint(graph: OpGraph) -> str:
  """A short hash of a graph's structure and costs (not its program).

  Plans and profiles record it so that they are never reused for another
  graph.

  Example:
    >>> graph = capture_zoo("two_branch", "tiny")
    >>> fingerprint = graph_fingerprint(graph)
    >>> len(fingerprint)                 # 16 hex digits of a SHA-256
    16
    >>> graph.save("graph.json")         # a graph read back is the same one
    >>> graph_fingerprint(OpGraph.load("graph.json")) == fingerprint
    True

  Args:
    graph: the operator graph.
  """
  # Remembered on the graph while its nodes, edges, loss nodes and shared
  # sizes are the same (nodes and edges are frozen: the same tuples are the
  # same values; the shared sizes, a dict, are compared by value). The
  # simulator checks the fingerprint of every plan it runs.
  memo = getattr(graph, "_fingerprint_memo", None)
  if (
    memo is not None
    and memo[0] is graph.nodes
    and memo[1] is graph.edges
    and memo[2] is graph.loss_nodes
    and memo[3] == graph.shared
  ):
    return memo[4]
  fingerprint = _fingerprint(graph)
  graph._fingerprint_memo = (
    graph.nodes,
    graph.edges,
    graph.loss_nodes,
    dict(graph.shared),
    fingerprint,
  )
  return fingerprint


def _fingerprint(graph: OpGraph) -> str:
  data = {
    "nodes": [dataclasses.asdict(n) for n in graph.nodes],
    "edges": [dataclasses.asdict(e) for e in graph.edges],
    "loss_nodes": list(graph.loss_nodes),
  }
  if graph.shared:
    data["shared"] = graph.shared
  text = json.dumps(data, sort_keys=True, default=str)
  return hashlib.sha256(text.encode()).hexdigest()[:16]


def made_for(plan, graph: OpGraph) -> bool:
  """Whether `plan` was made for `graph` (a plan that records no
  fingerprint, e.g. one written by hand, is taken as made for it).

  Example:
    >>> graph = capture_zoo("two_branch", "tiny")
    >>> made_for(graphpipe.plan(graph, 2, 8), graph)
    True
    >>> made_for(graphpipe.plan(graph, 2, 8), capture_zoo("mmt", "tiny"))
    False
  """
  return not plan.graph_fingerprint or (
    plan.graph_fingerprint == graph_fingerprint(graph)
  )
