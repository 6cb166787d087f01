"""Each private framework API the library uses (``collective_ops/torch/_compat.py``,
``collective_ops/mindspore/_compat.py``) is still where the library expects it in the installed release: each
entry of their ``PRIVATE_APIS`` / ``OVERRIDDEN_HOOKS`` has a check here, and a check fails naming the entry when
a release moves it. Importing ``collective_ops.mindspore`` changes no MindSpore class."""

from __future__ import annotations

import importlib
import inspect
import subprocess
import sys
from collections.abc import Callable

import pytest

torch = pytest.importorskip("torch")
from collective_ops.torch import _compat as torch_compat  # noqa: E402


def _resolve(dotted: str) -> object:
    """The object a dotted name names: the longest importable module prefix, then attributes."""
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            found = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for attr in parts[cut:]:
            found = getattr(found, attr)
        return found
    raise ImportError(dotted)


def _join_config() -> None:
    config = torch_compat.disabled_join_config()
    assert config.enable is False and config.throw_on_early_termination is False


def _end_of_backward() -> None:
    ran = []
    x = torch.ones(2, requires_grad=True)
    x.register_hook(lambda g: torch_compat.queue_at_end_of_backward(lambda: ran.append(True)) or g)
    (x * 2).sum().backward()
    assert ran == [True]


def _to_kwargs() -> None:
    moved, moved_kwargs = torch_compat.move_forward_inputs((torch.ones(1),), {"y": torch.ones(1)}, torch.device("cpu"))
    assert isinstance(moved, tuple) and torch.equal(moved[0][0], torch.ones(1)) and "y" in moved_kwargs[0]


def _default_store() -> None:
    assert callable(torch.distributed.distributed_c10d._get_default_store)


def _world() -> None:
    assert isinstance(torch_compat.every_process_group(), list)


def _first_bucket() -> None:
    assert torch_compat.ddp_first_bucket_bytes() == 1024 * 1024


def _ddp_marker() -> None:
    assert hasattr(torch.nn.parallel.DistributedDataParallel, torch_compat.DDP_ACTIVE_MARKER)


def _disable_dynamo() -> None:
    assert torch_compat.disable_dynamo(lambda: 3)() == 3
    assert torch_compat.disable_dynamo(recursive=False)(lambda: 4)() == 4


def _optimized_module() -> None:
    compiled = torch.compile(torch.nn.Linear(2, 2))
    assert torch_compat.is_compiled(compiled) and not torch_compat.is_compiled(torch.nn.Linear(2, 2))


def _unscale() -> None:
    grads, found = [torch.tensor([2.0, float("inf")])], torch.zeros(())
    torch_compat.non_finite_check_and_unscale_(grads, found, torch.tensor(0.5))
    assert grads[0][0].item() == 1.0 and found.item() == 1.0


def _scaler_state() -> None:
    p = torch.nn.Parameter(torch.ones(2))
    opt = torch.optim.SGD([p], lr=0.1)
    scaler = torch.amp.GradScaler("cpu")
    scaler.scale(p.sum()).backward()
    scaler.unscale_(opt)
    state = torch_compat.scaler_state_of(scaler, opt)
    assert "stage" in state and "found_inf_per_device" in state


def _opt_called() -> None:
    opt = torch.optim.SGD([torch.nn.Parameter(torch.ones(1))], lr=0.1)
    torch.optim.lr_scheduler.StepLR(opt, 1)
    opt.step()
    assert getattr(opt, "_opt_called", False) is True  # the scheduler's step wrapper sets it as the library does
    assert 'getattr(self.optimizer, "_opt_called", False)' in inspect.getsource(torch.optim.lr_scheduler)


def _version() -> None:
    t = torch.zeros(2)
    (before,) = torch_compat.versions_of([t])
    t.add_(1)
    assert torch_compat.versions_of([t, torch.zeros(1)]) == [before + 1, 0]


def _direct_members() -> None:
    m = torch.nn.BatchNorm1d(2)
    m.sub = torch.nn.Linear(1, 1)
    assert torch_compat.direct_member_names(m) == [
        "sub",
        "weight",
        "bias",
        "running_mean",
        "running_var",
        "num_batches_tracked",
    ]


def _sharded_tensor() -> None:
    assert callable(torch_compat.ShardedTensor._init_from_local_shards_and_global_metadata)


def _dcp_reader() -> None:
    from torch.distributed.checkpoint import state_dict

    reader = inspect.unwrap(getattr(state_dict, torch_compat.DCP_READS_OPTIMIZER_STATE))
    assert "info" in reader.__code__.co_varnames, "DCP's optimizer-state reader keeps its options elsewhere"
    assert state_dict.__name__ == torch_compat.TORCH_DCP_MODULE


def _getframe() -> None:
    def asks() -> bool:
        return torch_compat.called_by_torch_dcp()

    assert asks() is False


