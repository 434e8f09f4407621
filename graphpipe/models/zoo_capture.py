"""Capture a zoo model by name: the graph every experiment starts from."""

from graphpipe.capture import capture
from graphpipe.graph import OpGraph


def capture_zoo(
  name: str,
  config: str = "tiny",
  batch_size: int | None = None,
  granularity=None,
  costs: bool = True,
) -> OpGraph:
  """Captures zoo model `name` at size `config` on abstract weights.

  Example:
    >>> graph = capture_zoo("candle_uno", "paper")
    >>> len(graph.sources())
    7

  Args:
    name: a model of `graphpipe.models.NAMES`.
    config: 'paper' or 'tiny'.
    batch_size: batch size to trace at; per-sample figures do not depend on
      it (default 8).
    granularity: as in `graphpipe.capture`; default the model's depth.
    costs: measure per-node FLOPs and bytes.
  """
  from graphpipe import models  # the registry imports this module

  spec = models.get(name)
  cfg = models.config(name, config)
  model = models.build(name, cfg, abstract=True)
  batch = spec.abstract_batch(cfg, batch_size or 8)
  return capture(
    spec.loss_fn,
    model,
    batch,
    granularity=granularity or spec.capture_depth,
    costs=costs,
    name=name,
    config=config,
  )
