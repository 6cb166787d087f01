"""What ``wrap()`` and ``DistributedOptimizer()`` take, as data: every option once, with its default and its doc.

:class:`WrapOptions` holds every keyword ``collective_ops.wrap()`` takes (torch and MindSpore);
:class:`OptimizerOptions` those ``DistributedOptimizer`` takes besides the optimizer's own. Each field's
docstring (the string literal under it) is its documentation: ``python -m collective_ops.tools.reference``
renders them into docs/reference.md. A field that one framework alone takes says so in its metadata
(:func:`only`); :meth:`WrapOptions.build` refuses it on the other framework with what to use there instead.

Framework-free: names, defaults, checks and messages only.
"""

from __future__ import annotations

import ast
import dataclasses
import difflib
import functools
import inspect
import textwrap
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from .bucketing import DEFAULT_BUCKET_MB, DEFAULT_FIRST_BUCKET_MB, CommHook, hook_for_compression, validate_bucket_mb
from .bucketing.compression import PowerSGD
from .ops import parse_reduce_op

FRAMEWORKS = ("torch", "mindspore")


def only(framework: str, **elsewhere: str) -> dict[str, Any]:
    """Field metadata: the option is ``framework``'s alone; ``elsewhere[other]`` says what the other framework
    uses instead (shown when the option is given there)."""
    return {"framework": framework, "elsewhere": elsewhere}


