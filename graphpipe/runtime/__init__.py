"""The pipelined training runtime (shard_map + ppermute)."""

from graphpipe.errors import PipelineRuntimeError
from graphpipe.runtime.trainer import Trainer, TrainState

__all__ = ["PipelineRuntimeError", "TrainState", "Trainer"]
