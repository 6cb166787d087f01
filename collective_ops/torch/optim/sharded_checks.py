"""What ``DistributedOptimizer(..., shard=True)`` refuses, and the errors it raises, with what to do.

Sharded, each rank holds averaged gradients only in its own shard of every bucket, and runs the optimizer
on flat pieces of parameters: the refusals here keep a loop from training differently than under DDP
without an error.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from ...bucketing.hooks import allreduce_hook
from ...bucketing.interfaces import wait_with_timeout
from ...bucketing.manager import StallError
from ...comm.torch_engine import _all_gather_single
from ...options import names_text
from .optimizer_set import given_optimizers

# torch.optim classes whose update of an element reads only that element's gradient and state (and the
# group's hyperparameters): run on flat pieces of parameters, their arithmetic is unchanged.
ELEMENTWISE_OPTIMIZERS = tuple(
    getattr(torch.optim, name)
    for name in ("SGD", "Adam", "AdamW", "Adamax", "Adagrad", "Adadelta", "ASGD", "NAdam", "RAdam", "RMSprop", "Rprop")
)
GRAD_REDUCE_DTYPES = (None, "float32")


def check_sharded_arguments(optimizer_class: Any, grad_reduce_dtype: str | None, assume_elementwise: bool) -> None:
    """What shard=True takes: an element-wise optimizer class and a known gradient dtype."""
    if given_optimizers(optimizer_class) is not None:
        raise TypeError(
            "shard=True takes an optimizer class and its settings (DistributedOptimizer(model, torch.optim.AdamW, "
            "shard=True, lr=...)): it builds the class over this rank's shards. Optimizers built over whole "
            "parameters (several classes, e.g. Muon + AdamW) run with shard=False"
        )
    refuse_non_elementwise(optimizer_class, assume_elementwise)
    if grad_reduce_dtype not in GRAD_REDUCE_DTYPES:
        raise ValueError(
            f"grad_reduce_dtype must be None (the parameters' dtype) or 'float32', got {grad_reduce_dtype!r}"
        )


def refuse_non_elementwise(optimizer_class: Any, assume_elementwise: bool) -> None:
    """Pieces of parameters change the update of any optimizer that reads across a parameter: refused unless
    known (or said) to be element-wise, rather than training differently without an error."""
    if assume_elementwise or optimizer_class in ELEMENTWISE_OPTIMIZERS or not isinstance(optimizer_class, type):
        return  # (not a class: the base class refuses it)
    name = getattr(optimizer_class, "__name__", repr(optimizer_class))
    raise ValueError(
        f"shard=True runs {name} on flat pieces of parameters (a shard boundary may cut one), and {name} is not "
        "known to update each element from its own gradient and state alone: one that reads across a parameter "
        "(Adafactor factors a matrix's second moment by rows and columns, Muon orthogonalises whole matrices, "
        "LAMB scales by a parameter's norm) would train differently on pieces, without an error. Use shard=False "
        f"(parameters whole), or pass assume_elementwise=True if {name}'s update is element-wise (known: "
        f"{', '.join(cls.__name__ for cls in ELEMENTWISE_OPTIMIZERS)}; subclasses of them too need it)"
    )


def refuse_unsupported(model: Any, grad_dtype: Any) -> None:
    manager = model.manager
    if manager.comm_hook is not allreduce_hook and not model.compression:
        raise ValueError(
            "shard=True reduce-scatters gradients and replaces the model's comm hook; a custom comm_hook cannot be "
            "used with it (compression='fp16'/'bf16' can)"
        )
    if model.compression and not isinstance(model.compression, str):  # co.PowerSGD: whole matrices, not shards
        raise ValueError(
            f"shard=True reduce-scatters each bucket, and compression={model.compression!r} reduces whole gradient "
            "matrices: use DistributedOptimizer without shard=True, or compression='fp16'/'bf16'"
        )
    if grad_dtype is not None and model.compression:
        raise ValueError("pass either compression (on wrap) or grad_dtype, not both")


def params_moved(names: list[str]) -> RuntimeError:
    return RuntimeError(
        f"shard=True: the storage of {names_text(names, 3)} was replaced "
        "after DistributedOptimizer was built (p.data = tensor, p.set_(), or a cast or move of the inner "
        "module): the optimizer updates each parameter through its view of the shard buffers, so this one "
        "would keep its values while its shard trains. Change parameters' values in place (with "
        "torch.no_grad(): p.copy_(value)), load weights with model.load_state_dict(), and convert the model "
        "before wrap()"
    )


def optimizer_beside(optimizer: Any) -> RuntimeError:
    return RuntimeError(
        f"{type(optimizer).__name__}.step() over parameters of a model whose DistributedOptimizer has "
        "shard=True: each rank holds averaged gradients only for its shard of every bucket, and the all-gather "
        "writes every parameter of a bucket, so that optimizer would train on gradients not averaged and its "
        "updates be overwritten. Give every trained parameter to the DistributedOptimizer (parameter groups "
        "for different settings), or use shard=False"
    )


def bound_gradients_changed(bucket: int, members: str, order: str) -> RuntimeError:
    return RuntimeError(
        f"shard=True: the gradients of bucket {bucket} ({members}) were "
        "changed in place between backward() and step(), after opt.param_groups or opt.finish_reductions() "
        "bound them to this rank's shard. Each rank holds the averaged gradient only in its own shard, so what "
        "code outside the optimizer computes from them differs per rank: torch.nn.utils.clip_grad_norm_ over "
        "opt.param_groups (or over the parameters) takes this rank's norm only, and the ranks' weights would "
        "part. Clip with opt.clip_grad_norm_(max_norm) (the global norm, from the shards), or call "
        "opt.gather_gradients() on every rank first: it all-gathers the averaged gradients, after which "
        f"torch's clip_grad_norm_/clip_grad_value_ over model.parameters() work as under DDP{order}"
    )


def second_backward() -> RuntimeError:
    return RuntimeError(
        "shard=True: backward() ran again before step() used the gradients it reduced last time. Each "
        "backward reduce-scatters, so this rank holds the averaged gradient only in its own shard, and a "
        "second backward would add local gradients to it and mix the two (not DDP's accumulation). They are "
        "all-gathered first where the backward passes through the model's outputs, but not where gradients "
        "are reduced in another dtype than their buffers' (grad_reduce_dtype, compression), nor for a "
        "backward that does not. Accumulate micro-batches under `with model.no_sync():` (every one but the "
        "last), or call opt.step() (or opt.zero_grad() to drop them) between backward() calls"
    )


def kept_gradients(what: str, kept: list[str]) -> RuntimeError:
    return RuntimeError(
        f"shard=True: {what} the gradients that step used were never cleared "
        f"({names_text(kept, limit=3)}). Under DDP a plain optimizer "
        "would use them again (a second step() applies them twice; a backward adds onto them, accumulating "
        "across steps); sharded, the step consumed this rank's averaged shard of them and the rest holds its "
        "local gradients, so the result would differ from DDP's. Call opt.zero_grad() after step() or before "
        "the next backward (a backward whose gradients are then dropped by a zero_grad() is fine: a GAN's "
        "generator step through this model); to accumulate micro-batches, run all but the last backward of a "
        "step under `with model.no_sync():`"
    )


# The sharded optimizer's calls that gather from every rank: every rank makes the same one at the same point.
GATHERING_CALLS = ("state_dict()", "consolidate_state_dict()", "gather_gradients()", "add_param_group()")
_EVERY_RANK_CALLS = (
    "with shard=True it gathers from every rank, so every rank calls it at the same point (then save the result on "
    "one: state = opt.state_dict(); if rank == 0: torch.save(state, path)), as FSDP's and DeepSpeed's checkpoints; "
    "or, as torch's ZeroRedundancyOptimizer, opt.consolidate_state_dict(to=0) on every rank, then opt.state_dict() "
    "on rank 0 alone (only rank 0 then holds the state, in host memory)"
)


class GatheringCallsDifferError(RuntimeError):
    """The ranks came to different calls of the sharded optimizer that gather from every rank."""


def state_gather_stalled(rank: int, timeout: float, call: str) -> StallError:
    return StallError(
        f"rank {rank} waited {timeout:g} s in opt.{call} for the other ranks: {_EVERY_RANK_CALLS}. Set "
        "COLLECTIVE_OPS_STALL_TIMEOUT (seconds) to wait longer."
    )


def _call_code(call: str) -> int:
    return GATHERING_CALLS.index(call.split("(")[0] + "()") + 1


def gathering_calls_differ(rank: int, call: str, codes: list[int]) -> GatheringCallsDifferError:
    others = ", ".join(f"rank {r} in opt.{GATHERING_CALLS[c - 1]}" for r, c in enumerate(codes) if r != rank)
    return GatheringCallsDifferError(
        f"rank {rank} came to opt.{call} while the other ranks came to other calls ({others}): {_EVERY_RANK_CALLS}"
    )


class RankArrivals:
    """Only for "has every rank come to the same call that gathers from every rank?", on a group of its own: a rank
    that never comes (state_dict() called on rank 0 alone, as a DDP loop saves) cannot pair it with its training
    collectives, as it would on theirs. (Every rank constructs it at the same point: creating a group is a
    collective.)"""

    def __init__(self) -> None:
        self.group = dist.new_group(backend=dist.get_backend()) if dist.get_world_size() > 1 else None
        self._posted: Any = None  # this rank's arrival (its work, every rank's call), not yet matched by every rank
        self._marked_stalled = False  # the engine marked stalled by an arrival that had not been matched

    def wait(self, engine: Any, timeout: float, call: str) -> None:
        """Return once every rank has come to ``call``; raise ``GatheringCallsDifferError`` on every rank where they
        came to different calls, and ``StallError`` after ``timeout`` seconds where some did not come. The arrival
        then stays posted, and ``engine`` is marked stalled until a later call on every rank matches it: at exit
        meanwhile its groups are left behind, as destroying this one would wait for its all-gather."""
        if self.group is None:
            return
        codes = self._arrive(engine, timeout, call)
        if len(set(codes)) > 1:
            # An arrival left posted by a call that gave up waiting carries that call: every rank (each sees the
            # same codes) says again where it is now, and only a difference then is one.
            codes = self._arrive(engine, timeout, call)
            if len(set(codes)) > 1:
                raise gathering_calls_differ(engine.rank, call, codes)

    def _arrive(self, engine: Any, timeout: float, call: str) -> list[int]:
        """Every rank's call, from this rank's arrival (or the one a call that gave up waiting left posted)."""
        if self._posted is None:
            mine = torch.tensor([_call_code(call)], dtype=torch.int64, device=engine.device)
            calls = torch.empty(dist.get_world_size(self.group), dtype=torch.int64, device=engine.device)
            self._posted = (_all_gather_single(calls, mine, group=self.group, async_op=True), calls)
        work, calls = self._posted
        try:
            wait_with_timeout(work, timeout)
        except TimeoutError as exc:
            engine.mark_stalled()
            self._marked_stalled = True
            raise state_gather_stalled(engine.rank, timeout, call) from exc
        self._posted = None
        if self._marked_stalled:  # every rank came at last: nothing of this group is left in flight
            engine.stalled = self._marked_stalled = False
        return calls.tolist()

    def release(self) -> None:
        """Let go of the group (``co.shutdown()``: destroying it joins its worker threads while Python is alive)."""
        self.group = self._posted = None


class SteppedGradients:
    """The gradients the last sharded step used, and the reduction of a backward that added onto them.

    Under DDP a backward after step() without zero_grad() adds onto the averaged gradients the step used
    (accumulating across steps). Sharded, only this rank's shard of them was averaged (the rest holds its
    local gradients), so the next reduce-scatter sums something else: that reduction is marked and refused
    where it would be used (step(), clipping, gathering), on every rank alike; a zero_grad() drops it."""

    def __init__(self) -> None:
        self.stepped: list[tuple[Any, Any]] = []  # (parameter, the gradient step() used)
        self.marked: tuple[int, list[str]] | None = None  # (reduction, the names of the gradients it added onto)

    @property
    def awaits(self) -> bool:
        """True after a step, until the first gradient after it is checked (:meth:`take_kept`) or cleared."""
        return bool(self.stepped)

    def note_step(self, params: list[Any]) -> None:
        self.stepped = [(p, p.grad) for p in params if p.grad is not None]

    def follow(self) -> None:
        """After a replan: the gradients the last step used, now in the new buffers (the old ones, freed, are not
        to be held here)."""
        self.stepped = [(p, p.grad) for p, _ in self.stepped if p.grad is not None]

    def clear(self) -> None:
        self.stepped, self.marked = [], None

    def take_kept(self, name_of: Any, but: Any = None) -> list[str]:
        """The parameters whose gradient the last step used is still there and not all zeros (``but``'s aside).
        Asked once per step: where none is kept they were cleared, and those cleared in place stay all zeros
        until a backward."""
        stepped, self.stepped = self.stepped, []
        return [name_of(p) for p, grad in stepped if p is not but and p.grad is grad and bool(grad.any())]

    def marked_names(self, reduction: int) -> list[str] | None:
        """Where ``reduction`` is marked (it added onto a consumed step's gradients): the names of the gradients
        that step left; else None."""
        if self.marked is not None and self.marked[0] == reduction:
            return self.marked[1]
        return None

    def refuse_marked(self, call: str, reduction: int) -> None:
        """Raise where ``call`` would use the gradients of ``reduction``, marked."""
        kept = self.marked_names(reduction)
        if kept is not None:
            raise kept_gradients(f"{call} on gradients a backward added after the last step(), while", kept)

    def refuse_kept(self, what: str, name_of: Any, but: Any = None) -> None:
        """Raise where gradients the last step used are still there and not all zeros (``but``'s aside)."""
        kept = self.take_kept(name_of, but)
        if kept:
            raise kept_gradients(what, kept)