@dataclass(frozen=True)
class WrapOptions:
    """Every keyword of ``collective_ops.wrap(model, bucket_size_mb, **options)``.

    A field whose default is None is resolved by the framework's wrapper, as its doc says."""

    bucket_size_mb: float | str = DEFAULT_BUCKET_MB
    """Bucket size in MiB (DDP's ``bucket_cap_mb``, accepted too), or ``"auto"``: start at the default, profile
    one step (``auto_tune_step``) and settle on the size the cost model and simulator predict fastest."""

    first_bucket_mb: float | None = None
    """Size in MiB of the first bucket backward fills, so that communication starts early. None: 1 MiB (DDP's)
    where reductions overlap backward (always on torch; with ``overlap`` on MindSpore), else ``bucket_size_mb``."""

    reduce_op: str = "avg"
    """How gradients are combined across ranks: ``"avg"`` (as DDP) or ``"sum"``."""

    find_unused_parameters: bool = False
    """As DDP's: allow parameters that receive no gradient in a step (a parameter unused on one rank gets the
    average of the others'; one no rank used gets no gradient)."""

    compression: str | PowerSGD | None = None
    """Send gradients in a narrower dtype: ``"fp16"``/``"float16"`` or ``"bf16"``/``"bfloat16"`` (a built-in
    ``comm_hook``); or low-rank: :class:`PowerSGD` options (DDP's ``powerSGD_hook`` algorithm, each bucket's state
    kept by the wrapper: ``compression_state_dict()``; on MindSpore it reduces from Python, in PyNative mode or
    through ``net.reduce(grads)``, not inside a compiled GRAPH-mode step). None sends them as they are."""

    comm_hook: CommHook | None = None
    """A custom reduction of each bucket (``collective_ops.bucketing.CommHook``); give it or ``compression``,
    not both. None: allreduce."""

    rebuild_buckets: bool = True
    """Re-plan the buckets once, after the first step, in the order gradients actually became ready (as DDP)."""

    trace: bool | None = None
    """True starts a communication trace (``collective_ops.tracing``) at wrap; None (or False) joins the trace
    already started, if any (``co.init`` starts one under ``COLLECTIVE_OPS_TRACE=1``)."""

    check_step_alignment: bool | None = None
    """Check each synchronised step that every rank ran the same number of forward passes behind its gradients
    (one small integer all-reduce per step): where ranks differ, every rank raises at the same step, before
    anything is updated. None: on for torch, off for MindSpore."""

    gradient_as_bucket_view: bool = field(
        default=True,
        metadata=only(
            "torch",
            mindspore="MindSpore tensors have no views into a flat buffer: gradients are copied into the buckets "
            "and reduce() returns new tensors; leave the keyword out",
        ),
    )
    """Each ``p.grad`` is a view into its bucket (no second copy of the gradients). DDP's default is False."""

    broadcast_buffers: bool = field(
        default=True,
        metadata=only(
            "torch",
            mindspore="MindSpore keeps a network's state in Parameters: broadcast_parameters=True (the default) "
            "sends rank 0's parameters, non-trainable ones such as BatchNorm's moving statistics included, at wrap "
            "time; MindSpore's nn.SyncBatchNorm synchronises those statistics every step",
        ),
    )
    """As DDP's: rank 0's buffers (BatchNorm running statistics) are broadcast before each training step's first
    forward. DDP's newer name ``forward_sync_buffers`` is accepted too."""

    check_finite: bool = field(
        default=False,
        metadata=only(
            "torch",
            mindspore="a loss-scale cell skips a step whose gradients hold an inf or NaN, on every rank alike: "
            "Model(wrapped, loss_fn, optimizer, loss_scale_manager=DynamicLossScaleManager()), or train with "
            "collective_ops.mindspore.TrainOneStepWithLossScaleCell",
        ),
    )
    """Raise a ``FloatingPointError`` naming the parameters (and the rank where the NaN/Inf began) when the
    optimizer applied a non-finite reduced gradient."""

    auto_tune_step: int = 2
    """With ``bucket_size_mb="auto"``: the step whose backward is profiled for the choice (>= 1; on MindSpore,
    PyNative mode: the choice is made at the end of that step's ``reduce()``)."""

    row_sparse_embeddings: bool | str = field(
        default="auto", metadata=only("torch", mindspore="MindSpore gradients reach the wrapper dense; leave it out")
    )
    """Reduce embedding tables' gradients by the rows the ranks looked up: ``"auto"`` (CPU tables not shared
    with another module), True (any device) or False (dense, as DDP)."""

    init_sync: bool = field(
        default=True, metadata=only("torch", mindspore="broadcast_parameters (rank 0's weights at wrap)")
    )
    """As DDP's: rank 0's parameters and buffers become every rank's at wrap; False leaves each rank its own."""

    device_ids: Sequence[Any] | None = field(default=None, metadata=only("torch"))
    """DDP's: the one accelerator the model is on (``[local_rank]``); each forward moves its inputs there."""

    output_device: Any = field(default=None, metadata=only("torch"))
    """DDP's: where outputs go; only the model's own device is accepted (outputs stay there, as under DDP)."""

    dim: int = field(default=0, metadata=only("torch"))
    """DDP's: the dimension its old multi-device mode scattered inputs on; checked, otherwise unused."""

    process_group: Any = field(default=None, metadata=only("torch"))
    """DDP's: the group to reduce over; only the whole world (None, ``dist.group.WORLD``) is supported."""

    static_graph: bool = field(default=False, metadata=only("torch"))
    """DDP's: asks nothing of the buckets here (a model whose graph changes trains either way); checked."""

    check_reduction: bool = field(default=False, metadata=only("torch"))
    """DDP's deprecated flag; checked, otherwise unused."""

    broadcast_parameters: bool = field(
        default=True, metadata=only("mindspore", torch="init_sync (DDP's name for rank 0's weights at wrap)")
    )
    """Rank 0's parameters become every rank's at wrap; False leaves each rank its own."""

    overlap: bool | None = field(
        default=None, metadata=only("mindspore", torch="torch's wrap always overlaps reductions with backward")
    )
    """Reduce buckets during backward (parameter hooks; PyNative mode only). None: on in PyNative mode except on
    the CPU (MCCL), where collectives share backward's queue and reducing after backward is faster."""

    compile_reduction: bool = field(
        default=True, metadata=only("mindspore", torch="torch's reductions run eagerly, bucket by bucket")
    )
    """Reduce the whole plan after backward in one compiled graph where the default hook applies (as
    ``DistributedGradReducer``'s ``@jit``)."""

    @classmethod
    def build(
        cls, framework: str, bucket_size_mb: Any = DEFAULT_BUCKET_MB, keywords: Mapping[str, Any] = {}
    ) -> WrapOptions:  # noqa: B006
        """The options of a ``wrap()`` call on ``framework``: an unknown keyword raises ``TypeError`` (with the
        closest names), one the other framework alone takes raises ``TypeError`` with what to use instead."""
        check_keywords(cls, framework, keywords, "wrap()")
        return cls(bucket_size_mb=bucket_size_mb, **keywords)

    def keywords(self, framework: str) -> dict[str, Any]:
        """The options ``framework``'s wrapper takes, by name (the other framework's left out)."""
        return {f.name: getattr(self, f.name) for f in fields_for(type(self), framework)}


