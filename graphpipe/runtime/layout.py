"""Static layout of a pipelined step: who computes, stores and sends what.

Everything here is plain Python over the plan, the schedule and the captured
program; the jitted step only reads the tables it produces.

Values crossing stages travel as *edge matrices*: every value of a stage
edge, batch axis moved first and flattened to rows of samples, concatenated
along columns, in float32 (other float types are widened, 32-bit integers
bit-cast). A data-parallel stage with k devices gives each device rows
[r*b/k, (r+1)*b/k) of a micro-batch of b samples, so a transfer between two
stages is a contiguous run of rows of one edge matrix: contiguous in memory
at both ends.

Stages may take different micro-batch sizes (sizes grow along stage edges
by whole multiples, `graphpipe.schedules.grid`): across an edge whose
destination is k times larger, the source's micro-batch i is *piece*
i mod k of the destination's micro-batch i // k, rows [(i mod k) b,
(i mod k + 1) b) of it. Transfers are made per piece: the rows of piece p
go to the destination devices holding them, and in the backward the
destination returns its input gradients in the same k pieces.
"""

from __future__ import annotations

import dataclasses
import math

from graphpipe.core.channels import overlaps
from graphpipe.core.graph import OpGraph
from graphpipe.core.stages import Plan
from graphpipe.errors import PipelineRuntimeError
from graphpipe.frontend import samples
from graphpipe.frontend.program import Program
from graphpipe.schedules.grid import Schedule


@dataclasses.dataclass(frozen=True)
class ValueSpec:
  """A value crossing stages: its key, shape at one chunk, batch axis."""

  key: str
  shape: tuple[int, ...]  # at `rows` samples
  dtype: str
  batch_axis: int  # sample-major: its size is rows x (elements per sample)
  rows: int

  @property
  def width(self) -> int:
    """Elements per sample."""
    return math.prod(self.shape) // self.rows

  def shape_at(self, rows: int) -> tuple[int, ...]:
    """The value's shape for a chunk of `rows` samples."""
    shape = list(self.shape)
    shape[self.batch_axis] = shape[self.batch_axis] // self.rows * rows
    return tuple(shape)


@dataclasses.dataclass(frozen=True)
class EdgeLayout:
  """The values of one stage edge, as columns of its edge matrix."""

  src: int
  dst: int
  values: tuple[ValueSpec, ...]  # shapes at the *source* chunk size

  @property
  def token(self) -> bool:
    """The edge only orders its stages: it carries one zero per sample."""
    return not self.values

  @property
  def width(self) -> int:
    return sum(v.width for v in self.values) if self.values else 1


@dataclasses.dataclass(frozen=True)
class Transfer:
  """Rows of an edge matrix moving between two devices (forward sense)."""

  edge: int  # index into Layout.edges
  src_device: int
  dst_device: int
  src_row: int  # first row in the sender's edge matrix
  dst_row: int  # first row in the receiver's edge matrix
  rows: int
  # Which of the k source micro-batches that make one destination
  # micro-batch this is (0 when both ends take the same size).
  piece: int = 0


@dataclasses.dataclass(frozen=True)
class StageLayout:
  """One stage's inputs and outputs, in the order the runtime uses."""

  id: int
  nodes: tuple[int, ...]
  devices: tuple[int, ...]
  chunk: int  # samples per device per micro-batch
  size: int  # samples per micro-batch (all devices of the stage)
  params: tuple[str, ...]  # 'param:' keys, in flat-buffer order
  state: tuple[str, ...]  # 'state:' keys, in flat-buffer order
  batch: tuple[str, ...]  # 'batch:' keys read
  in_edges: tuple[int, ...]  # indices into Layout.edges
  out_edges: tuple[int, ...]
  loss_keys: tuple[str, ...]
  streams: tuple[str, ...] = ()  # 'rng:' keys of random streams read
  # ('state:' key, node output key): variables its nodes update
  updates: tuple[tuple[str, str], ...] = ()
  sharding: str = "replicated"  # `Stage.sharding`


