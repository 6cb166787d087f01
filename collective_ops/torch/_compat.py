"""Every private torch API the library uses, in one place, each with the reason it is used.

torch may move any of these in a release. ``tests/test_compat.py`` checks each one against the installed torch
(it fails, naming the entry, when one moves), and ``tests/test_layout.py`` refuses a private torch name anywhere
else in the library. :data:`PRIVATE_APIS` lists them; :data:`OVERRIDDEN_HOOKS` lists the private methods and
attributes of torch's classes that the library's own classes define because torch calls or reads them.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed._shard.metadata import ShardMetadata
from torch.distributed._shard.sharded_tensor import Shard, ShardedTensor
from torch.distributed._shard.sharded_tensor.metadata import ShardedTensorMetadata, TensorProperties
from torch.distributed._shard.sharding_spec import EnumerableShardingSpec
from torch.distributed._shard.sharding_spec.api import custom_sharding_spec_op
from torch.distributed.algorithms.join import _JoinConfig
from torch.distributed.utils import _to_kwargs

# dotted name -> why the library needs it (the test checks that each resolves in the installed torch)
PRIVATE_APIS: dict[str, str] = {
    "torch.distributed.algorithms.join._JoinConfig": "a Joinable's configuration outside join() (DDP sets its own)",
    "torch.autograd.Variable._execution_engine": "a callback at the end of the backward pass, as DDP queues one",
    "torch.distributed.utils._to_kwargs": "DDP's own mover of a forward's inputs to the model's device",
    "torch.distributed.distributed_c10d._get_default_store": "the rendezvous store: a side channel in a stall",
    "torch.distributed.distributed_c10d._world": "every process group of the process, held when one stalls",
    "torch.distributed._DEFAULT_FIRST_BUCKET_BYTES": "DDP's first bucket, the floor of compile's graph split",
    "torch.nn.parallel.DistributedDataParallel._active_ddp_module": "marks the module compile splits as DDP's",
    "torch._disable_dynamo": "the wrapper's step bookkeeping runs outside a compiled graph",
    "torch._dynamo.eval_frame.OptimizedModule": "recognises torch.compile's module wrapper",
    "torch._amp_foreach_non_finite_check_and_unscale_": "unscales gradients with GradScaler's own kernel",
    "torch.amp.GradScaler._per_optimizer_states": "GradScaler's record of one optimizer's step (instance state)",
    "torch.optim.Optimizer._opt_called": "tells an LR scheduler the optimizer stepped (instance attribute)",
    "torch.Tensor._version": "a tensor's in-place version counter: a change after a bucket was read",
    "torch.nn.Module._modules": "a module's direct children, parameters and buffers (with _parameters, _buffers)",
    "torch.distributed._shard.sharded_tensor.ShardedTensor": "sharded optimizer state in DCP's sharded format",
    "torch.distributed.checkpoint.state_dict._get_optim_state_dict": "DCP asking for a sharded state dict",
    "sys._getframe": "who reads the optimizer's state or the model's names (DCP, recognised by its frames)",
}

# Private members of torch's classes that the library's classes define: torch calls or reads each by name.
OVERRIDDEN_HOOKS: dict[str, str] = {
    "_apply": "nn.Module.to()/half()/cuda() convert through it: the wrapper refuses training after a conversion",
    "_fqn_modifiers": "torch.distributed.checkpoint asks a wrapper which state-dict levels its names skip",
    "_step_supports_amp_scaling": "GradScaler.step() hands itself to an optimizer that declares it",
    "_join_config": "Join reads a Joinable's configuration from it",
}

# Re-exported: torch.distributed._shard's classes, for the sharded optimizer's DCP state (torch/optim/dcp.py)
__all__ = [
    "EnumerableShardingSpec",
    "Shard",
    "ShardMetadata",
    "ShardedTensor",
    "ShardedTensorMetadata",
    "TensorProperties",
    "custom_sharding_spec_op",
]

# torch.distributed.checkpoint's get/set_state_dict() (and their model/optimizer halves): they map optimizer state
# to names through the model's named_parameters() and the optimizer's param_groups
TORCH_DCP_MODULE = "torch.distributed.checkpoint.state_dict"
# DCP's function that reads an optimizer's state_dict(), with its options in a local named ``info``
DCP_READS_OPTIMIZER_STATE = "_get_optim_state_dict"


def disabled_join_config() -> Any:
    """A Joinable's configuration outside ``join()``: as torch's DDP and ZeroRedundancyOptimizer start."""
    return _JoinConfig.construct_disabled_join_config()


def queue_at_end_of_backward(callback: Callable[[], None]) -> None:
    """Run ``callback`` once the running backward pass has delivered every gradient (DDP's finalize point)."""
    torch.autograd.Variable._execution_engine.queue_callback(callback)


def move_forward_inputs(args: tuple, kwargs: dict, device: torch.device) -> tuple[tuple, tuple]:
    """DDP's mover of a forward's inputs to ``device`` (tensors inside containers and dataclasses too)."""
    return _to_kwargs(args, kwargs, device, False)


def default_store() -> Any:
    """The default process group's rendezvous store (raises where there is none)."""
    return dist.distributed_c10d._get_default_store()


def every_process_group() -> list[Any]:
    """Every process group made in this process."""
    return list(dist.distributed_c10d._world.pg_map)


def ddp_first_bucket_bytes() -> int:
    """DDP's first bucket size (0 where this torch has none)."""
    return getattr(torch.distributed, "_DEFAULT_FIRST_BUCKET_BYTES", 0)


# The class attribute naming the DDP module whose forward runs: torch.compile splits that module's graph at
# bucket boundaries (its DDPOptimizer). The wrapper sets it around its forward as torch's DDP does.
DDP_ACTIVE_MARKER = "_active_ddp_module"


disable_dynamo = torch._disable_dynamo
"""``torch._disable_dynamo``: a function that runs outside any compiled graph (``recursive=False`` as torch's)."""


def is_compiled(module: nn.Module) -> bool:
    """``module`` is ``torch.compile``'s wrapper of a module (looked up: nobody compiled where dynamo is not
    imported)."""
    compiled = getattr(sys.modules.get("torch._dynamo.eval_frame"), "OptimizedModule", None)
    return compiled is not None and isinstance(module, compiled)


def non_finite_check_and_unscale_(grads: list[torch.Tensor], found: torch.Tensor, inv_scale: torch.Tensor) -> None:
    """GradScaler's own unscaling kernel: ``grads`` multiplied by ``inv_scale``, ``found`` set on a non-finite."""
    torch._amp_foreach_non_finite_check_and_unscale_(grads, found, inv_scale)


def scaler_state_of(scaler: Any, optimizer: Any) -> dict[str, Any]:
    """GradScaler's record of ``optimizer``'s step (its stage, its per-device non-finite flags)."""
    return scaler._per_optimizer_states[id(optimizer)]


def mark_stepped(optimizer: torch.optim.Optimizer) -> None:
    """Tell an LR scheduler over ``optimizer`` that it has stepped (torch's step wrapper sets this)."""
    optimizer._opt_called = True


def versions_of(tensors: Iterable[torch.Tensor]) -> list[int]:
    """Each tensor's in-place version counter (one call for a bucket's tensors, not one per tensor)."""
    return [tensor._version for tensor in tensors]


def direct_member_names(module: nn.Module) -> list[str]:
    """The names of ``module``'s direct children, parameters and buffers."""
    return [*module._modules, *module._parameters, *module._buffers]


def sharded_tensor(local_shards: list[Shard], metadata: ShardedTensorMetadata, spec: Any) -> ShardedTensor:
    """A ShardedTensor from this rank's shards and the whole tensor's metadata (no collective)."""
    return ShardedTensor._init_from_local_shards_and_global_metadata(local_shards, metadata, sharding_spec=spec)


def called_by_torch_dcp() -> bool:
    """Whether the function that calls this was called from torch.distributed.checkpoint's state-dict module
    (:data:`TORCH_DCP_MODULE`): what it reads (parameter names, optimizer groups) it reads for checkpoints."""
    return sys._getframe(2).f_globals.get("__name__") == TORCH_DCP_MODULE


def dcp_asks_sharded_optimizer_state() -> bool:
    """Whether torch.distributed.checkpoint is reading an optimizer's ``state_dict()`` for a sharded state dict
    (``full_state_dict=False``) that it saves as it is: read off DCP's own frame (its ``info``). Anything else,
    including a torch whose DCP is laid out otherwise, answers False (the full state, always correct)."""
    frame = sys._getframe(1)
    while frame is not None and frame.f_globals.get("__name__") != TORCH_DCP_MODULE:
        frame = frame.f_back
    if frame is None or frame.f_code.co_name != DCP_READS_OPTIMIZER_STATE:
        return False
    info = frame.f_locals.get("info")
    return getattr(info, "full_state_dict", True) is False