TORCH_CHECKS: dict[str, Callable[[], None]] = {
    "torch.distributed.algorithms.join._JoinConfig": _join_config,
    "torch.autograd.Variable._execution_engine": _end_of_backward,
    "torch.distributed.utils._to_kwargs": _to_kwargs,
    "torch.distributed.distributed_c10d._get_default_store": _default_store,
    "torch.distributed.distributed_c10d._world": _world,
    "torch.distributed._DEFAULT_FIRST_BUCKET_BYTES": _first_bucket,
    "torch.nn.parallel.DistributedDataParallel._active_ddp_module": _ddp_marker,
    "torch._disable_dynamo": _disable_dynamo,
    "torch._dynamo.eval_frame.OptimizedModule": _optimized_module,
    "torch._amp_foreach_non_finite_check_and_unscale_": _unscale,
    "torch.amp.GradScaler._per_optimizer_states": _scaler_state,
    "torch.optim.Optimizer._opt_called": _opt_called,
    "torch.Tensor._version": _version,
    "torch.nn.Module._modules": _direct_members,
    "torch.distributed._shard.sharded_tensor.ShardedTensor": _sharded_tensor,
    "torch.distributed.checkpoint.state_dict._get_optim_state_dict": _dcp_reader,
    "sys._getframe": _getframe,
}

# Instance attributes (set in __init__ or by a call) rather than names on a module or class
_INSTANCE_STATE = {
    "torch.amp.GradScaler._per_optimizer_states",
    "torch.optim.Optimizer._opt_called",
    "torch.nn.Module._modules",
}


def test_every_private_torch_api_has_a_check() -> None:
    assert set(TORCH_CHECKS) == set(torch_compat.PRIVATE_APIS)


@pytest.mark.parametrize("name", sorted(torch_compat.PRIVATE_APIS))
def test_private_torch_api_is_where_the_library_expects_it(name: str) -> None:
    if name not in _INSTANCE_STATE:
        _resolve(name)
    TORCH_CHECKS[name]()


def test_torch_still_calls_the_hooks_the_library_overrides() -> None:
    """Each private member the library's classes define is one torch calls or reads by that name."""
    from torch.distributed.algorithms import join
    from torch.distributed.checkpoint import state_dict

    assert set(torch_compat.OVERRIDDEN_HOOKS) == {
        "_apply",
        "_fqn_modifiers",
        "_step_supports_amp_scaling",
        "_join_config",
    }
    assert "self._apply(" in inspect.getsource(torch.nn.Module.to)
    assert "_fqn_modifiers" in inspect.getsource(state_dict)
    assert "_step_supports_amp_scaling" in inspect.getsource(torch.amp.GradScaler.step)
    assert "_join_config" in inspect.getsource(join.Join)
    assert state_dict is not None


ms = pytest.importorskip("mindspore")


def _ms_compat():
    from collective_ops.mindspore import _compat

    return _compat


def test_private_mindspore_apis_are_where_the_library_expects_them() -> None:
    compat = _ms_compat()
    from mindspore import Parameter, Tensor, nn

    assert set(compat.PRIVATE_APIS) == {
        "mindspore.nn.Cell._params",
        "mindspore.nn.Optimizer._params",
        "mindspore.Parameter._version",
        "mindspore._no_grad",
        "mindspore.train.amp._config_level",
    }
    dense = nn.Dense(2, 2)
    assert set(compat.own_parameters(dense)) == {"weight", "bias"}
    opt = nn.Momentum(dense.trainable_params(), 0.1, 0.9)
    assert any(name.startswith("moments") for name in compat.optimizer_parameter_table(opt)), "Optimizer._params"
    p = Parameter(Tensor([1.0, 2.0], ms.float32), name="p")
    assert isinstance(compat.version_of(p), int)
    assert hasattr(ms, "_no_grad")
    with compat.no_grad():
        pass
    from mindspore.train import amp

    assert "O2" in amp._config_level and compat.amp_loss_scale_manager("O2") is not None


def test_importing_the_mindspore_package_changes_no_mindspore_class_and_wrap_installs_until_shutdown() -> None:
    """In a fresh interpreter: every attribute the library can replace is MindSpore's own after import; the
    patches are in place once a network is wrapped and MindSpore's own again after shutdown()."""
    script = """
import mindspore as ms
from mindspore import nn
from mindspore.train import amp
owners = (nn.Cell, nn.TrainOneStepCell, nn.TrainOneStepWithLossScaleCell, amp)
before = [dict(vars(o)) for o in owners]
def same():
    return [k for o, b in zip(owners, before) for k in set(vars(o)) | set(b) if vars(o).get(k) is not b.get(k)]
import collective_ops as co
import collective_ops.mindspore
from collective_ops.mindspore import _compat
assert set(_compat.TRAINING_PATCHES.owners) == set(owners)
assert same() == [], same()
_compat.TRAINING_PATCHES.install()
installed = sorted(same())
_compat.TRAINING_PATCHES.remove()
assert same() == [], same()
print(installed)
"""
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    assert (
        out.stdout.strip().splitlines()[-1] == "['__init__', '__init__', 'build_train_network', 'parameters_and_names']"
    )
