"""`OpGraph`: the operator DAG that the planner, simulator and runtime share.

A node is a group of traced equations (one Flax module call, at the chosen
granularity) with its costs; an edge carries the values one node produces and
another consumes. Figures that scale with the batch are per sample; the
batch-independent remainder of the same figure is kept in a `*_fixed` field
(per step), so a cost at micro-batch b is `per_sample * b + fixed`.

A graph made by `graphpipe.capture` also holds the executable pieces (one closed
jaxpr per node, see `graphpipe.frontend.program`); a graph loaded from JSON has
the structure and costs only, which is all the planner needs.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
from collections.abc import Sequence
from typing import Any

from graphpipe.core.files import (
  EDGE_FIGURES,
  NODE_FIGURES,
  check_figures,
  read_json,
)
from graphpipe.errors import GraphError, GraphFormatError, NodeNotFoundError

FORMAT_VERSION = 2


@dataclasses.dataclass(frozen=True)
class Node:
  """One operator node: a module call (or glue code) of the traced loss.

  Attributes:
    id: position in topological order (edges go from lower to higher ids).
    name: the module path, e.g. 'branches.0.layers.3' ('#k' marks a second
      call of the same module, 'glue'/'loss' code outside modules).
    params: paths of the trainable parameters this node owns.
    param_bytes: bytes of those parameters.
    state: paths of non-trainable variables it reads (e.g. batch statistics).
    state_bytes: bytes of those variables.
    fwd_flops / bwd_flops: FLOPs of the forward / backward pass, per sample.
    fwd_bytes / bwd_bytes: bytes accessed (XLA's count before fusion), per
      sample.
    activation_bytes: bytes of the outputs other nodes (or the loss) read,
      per sample.
    saved_bytes: bytes the backward pass keeps from the forward (residuals,
      including the node's own inputs when the backward needs them), per
      sample: every intermediate the VJP reads.
    kept_bytes: the part of those the runtime stashes, per sample: the
      outputs of its matrix products and the inputs its backward reads (it
      recomputes the elementwise work between them; the policy
      `graphpipe.frontend.node_costs.save_products`). None: saved_bytes.
    fixed: the batch-independent part of the figures above, by field name
      (per step; usually ~0).
    batch_inputs: names of the batch leaves the node reads.
  """

  id: int
  name: str
  params: tuple[str, ...] = ()
  param_bytes: int = 0
  state: tuple[str, ...] = ()
  state_bytes: int = 0
  fwd_flops: float = 0.0
  bwd_flops: float = 0.0
  fwd_bytes: float = 0.0
  bwd_bytes: float = 0.0
  activation_bytes: float = 0.0
  saved_bytes: float = 0.0
  fixed: dict[str, float] = dataclasses.field(default_factory=dict)
  batch_inputs: tuple[str, ...] = ()
  kept_bytes: float | None = None

  def __post_init__(self):
    if self.kept_bytes is None:
      object.__setattr__(self, "kept_bytes", self.saved_bytes)

  def cost(self, field: str, batch: int) -> float:
    """`field` (e.g. 'fwd_flops') at a micro-batch of `batch` samples."""
    return getattr(self, field) * batch + self.fixed.get(field, 0.0)


@dataclasses.dataclass(frozen=True)
class Edge:
  """Values produced by node `src` and read by node `dst`.

  Attributes:
    src, dst: node ids (src < dst).
    bytes: bytes per sample of the values carried.
    fixed_bytes: batch-independent bytes carried (per step).
    num_values: how many arrays travel on the edge.
  """

  src: int
  dst: int
  bytes: float
  fixed_bytes: float = 0.0
  num_values: int = 1


@dataclasses.dataclass(frozen=True)
class InputSpec:
  """A leaf of the batch: its name, per-sample shape and dtype."""

  name: str
  shape: tuple[int, ...]
  dtype: str


class OpGraph:
  """A DAG of operator nodes with costs; the unit of planning.

  Example:
    >>> graph = capture_zoo("two_branch", "tiny")   # a captured zoo model
    >>> print(graph)                     # a table of nodes
    OpGraph two_branch tiny: 9 nodes, 8 edges, loss at [8] (figures per sample)
      id name              fwd GFLOP bwd GFLOP params MB act KB saved KB preds
    ------------------------------------------------------------------...
       0 branches.0.layers.0  0.0000    0.0001    0.009   0.51    13.70  -
       1 branches.0.layers.1  0.0000    0.0001    0.009   0.51    13.70  0
    ...
       8 classifier           0.0000    0.0000    0.001   0.00     0.16  3,7
    ------------------------------------------------------------------...
         total                0.0003    0.0006    0.072   4.10   109.72
    >>> graph.successors(3), graph.predecessors(8), graph.sources()
    ([8], [3, 7], [0, 4])
    >>> graph.totals()["num_params"]
    17957
    >>> graph.save("graph.json")
    >>> OpGraph.load("graph.json")       # structure and costs, no program
    OpGraph(model='two_branch', nodes=9, edges=8)

  Args:
    nodes: nodes with ids 0..n-1 in a topological order.
    edges: edges between them, src < dst.
    inputs: the batch leaves.
    loss_nodes: nodes whose scalar outputs sum to the loss (one for most
      models; several for multi-task models whose losses are summed).
    batch_size: the batch size the graph was traced at.
    model, config: descriptive names (free text).
    program: the executable pieces, when the graph was captured.
    meta: free-form facts about the capture (granularity, framework, ...).
    shared: bytes of each variable several nodes read ('param:<path>' or
      'state:<path>' -> bytes): a tied embedding, a bias every layer adds.
      Each stage holding a reader holds a copy (`variable_bytes`); the
      runtime sums the copies' gradients.
  """

  def __init__(
    self,
    nodes: Sequence[Node],
    edges: Sequence[Edge],
    *,
    inputs: Sequence[InputSpec] = (),
    loss_nodes: Sequence[int] = (),
    batch_size: int = 1,
    model: str = "",
    config: str = "",
    program: Any = None,
    meta: dict | None = None,
    shared: dict | None = None,
  ):
    self.nodes = tuple(nodes)
    self.edges = tuple(edges)
    self.inputs = tuple(inputs)
    self.loss_nodes = tuple(loss_nodes) or (
      (len(self.nodes) - 1,) if self.nodes else ()
    )
    self.batch_size = int(batch_size)
    self.model = model
    self.config = config
    self.program = program
    self.meta = dict(meta or {})
    self.shared = dict(shared or {})
    self._held: dict[tuple, int] = {}  # `variable_bytes`, memoised
    self._assumed = False  # `assuming_traces`
    self._validate()
    self._readers = {
      key: tuple(
        n.id for n in self.nodes if key.partition(":")[2] in _names(n, key)
      )
      for key in self.shared
    }
    self._succ = {n.id: [] for n in self.nodes}
    self._pred = {n.id: [] for n in self.nodes}
    for e in self.edges:
      self._succ[e.src].append(e.dst)
      self._pred[e.dst].append(e.src)

  def _validate(self):
    ids = [n.id for n in self.nodes]
    if ids != list(range(len(ids))):
      raise GraphError(
        f"node ids must be 0..{len(ids) - 1} in order, got {ids[:10]}..."
      )
    seen = set()
    for e in self.edges:
      if not (0 <= e.src < e.dst < len(ids)):
        raise GraphError(
          f"edge {e.src}->{e.dst} does not go forward between existing "
          "nodes: ids must be a topological order"
        )
      if (e.src, e.dst) in seen:
        raise GraphError(f"duplicate edge {e.src}->{e.dst}")
      seen.add((e.src, e.dst))
    for i in self.loss_nodes:
      if not 0 <= i < len(ids):
        raise GraphError(f"loss node {i} is not a node of the graph")
    for key, size in self.shared.items():
      kind, _, name = key.partition(":")
      readers = [n for n in self.nodes if name in _names(n, key)]
      if (
        kind not in ("param", "state")
        or len(readers) < 2
        or not (isinstance(size, int | float) and size >= 0)
      ):
        raise GraphError(
          f"shared variable {key!r} ({size!r} bytes) is not a 'param:' or "
          "'state:' variable of at least two nodes with a size >= 0"
        )

  def shared_readers(self) -> dict[str, tuple[int, ...]]:
    """Each shared variable ('param:<path>', 'state:<path>') -> the nodes
    that read it."""
    return dict(self._readers)

  def variable_bytes(self, nodes, kind: str = "param") -> int:
    """Bytes of the parameters ('param') or non-trainable variables
    ('state') a stage of `nodes` holds: a variable several of them read
    counts once (its readers' `param_bytes` each include it)."""
    nodes = tuple(nodes)
    # Memoised: the planners ask about the same stages thousands of times
    # (the graph's nodes and shared variables never change).
    found = self._held.get((nodes, kind))
    if found is not None:
      return found
    field = "param_bytes" if kind == "param" else "state_bytes"
    total = sum(getattr(self.nodes[n], field) for n in nodes)
    if self.shared:
      inside = set(nodes)
      for key, readers in self._readers.items():
        if key.startswith(kind + ":"):
          count = sum(n in inside for n in readers)
          if count > 1:
            total -= (count - 1) * self.shared[key]
    self._held[(nodes, kind)] = total
    return total

  def exchanged_bytes(self, stage_nodes) -> int:
    """Bytes of shared parameters held by more than one of the stages
    (`stage_nodes`: each stage's nodes): their gradients are summed
    across the holders every step."""
    if not self.shared:
      return 0
    total = 0
    for key, readers in self._readers.items():
      if key.startswith("param:"):
        holders = sum(any(n in readers for n in nodes) for nodes in stage_nodes)
        if holders > 1:
          total += self.shared[key]
    return total

  @property
  def loss_form(self) -> str:
    """How the loss combines micro-batches, as capture proved it from its
    program (`graphpipe.frontend.loss_form`; '' for a graph built by
    hand)."""
    return self.meta.get("loss_form", "")

  def traces_at(self, batch_size: int) -> bool:
    """Whether the captured model's code traces at `batch_size` samples
    (True for a graph without a program: nothing to ask). Within
    `assuming_traces`, whether no trace at that size has failed yet."""
    if self.program is None:
      return True
    if self._assumed:
      return not self.program.known_refused(batch_size)
    return self.program.traces_at(batch_size)

  @contextlib.contextmanager
  def assuming_traces(self):
    """Within: `traces_at` answers without tracing, True unless a trace
    at that size failed before.

    A trace of a paper-size model takes about a second and a search asks
    about every micro-batch and chunk size; the planners search assuming
    and then trace the sizes of the plan they chose, searching again
    without a size that fails (`graphpipe.planning.search.plan`).
    """
    before, self._assumed = self._assumed, True
    try:
      yield
    finally:
      self._assumed = before

  @property
  def whole_batch_only(self) -> str | None:
    """Why the loss is exact only with the whole batch in one piece (a
    max or a product across samples), or None: plans must not split the
    batch."""
    return self.meta.get("whole_batch_only")

  @property
  def collective_axes(self) -> tuple[str, ...]:
    """The collective axes the model's code names (BatchNorm(axis_name=
    'batch')): the replicas of a micro-batch, which the plans keep on one
    device (no data-parallel stage), so a statistic over the axis is the
    whole micro-batch's."""
    return tuple(self.meta.get("collective_axes", ()))

  # Structure.

  def __len__(self) -> int:
    return len(self.nodes)

  def successors(self, node: int) -> list[int]:
    """Ids of the nodes that read `node`'s outputs."""
    return list(self._succ[node])

  def predecessors(self, node: int) -> list[int]:
    """Ids of the nodes whose outputs `node` reads."""
    return list(self._pred[node])

  def edge(self, src: int, dst: int) -> Edge:
    """The edge src -> dst (`NodeNotFoundError`, a KeyError, if absent)."""
    for e in self.edges:
      if e.src == src and e.dst == dst:
        return e
    raise NodeNotFoundError(f"the graph has no edge {src}->{dst}")

  def sources(self) -> list[int]:
    """Nodes with no predecessor."""
    return [n.id for n in self.nodes if not self._pred[n.id]]

  def sinks(self) -> list[int]:
    """Nodes with no successor."""
    return [n.id for n in self.nodes if not self._succ[n.id]]

  def node_by_name(self, name: str) -> Node:
    """The node called `name`."""
    for n in self.nodes:
      if n.name == name:
        return n
    known = ", ".join(n.name for n in self.nodes[:5])
    raise NodeNotFoundError(
      f"no node is called {name!r}; the graph's nodes are {known}, ..."
    )

  def totals(self) -> dict[str, float]:
    """Sums over nodes: per-sample FLOPs and bytes, parameter bytes, ..."""
    fields = (
      "fwd_flops",
      "bwd_flops",
      "fwd_bytes",
      "bwd_bytes",
      "activation_bytes",
      "saved_bytes",
      "param_bytes",
      "state_bytes",
    )
    out = {f: sum(getattr(n, f) for n in self.nodes) for f in fields}
    everything = range(len(self.nodes))
    out["param_bytes"] = self.variable_bytes(everything, "param")
    out["state_bytes"] = self.variable_bytes(everything, "state")
    out["num_params"] = self.meta.get("num_params", 0)
    out["num_nodes"] = len(self.nodes)
    out["num_edges"] = len(self.edges)
    return out

  # Printing and files.

  def table(self) -> str:
    """A readable table of the nodes (per-sample figures)."""
    head = (
      f"{'id':>4} {'name':<34} {'fwd GFLOP':>10} {'bwd GFLOP':>10} "
      f"{'params MB':>10} {'act KB':>9} {'saved KB':>9}  preds"
    )
    lines = [head, "-" * len(head)]
    for n in self.nodes:
      name = n.name if len(n.name) <= 34 else "..." + n.name[-31:]
      preds = ",".join(str(p) for p in self._pred[n.id]) or "-"
      lines.append(
        f"{n.id:>4} {name:<34} {n.fwd_flops / 1e9:>10.4f} "
        f"{n.bwd_flops / 1e9:>10.4f} {n.param_bytes / 1e6:>10.3f} "
        f"{n.activation_bytes / 1e3:>9.2f} {n.saved_bytes / 1e3:>9.2f}  "
        f"{preds}"
      )
    t = self.totals()
    lines.append("-" * len(head))
    lines.append(
      f"{'':>4} {'total':<34} {t['fwd_flops'] / 1e9:>10.4f} "
      f"{t['bwd_flops'] / 1e9:>10.4f} {t['param_bytes'] / 1e6:>10.3f} "
      f"{t['activation_bytes'] / 1e3:>9.2f} {t['saved_bytes'] / 1e3:>9.2f}"
    )
    return "\n".join(lines)

  def __str__(self) -> str:
    title = f"OpGraph {self.model or ''} {self.config or ''}".rstrip()
    return (
      f"{title}: {len(self.nodes)} nodes, {len(self.edges)} edges, "
      f"loss at {list(self.loss_nodes)} (figures per sample)\n{self.table()}"
    )

  def __repr__(self) -> str:
    return (
      f"OpGraph(model={self.model!r}, nodes={len(self.nodes)}, "
      f"edges={len(self.edges)})"
    )

  def to_dict(self) -> dict:
    """A JSON-ready dict (the executable program is not included)."""
    return {
      "format_version": FORMAT_VERSION,
      "model": self.model,
      "config": self.config,
      "batch_size": self.batch_size,
      "loss_nodes": list(self.loss_nodes),
      "inputs": [dataclasses.asdict(i) for i in self.inputs],
      "nodes": [dataclasses.asdict(n) for n in self.nodes],
      "edges": [dataclasses.asdict(e) for e in self.edges],
      "totals": self.totals(),
      "meta": self.meta,
      "shared": self.shared,
    }

  @classmethod
  def from_dict(cls, data: dict) -> OpGraph:
    """Inverse of `to_dict`; refuses missing, non-numeric, negative figures."""
    if not isinstance(data, dict):
      raise GraphFormatError(
        f"not a graphpipe graph file: a {type(data).__name__}, not an object"
      )
    try:
      if data.get("format_version") != FORMAT_VERSION:
        raise GraphFormatError(
          f"graph format version {data.get('format_version')!r}, expected "
          f"{FORMAT_VERSION}: re-capture the model"
        )
      nodes = [
        Node(
          **{
            **n,
            "params": tuple(n["params"]),
            "state": tuple(n["state"]),
            "batch_inputs": tuple(n["batch_inputs"]),
          }
        )
        for n in data["nodes"]
      ]
      edges = [Edge(**e) for e in data["edges"]]
      check_figures(data["nodes"], NODE_FIGURES, "node")
      check_figures(data["edges"], EDGE_FIGURES, "edge")
      if not nodes:
        raise GraphFormatError("the graph file has no nodes")
      inputs = [
        InputSpec(i["name"], tuple(i["shape"]), i["dtype"])
        for i in data["inputs"]
      ]
      return cls(
        nodes,
        edges,
        inputs=inputs,
        loss_nodes=data["loss_nodes"],
        batch_size=data["batch_size"],
        model=data.get("model", ""),
        config=data.get("config", ""),
        meta=data.get("meta", {}),
        shared=data.get("shared", {}),
      )
    except (KeyError, TypeError) as err:
      raise GraphFormatError(f"not a graphpipe graph file: {err!r}") from err

  def save(self, path: str) -> None:
    """Writes the graph (structure and costs) as JSON."""
    with open(path, "w") as f:
      json.dump(self.to_dict(), f, indent=1)

  @classmethod
  def load(cls, path: str) -> OpGraph:
    """Reads a graph written by `save` (without the executable program)."""
    return cls.from_dict(read_json(path, "a graph"))

  def to_dot(self) -> str:
    """Graphviz DOT text: one box per node, edges labelled in KB/sample."""
    lines = [
      "digraph opgraph {",
      "  rankdir=TB;",
      '  node [shape=box, fontname="monospace", fontsize=10];',
    ]
    for n in self.nodes:
      label = (
        f"{n.id}: {n.name}\\nfwd {n.fwd_flops / 1e6:.3g} MFLOP/sample"
        f"\\nparams {n.param_bytes / 1e6:.3g} MB"
      )
      style = (
        ', style=filled, fillcolor="#fde2c0"'
        if (n.id in self.loss_nodes)
        else ""
      )
      lines.append(f'  n{n.id} [label="{label}"{style}];')
    for e in self.edges:
      lines.append(f'  n{e.src} -> n{e.dst} [label="{e.bytes / 1e3:.3g} KB"];')
    lines.append("}")
    return "\n".join(lines) + "\n"

  # Execution (captured graphs only).

  def _require_program(self):
    if self.program is None:
      raise GraphError(
        "this graph has no executable program (it was loaded from JSON): "
        "capture the model with graphpipe.capture to run it"
      )
    return self.program

  def evaluate(self, variables, batch, rng=None):
    """The loss, computed node by node in topological order.

    Args:
      variables: the model's variables as at capture: an `nnx.State` (or the
        NNX model itself) for NNX, the variables dict for linen.
      batch: a batch with the same structure as at capture (any batch size).
      rng: for a model that draws in training, the key of the step (its
        streams' keys, `graphpipe.frontend.streams`); an NNX model's own
        keys otherwise.

    Returns:
      The scalar loss, equal to `loss_fn(model, batch)`.
    """
    return self._require_program().evaluate(variables, batch, rng)


def _names(node: Node, key: str) -> tuple[str, ...]:
  return node.params if key.startswith("param:") else node.state
