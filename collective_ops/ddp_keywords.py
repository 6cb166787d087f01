"""DDP's constructor keywords, so that ``torch.nn.parallel.DistributedDataParallel(model, **kw)`` ports to
``wrap(model, **kw)``: its names for our settings are taken, the ones we have no counterpart for are refused
with what to do instead (framework-free: names and messages only)."""

from __future__ import annotations

from typing import Any

UNSUPPORTED = {
    "mixed_precision": "cast the model to bf16/fp16 before wrap() and keep fp32 main gradients and masters with "
    "DistributedOptimizer(model, ..., master_weights=True), or run the forward under torch.autocast; "
    "compression='bf16' sends the gradients in bf16",
    "device_mesh": "wrap() reduces over every rank of the default process group; a mesh's data-parallel "
    "dimension alone is not supported",
    "delay_all_reduce_named_params": "every trainable parameter is reduced in its bucket during backward; "
    "freeze the parameters you reduce yourself (requires_grad=False) before wrap()",
    "param_to_hook_all_reduce": "every trainable parameter is reduced in its bucket during backward; "
    "freeze the parameters you reduce yourself (requires_grad=False) before wrap()",
    "skip_all_reduce_unused_params": "with find_unused_parameters=True a parameter no rank used gets no "
    "gradient and no update, as under DDP; there is no option to leave it unreduced on some ranks",
    "bucket_cap_mb_list": "give bucket_size_mb (and first_bucket_mb for the first bucket), or "
    "bucket_size_mb='auto' to let the tuner choose",
    "batched_grad_copy": "gradients are views of the buckets already (gradient_as_bucket_view=True, the "
    "default): there is no copy to batch",
}


def translate_ddp_keywords(bucket_size_mb: Any, default_bucket_mb: float, options: dict[str, Any]) -> Any:
    """``options`` with DDP's names for our settings renamed (in place: ``bucket_cap_mb`` is ``bucket_size_mb``,
    ``forward_sync_buffers`` is ``broadcast_buffers``); the bucket size to use. Raises
    ValueError where both names are given and disagree, or for a DDP keyword with no counterpart here."""
    for name, advice in UNSUPPORTED.items():
        if name in options:
            raise ValueError(f"DDP's {name} is not supported by collective_ops.wrap: {advice}")
    if "bucket_cap_mb" in options:  # (MiB in both)
        cap = options.pop("bucket_cap_mb")
        if bucket_size_mb != default_bucket_mb and bucket_size_mb != cap:
            raise ValueError(
                f"bucket_cap_mb={cap!r} (DDP's name) and bucket_size_mb={bucket_size_mb!r} disagree: give one, in MiB"
            )
        bucket_size_mb = cap
    if "forward_sync_buffers" in options:
        sync = options.pop("forward_sync_buffers")
        if sync is not None:  # (None: DDP's default, broadcast_buffers decides)
            if "broadcast_buffers" in options and options["broadcast_buffers"] not in (None, sync):
                raise ValueError(
                    f"forward_sync_buffers={sync!r} (DDP's newer name) and broadcast_buffers="
                    f"{options['broadcast_buffers']!r} disagree: give one"
                )
            options["broadcast_buffers"] = sync
    if options.get("broadcast_buffers", True) is None:  # DDP's signature default, meaning True
        options["broadcast_buffers"] = True
    return bucket_size_mb
