"""The pipelined training runtime (shard_map + ppermute)."""

from graphpipe.runtime.layout import PipelineRuntimeError
from graphpipe.runtime.trainer import Trainer, TrainState

__all__ = ["PipelineRuntimeError", "TrainState", "Trainer"]
