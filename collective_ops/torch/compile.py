"""The wrapper's forward under ``torch.compile``: what runs around the compiled graph (not traced), and the graph
split at bucket boundaries as torch's DDP has it."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from torch import nn

from ._compat import DDP_ACTIVE_MARKER, disable_dynamo


@disable_dynamo
def start_compiled_forward(model: Any) -> None:
    model._start_forward(compiled=True)


@disable_dynamo
def end_compiled_forward(model: Any) -> None:
    model._end_forward()


@contextlib.contextmanager
@disable_dynamo(recursive=False)
def compiled_as_ddp(model: Any) -> Iterator[None]:
    """Under ``torch.compile``, have the module's graph split at bucket boundaries as DDP's is.

    Dynamo splits a compiled graph into bucket-sized pieces (its DDPOptimizer) while torch's DDP
    marks itself active around its module's forward; without the split the compiled backward
    is one piece that hands every gradient over at its end, and no bucket overlaps it. The
    same marker, with this model's bucket size, gives collective_ops' buckets the same pieces.
    Skipped where this torch has no such marker.
    """
    ddp = nn.parallel.DistributedDataParallel
    if not hasattr(ddp, DDP_ACTIVE_MARKER):
        yield
        return
    previous = getattr(ddp, DDP_ACTIVE_MARKER)
    setattr(ddp, DDP_ACTIVE_MARKER, model)
    try:
        yield
    finally:
        setattr(ddp, DDP_ACTIVE_MARKER, previous)
