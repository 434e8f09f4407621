"""graphpipe: graph pipeline parallelism for JAX / Flax.

graph = graphpipe.capture(loss_fn, model, batch)   # an operator DAG
print(graph)                                       # node table
"""

from graphpipe import models
from graphpipe.capture import capture
from graphpipe.errors import (
  CaptureError,
  GraphCutError,
  GraphFormatError,
  GraphpipeError,
)
from graphpipe.graph import Edge, InputSpec, Node, OpGraph

__all__ = [
  "CaptureError",
  "Edge",
  "GraphCutError",
  "GraphFormatError",
  "GraphpipeError",
  "InputSpec",
  "Node",
  "OpGraph",
  "capture",
  "models",
]
