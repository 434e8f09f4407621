"""Layers that update running values in training (BatchNorm), read from
the loss's program.

BatchNorm with `use_running_average=False` (linen: `mutable=
['batch_stats']`) normalises by statistics of its batch and folds them
into running values: the traced loss returns the new values beside the
loss. Under micro-batching each chunk normalises by its own statistics, as
GPipe and torch pipelines do; `chunk_statistics` finds those statistics
(the reductions over the batch the updates read) so that the per-sample
walk (`samplewise`) treats them as values of the chunk, like a parameter,
and the layer's output stays per sample. `check_reads` refuses what
chunking would make wrong: a loss computed from the running values it
updates, or reading a statistic other than through its layer's outputs.
"""

from __future__ import annotations

from graphpipe.errors import CaptureError
from graphpipe.frontend import samplewise as sw
from graphpipe.frontend.dataflow import operands, slice_of


def chunk_statistics(jaxpr, producer, states, updates, batched) -> list:
  """The batch statistics a layer keeps running values of (BatchNorm's
  mean and variance): reductions over the batch that the state updates
  read. Under micro-batching they are the chunk's statistics, by the
  semantics of GPipe and torch pipelines; the walk sees them as values
  of the chunk like a parameter, so the layer's output stays per sample."""
  found = []
  for i in slice_of(jaxpr, producer, updates):
    eqn = jaxpr.eqns[i]
    if not any(batched(u) for u in operands(eqn)):
      continue
    for v in eqn.outvars:
      # (MIXED where an earlier such layer made its input so in this
      # walk, which does not know of the statistics yet.)
      if states[v].kind in (sw.GLOBAL, sw.MIXED) and not batched(v):
        found.append(v)
  return found


def check_reads(jaxpr, producer, sums, roots, statistics, updated):
  """Refuses a loss that reads a state variable it updates (the backward
  would see the value later micro-batches left), or that reads a batch
  statistic other than through its layer's per-sample values."""
  if not updated:
    return
  inputs = {jaxpr.invars[k] for k in updated}
  for i in slice_of(jaxpr, producer, sums + roots):
    for u in operands(jaxpr.eqns[i]):
      if u in inputs:
        eqn = jaxpr.eqns[i]
        inside = (
          " (a nested call that both updates it and computes the loss's "
          "values: capture does not look inside; call such a layer outside "
          "jit / remat)"
          if eqn.primitive.name in sw.CALLS
          else ""
        )
        raise CaptureError(
          f"the loss reads a state variable it updates ({u.aval}, read by "
          f"{sw.describe(eqn)}){inside}: a layer in training may update "
          "running values (BatchNorm use_running_average=False) but not "
          "compute its output from them"
        )
  stats = set(statistics)
  for v in roots:
    reads = [v] if v in stats else []
    reads += [
      u
      for i in slice_of(jaxpr, producer, [v])
      for u in operands(jaxpr.eqns[i])
      if u in stats
    ]
    if reads:
      raise CaptureError(
        "the loss reads a batch statistic that a layer keeps running "
        f"values of ({sw.describe(jaxpr.eqns[producer[reads[0]][0]])}) "
        "as a term of its own: under micro-batches it is each chunk's; "
        "only the layer's per-sample outputs may use it"
      )
