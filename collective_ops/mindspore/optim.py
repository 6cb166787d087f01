"""MindSpore: ``DistributedOptimizer(net, nn.Adam, shard=True, ...)``, optimizer state sharded over the ranks (ZeRO-1).

The wrapped network's bucket plan is cut by the core's :class:`~collective_ops.bucketing.ShardLayout`
(Megatron-core's layout: each bucket padded to a multiple of the world size, rank ``r`` owning
the ``r``-th equal slice). Each rank keeps a float32 ``Parameter`` for every piece of a
parameter inside its shards and gives only those to the wrapped MindSpore optimizer, so its
state (Adam's two moments, Momentum's accumulator) is about 1/N of the plain optimizer's.

A step (``opt(grads)``, where a MindSpore optimizer is called): every bucket's gradients are
packed and reduce-scattered (summed, then times ``1/world`` as ``DistributedGradReducer``
averages) in one compiled graph, the wrapped optimizer updates this rank's pieces, and the
updated shards are all-gathered and assigned into every rank's network parameters, in place, in
a second compiled graph (the engine's ``compiled_shard_step``). The reduce-scatter is an
all-reduce and a slice (MCCL, MindSpore's CPU backend, has no ReduceScatter kernel), which moves
twice a reduce-scatter's bytes (a warning says so once on MCCL); the state saving holds.

Element-wise optimizers only (Momentum, SGD, Adam, AdamWeightDecay, ...): ``Lamb`` and
``LARS`` read whole-parameter norms that a piece does not have, and are refused, as is
``grad_centralization``. PyNative mode; the wrapper must reduce after backward
(``overlap=False``), since the optimizer does the reduction itself.

``shard=False`` is the same call on the network's parameters after ``net.reduce(grads)``; in PyNative, where the
wrapper reduces bucket by bucket (``overlap=True``), each bucket's update is owed to the next forward
(:mod:`.bucket_updates`). ``shard=True`` updates after the whole reduction.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Sequence
from typing import Any

import mindspore as ms
import numpy as np
from mindspore import Parameter, mint, nn

from ..bucketing import allreduce_hook
from ..bucketing.shard import ShardLayout, ShardPiece
from ..comm.mindspore_engine import fresh_copy
from ._compat import version_of
from .bucket_updates import BucketUpdates
from .data_parallel import DataParallel, _pynative, _refuse_misordered

logger = logging.getLogger("collective_ops")

# mindspore.nn optimizers whose update of an element reads only that element's gradient and state (and the
# group's hyperparameters): run on flat pieces of parameters, their arithmetic is unchanged
ELEMENTWISE_OPTIMIZERS = tuple(
    getattr(nn, name)
    for name in (
        "SGD",
        "Momentum",
        "Adam",
        "AdamWeightDecay",
        "AdaMax",
        "Adagrad",
        "Adadelta",
        "RMSProp",
        "Rprop",
        "ASGD",
    )
)
_warned_mccl = False


def _group_list(params: Any, default: list) -> tuple[list[dict], list[Parameter]]:
    """The parameter groups (dicts, MindSpore's format) and the order of ``opt.parameters``."""
    if params is None:
        params = default
    params = list(params)
    if not params or not isinstance(params[0], dict):
        return [{"params": params}], params
    groups = [dict(g) for g in params if "order_params" not in g]
    order = next((list(g["order_params"]) for g in params if "order_params" in g), None)
    for group in groups:
        if group.get("grad_centralization"):
            raise ValueError(
                "grad_centralization needs each gradient's whole shape, which a shard's piece does not have: "
                "leave it off with shard=True"
            )
    flat = [p for g in groups for p in g["params"]]
    return groups, order if order is not None else flat


class DistributedOptimizer(nn.Optimizer):
    """A MindSpore optimizer over a wrapped network: ``opt(grads)`` reduces and updates, as
    ``optimizer(net.reduce(grads))`` does; with ``shard=True`` each rank keeps the state of its shards only.

    An ``nn.Optimizer`` (a ``Cell``): ``Model(wrapped, loss_fn, opt)`` and ``nn.TrainOneStepCell`` take it, and
    their step then leaves the reduction to it (no second one). In GRAPH mode (``shard=False``) its step is
    compiled: the wrapper's compiled reduction, then the wrapped optimizer. In PyNative over a wrapper that reduces
    bucket by bucket (``overlap=True``) a step owes each bucket's update to the next forward, which applies it
    before the first cell that reads the bucket's parameters (:mod:`.bucket_updates`; ``synchronize()`` applies
    every owed update at once; checkpoints and parameter listings do so themselves).

    ``optimizer_class`` is a ``mindspore.nn.Optimizer`` subclass, built with ``params`` (default:
    the network's trainable parameters; MindSpore's group dicts work) and ``kwargs``. Take
    gradients with respect to ``opt.parameters`` (``ms.value_and_grad(fn, None, opt.parameters)``).
    """

    def __init__(
        self,
        network: DataParallel,
        optimizer_class: type,
        params: Any = None,
        *,
        shard: bool = False,
        assume_elementwise: bool = False,
        **kwargs: Any,
    ) -> None:
        nn.Cell.__init__(self, auto_prefix=False)  # not nn.Optimizer's: the wrapped optimizer holds the state
        if not isinstance(network, DataParallel):
            raise TypeError(
                f"DistributedOptimizer takes a network wrapped by collective_ops.wrap(), got {type(network).__name__}; "
                "wrap it first: net = collective_ops.wrap(net, overlap=False)"
            )
        if not (isinstance(optimizer_class, type) and issubclass(optimizer_class, nn.Optimizer)):
            raise TypeError(
                f"optimizer_class must be a mindspore.nn.Optimizer subclass (e.g. nn.Adam), got {optimizer_class!r}"
            )
        # not through Cell.__setattr__: the network is no part of the optimizer, nor its parameters this Cell's
        object.__setattr__(self, "network", network)
        self.shard = shard
        groups, order = _group_list(params, network.trainable_params())
        object.__setattr__(self, "parameters", tuple(order))
        self._indices = network._indices_of(self.parameters)
        if not shard:
            self.optimizer = optimizer_class(params if params is not None else list(self.parameters), **kwargs)
            self._own = {id(p) for p in self.optimizer.parameters}
            # what a compiled step (GRAPH mode: construct) reduces with; PyNative calls reduce() from Python
            self.grad_reducer = nn.Identity() if _pynative() else network.graph_reducer(list(self.parameters))
            object.__setattr__(
                self, "_updates", None
            )  # GRAPH mode: one compiled step, the update after the whole reduction
            if _pynative():
                updates = BucketUpdates(
                    network, self.optimizer, self._bucket_builder(optimizer_class, params, order, kwargs)
                )
                object.__setattr__(self, "_updates", updates)
                network._participant = updates
            return
        self._refuse_unshardable(optimizer_class, assume_elementwise)
        engine = network.engine
        # the plan as it is now, for good: a later replan of the wrapper (reduce() rebuilds buckets after its first
        # step, set_bucket_size) must not move the shards this rank's state belongs to
        self._layout = ShardLayout(network.manager.plan, engine.world_size)
        self._rank_pieces = self._layout.pieces(engine.rank)
        self._pieces = {piece: self._piece_parameter(piece) for piece in self._rank_pieces}
        group_of = {network._index[p.name]: k for k, g in enumerate(groups) for p in g["params"]}
        inner_groups = [
            {**g, "params": [param for piece, param in self._pieces.items() if group_of[piece.param_index] == k]}
            for k, g in enumerate(groups)
        ]
        inner_groups = [g for g in inner_groups if g["params"]]  # a rank may own nothing of a small group
        if params is None or not isinstance(list(params)[0], dict):
            self.optimizer = optimizer_class([p for g in inner_groups for p in g["params"]], **kwargs)
        else:
            self.optimizer = optimizer_class(inner_groups, **kwargs)
        self._own = {id(p) for p in self.optimizer.parameters}
        piece_of = {id(param): piece for piece, param in self._pieces.items()}
        self._inner_order = [piece_of[id(p)] for p in self.optimizer.parameters]  # the pieces as it lists them
        network._sharded_optimizer = True  # join() refuses: a joined rank cannot shadow this optimizer's steps
        layout = self._layout
        reduce_scatter, all_gather = engine.compiled_shard_step(
            network._grad_params,
            [bucket.param_indices for bucket in layout.plan.buckets],
            [shards.padded_numel - shards.numel for shards in layout.buckets],
            [shards.shard_numel for shards in layout.buckets],
            [
                [self._pieces[piece] for piece in layout.bucket_pieces(b, engine.rank)]
                for b in range(len(layout.buckets))
            ],
            network.manager.reduce_op,
        )
        object.__setattr__(self, "_reduce_scatter", reduce_scatter)  # called from Python (PyNative), no sub-cells
        object.__setattr__(self, "_all_gather", all_gather)
        self._note_written()
        self._warn_mccl()

    # -- construction ----------------------------------------------------------------
    @staticmethod
    def _bucket_builder(optimizer_class: type, params: Any, order: Sequence[Parameter], kwargs: dict) -> Any:
        """ids of one bucket's parameters -> ``optimizer_class`` over them, each in its parameter group."""
        groups, _ = _group_list(params, list(order))

        def build(members: set[int]) -> nn.Optimizer:
            if params is None or not isinstance(list(params)[0], dict):
                return optimizer_class([p for p in order if id(p) in members], **kwargs)
            narrowed = [{**g, "params": [p for p in g["params"] if id(p) in members]} for g in groups]
            return optimizer_class([g for g in narrowed if g["params"]], **kwargs)

        return build

    def synchronize(self) -> None:
        """Apply every update a step still owes (the next forward, a checkpoint or a parameter listing would)."""
        updates = self.__dict__.get("_updates")  # (None: sharded, GRAPH mode, or not built yet)
        if updates is not None:
            updates.synchronize()

    def _refuse_unshardable(self, optimizer_class: type, assume_elementwise: bool) -> None:
        network = self.network
        if not _pynative():
            raise ValueError("DistributedOptimizer(shard=True) needs PyNative mode: its step runs from Python")
        if network.overlap:
            raise ValueError(
                "shard=True reduce-scatters each bucket itself after backward: wrap the network with "
                "overlap=False (the wrapper's own hooks would all-reduce the gradients a second time)"
            )
        if network.compression is not None or network.manager.comm_hook is not allreduce_hook:
            raise ValueError("shard=True reduces in the gradients' dtype: leave compression and comm_hook unset")
        if sorted(self._indices) != list(range(len(network._grad_params))):
            raise ValueError("shard=True needs every trainable parameter of the network, each once, in params")
        if optimizer_class not in ELEMENTWISE_OPTIMIZERS and not assume_elementwise:
            name = optimizer_class.__name__
            raise ValueError(
                f"shard=True runs {name} on flat pieces of parameters (a shard boundary may cut one), and {name} is "
                "not known to update each element from its own gradient and state alone: one that reads across a "
                "parameter (Lamb and LARS scale by a parameter's norm) would train differently on pieces, without an "
                f"error. Use shard=False, or pass assume_elementwise=True if {name}'s update is element-wise (known: "
                f"{', '.join(c.__name__ for c in ELEMENTWISE_OPTIMIZERS)}; subclasses of them too need it)"
            )
        wrong = [p.name for p in network._grad_params if p.dtype != ms.float32]
        if wrong:
            raise ValueError(f"shard=True supports float32 parameters; {wrong[:3]} are not (cast them, or shard=False)")

    def _piece_parameter(self, piece: ShardPiece) -> Parameter:
        """A float32 Parameter holding one piece of a network parameter, named after it (so MindSpore's
        name-based weight-decay filter, 'beta'/'gamma', treats it as its parameter)."""
        param = self.network._grad_params[piece.param_index]
        return Parameter(self._network_values(piece), name=f"{param.name}.shard_{piece.param_start}")

    def _network_values(self, piece: ShardPiece) -> ms.Tensor:
        """A float32 copy of the network parameter's elements that ``piece`` holds."""
        param = self.network._grad_params[piece.param_index]
        return fresh_copy(param.value().reshape(-1)[piece.param_start : piece.param_end])

    def _warn_mccl(self) -> None:
        global _warned_mccl
        engine = self.network.engine
        if engine.backend == "mccl" and engine.world_size > 1 and not _warned_mccl:
            _warned_mccl = True
            logger.warning(
                "shard=True on MindSpore's CPU backend (MCCL): it has no ReduceScatter, so each bucket is "
                "all-reduced and this rank keeps its shard (twice a reduce-scatter's bytes); the state is still sharded"
            )

    # -- the step --------------------------------------------------------------------
    reduces_gradients = True  # a training cell stepping with this optimizer leaves the reduction to it

    def construct(self, grads: Any) -> Any:
        """The compiled step (GRAPH mode, shard=False): the wrapper's compiled reduction, then the update."""
        return self.optimizer(self.grad_reducer(grads))

    def __call__(self, grads: Sequence[ms.Tensor]) -> Any:
        if not _pynative():
            return super().__call__(grads)  # compiles construct (PyNative runs this method's Python instead)
        if not self.shard:
            return self._updates.step(grads, self.parameters)
        grads = tuple(grads)
        if len(grads) != len(self.parameters):
            raise ValueError(f"got {len(grads)} gradients for {len(self.parameters)} parameters (opt.parameters)")
        _refuse_misordered(grads, self.parameters)  # packed by size alone, misordered ones would be used silently
        self._take_network_values()
        by_index = dict(zip(self._indices, grads))
        # one compiled graph each: op by op in PyNative they cost 5-10x the step's update (docs/sharding.md)
        reduced = self._reduce_scatter(tuple(by_index[i] for i in range(len(self.network._grad_params))))
        piece_grads = dict(zip(self._rank_pieces, reduced))  # both bucket by bucket, in buffer order
        result = self.optimizer(tuple(piece_grads[piece] for piece in self._inner_order))
        self._all_gather()  # every rank's updated shards, into every rank's network parameters, in place
        self._note_written()
        return result

    def _note_written(self) -> None:
        """Each network parameter's data address and version now, when its values are the pieces' (built, or
        all-gathered): a later ``set_data`` (``ms.load_param_into_net``) moves the address, ``copy_`` the version."""
        self._written = [_written_mark(p) for p in self.network._grad_params]

    def _take_network_values(self) -> None:
        """The pieces of parameters whose data was replaced or copied into since the optimizer wrote them, from
        the parameters, before the step updates them: weights loaded after the optimizer was built (a loop that
        builds everything, then resumes with ``ms.load_param_into_net``) are what this step updates, as with a
        plain optimizer. The pieces are float32 copies (MindSpore has no views): without this the step's
        all-gather wrote the old values back over the loaded ones. In-place ops that move neither mark
        (``ops.assign``, item assignment, ``add_``) are not seen: ``opt.reload_network_params()`` after them."""
        params = self.network._grad_params
        changed = {i for i, (p, mark) in enumerate(zip(params, self._written)) if _written_mark(p) != mark}
        self._copy_pieces_from_network(lambda piece: piece.param_index in changed)

    def reload_network_params(self) -> None:
        """Take every piece from the network's parameters (after writing them by a means not seen at the step)."""
        self._copy_pieces_from_network(lambda piece: True)

    def _copy_pieces_from_network(self, which: Any) -> None:
        for piece, holder in self._pieces.items():
            if which(piece):
                holder.copy_(self._network_values(piece))

    def _gather(self, value_of: Any) -> Iterator[tuple[int, ms.Tensor]]:
        """(parameter index, a copy of its flat values) for every parameter, all-gathered bucket by bucket from
        every rank's ``value_of(piece)``."""
        plan = self._layout.plan
        for bucket, shards in enumerate(self._layout.buckets):
            full = self.network.engine.allgather(self._shard_values(bucket, value_of))
            spec = plan.buckets[bucket]
            sizes = [plan.params[i].numel for i in spec.param_indices]  # the parameters fill the bucket; padding after
            parts = _split(full, [*sizes, shards.padded_numel - shards.numel])
            for index, part in zip(spec.param_indices, parts):
                yield index, fresh_copy(part)

    def _shard_values(self, bucket: int, value_of: Any) -> ms.Tensor:
        """A float32 shard of bucket ``bucket``: ``value_of(piece)`` for this rank's pieces, which fill it from its
        start, then zeros for the padding."""
        pieces = self._layout.bucket_pieces(bucket, self.network.engine.rank)
        parts = [value_of(piece).reshape(-1) for piece in pieces]
        padding = self._layout.buckets[bucket].shard_numel - sum(piece.numel for piece in pieces)
        if padding:
            parts.append(ms.ops.zeros(padding, ms.float32))
        return ms.ops.cat(parts)

    # -- state -----------------------------------------------------------------------
    def state_elements(self) -> int:
        """Elements of optimizer state this rank holds (Adam's moments, Momentum's accumulator: one tensor per
        parameter or piece; not step counters or learning rates). With ``shard=True`` it also holds
        :attr:`piece_elements`: float32 copies of its pieces of the parameters, which the optimizer updates
        (MindSpore has no views to give it)."""
        if self.shard:
            by_prefix, _ = self._state_by_prefix()
            return sum(int(p.size) for of_piece in by_prefix.values() for p in of_piece.values())
        names = {p.name for p in self.parameters}
        state = [p for p in self.optimizer.get_parameters() if p.name.partition(".")[2] in names]
        return sum(int(p.size) for p in state if not self._is_own(p))

    @property
    def piece_elements(self) -> int:
        """Elements of this rank's parameter pieces (0 unsharded: the optimizer updates the network's own)."""
        return sum(p.numel for p in self._rank_pieces) if self.shard else 0

    def gathered_state(self) -> dict[str, np.ndarray]:
        """The optimizer's whole state, named as a plain optimizer of the same class over the network's parameters
        names it (``moment1.fc1.weight``, ``global_step``, ...): every rank must call it (all-gathers), and each
        gets the same dict. Save it on one rank (``ms.save_checkpoint([{"name": k, "data": ms.Tensor(v)} ...])``);
        a plain optimizer loads it with ``ms.load_param_into_net``, this one at any world size with
        :meth:`load_gathered_state`."""
        if not self.shard:
            return {p.name: p.asnumpy().copy() for p in self.optimizer.get_parameters() if not self._is_own(p)}
        by_prefix, scalars = self._state_by_prefix()
        state = {name: value.asnumpy().copy() for name, value in scalars.items()}  # asnumpy() may share memory
        for prefix, of_piece in by_prefix.items():
            for index, values in self._gather(lambda piece, of_piece=of_piece: of_piece[piece].value()):
                param = self.network._grad_params[index]
                state[f"{prefix}.{param.name}"] = values.asnumpy().reshape(param.shape)
        return state

    def load_gathered_state(self, state: dict[str, Any]) -> None:
        """Load a whole state (from :meth:`gathered_state`, at any world size, or a plain optimizer's
        Parameters by name): each rank takes its pieces."""
        if not self.shard:
            ms.load_param_into_net(
                self.optimizer, {k: Parameter(ms.Tensor(np.asarray(v)), name=k) for k, v in state.items()}
            )
            return
        by_prefix, scalars = self._state_by_prefix()
        missing = [name for name in scalars if name not in state]
        missing += [
            f"{prefix}.{self.network._grad_params[p.param_index].name}"
            for prefix, of_piece in by_prefix.items()
            for p in of_piece
            if f"{prefix}.{self.network._grad_params[p.param_index].name}" not in state
        ]
        if missing:
            raise KeyError(
                f"the state lacks {sorted(set(missing))[:5]}: was it saved from an optimizer of the same class?"
            )
        for name, param in scalars.items():
            param.set_data(ms.Tensor(np.asarray(state[name]), param.dtype))
        for prefix, of_piece in by_prefix.items():
            for piece, param in of_piece.items():
                full = np.asarray(state[f"{prefix}.{self.network._grad_params[piece.param_index].name}"]).reshape(-1)
                param.set_data(ms.Tensor(full[piece.param_start : piece.param_end].copy(), param.dtype))

    def _is_own(self, param: Parameter) -> bool:
        return id(param) in self._own

    def _state_by_prefix(self) -> tuple[dict[str, dict[ShardPiece, Parameter]], dict[str, Parameter]]:
        """The optimizer's state Parameters: per-piece ones by prefix (``moment1`` of ``moment1.<piece name>``)
        and the rest (step counters, powers, learning rates) by name."""
        piece_of_name = {param.name: piece for piece, param in self._pieces.items()}
        by_prefix: dict[str, dict[ShardPiece, Parameter]] = {}
        scalars: dict[str, Parameter] = {}
        for param in self.optimizer.get_parameters():
            if self._is_own(param):
                continue
            prefix, _, rest = param.name.partition(".")
            if rest in piece_of_name:
                by_prefix.setdefault(prefix, {})[piece_of_name[rest]] = param
            else:
                scalars[param.name] = param
        return by_prefix, scalars

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)  # this Cell's sub-cells: "optimizer", "grad_reducer"
        except AttributeError:
            # the wrapped optimizer's own attributes (learning_rate, get_lr, global_step, ...)
            inner = self.__dict__.get("_cells", {}).get("optimizer")
            if inner is None or name.startswith("__") or name in ("network", "_own", "_updates"):
                raise
            self.synchronize()  # the wrapped optimizer's state, read or written: every owed update applied first
            return getattr(inner, name)


def _written_mark(param: Parameter) -> tuple[int, int]:
    """What a write to a parameter changes: its data address (``set_data``) and its version (``copy_``)."""
    return param.data_ptr(), version_of(param)


def _split(tensor: ms.Tensor, sizes: list[int]) -> tuple[ms.Tensor, ...]:
    """``tensor`` cut into consecutive parts of ``sizes`` (a last size of 0 dropped): one ``mint.split``, where
    a slice per part costs ~0.1 ms each in PyNative."""
    return mint.split(tensor, sizes if sizes[-1] else sizes[:-1])
