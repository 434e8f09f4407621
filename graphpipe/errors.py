"""Errors raised by graphpipe.

Every error the package raises on bad input derives from `GraphpipeError`,
so callers can catch one class. Messages say what was wrong and what to do.
"""


class GraphpipeError(Exception):
  """Base class of every error graphpipe raises on bad input."""


class CaptureError(GraphpipeError):
  """The model, loss or batch could not be traced into an operator graph."""


class GraphCutError(GraphpipeError):
  """The traced computation cannot be cut into more than one operator node."""


class GraphFormatError(GraphpipeError):
  """A saved graph file is malformed or from an incompatible version."""
