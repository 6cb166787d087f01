"""Which owed buckets a forward must finish before each module reads its parameters (framework-free).

A per-bucket optimizer owes the updates of buckets whose reductions land after ``step()``; the next
forward finishes a bucket just before the first module that reads one of its parameters. Which
parameters a module's forward reads is learnt from the first forward (:class:`ForwardReads`): its
own, plus those of submodules whose forward never runs (``MultiheadAttention`` reads
``out_proj.weight`` itself), plus reads caught later at the read itself (a parent's forward reading a
child's bias before the child runs). Modules are any hashable keys; parameters are indices into the
model's parameter list, buckets positions in the bucket plan.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterable, Mapping, Sequence


class ForwardReads:
    """The parameters each module's forward reads, learnt from the forwards that ran."""

    def __init__(self) -> None:
        self.ran: set[Hashable] | None = set()  # the modules whose forward ran in the first forward (None after)
        self.needs: dict[Hashable, list[int]] = {}

    def module_runs(self, module: Hashable) -> None:
        """``module``'s forward starts (noted during the first forward only)."""
        if self.ran is not None:
            self.ran.add(module)

    def reads_of(self, module: Hashable, own: Callable[[], list[int]]) -> list[int]:
        """What ``module``'s forward reads: learnt, or, for a module not seen yet, at least ``own()`` (its own
        parameters)."""
        indices = self.needs.get(module)
        return own() if indices is None else indices

    def caught(self, reader: Hashable, index: int, own: Callable[[], list[int]]) -> None:
        """``reader``'s forward read parameter ``index`` without it among its learnt reads: its forward finishes
        that parameter's bucket from the next forward on."""
        needs = self.needs.setdefault(reader, list(self.reads_of(reader, own)))
        if index not in needs:
            needs.append(index)

    def first_forward_ended(
        self, own: Callable[[Hashable], list[int]], children: Callable[[Hashable], Iterable[Hashable]]
    ) -> None:
        """At the end of the first forward: each module that ran reads its own parameters and those of its
        submodules that never ran themselves (``own(module)``, ``children(module)``), and the reads caught
        during that forward. Later forwards learn only from reads caught."""
        if self.ran is None:
            return
        ran, self.ran = self.ran, None
        for owner in ran:
            indices: list[int] = []
            stack = [owner]
            while stack:  # the owner's parameters and those of its submodules that never ran themselves
                current = stack.pop()
                indices += own(current)
                stack += [child for child in children(current) if child not in ran]
            caught = [i for i in self.needs.get(owner, ()) if i not in indices]  # reads caught in this forward
            self.needs[owner] = indices + caught


def buckets_read(indices: Iterable[int], location: Mapping[int, Sequence[int]] | Sequence[Sequence[int]]) -> list[int]:
    """The buckets holding parameters ``indices`` (``location[i][0]``: parameter ``i``'s bucket), in plan
    order, each once: the order every rank finishes them in."""
    return sorted({location[i][0] for i in indices})


__all__ = ["ForwardReads", "buckets_read"]
