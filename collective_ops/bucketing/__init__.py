"""The framework-free bucketing core: planner, bucket manager, communication hooks.

Nothing here imports a deep-learning framework; adapters pass a ``BucketEngine``.
"""

from .alignment import StepAlignment, StepMisalignedError
from .compression import hook_for_compression
from .diagnosis import CommHookError, CommunicationError, StallError
from .fusion import fused_collective
from .gradient_bucket import GradientBucket
from .hooks import BucketContext, CommHook, allreduce_hook, compression_hook
from .interfaces import BucketEngine, CompletedHandle, Handle, ThenHandle
from .manager import BucketManager
from .plan import (
    DEFAULT_BUCKET_MB,
    DEFAULT_FIRST_BUCKET_MB,
    MIB,
    BucketPlan,
    BucketSpec,
    ParamSpec,
    complete_order,
    plan_buckets,
    validate_bucket_mb,
)
from .row_sparse import RowSparseBucket, RowSparseReduction
from .stats import BucketTiming, StepStats

__all__ = [
    "DEFAULT_BUCKET_MB",
    "DEFAULT_FIRST_BUCKET_MB",
    "MIB",
    "BucketContext",
    "BucketEngine",
    "BucketManager",
    "BucketPlan",
    "BucketSpec",
    "BucketTiming",
    "CommHookError",
    "CommunicationError",
    "StallError",
    "StepAlignment",
    "StepMisalignedError",
    "CommHook",
    "CompletedHandle",
    "GradientBucket",
    "Handle",
    "ParamSpec",
    "RowSparseBucket",
    "RowSparseReduction",
    "StepStats",
    "ThenHandle",
    "allreduce_hook",
    "complete_order",
    "compression_hook",
    "fused_collective",
    "hook_for_compression",
    "plan_buckets",
    "validate_bucket_mb",
]
