"""A stage's code: its node jaxprs as one function, and its residuals.

`StageCode.stage_function(stage)` runs a stage's nodes on a block of its
input edge matrices and the batch rows (with the batch's data statistics,
`global:` keys), and returns its output edge matrices (flat) and its part
of the loss's sums over the batch, placed in the vector of all sums
(`SumLayout`). `_vjp_parts` is that function's VJP with the residual
policy of the runtime: outputs of matrix products are kept, the
elementwise work between them is recomputed in the backward.
The loss's once-per-step pieces are `graphpipe.runtime.loss_terms`'.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax import lax

from graphpipe.frontend import streams
from graphpipe.frontend.node_costs import save_products
from graphpipe.frontend.program import Program
from graphpipe.runtime import packing
from graphpipe.runtime.layout import Layout
from graphpipe.runtime.loss_terms import LossTerms


class StageCode:
  """The node programs of a layout's stages, traced at each stage's chunk.

  Args:
    layout: the static layout (stages, edges, transfers).
    program: the captured program (node jaxprs), re-traced per chunk size.
    batch_size: the mini-batch's size (the head divides by it).
  """

  def __init__(self, layout: Layout, program: Program, batch_size: int):
    self.layout = layout
    self.programs = {
      s.chunk: program.at_batch_size(s.chunk) for s in layout.stages
    }
    self.whole = program.at_batch_size(batch_size)
    self.consts = program.consts
    self._residual_avals = {}
    self.terms = LossTerms(self.whole, layout)

  def stage_function(self, stage: int):
    """f(params, acts_block, batch_rows) -> ((outputs block, sums),
    updates): the stage's part of the loss's sums in the vector of all
    (`terms.sums`), and the new values of the state variables its nodes
    update ('state:' key -> array; BatchNorm's running statistics after
    this chunk); `batch_rows` holds the data statistics too."""
    s = self.layout.stages[stage]
    program = self.programs[s.chunk]
    edges = self.layout.edges
    in_offsets = self.layout.in_offsets(stage)

    def f(params: dict, acts_block, batch: dict):
      env = dict(self.consts)
      env.update(params)
      env.update(batch)
      tokens = []
      for e in s.in_edges:
        edge = edges[e]
        start = in_offsets[e]
        width = edge.width
        matrix = lax.dynamic_slice_in_dim(acts_block, start, s.chunk * width)
        matrix = matrix.reshape(s.chunk, width)
        if edge.token:
          tokens.append(matrix)
        col = 0
        for v in edge.values:
          env[v.key] = packing.from_rows(
            matrix[:, col : col + v.width], v, s.chunk
          )
          col += v.width
      if tokens:
        # An order-only edge: nothing of the stage may start before its
        # tokens arrived (else XLA drops the unread token and its transfer,
        # and the chained stages no longer wait for each other).
        tokens, env = lax.optimization_barrier((tokens, env))
      for n in s.nodes:
        node = program.nodes[n]
        outs = node(*[env[k] for k in node.inputs])
        env.update(zip(node.outputs, outs, strict=True))
      loss = self.terms.sums.pack({k: env[k] for k in s.loss_keys})
      blocks = {}
      for e in s.out_edges:
        if not edges[e].token:
          rows = [
            packing.to_rows(env[v.key], v, s.chunk) for v in edges[e].values
          ]
          blocks[e] = jnp.concatenate(rows, axis=1).reshape(-1)
      for e in s.out_edges:
        if edges[e].token:
          # Sent once the stage's work is done, like a value would be.
          zeros = jnp.zeros((s.chunk,), jnp.float32)
          blocks[e], _ = lax.optimization_barrier((zeros, (loss, blocks)))
      blocks = [blocks[e] for e in s.out_edges]
      out = jnp.concatenate(blocks) if blocks else jnp.zeros((0,), jnp.float32)
      return (out, loss), {k: env[v] for k, v in s.updates}

    return f

  def chunk_streams(self, stage, device, microbatch, statistics) -> dict:
    """The stage's random streams' keys for the chunk `device` runs of
    micro-batch `microbatch` (traced): from its first sample of the batch
    on (the per-sample rule, `graphpipe.frontend.streams`); the step's
    keys' data are in `statistics`."""
    s = self.layout.stages[stage]
    first = microbatch * s.size + s.devices.index(device) * s.chunk
    return {
      k: streams.at_sample(
        jax.random.wrap_key_data(statistics[k], impl=streams.PER_SAMPLE),
        first,
      )
      for k in s.streams
    }

  # Residuals (when not recomputing).

  def _abstract_inputs(self, stage):
    lay = self.layout
    s = lay.stages[stage]
    params = {
      k: jax.ShapeDtypeStruct(*lay.param_shapes[k]) for k in s.params + s.state
    }
    acts = jax.ShapeDtypeStruct((max(1, lay.in_size(stage)),), jnp.float32)
    program = self.programs[s.chunk]
    batch_avals = {}
    for node in program.nodes:
      for k, a in zip(node.inputs, node.input_avals(), strict=True):
        if k.startswith("batch:"):
          batch_avals[k] = jax.ShapeDtypeStruct(a.shape, a.dtype)
    batch = {k: batch_avals[k] for k in s.batch}
    batch.update(
      (k, jax.ShapeDtypeStruct(a.shape, a.dtype))
      for k, a in self.terms.statistic_avals.items()
    )
    batch.update(
      (k, jax.ShapeDtypeStruct((), streams.DTYPE)) for k in s.streams
    )
    return params, acts, batch

  def _vjp_parts(self, stage, params, acts, batch):
    """(outputs, loss), residual leaves, their treedef, the positions of
    those kept and of parameters, the state updates."""
    s = self.layout.stages[stage]
    f = self.stage_function(stage)
    trainable = {k: params[k] for k in s.params}
    frozen = {k: params[k] for k in s.state}

    # Residuals are the outputs of matrix products (and the stage's
    # inputs); the backward recomputes the elementwise work between them.
    # The VJP's own residuals were several times as many bytes (every
    # intermediate of every elementwise op), and writing and reading them
    # through the stash cost more than recomputing them: plain XLA keeps
    # about this much, by fusing that elementwise work into the backward.
    diff = jax.checkpoint(
      lambda p, a: f({**p, **frozen}, a, batch), policy=save_products
    )
    outs, vjp, updates = jax.vjp(diff, trainable, acts, has_aux=True)
    leaves, treedef = jax.tree.flatten(vjp)
    param_ids = {id(v): k for k, v in trainable.items()}
    # Keys of random streams are not stashed: the backward derives them
    # again from its own inputs (the same micro-batch's keys).
    keep = [
      i
      for i, x in enumerate(leaves)
      if id(x) not in param_ids
      and not jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key)
    ]
    sources = {
      i: param_ids[id(x)] for i, x in enumerate(leaves) if id(x) in param_ids
    }
    return outs, leaves, treedef, keep, sources, updates

  def _residual_size(self, stage):
    params, acts, batch = self._abstract_inputs(stage)
    info = {}

    def probe(params, acts, batch):
      _, leaves, _, keep, *_ = self._vjp_parts(stage, params, acts, batch)
      info["avals"] = [
        jax.ShapeDtypeStruct(leaves[i].shape, leaves[i].dtype) for i in keep
      ]
      return 0

    jax.eval_shape(probe, params, acts, batch)
    self._residual_avals[stage] = info["avals"]
    return sum(math.prod(a.shape) for a in info["avals"])
