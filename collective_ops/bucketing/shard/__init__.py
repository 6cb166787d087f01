"""Sharded state (ZeRO-1) on the buckets, framework-free: ``layout`` (which rank owns which elements of each
bucket) and ``step`` (the shard step sequence: updates, then all-gathers in one fixed order)."""

from .layout import Box, BucketShards, ShardLayout, ShardPiece, flat_range_boxes, padded_numel

__all__ = ["Box", "BucketShards", "ShardLayout", "ShardPiece", "flat_range_boxes", "padded_numel"]
