"""collective-ops for MindSpore: ``wrap`` a ``mindspore.nn.Cell``, step it with ``DistributedOptimizer``."""

from __future__ import annotations

from .data_parallel import DataParallel, TrainOneStepCell, TrainOneStepWithLossScaleCell, wrap
from .optim import DistributedOptimizer

__all__ = ["DataParallel", "DistributedOptimizer", "TrainOneStepCell", "TrainOneStepWithLossScaleCell", "wrap"]
