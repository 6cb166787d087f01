"""What a data-parallel wrapper calls on the optimizer attached to it (framework-free).

A per-bucket optimizer (``DistributedOptimizer``) follows its wrapper's buckets: the wrapper tells
it where the step is (a backward starts, reaches its end, a forward settles, a replan, a joined
rank's shadow step), and asks it whether updates are still owed before anything reads the
parameters. The wrapper calls only these members; everything else on the optimizer is its own.
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable


@runtime_checkable
class UpdateParticipant(Protocol):
    """The optimizer side of a wrapper's step, as the wrapper sees it."""

    #: True where the optimizer owns gradients after their reduction (sharded: each rank's shard only)
    shards: bool

    @property
    def defers(self) -> bool:
        """True if backward returns once buckets are launched (their reductions finished later, as needed)."""
        ...

    @property
    def in_flight(self) -> bool:
        """True while a step's reductions or updates are not all finished (:meth:`synchronize` finishes them)."""
        ...

    @property
    def stepping(self) -> bool:
        """True while the optimizer runs its wrapped class's step (another optimizer's step is not this one's)."""
        ...

    @property
    def awaits_first_gradient(self) -> bool:
        """True after a step until a gradient arrives (:meth:`first_gradient_after_step`) or gradients clear."""
        ...

    def synchronize(self) -> None:
        """Finish every bucket in flight and apply every owed update (blocking)."""

    def on_plan_change(self, plan: Any) -> None:
        """The wrapper's buckets were replanned (first-step rebuild, bucket-size tune)."""

    def first_gradient_after_step(self, param: Any) -> None:
        """The first gradient to arrive after a step (while :attr:`awaits_first_gradient`), ``param``'s."""

    def backward_reaches_outputs(self) -> None:
        """A backward reached the model's outputs, before any parameter's gradient (every rank alike)."""

    def backward_starts(self, param: Any = None) -> None:
        """The first gradient of a backward that reduces (``param``'s; every rank at the same point)."""

    def backward_ended(self) -> None:
        """The end of a backward whose reductions run on past it (deferred)."""

    def on_settle(self, forward_ended: bool = True) -> None:
        """The end of a forward (``forward_ended``) or of a backward that finished every bucket; every rank alike."""

    def compiled_forward_starts(self) -> None:
        """Before a compiled forward (one graph: no per-module waits inside it)."""

    def step_while_joined(self) -> None:
        """A step that a rank out of data shadows (``model.join()``), where the optimizer :attr:`shards`."""

    def settings_while_joined(self, active: bool) -> None:
        """Inside ``model.join()``, at each forward on every rank alike: where the optimizer :attr:`shards`, the
        active ranks' settings (an LR scheduler's) given to the joined ones; unsharded, nothing."""

    def before_optimizer_beside(self, optimizer: Any) -> None:
        """Another optimizer is about to step parameters of this wrapper's model."""

    def predict_overlapped(self, plan: Any, cost: Any) -> Any:
        """For the bucket-size tune: the simulated step were the model bucketed as ``plan`` (an ``OrderPrediction``
        with ``step_s`` and ``forward_wait_s``), or None where the optimizer has no profile of the step."""


__all__ = ["UpdateParticipant"]
