"""Hugging Face Accelerate with the model wrapped by ``collective_ops.wrap`` where ``accelerator.prepare`` uses DDP.

.. code-block:: python

    from accelerate import Accelerator
    import collective_ops.accelerate as co_accelerate

    accelerator = Accelerator(gradient_accumulation_steps=2, mixed_precision="bf16")
    model, optimizer, loader = co_accelerate.prepare(accelerator, model, optimizer, loader, bucket_size_mb=25)
    # the loop is Accelerate's as usual: accumulate(), backward(), clip_grad_norm_(), gather_for_metrics(),
    # unwrap_model(), save_state()/load_state()

    co_accelerate.use(accelerator)  # or: every later accelerator.prepare() wraps models this way (a Trainer's)

Each model is prepared by Accelerate itself (device placement, the mixed-precision autocast of its forward),
without DDP, then wrapped by :func:`collective_ops.wrap` and registered with the accelerator in DDP's place:
``accumulate()`` reaches the wrapper's ``no_sync()``, ``save_state()`` saves its weights (and, registered for
checkpointing, every rank's PowerSGD state), ``unwrap_model()`` returns the model as given. Optimizers, data
loaders and schedulers are Accelerate's, unchanged.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from accelerate import Accelerator
from accelerate.utils import DistributedType, DynamoBackend
from torch import nn

import collective_ops as co

from .torch.ddp import DistributedDataParallel as WrappedModel
from .torch.rank_states import RankCompressionStates

# Where Accelerate would not wrap a model in DDP either: nothing for collective_ops to do.
_DATA_PARALLEL = (DistributedType.MULTI_CPU, DistributedType.MULTI_GPU, DistributedType.MULTI_NPU)


def prepare(accelerator: Accelerator, *objects: Any, **wrap_options: Any) -> Any:
    """What ``accelerator.prepare(*objects)`` returns, with each model wrapped by ``collective_ops.wrap``
    (``wrap_options`` are its options) instead of torch's DDP."""
    _check_supported(accelerator)
    prepare_others = getattr(accelerator, "_collective_ops_original_prepare", accelerator.prepare)
    models = {i: _prepare_model(accelerator, obj, wrap_options) for i, obj in enumerate(objects) if _is_model(obj)}
    others = [obj for i, obj in enumerate(objects) if i not in models]
    prepared = prepare_others(*others) if others else ()
    prepared = list(prepared) if len(others) > 1 else [prepared] if others else []
    results = [models[i] if i in models else prepared.pop(0) for i in range(len(objects))]
    _route_unwrap(accelerator)
    return results[0] if len(results) == 1 else tuple(results)


def use(accelerator: Accelerator, **wrap_options: Any) -> Accelerator:
    """From now on ``accelerator.prepare(...)`` prepares as :func:`prepare` does: for code that calls it itself,
    a transformers ``Trainer`` (``use(trainer.accelerator)`` before ``trainer.train()``). Returns ``accelerator``."""
    if not hasattr(accelerator, "_collective_ops_original_prepare"):
        accelerator._collective_ops_original_prepare = accelerator.prepare
    accelerator.prepare = functools.partial(prepare, accelerator, **wrap_options)
    return accelerator


def _is_model(obj: Any) -> bool:
    return isinstance(obj, nn.Module) and not isinstance(obj, WrappedModel)


def _check_supported(accelerator: Accelerator) -> None:
    if accelerator.distributed_type not in (*_DATA_PARALLEL, DistributedType.NO):
        raise ValueError(
            f"collective_ops.accelerate prepares data-parallel runs (DDP's place); this accelerator is configured for "
            f"{accelerator.distributed_type}: use accelerator.prepare() for it"
        )
    if accelerator.state.dynamo_plugin.backend != DynamoBackend.NO:
        raise ValueError(
            "collective_ops.accelerate does not compile models: configure Accelerate without dynamo "
            "(torch.compile the wrapped model yourself: co.wrap(model) under torch.compile is supported)"
        )


def _adopt_process_group(accelerator: Accelerator) -> None:
    """Accelerate's state made the process group (from the launcher's environment); collective_ops joins it."""
    if not co.is_initialized("torch"):
        co.init(rank=accelerator.process_index, world_size=accelerator.num_processes)


def _prepare_model(accelerator: Accelerator, model: nn.Module, wrap_options: dict[str, Any]) -> nn.Module:
    """Accelerate's preparation without its DDP (device, autocast), then ours, registered in DDP's place."""
    prepared = accelerator.prepare_model(model, evaluation_mode=True)
    if accelerator.distributed_type not in _DATA_PARALLEL:
        return prepared  # one process: Accelerate wraps nothing either
    _adopt_process_group(accelerator)
    handler = accelerator.ddp_handler  # DistributedDataParallelKwargs: DDP's names, which wrap() takes
    wrapped = co.wrap(prepared, **{**(handler.to_kwargs() if handler is not None else {}), **wrap_options})
    if handler is not None:
        handler.register_comm_hook(wrapped)  # its comm_hook, as on DDP (none by default)
    accelerator._models[:] = [wrapped if m is prepared else m for m in accelerator._models]
    if RankCompressionStates.needed(wrapped):  # save_state()/load_state() carry every rank's PowerSGD state
        accelerator.register_for_checkpointing(RankCompressionStates(wrapped, writer=_writer_of(accelerator)))
    return wrapped


def _route_unwrap(accelerator: Accelerator) -> None:
    """``accelerator.unwrap_model`` (which ``save_state``, ``get_state_dict`` and a Trainer's saving call) sees
    through the wrapper as through DDP: Accelerate knows only its own wrapper classes."""
    if getattr(accelerator, "_collective_ops_unwraps", False):
        return
    unwrap = accelerator.unwrap_model

    def unwrap_model(model: nn.Module, *args: Any, **kwargs: Any) -> nn.Module:
        return unwrap(model.module if isinstance(model, WrappedModel) else model, *args, **kwargs)

    accelerator.unwrap_model = unwrap_model
    accelerator._collective_ops_unwraps = True


def _writer_of(accelerator: Accelerator) -> Callable[[], int | None]:
    """The rank that writes ``save_state``'s files, as Accelerate's ``save`` decides when it writes: the main
    process, or with ``save_on_each_node`` each node's first (None: every rank then receives every state)."""
    return lambda: None if accelerator.project_configuration.save_on_each_node else 0


__all__ = ["prepare", "use"]
