"""The GraphPipe case study: a two-branch transformer.

Two branches of 4 blocks, each block [multi-head attention + 2 linear] (one
pre-LN transformer layer), concatenated, pooled and classified. With 8
devices both planners in the paper choose 8 one-block stages: a sequential
pipeline of depth 8 against a graph pipeline of depth 4.

The architecture is the multi-modal transformer's (`mmt.Model`) with two
branches of four layers, so this module only fixes the sizes and re-exports
the rest.
"""

import dataclasses

from graphpipe.models import mmt
from graphpipe.models.mmt import (
  Model,
  abstract_batch,
  loss_fn,
  make_batch,
  modalities,
  modality_key,
)

__all__ = [
  "Config",
  "Model",
  "abstract_batch",
  "loss_fn",
  "make_batch",
  "modalities",
  "modality_key",
]


@dataclasses.dataclass(frozen=True)
class Config(mmt.Config):
  """Sizes of the case-study model: 2 branches x 4 layers of the MMT size.

  Example:
    >>> Config.paper().num_branches, Config.tiny().num_layers
    (2, 4)

  Args:
    num_branches: transformer branches (2 in the case study).
    num_layers: transformer blocks per branch (4 in the case study).
    seq_len: tokens per branch input.
    hidden: model width.
    num_heads: attention heads per layer.
    ffn: inner width of each layer's feed-forward block.
    num_classes: classifier outputs (our choice).
  """

  num_branches: int = 2
  num_layers: int = 4

  @classmethod
  def tiny(cls) -> "Config":
    """2 branches x 4 layers of width 16 (~2k parameters a layer), seq 8."""
    return cls(seq_len=8, hidden=16, num_heads=2, ffn=32, num_classes=5)