@dataclass(frozen=True)
class OptimizerOptions:
    """``DistributedOptimizer(model, optimizer_class, *args, **options)``'s own keywords (the rest of the
    keywords go to ``optimizer_class``)."""

    shard: bool = False
    """Shard the optimizer state (and fp32 masters) across ranks: gradients are reduce-scattered, each rank
    updates its shard, parameters are all-gathered (ZeroRedundancyOptimizer's memory, overlapped)."""

    assume_elementwise: bool = False
    """With ``shard``: step optimizers not known to update element by element anyway (their update of a shard
    must equal the shard of their update)."""

    overlap: bool = field(default=True, metadata=only("torch"))
    """Update each bucket's parameters as soon as its reduction lands, overlapping the next forward; False
    updates after the whole reduction, in ``step()``."""

    schedule: str | None = field(default=None, metadata=only("torch"))
    """Launch order of the buckets' reductions: ``"plan"`` (plan order) or ``"auto"`` (a simulated best order,
    tried on live steps; with ``shard``, whole buckets only). None: ``"plan"`` with a custom comm hook, else
    ``"auto"``."""

    grad_dtype: Any = field(default=None, metadata=only("torch"))
    """The dtype gradients are kept, accumulated across ``no_sync()`` micro-steps and averaged in:
    ``torch.float32`` (or ``"float32"``) for fp32 main gradients of a bf16/fp16 model, in the bucket buffers (each
    ``p.grad`` autograd makes is added into them and dropped); None: the parameters' own (fp32 with
    ``master_weights``). Unsharded, fp32 main gradients need ``master_weights=True``."""

    master_weights: bool | None = field(default=None, metadata=only("torch"))
    """Keep fp32 masters of the bf16/fp16 parameters: the optimizer class updates them from fp32 main gradients
    (its state in fp32 too) and rounds them into the parameters after each step; saved in ``state_dict()`` as
    ``"master_param"``. None: on with ``shard`` (its 1/N of them), off without. Unsharded it takes SGD, Adam or
    AdamW, each bucket updated as one tensor."""

    grad_reduce_dtype: str | None = field(default=None, metadata=only("torch"))
    """With ``shard``: a deprecated alias of ``grad_dtype`` (a DeprecationWarning)."""

    @classmethod
    def split(cls, framework: str, keywords: Mapping[str, Any]) -> tuple[OptimizerOptions, dict[str, Any]]:
        """(this optimizer's options, the keywords left for ``optimizer_class``); a keyword the other framework
        alone takes raises ``TypeError`` with what to use instead."""
        ours = {k: v for k, v in keywords.items() if k in field_names(cls)}
        check_keywords(cls, framework, ours, "DistributedOptimizer")
        return cls(**ours), {k: v for k, v in keywords.items() if k not in ours}


def field_names(cls: type) -> frozenset[str]:
    return frozenset(f.name for f in dataclasses.fields(cls))


