"""disco: distributed inference with sparse cross-node communication.

Layers split over N nodes whose cross-node weight columns are gated by
learned masks (`DiscoDense`, `DiscoConv`); models built from them
(`disco.models`); channel selection (`disco.prune`); costs of one inference
(`disco.metrics`); training (`disco.train`); checkpoints
(`disco.checkpoint`); data that needs no download (`disco.data`);
distributed inference, one device per node (`disco.distributed`; each
model registers its lowering with `disco.lowering`); every error class
(`disco.errors`).

Example:
  >>> import disco
  >>> from flax import nnx
  >>> model = disco.models.ResNet(disco.models.ResNetConfig(num_nodes=2),
  ...                             rngs=nnx.Rngs(0))
  >>> disco.prune.to_ratio(model, comm_ratio=0.2)
  >>> round(disco.prune.comm_ratio(model), 3)
  0.175
"""

from disco import (
  checkpoint,
  data,
  distributed,
  metrics,
  models,
  prune,
  train,
)
from disco.errors import (
  CheckpointError,
  ConfigError,
  DataError,
  DiscoError,
  DistributedError,
  HloError,
  InputError,
  MetricsError,
  PartitionError,
  PruneError,
)
from disco.layers import CommMask, DiscoConv, DiscoDense

__all__ = [
  "CheckpointError",
  "CommMask",
  "ConfigError",
  "DataError",
  "DiscoConv",
  "DiscoDense",
  "DiscoError",
  "DistributedError",
  "HloError",
  "InputError",
  "MetricsError",
  "PartitionError",
  "PruneError",
  "checkpoint",
  "data",
  "distributed",
  "metrics",
  "models",
  "prune",
  "train",
]
