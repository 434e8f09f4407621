"""Per-node costs from XLA: FLOPs, bytes accessed, saved activations.

Each node's jaxpr is compiled on its own from abstract values (nothing is
allocated) and XLA's cost analysis of the optimised program gives FLOPs and
bytes accessed (after fusion). Identical layers share one measurement. The
backward pass is measured as the node's VJP minus its forward. Bytes the
backward keeps are the residuals of `jax.vjp` (its pytree leaves), which
include the node's own inputs when the backward reads them; the part the
runtime stashes (`kept_bytes`) are the residuals of the same VJP under
the runtime's checkpoint policy (`save_products`: matrix products'
outputs, and the inputs the backward recomputes from).

Measurements are kept for the life of the process, keyed by the node's
jaxpr text (its equations and every shape and dtype): a model captured
again (another test, a notebook cell re-run, a sweep over device counts)
compiles nothing new.

Figures are measured at two batch sizes and split into a per-sample slope
and a batch-independent remainder, so no axis has to be guessed as the
batch axis.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from graphpipe.frontend.program import NodeProgram, Program

FIELDS = (
  "fwd_flops",
  "bwd_flops",
  "fwd_bytes",
  "bwd_bytes",
  "activation_bytes",
  "saved_bytes",
  "kept_bytes",
)
# Residual figures: their batch-independent part is weights (or derived
# from them), held once by the stage, not once per stashed micro-batch.
RESIDUALS = ("saved_bytes", "kept_bytes")
# Figures by jaxpr text (see the module docstring); at most this many.
_MEASURED: dict[str, dict[str, float]] = {}
_MEASURED_MAX = 4096


def save_products(primitive, *_, **__) -> bool:
  """The runtime's checkpoint policy: keep matrix products' outputs (the
  elementwise work between them is recomputed in the backward)."""
  return primitive in (jax.lax.dot_general_p, jax.lax.conv_general_dilated_p)


def aval_bytes(aval) -> int:
  # `dtype.itemsize`, not np.dtype(...): typed PRNG keys (an nnx Dropout's
  # RngKey) have an extended dtype numpy cannot read.
  return int(np.prod(aval.shape)) * aval.dtype.itemsize


def args_of(avals):
  return [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in avals]


# XLA's cost analysis reads the optimised HLO; the backend's own
# optimisation (LLVM on CPU) changes no figure and took a third of the
# compile time (paper MMT: 3.2 s -> 2.5 s, every figure identical).
_COST_ONLY = {"xla_backend_optimization_level": 0}


def _cost(fn, args) -> tuple[float, float]:
  compiled = jax.jit(fn).lower(*args).compile(compiler_options=_COST_ONLY)
  analysis = compiled.cost_analysis() or {}
  if isinstance(analysis, list):  # older jax returned one dict per device
    analysis = analysis[0] if analysis else {}
  return float(analysis.get("flops", 0.0)), float(
    analysis.get("bytes accessed", 0.0)
  )


def _differentiable(avals):
  return [jnp.issubdtype(a.dtype, jnp.inexact) for a in avals]


def node_figures(node: NodeProgram) -> dict[str, float]:
  """Forward/backward FLOPs and bytes, output and saved bytes of a node."""
  in_avals = node.input_avals()
  out_avals = node.output_avals()
  args = args_of(in_avals)
  fwd_flops, fwd_bytes = _cost(node, args)
  wrt = _differentiable(in_avals)
  float_out = _differentiable(out_avals)
  figures = {
    "fwd_flops": fwd_flops,
    "fwd_bytes": fwd_bytes,
    "bwd_flops": 0.0,
    "bwd_bytes": 0.0,
    "saved_bytes": 0.0,
    "kept_bytes": 0.0,
    "activation_bytes": float(sum(aval_bytes(a) for a in out_avals)),
  }
  if not any(wrt) or not any(float_out):
    return figures
  fixed = [a for a, w in zip(args, wrt, strict=True) if not w]
  diff = [a for a, w in zip(args, wrt, strict=True) if w]
  cts = [a for a, f in zip(args_of(out_avals), float_out, strict=True) if f]

  def differentiable_part(fixed_in):
    def fn(*diff_in):
      it_diff, it_fixed = iter(diff_in), iter(fixed_in)
      outs = node(*[next(it_diff) if w else next(it_fixed) for w in wrt])
      return tuple(o for o, f in zip(outs, float_out, strict=True) if f)

    return fn

  def backward(fixed_in, diff_in, cotangents):
    # The primal outputs are returned too: otherwise dead-code elimination
    # drops forward work the backward does not read, and the difference
    # below would undercount the backward.
    outs, vjp = jax.vjp(differentiable_part(fixed_in), *diff_in)
    return outs, vjp(tuple(cotangents))

  bwd_flops, bwd_bytes = _cost(backward, [fixed, diff, cts])
  figures["bwd_flops"] = max(bwd_flops - fwd_flops, 0.0)
  figures["bwd_bytes"] = max(bwd_bytes - fwd_bytes, 0.0)
  saved = jax.eval_shape(
    lambda fixed_in, diff_in: jax.vjp(differentiable_part(fixed_in), *diff_in)[
      1
    ],
    fixed,
    diff,
  )
  figures["saved_bytes"] = float(
    sum(aval_bytes(x) for x in jax.tree.leaves(saved))
  )
  kept = jax.eval_shape(
    lambda fixed_in, diff_in: jax.vjp(
      jax.checkpoint(differentiable_part(fixed_in), policy=save_products),
      *diff_in,
    )[1],
    fixed,
    diff,
  )
  figures["kept_bytes"] = float(
    sum(aval_bytes(x) for x in jax.tree.leaves(kept))
  )
  return figures


def per_sample(
  small: Program, large: Program
) -> list[tuple[dict[str, float], dict[str, float]]]:
  """(per-sample, fixed) figures of every node from two batch sizes."""
  db = large.batch_size - small.batch_size

  def figures(node):
    # Repeated layers print to the same jaxpr: measure each kind once.
    key = str(node.jaxpr)
    if key not in _MEASURED:
      if len(_MEASURED) >= _MEASURED_MAX:
        _MEASURED.pop(next(iter(_MEASURED)))
      _MEASURED[key] = node_figures(node)
    return dict(_MEASURED[key])

  out = []
  for a_node, b_node in zip(small.nodes, large.nodes, strict=True):
    a, b = figures(a_node), figures(b_node)
    slope = {f: max((b[f] - a[f]) / db, 0.0) for f in FIELDS}
    fixed = {
      f: a[f] - slope[f] * small.batch_size
      for f in FIELDS
      if f not in RESIDUALS
    }
    fixed = {f: v for f, v in fixed.items() if abs(v) > 1e-9 * (1 + a[f])}
    out.append((slope, fixed))
  return out


def edge_bytes(program: Program) -> dict[tuple[int, int], tuple[float, int]]:
  """(src, dst) -> (bytes at the program's batch size, number of values)."""
  avals = {}
  for i, node in enumerate(program.nodes):
    for key, aval in zip(node.outputs, node.output_avals(), strict=True):
      avals[key] = (i, aval)
  edges = {}
  for dst, node in enumerate(program.nodes):
    for key in node.inputs:
      if key in avals:
        src, aval = avals[key]
        size, count = edges.get((src, dst), (0.0, 0))
        edges[(src, dst)] = (size + aval_bytes(aval), count + 1)
  return edges
