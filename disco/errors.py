"""Errors raised by disco.

Every error the package raises on bad input derives from `DiscoError`, so
callers can catch one class. Messages say what was wrong and what to do.
"""


class DiscoError(Exception):
  """Base class of every error disco raises on bad input."""


class PartitionError(DiscoError):
  """Channels cannot be split over the nodes as asked."""


class PruneError(DiscoError):
  """A pruning request is out of range or inconsistent with the masks."""


class CheckpointError(DiscoError):
  """A checkpoint is missing, malformed or from another architecture."""


class DataError(DiscoError):
  """A dataset folder or file is missing or not in the expected format."""


class ConfigError(DiscoError):
  """A model configuration is inconsistent."""
