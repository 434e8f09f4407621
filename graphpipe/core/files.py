"""Reading graph and plan files: JSON that a person may have edited."""

from __future__ import annotations

import json
import math

from graphpipe.errors import GraphFormatError

NODE_FIGURES = (
  "param_bytes",
  "state_bytes",
  "fwd_flops",
  "bwd_flops",
  "fwd_bytes",
  "bwd_bytes",
  "activation_bytes",
  "saved_bytes",
  "kept_bytes",
)
EDGE_FIGURES = ("bytes", "fixed_bytes", "num_values")


def check_figures(items, names, what) -> None:
  """Every figure of a loaded node or edge: present, finite and >= 0
  (the batch-independent parts in `fixed` may be negative)."""
  for item in items:
    figures = [(k, item[k], 0) for k in names]
    figures += [
      (f"fixed.{k}", v, -math.inf) for k, v in item.get("fixed", {}).items()
    ]
    for name, value, least in figures:
      number = isinstance(value, int | float) and not isinstance(value, bool)
      if not number or not math.isfinite(value) or value < least:
        bound = ">= 0" if least == 0 else ""
        raise GraphFormatError(
          f"{what} {item.get('id', (item.get('src'), item.get('dst')))}: "
          f"{name} = {value!r} is not a finite number {bound} (edited file?)"
        )


def read_json(path: str, what: str):
  """The JSON document at `path`; `GraphFormatError` if unreadable.

  Args:
    path: the file.
    what: what the file should hold, for the message ('a graph', ...).
  """
  try:
    with open(path) as f:
      return json.load(f)
  except json.JSONDecodeError as err:
    raise GraphFormatError(f"{path} is not JSON: {err}") from err
  except OSError as err:
    raise GraphFormatError(f"cannot read {what} from {path}: {err}") from None