def fields_for(cls: type, framework: str) -> list[dataclasses.Field]:
    """``cls``'s fields that ``framework`` takes: the shared ones and its own."""
    return [f for f in dataclasses.fields(cls) if f.metadata.get("framework", framework) == framework]


def check_keywords(cls: type, framework: str, keywords: Mapping[str, Any], what: str) -> None:
    """Raise ``TypeError`` for a keyword ``cls`` lacks (naming the closest) or that another framework alone takes
    (naming what ``framework`` uses instead)."""
    if framework not in FRAMEWORKS:
        raise ValueError(f"framework must be one of {FRAMEWORKS}, got {framework!r}")
    by_name = {f.name: f for f in dataclasses.fields(cls)}
    for name in keywords:
        spec = by_name.get(name)
        if spec is None:
            close = difflib.get_close_matches(name, [f.name for f in fields_for(cls, framework)], n=3)
            hint = f"; did you mean {', '.join(close)}?" if close else ""
            raise TypeError(
                f"{what} got an unexpected keyword argument {name!r}{hint} (every option: python -m collective_ops.tools.reference, or docs/reference.md)"
            )
        owner = spec.metadata.get("framework", framework)
        if owner != framework:
            instead = spec.metadata.get("elsewhere", {}).get(framework)
            raise TypeError(
                f"{what}: {name!r} is a {owner} option, not taken for a {framework} model"
                + (f"; on {framework}: {instead}" if instead else "")
            )


@functools.cache
def field_docs(cls: type) -> dict[str, str]:
    """Each field's docstring (the string literal under it in the class body), dedented and joined to one
    paragraph; "" where a field has none."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    body = tree.body[0].body
    docs: dict[str, str] = {}
    for node, after in zip(body, body[1:]):
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and _is_docstring(after):
            docs[node.target.id] = " ".join(inspect.cleandoc(after.value.value).split())
    return {f.name: docs.get(f.name, "") for f in dataclasses.fields(cls)}


def _is_docstring(node: ast.stmt) -> bool:
    return isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str)


def resolve_options(
    bucket_size_mb: float,
    first_bucket_mb: float | None,
    reduce_op: Any,
    compression: str | PowerSGD | None,
    comm_hook: CommHook | None,
) -> tuple[float, float | None, str, CommHook]:
    """Validated (bucket_size_mb, first_bucket_mb, reduce_op, comm_hook), or a clear error."""
    bucket_size_mb = validate_bucket_mb(bucket_size_mb, "bucket_size_mb")
    if first_bucket_mb is not None:  # None: the adapter chooses
        first_bucket_mb = validate_bucket_mb(first_bucket_mb, "first_bucket_mb")
    reduce_op = parse_reduce_op(reduce_op)
    if reduce_op not in ("avg", "sum"):
        raise ValueError(f"reduce_op for gradients must be 'avg' or 'sum', got {reduce_op!r}")
    if comm_hook is not None and compression is not None:
        raise ValueError("give either compression or comm_hook, not both (compression is a built-in comm_hook)")
    hook = comm_hook or hook_for_compression(compression)
    if hasattr(hook, "bind_shapes") and reduce_op != "avg":  # a low-rank compression (PowerSGD) averages
        raise ValueError(f"compression={compression!r} averages gradients: it needs reduce_op='avg', got {reduce_op!r}")
    return bucket_size_mb, first_bucket_mb, reduce_op, hook


def names_text(names: Sequence[str], limit: int = 5) -> str:
    """Parameter names for an error message: the first ``limit``, quoted, then "..." if there are more."""
    return ", ".join(repr(n) for n in names[:limit]) + (" ..." if len(names) > limit else "")


__all__ = [
    "DEFAULT_BUCKET_MB",
    "DEFAULT_FIRST_BUCKET_MB",
    "OptimizerOptions",
    "WrapOptions",
    "check_keywords",
    "field_docs",
    "fields_for",
    "names_text",
    "resolve_options",
]