@dataclasses.dataclass(frozen=True)
class Layout:
  """Stages, edges, transfers and buffer sizes of a pipelined step."""

  stages: tuple[StageLayout, ...]
  edges: tuple[EdgeLayout, ...]
  transfers: tuple[Transfer, ...]
  param_shapes: dict  # key -> (shape, dtype)
  micro_batch_size: int  # the smallest stage's
  num_microbatches: int  # of the smallest stage
  num_devices: int

  def stage_of_device(self) -> dict[int, int]:
    return {d: s.id for s in self.stages for d in s.devices}

  @property
  def batch_size(self) -> int:
    return self.micro_batch_size * self.num_microbatches

  def microbatches(self, stage: int) -> int:
    """Micro-batches `stage` runs per step."""
    return self.batch_size // self.stages[stage].size

  def pieces(self, edge: int) -> int:
    """Source micro-batches per destination micro-batch across `edge`."""
    e = self.edges[edge]
    return self.stages[e.dst].size // self.stages[e.src].size

  def in_offsets(self, stage: int) -> dict[int, int]:
    """Edge index -> element offset of its block in the stage's inputs."""
    return _offsets(self, self.stages[stage].in_edges, stage)

  def out_offsets(self, stage: int) -> dict[int, int]:
    """Edge index -> element offset of its block in the stage's outputs."""
    return _offsets(self, self.stages[stage].out_edges, stage)

  def in_size(self, stage: int) -> int:
    s = self.stages[stage]
    return sum(self.edges[e].width for e in s.in_edges) * s.chunk

  def out_size(self, stage: int) -> int:
    s = self.stages[stage]
    return sum(self.edges[e].width for e in s.out_edges) * s.chunk

  def param_size(self, stage: int, kind: str = "params") -> int:
    return sum(
      math.prod(self.param_shapes[k][0])
      for k in getattr(self.stages[stage], kind)
    )


def _offsets(layout, edges, stage):
  offsets, at = {}, 0
  for e in edges:
    offsets[e] = at
    at += layout.edges[e].width * layout.stages[stage].chunk
  return offsets


def batch_axis(small_shape, large_shape, key: str, source: str = "") -> int:
  """The axis that grows with the batch, from shapes at two batch sizes
  (`source` names the value's node in messages)."""
  axes = [
    i
    for i, (a, b) in enumerate(zip(small_shape, large_shape, strict=True))
    if a != b
  ]
  if len(axes) != 1:
    raise PipelineRuntimeError(
      f"value {key}{source} crosses pipeline stages but "
      + (
        f"has no batch axis (shape {tuple(small_shape)} at any batch "
        "size): a value reduced over the batch (e.g. an auxiliary loss a "
        "layer returns as a scalar and loss_fn adds) or one that reads "
        "no sample cannot be cut into micro-batches. Return such a loss "
        "per sample (a (batch,) vector) and reduce it in loss_fn, or keep "
        "its producer and readers in one stage"
        if not axes
        else f"has several axes that grow with the batch {axes}"
      )
    )
  return axes[0]


def _check_sample_rows(program: Program, crossings, probe: bool) -> None:
  """Values cut or joined between chunks of other sizes must hold each
  sample's rows as one block (`graphpipe.frontend.samples`); with `probe`,
  also on made-up inputs."""
  crossings = sorted(crossings)
  apart = dict(program.form.apart)
  for key, src, dst in crossings:
    why = apart.get(program.refs.get(key))
    if why:
      raise PipelineRuntimeError(
        f"value {key} goes from stage {src} to stage {dst}, which takes "
        "chunks of another size, but it does not hold each sample's rows "
        f"together along its batch axis: {why}. Keep the batch axis "
        "sample-major where a value leaves a stage ((B, T, ...) -> "
        "(B * T, ...)), or keep such values inside one stage"
      )
  # A second line of defence: the same on made-up inputs. (Not where
  # layers normalise by their chunk's statistics: every value after them
  # changes with every sample of the chunk, by the semantics chosen.)
  if program.statistic_nodes or not probe:
    return
  mixed = samples.mixed_values(program, {key for key, _, _ in crossings})
  for key, src, dst in crossings:
    if key in mixed:
      sample, rows, per, size = mixed[key]
      raise PipelineRuntimeError(
        f"value {key} goes from stage {src} to stage {dst}, which takes "
        "chunks of another size, but it does not hold each sample's rows "
        f"together along its batch axis: at batch size {size}, sample "
        f"{sample}'s inputs change its rows "
        f"{rows}, not rows {sample * per}-{(sample + 1) * per - 1} (e.g. a "
        "time-major (T * B, ...) reshape, two views concatenated along the "
        "batch axis, or a statistic over the batch). Keep the batch axis "
        "sample-major where a value leaves a stage ((B, T, ...) -> "
        "(B * T, ...)), or keep such values inside one stage"
      )


SUPPORTED_DTYPES = (
  "float32",
  "float16",
  "bfloat16",
  "int32",
  "uint32",
  "int16",
  "uint16",
  "int8",
  "uint8",
  "bool",
)


