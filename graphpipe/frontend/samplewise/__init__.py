"""Which values of a traced loss hold each sample apart, read from the jaxpr.

The runtime runs a model's code on micro-batches: a chunk of b samples
instead of the batch's B, the same program traced at b. That is exact
only for values computed *per sample*: the chunk's program must produce
exactly its samples' part of the value the whole batch would give. This
module proves it, or finds where it fails, from the program alone (no
made-up inputs): the loss is traced at two batch sizes, and every
variable is given a `State` by walking both jaxprs side by side, one rule
per primitive.

States:
  FREE      no batch axis and nothing from the batch (parameters,
            constants, what is computed from them alone).
  ROWS      has a batch axis (the one axis whose size grows with the
            batch) and each sample's elements depend only on that sample:
            the chunk program computes the chunk's part. `layout` says
            where a sample's elements sit along the axis (its virtual
            dimensions, e.g. ((2, False), (16, True)) for a time-major
            (T * B) axis); None for a value constant along the axis (a
            broadcast), which fits any layout.
  POSITION  batch-shaped, but rows differ by their position in the batch
            (an iota along the batch axis, a draw from a fixed key): a
            chunk would start counting again.
  GLOBAL    no batch axis, computed from the batch (a reduction over it,
            and what is computed from such values). `summed` marks the
            direct result of a sum over samples; `local` one made inside a
            nested jaxpr (no top-level equation computes it).
  MIXED     anything else: elements that combine samples (a contrastive
            product across the batch, normalisation by a batch statistic
            of parameter-dependent values, a sort over the batch, ...),
            with the first reason found, naming the equation.

Every state also says whether the value depends on a model variable
(`params`). The walk is conservative: a primitive without a rule makes a
batch-carrying value MIXED.
"""

from graphpipe.frontend.samplewise.state import (
  FREE,
  GLOBAL,
  MIXED,
  POSITION,
  ROWS,
  State,
  batch_axes,
  describe,
  free,
  join,
  mixed,
  rows,
)
from graphpipe.frontend.samplewise.walk import CALLS, Walk

__all__ = [
  "CALLS",
  "FREE",
  "GLOBAL",
  "MIXED",
  "POSITION",
  "ROWS",
  "State",
  "Walk",
  "batch_axes",
  "describe",
  "free",
  "join",
  "mixed",
  "rows",
]
