"""The front end: a Flax model and its loss, traced into an `OpGraph`.

tracer      `capture`: jax.make_jaxpr of the loss, nodes, figures
scopes      NNX module paths during the trace; linen name stacks
grouping    labelled equations -> operator nodes (the grouping rules)
program     one closed jaxpr per node, re-traced at any batch size
node_costs  per-node FLOPs and bytes from XLA's cost analysis
"""

from graphpipe.frontend.program import NodeProgram, Program
from graphpipe.frontend.tracer import capture

__all__ = ["NodeProgram", "Program", "capture"]