def build_layout(
  graph: OpGraph, plan: Plan, schedule: Schedule, *, probe: bool = True
) -> Layout:
  """The static layout of `plan` over the captured `graph`.

  `probe=False` skips running the program on made-up inputs to find
  values whose samples' rows are mixed (`samples.mixed_values`), the
  second line of defence behind the captured program's own analysis: for
  sizes only (`graphpipe.memory_report`; on paper-size models the probe
  took 13 of the report's 14 s). A trainer always probes.
  """
  program: Program = graph.program
  sizes = {s.id: s.micro_batch_size for s in plan.stages}
  for s in plan.stages:
    b = s.micro_batch_size
    if b < 1 or plan.batch_size % b:
      raise PipelineRuntimeError(
        f"batch size {plan.batch_size} is not a multiple of stage {s.id}'s "
        f"micro-batch size {b}"
      )
    if b % len(s.devices):
      raise PipelineRuntimeError(
        f"stage {s.id} splits micro-batches of {b} over "
        f"{len(s.devices)} devices: the micro-batch must divide evenly"
      )
    if schedule.microbatches(s.id) != plan.batch_size // b:
      raise PipelineRuntimeError(
        "the schedule and the plan disagree on micro-batches"
      )
  for src, dst in plan.stage_edges:
    if sizes[dst] % sizes[src]:
      raise PipelineRuntimeError(
        f"stage {dst} takes micro-batches of {sizes[dst]}, not a multiple of "
        f"stage {src}'s {sizes[src]}: sizes may only grow along stage edges"
      )
  owner = {n: s.id for s in plan.stages for n in s.nodes}
  if sorted(owner) != list(range(len(graph.nodes))):
    raise PipelineRuntimeError(
      "the plan's stages do not cover the graph's nodes exactly once: was "
      "the plan made for another graph?"
    )
  base = program
  large = program.at_batch_size(2 * program.batch_size)
  shapes_small, shapes_large, dtypes = {}, {}, {}
  for node_s, node_l in zip(base.nodes, large.nodes, strict=True):
    for key, a, c in zip(
      node_s.outputs, node_s.output_avals(), node_l.output_avals(), strict=True
    ):
      shapes_small[key], shapes_large[key] = a.shape, c.shape
      dtypes[key] = str(a.dtype)
  if any(
    s.micro_batch_size < plan.batch_size or len(s.devices) > 1
    for s in plan.stages
  ):
    draws = [
      f"node {graph.nodes[n].name!r} draws {shape} ({primitive})"
      for n, primitive, shape in dict.fromkeys(
        samples.batch_shaped_draws(base, large)
      )
    ]
    if draws:
      raise PipelineRuntimeError(
        "the loss draws random numbers in the shape of the batch that are "
        f"not each sample's own ({'; '.join(draws)}): every micro-batch "
        "would draw its own from the same source, not its rows of the "
        "whole batch's draw (e.g. bernoulli(key(0), p, h.shape), "
        "split(key(0), B) handed out per sample, fold_in(key, arange(B)), "
        "or dropout given nnx.Rngs(0) inside the loss). Draw per sample "
        "from keys or ids carried in the batch, or run the model "
        "deterministically"
      )
  key_avals = {}
  for node in [*base.nodes, *base.penalties.values()]:
    for key, aval in zip(node.inputs, node.input_avals(), strict=True):
      key_avals[key] = aval

  def chunk_shape(key, chunk):
    small, large_ = shapes_small[key], shapes_large[key]
    node = produced_by.get(key)
    source = (
      f" (of node {graph.nodes[node].name!r})" if node is not None else ""
    )
    axis = batch_axis(small, large_, key, source)
    per = small[axis] // base.batch_size
    if small[axis] != per * base.batch_size:
      raise PipelineRuntimeError(
        f"value {key}'s batch axis is not a sample axis"
      )
    shape = list(small)
    shape[axis] = per * chunk
    return tuple(shape), axis

  produced_by = {}
  for n, node in enumerate(base.nodes):
    for key in node.outputs:
      produced_by[key] = n
  edges, edge_index, rechunked = [], {}, set()
  for src, dst in sorted(plan.stage_edges):
    keys = sorted(
      {
        key
        for n in plan.stages[dst].nodes
        for key in base.nodes[n].inputs
        if key in produced_by and owner[produced_by[key]] == src
      },
      key=_key_order,
    )
    # Sequential plans chain stages of independent branches: such an edge
    # carries no value, only the order. A one-column token keeps that order
    # physical, as a sequential pipeline's data flow would.
    chunk = sizes[src] // len(plan.stages[src].devices)
    values = []
    for key in keys:
      if dtypes[key] not in SUPPORTED_DTYPES:
        raise PipelineRuntimeError(
          f"value {key} of dtype {dtypes[key]} crosses stages; supported: "
          f"{', '.join(SUPPORTED_DTYPES)}"
        )
      shape, axis = chunk_shape(key, chunk)
      values.append(ValueSpec(key, shape, dtypes[key], axis, chunk))
    if chunk != sizes[dst] // len(plan.stages[dst].devices):
      rechunked.update((key, src, dst) for key in keys)
    edge_index[(src, dst)] = len(edges)
    edges.append(EdgeLayout(src, dst, tuple(values)))
  chunks = {
    s.id: s.micro_batch_size // len(s.devices)
    for s in plan.stages
    if any(n in program.statistic_nodes for n in s.nodes)
  }
  if len(set(chunks.values())) > 1:
    raise PipelineRuntimeError(
      "layers normalising by their chunk's batch statistics (BatchNorm in "
      f"training) run on chunks of different sizes (stage: samples "
      f"{chunks}): each would see statistics of another number of "
      "samples. Give those stages one micro-batch size per device"
    )
  _check_sample_rows(program, rechunked, probe)
  # Every cross-stage read must follow a stage edge.
  for s in plan.stages:
    for n in s.nodes:
      for key in base.nodes[n].inputs:
        if key in produced_by and owner[produced_by[key]] != s.id:
          if (owner[produced_by[key]], s.id) not in edge_index:
            raise PipelineRuntimeError(
              f"stage {s.id} reads {key} from stage "
              f"{owner[produced_by[key]]} but the plan has no such edge"
            )
  stages = []
  loss_keys = set(base.loss_keys)
  for s in plan.stages:
    # A stage holds what its nodes read, and what the loss's penalty
    # terms its nodes own read (a penalty on a parameter no layer uses).
    reads = [k for n in s.nodes for k in base.nodes[n].inputs] + [
      k
      for n in s.nodes
      if n in base.penalties
      for k in base.penalties[n].inputs
    ]
    produced = [k for n in s.nodes for k in base.nodes[n].outputs]
    stages.append(
      StageLayout(
        id=s.id,
        nodes=tuple(sorted(s.nodes)),
        devices=tuple(s.devices),
        sharding=s.sharding,
        chunk=s.micro_batch_size // len(s.devices),
        size=s.micro_batch_size,
        params=tuple(
          sorted({k for k in reads if k.startswith("param:")}, key=_key_order)
        ),
        state=tuple(
          sorted({k for k in reads if k.startswith("state:")}, key=_key_order)
        ),
        streams=tuple(sorted({k for k in reads if k.startswith("rng:")})),
        batch=tuple(
          sorted({k for k in reads if k.startswith("batch:")}, key=_key_order)
        ),
        in_edges=tuple(
          edge_index[(p, s.id)] for p in sorted(plan.predecessors(s.id))
        ),
        out_edges=tuple(
          edge_index[(s.id, t)] for t in sorted(plan.successors(s.id))
        ),
        loss_keys=tuple(k for k in produced if k in loss_keys),
        updates=tuple(
          (k, v) for k, v in base.updates.items() if v in set(produced)
        ),
      )
    )
  _check_updates(stages)
  transfers = [
    Transfer(e, sd, dd, src_row, dst_row, rows, piece)
    for e, sd, dd, piece, src_row, dst_row, rows in overlaps(
      [s.devices for s in plan.stages],
      [s.micro_batch_size for s in plan.stages],
      plan.stage_edges,
    )
  ]
  param_shapes = {
    k: (tuple(a.shape), str(a.dtype))
    for k, a in key_avals.items()
    if k.startswith(("param:", "state:"))
  }
  return Layout(
    stages=tuple(stages),
    edges=tuple(edges),
    transfers=tuple(transfers),
    param_shapes=param_shapes,
    micro_batch_size=plan.micro_batch_size,
    num_microbatches=plan.num_microbatches,
    num_devices=plan.num_devices,
  )


def _check_updates(stages):
  """A state variable a stage updates is read by that stage alone."""
  for s in stages:
    for key, _ in s.updates:
      others = [t.id for t in stages if t.id != s.id and key in t.state]
      if key not in s.state or others:
        raise PipelineRuntimeError(
          f"{key} is updated by stage {s.id} but read by stage(s) "
          f"{others or 'none holding it'}: a variable the loss updates "
          "(running statistics) must stay with the stage that updates it"
        )


def _key_order(key: str):
  # 'node12:3' sorts numerically so layouts read in graph order.
  head, _, tail = key.partition(":")
  if head.startswith("node"):
    return (0, int(head[4:]), int(tail), "")
  return (1, 0, 0, key)
