"""What both framework wrappers do around the bucket manager, once: the manager's construction from the options,
and the methods that read or change the plan, the compression's state and the statistics.

torch's ``DistributedDataParallel`` and MindSpore's ``DataParallel`` each subclass :class:`BucketedWrapper` beside
their framework's module class; each keeps what only its framework has (hooks on autograd or on Parameters,
views, compiled reductions). Framework-free: no framework is imported here.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from . import tracing
from .bucketing import BucketManager, BucketPlan, validate_bucket_mb
from .bucketing.compression import load_hook_state
from .options import WrapOptions


class BucketedWrapper:
    """The wrapper side both frameworks share. A subclass sets ``options`` (:class:`WrapOptions`), ``engine``,
    ``compression``, ``_auto_tune_at`` (the auto-tune step, None once settled or for a fixed size),
    ``_hook_handles`` (what :meth:`remove_hooks` detaches) and ``manager`` (:meth:`_start_manager`), and
    overrides :meth:`finish_owed_updates` where an optimizer may owe updates to the buckets."""

    options: WrapOptions
    engine: Any
    compression: Any
    manager: BucketManager
    _auto_tune_at: int | None
    _hook_handles: list

    def _start_manager(
        self,
        plan: BucketPlan,
        reduce_op: str,
        hook: Any,
        check_step_alignment: bool,
        on_rebuild: Callable[[BucketPlan], None] | None = None,
    ) -> BucketManager:
        """The bucket manager of ``plan`` with this wrapper's options (``reduce_op``, ``hook``: as resolved)."""
        o = self.options
        return BucketManager(
            plan,
            self.engine,
            reduce_op=reduce_op,
            comm_hook=hook,
            find_unused_parameters=o.find_unused_parameters,
            rebuild_after_first_step=o.rebuild_buckets,
            on_rebuild=on_rebuild,
            observer=tracing.start(self.engine) if o.trace else tracing.get_tracer(),
            check_step_alignment=check_step_alignment,
        )

    def finish_owed_updates(self) -> None:
        """Apply the updates a DistributedOptimizer still owes to this wrapper's buckets (none by default)."""

    def _check_replannable(self) -> None:
        """Raise where the buckets cannot be replanned now (a framework's compiled step holds the plan)."""

    @property
    def tune_pending(self) -> bool:
        """True until ``bucket_size_mb="auto"`` has settled on a size (False for a fixed size)."""
        return self._auto_tune_at is not None

    def set_bucket_size(self, bucket_size_mb: float, first_bucket_mb: float | None = None) -> None:
        """Replan with another bucket size between steps (every rank must call it with the same value); owed
        updates land first (they belong to the buckets of the plan they were owed in)."""
        self._check_replannable()
        self.finish_owed_updates()
        bucket_size_mb = validate_bucket_mb(bucket_size_mb, "bucket_size_mb")
        if first_bucket_mb is not None:
            first_bucket_mb = validate_bucket_mb(first_bucket_mb, "first_bucket_mb")
        self.manager.replan(bucket_size_mb, first_bucket_mb)

    def compression_state_dict(self) -> dict[str, Any]:
        """The compression's state between steps, for a checkpoint beside the model's and the optimizer's: with
        ``compression=co.PowerSGD(...)`` each bucket's error-feedback memory and Q factors (the framework's
        tensors), the step count and the random state (``{}`` for the stateless compressions)."""
        hook = self.manager.comm_hook
        if not hasattr(hook, "state_dict"):
            return {}
        self.finish_owed_updates()  # the step's last buckets land (and their error) before it is read
        return hook.state_dict()

    def load_compression_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`compression_state_dict` (a model wrapped with the same options, before its next step)."""
        load_hook_state(self.manager.comm_hook, state, self.engine)

    def remove_hooks(self) -> None:
        """Detach from the model's parameters (the model keeps working unwrapped)."""
        for handle in self._hook_handles:
            handle.remove()
        self._hook_handles.clear()  # (in place: shutdown's registry holds the same list)

    @property
    def comm_mode(self) -> str:
        """How the last step reduced: ``"overlap"`` (during backward) unless the framework says otherwise."""
        return "overlap"

    def comm_stats(self) -> dict[str, Any]:
        """Buckets, collectives and bytes per step, and communication time not hidden behind backward."""
        return {
            "mode": self.comm_mode,
            "backend": self.engine.backend,
            "compression": self.compression,
            **self.manager.stats_summary(),
        }

    def describe_plan(self) -> str:
        """The bucket plan, one line per bucket."""
        return self.manager.plan.describe()
