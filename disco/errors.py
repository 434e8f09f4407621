"""Errors raised by disco, all in one place.

Every error the package raises on bad input derives from `DiscoError`, so
callers can catch one class. Errors about a bad value also derive from
`ValueError`, so code that already catches the builtin keeps working.
Messages say what was wrong and what to do. `require_int` and
`require_number` are the checks of counts and rates that raise them (one
wording for the configs and the experiments' settings).

Example:
  >>> from disco.splits import split_channels
  >>> try:
  ...   split_channels(3, num_nodes=4)
  ... except ValueError as error:
  ...   isinstance(error, DiscoError)
  True
"""

import math
import numbers


class DiscoError(Exception):
  """Base class of every error disco raises on bad input."""


class PartitionError(DiscoError, ValueError):
  """Channels cannot be split over the nodes as asked."""


class PruneError(DiscoError, ValueError):
  """A pruning request is out of range or inconsistent with the masks."""


class ConfigError(DiscoError, ValueError):
  """A model configuration is inconsistent."""


class MetricsError(DiscoError, ValueError):
  """A model or input shape whose costs `disco.metrics` cannot count."""


class DistributedError(DiscoError, ValueError):
  """A model, mesh or input that distributed inference cannot run."""


class HloError(DiscoError, ValueError):
  """HLO text that is unreadable or has a collective that cannot be counted."""


class InputError(DiscoError, ValueError):
  """An input array whose shape the layer or model cannot take."""


class CheckpointError(DiscoError):
  """A checkpoint is missing, malformed or from another architecture."""


class DataError(DiscoError):
  """A dataset is missing, malformed or too small for what is asked of it."""


def require_int(name: str, value, least: int, error=ConfigError) -> None:
  """Raises `error` unless `value` is an int >= `least` (True is no int).

  Example:
    >>> require_int("epochs", -1, 0)
    Traceback (most recent call last):
    ...
    disco.errors.ConfigError: epochs must be an int >= 0, got -1
  """
  integral = isinstance(value, numbers.Integral)  # numpy's ints as well
  if isinstance(value, bool) or not integral or value < least:
    raise error(f"{name} must be an int >= {least}, got {value!r}")


def require_number(
  name: str, value, positive: bool = False, error=ConfigError
) -> None:
  """Raises `error` unless `value` is a finite real number >= 0 (> 0 when
  `positive`)."""
  real = isinstance(value, numbers.Real) and not isinstance(value, bool)
  if not (
    real and math.isfinite(value) and (value > 0 if positive else value >= 0)
  ):
    bound = "> 0" if positive else ">= 0"
    raise error(f"{name} must be a finite number {bound}, got {value!r}")


__all__ = [
  "CheckpointError",
  "ConfigError",
  "DataError",
  "DiscoError",
  "DistributedError",
  "HloError",
  "InputError",
  "MetricsError",
  "PartitionError",
  "PruneError",
]
