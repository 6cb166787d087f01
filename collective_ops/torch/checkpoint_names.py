"""torch.distributed.checkpoint's state-dict functions, recognised by their module: they name optimizer state
through the model's ``named_parameters()`` and the optimizer's ``param_groups``, which then answer as they must
for checkpoints."""

from __future__ import annotations

import sys

# torch.distributed.checkpoint's get/set_state_dict() (and their model/optimizer halves): they map optimizer state
# to names through the model's named_parameters() and the optimizer's param_groups
TORCH_DCP_MODULE = "torch.distributed.checkpoint.state_dict"


def called_by_torch_dcp() -> bool:
    """Whether the function that calls this was called from torch.distributed.checkpoint's state-dict module
    (:data:`TORCH_DCP_MODULE`): what it reads (parameter names, optimizer groups) it reads for checkpoints."""
    return sys._getframe(2).f_globals.get("__name__") == TORCH_DCP_MODULE
