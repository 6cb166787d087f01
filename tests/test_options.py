"""The options as data: one default each, documented field by field, checked per framework; the reference page
rendered from them is current. (No rank group: framework-free checks.)"""

from __future__ import annotations

import dataclasses
import inspect

import pytest

from collective_ops.options import DEFAULT_BUCKET_MB, OptimizerOptions, WrapOptions, field_docs, fields_for
from collective_ops.tools import reference


def test_the_reference_page_is_current() -> None:
    assert reference.PAGE.read_text() == reference.render(), (
        "docs/reference.md is not what the option dataclasses render: run "
        "python -m collective_ops.tools.reference --write"
    )


@pytest.mark.parametrize("cls", [WrapOptions, OptimizerOptions])
def test_every_option_is_documented(cls) -> None:
    docs = field_docs(cls)
    assert [name for name, doc in docs.items() if len(doc) < 20] == []
    assert all(f.name in reference.render() for f in dataclasses.fields(cls))


def test_every_bucket_size_signature_takes_the_one_default() -> None:
    import collective_ops as co
    from collective_ops.bucketing import plan_buckets
    from collective_ops.frameworks import wrap as dispatching_wrap
    from collective_ops.torch.ddp import DistributedDataParallel
    from collective_ops.torch.ddp import wrap as torch_wrap

    assert WrapOptions().bucket_size_mb == DEFAULT_BUCKET_MB
    for fn in (co.wrap, dispatching_wrap, torch_wrap, DistributedDataParallel.__init__, plan_buckets):
        assert inspect.signature(fn).parameters["bucket_size_mb"].default == DEFAULT_BUCKET_MB, fn
    assert inspect.signature(co.GradientBucket).parameters["bucket_size_mb"].default == DEFAULT_BUCKET_MB


def test_each_framework_takes_its_own_options_and_is_told_the_others_counterpart() -> None:
    torch_only = {f.name for f in fields_for(WrapOptions, "torch")} - {
        f.name for f in fields_for(WrapOptions, "mindspore")
    }
    assert {"check_finite", "broadcast_buffers", "gradient_as_bucket_view", "init_sync"} <= torch_only
    with pytest.raises(TypeError, match=r"'check_finite' is a torch option.*TrainOneStepWithLossScaleCell"):
        WrapOptions.build("mindspore", 25.0, {"check_finite": True})
    with pytest.raises(TypeError, match=r"'broadcast_buffers' is a torch option.*broadcast_parameters"):
        WrapOptions.build("mindspore", 25.0, {"broadcast_buffers": False})
    with pytest.raises(TypeError, match=r"'broadcast_parameters' is a mindspore option.*init_sync"):
        WrapOptions.build("torch", 25.0, {"broadcast_parameters": False})
    with pytest.raises(TypeError, match=r"unexpected keyword argument 'bucket_sise_mb'; did you mean bucket_size_mb"):
        WrapOptions.build("torch", 25.0, {"bucket_sise_mb": 5})
    built = WrapOptions.build("mindspore", "auto", {"overlap": False})
    assert built.bucket_size_mb == "auto" and not built.overlap
    assert "check_finite" not in built.keywords("mindspore") and "overlap" in built.keywords("mindspore")


def test_the_optimizer_options_leave_the_optimizers_own_keywords() -> None:
    options, rest = OptimizerOptions.split("torch", {"lr": 0.1, "shard": True, "schedule": "plan"})
    assert (options.shard, options.schedule, rest) == (True, "plan", {"lr": 0.1})
    with pytest.raises(TypeError, match="'schedule' is a torch option"):
        OptimizerOptions.split("mindspore", {"lr": 0.1, "schedule": "plan"})
