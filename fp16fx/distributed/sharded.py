"""Sharded (ZeRO-1 style) state: each of d ranks keeps 1/d of the masters and moments.

Layer: ``distributed`` (docs/design.md). No optimizer math and no loss-scale math here: the
shard is an ordinary :class:`~fp16fx.state.MixedPrecisionState` over this rank's slices of the
flat buffers, stepped by the one core. One step, on every rank::

    flat grad (FP16, padded to d * s)  /= d                  # as DDP pre-divides its buckets
    shard grad (s values)  = reduce_scatter(flat grad)        # the averaged grads of my slice
                                                              # (gloo: all_reduce, then slice)
    shard step             = the core on my slice             # finite + norm agreed by all ranks
    flat param (FP16)      = all_gather(my slice)             # every rank gets the new params

A bucket of n values is padded with zeros to a multiple of d (of d blocks with int8 moments,
so that every slice is whole blocks); the padding's params, grads, masters and moments stay 0
(an Adam or SGD update of a zero grad on a zero param is 0), so an uneven last shard needs no
special case. The consensus is :class:`Consensus` with
``sharded=True``: the global gradient norm is the root of the ranks' summed squares.
:class:`Sharding` is the one place that slices, reduce-scatters and all-gathers; the functional
:func:`sharded_step` and ``FP16_Optimizer(shard=True)`` both step through it.

Persistent bytes per param and rank, Adam: FP16 param 2 + FP16 grad 2 + (master 4 + m 4 +
v 4) / d = 4 + 12/d; with compensated masters and int8 moments (correction 1 + m 1 + v 1 +
their scales 8/256) / d, about 4 + 3/d.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Sequence
from typing import Any

import optree
import torch
import torch.distributed as dist

from fp16fx import flat, tree
from fp16fx.compile import StepFunction
from fp16fx.consensus import Consensus, collective_error
from fp16fx.distributed.init_checks import check_on_every_rank
from fp16fx.flat import FlatParams
from fp16fx.scaling import LossScalePolicy
from fp16fx.state import MixedPrecisionState, init
from fp16fx.step import StepInfo
from fp16fx.transforms import GradientTransformation

# torch >= 2.14 renamed the flat collectives (the old names warn); torch 2.6 has only the old.
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor

#: A step over a state and its grads, e.g. ``fp16fx.compile_step(inplace=True)``.
StepFn = Callable[[MixedPrecisionState, Any], tuple[MixedPrecisionState, StepInfo]]


def all_reduce_mean(buffer: torch.Tensor, group: Any) -> None:
    """Replaces ``buffer`` by its mean over ``group``'s ranks, in place.

    Divided by d first, as DDP does: exact for a power-of-two d down to the dtype's
    subnormals (which round alike sharded and not), and the FP16 sum cannot overflow where
    the mean would not.
    """
    buffer.div_(dist.get_world_size(group))
    dist.all_reduce(buffer, group=group)


def first_rank(group: Any) -> int:
    """Returns the global rank of ``group``'s rank 0 (the world's when None)."""
    return 0 if group is None else dist.get_global_rank(group, 0)


class Sharding:
    """Which slice of each padded flat buffer this rank owns, and the collectives over them.

    One definition of ZeRO-1's data movement, used by :class:`ShardedState` (the functional
    API and ``FP16_Optimizer(shard=True)``). Holds numbers and a group, no tensors.

    Attributes:
      group, world_size, rank: the process group and this rank's place in it.
      scatter_by_all_reduce: reduce the grads with an all-reduce and read this rank's slice,
        instead of a reduce-scatter. True on gloo, whose reduce-scatter of GPT-2's 249 MB of
        FP16 grads took 396 ms against 277 ms for an all-reduce of them (2 processes, CPU);
        NCCL's reduce-scatter moves 1/d of an all-reduce's bytes into the rank.
    """

    def __init__(self, group: Any) -> None:
        self.group = group
        self.world_size = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self.scatter_by_all_reduce = dist.get_backend(group) == dist.Backend.GLOO

    @property
    def process_group(self) -> Any:
        """``group``, or ``dist.group.WORLD`` where it is None (torch's name for the default
        group; :func:`~fp16fx.distributed.agreement.loading_together` takes None as no group)."""
        return dist.group.WORLD if self.group is None else self.group

    def slice(self, bucket: flat.Bucket) -> slice:
        """Returns this rank's range in ``bucket``'s padded buffer."""
        return flat.shard_slice(bucket, self.rank, self.world_size)

    def broadcast(self, buffers: Sequence[torch.Tensor]) -> None:
        """Overwrites ``buffers`` with the group's first rank's (as DDP does at the start)."""
        with torch.no_grad():
            for buffer in buffers:
                dist.broadcast(buffer, src=first_rank(self.group), group=self.group)

    def reduce_scatter(
        self, buckets: Sequence[flat.Bucket], grads: Sequence[torch.Tensor]
    ) -> list[torch.Tensor]:
        """Returns, per bucket, this rank's slice of the mean of every rank's ``grads``.

        The grads are divided by d in place first (they are spent): as DDP pre-divides, exact
        for a power-of-two d down to the dtype's subnormals, and the FP16 sum cannot overflow
        where the mean would not. With :attr:`scatter_by_all_reduce` the buffers are
        all-reduced in place (then they hold the mean, as after DDP); otherwise this rank's
        slice of each buffer takes its mean. Either way the slices returned are views of the
        buffers, so that grads written on every rank alike between a clip (which reduces
        them) and the step reach the step on both routes.
        """
        shards = []
        with torch.no_grad():
            for bucket, buffer in zip(buckets, grads):
                mine = buffer[self.slice(bucket)]
                try:
                    if self.scatter_by_all_reduce:
                        all_reduce_mean(buffer, self.group)
                    else:
                        buffer.div_(self.world_size)
                        reduced = buffer.new_empty(mine.numel())  # an input must not alias it
                        _reduce_scatter(reduced, buffer, group=self.group)
                        mine.copy_(reduced)
                except RuntimeError as err:
                    raise collective_error("the gradients' reduce-scatter", err) from err
                shards.append(mine)
        return shards

    def all_gather(self, buckets: Sequence[flat.Bucket], params: Sequence[torch.Tensor]) -> None:
        """Writes every rank's slice of each of ``params`` into all ranks' buffers."""
        with torch.no_grad():
            for bucket, buffer in zip(buckets, params):
                mine = buffer[self.slice(bucket)].clone()  # a collective's input must not alias
                try:
                    _all_gather(buffer, mine, group=self.group)
                except RuntimeError as err:
                    raise collective_error("the params' all-gather", err) from err


class ShardedState:
    """This rank's training state: the whole low-precision params, 1/d of the rest (stateful).

    Attributes:
      flat: the :class:`~fp16fx.flat.FlatParams` holding the params (each given tensor is
        re-pointed at its view of a padded flat buffer, so a model built on them trains in
        place) and their flat grad buffers; every rank holds all of them.
      sharding: this rank's :class:`Sharding` of those buffers.
      shard: the :class:`~fp16fx.state.MixedPrecisionState` of this rank's slice of each
        bucket: its params are views into ``flat``'s buffers, its masters (FP32, or a compact
        precision's corrections) and optimizer moments exist only for the slice.
        Hyperparameters and the loss scale live here
        (``fp16fx.set_hyperparams(state.shard, lr=..., inplace=True)``).
      treedef, trained: the structure of the params as given, and which of its flat leaves
        are trained (not None), in ``flat.params`` order.
    """

    def __init__(
        self,
        flat_params: FlatParams,
        sharding: Sharding,
        shard: MixedPrecisionState,
        treedef: Any,
        trained: Sequence[int],
    ) -> None:
        self.flat = flat_params
        self.sharding = sharding
        self.shard = shard
        self.treedef = treedef
        self.trained = tuple(trained)

    @property
    def buckets(self) -> tuple[flat.Bucket, ...]:
        """The flat buffers' buckets (padded to a multiple of d)."""
        return self.flat.layout.buckets

    @property
    def params(self) -> Any:
        """The params, structured as given to ``init`` (the re-pointed tensors)."""
        return self._tree(self.flat.params)

    def grad_buffers(self) -> Any:
        """Returns the flat grad buffers' views, structured like :attr:`params`."""
        return self._tree(self.flat.grad_views)

    def _tree(self, trained: Sequence[torch.Tensor]) -> Any:
        leaves: list[torch.Tensor | None] = [None] * self.treedef.num_leaves
        for i, t in zip(self.trained, trained):
            leaves[i] = t
        return tree.unflatten(self.treedef, leaves)

    def __repr__(self) -> str:
        n = sum(b.numel for b in self.buckets)
        mine = sum(b.padded // self.sharding.world_size for b in self.buckets)
        return (
            f"ShardedState({n:,} trained values, {mine:,} of them mastered here, rank "
            f"{self.sharding.rank} of {self.sharding.world_size}, "
            f"count={self.shard.count.tolist()})"
        )


def init_sharded(
    params: Any,
    optimizer: GradientTransformation,
    loss_scale: LossScalePolicy | None = None,
    *,
    group: Any = None,
    master: str = "fp32",
    moments: str = "fp32",
    names: Sequence[str] | None = None,
    agreed: Sequence[tuple[str, Any]] = (),
) -> ShardedState:
    """Returns this rank's :class:`ShardedState` for ``params`` (the same on every rank).

    The params move into one padded flat buffer per dtype (and optimizer label), each given
    tensor re-pointed at its view, and are broadcast from the group's first rank (as DDP
    does), so every rank starts from the same values. ``master`` and ``moments`` are the
    shard's storage, as for :func:`fp16fx.init`; with int8 moments each buffer is padded to a
    multiple of d blocks, so that every slice is whole blocks and the ranks' blocks are the
    bucket's. ``names``: each leaf's name in errors (default: its path in ``params``);
    ``agreed``: more ``(name, value)`` pairs every rank must hold alike
    (:func:`~fp16fx.distributed.init_checks.check_on_every_rank`).
    """
    args = check_on_every_rank(
        params,
        optimizer,
        loss_scale,
        group,
        master=master,
        moments=moments,
        buckets=True,
        names=names,
        agreed=agreed,
    )
    leaves, treedef, labels, precision = args.leaves, args.treedef, args.labels, args.precision
    trained = [i for i, p in enumerate(leaves) if p is not None]
    world = dist.get_world_size(group)
    flat_params = FlatParams(
        [leaves[i] for i in trained],
        None if labels is None else [labels[i] for i in trained],
        multiple=world * precision.multiple,
    )
    sharding = Sharding(group)
    sharding.broadcast(flat_params.param_buffers)
    buckets = flat_params.layout.buckets
    slices = [buffer[sharding.slice(b)] for b, buffer in zip(buckets, flat_params.param_buffers)]
    # The shard's params are a list of slices, one per bucket: its leaf labels are the buckets'.
    bucket_labels = tuple(b.label for b in buckets)
    shard_optimizer = optimizer._replace(
        param_labels=None if labels is None else lambda _: bucket_labels
    )
    shard = init(
        slices,
        shard_optimizer,
        loss_scale,
        consensus=Consensus(group, sharded=True),
        master=master,
        moments=moments,
    )
    # The slices' values are dithered by their places in the whole buckets, as a replicated
    # state's are: a sharded run rounds as an unsharded one does.
    shard = shard.replace(bucket_starts=tuple(sharding.slice(b).start for b in buckets))
    return ShardedState(flat_params, sharding, shard, treedef, trained)


def check_sharded(state: Any, caller: str, unsharded: str) -> None:
    """Raises TypeError naming ``caller`` unless ``state`` is a ShardedState; an unsharded
    state (``fdist.init(..., shard=False)``'s) is told to use ``unsharded`` instead."""
    if not isinstance(state, ShardedState):
        hint = f" (an unsharded state: use {unsharded})"
        raise TypeError(
            f"{caller} expects the ShardedState fdist.init(..., shard=True) returns, got a "
            f"{type(state).__name__}{hint if isinstance(state, MixedPrecisionState) else ''}"
        )


def grad_buffers(state: ShardedState) -> Any:
    """Returns zeroed grads structured like ``state.params``: views into padded flat buffers.

    Make them the model params' ``.grad`` (autograd accumulates into them); a step then reads
    them without a copy. :func:`sharded_step` divides them by d in place (they are spent).
    """
    check_sharded(state, "fdist.grad_buffers", "fp16fx.grad_buffers")
    for buffer in state.flat.grad_buffers:
        buffer.zero_()
    return state.grad_buffers()


def reduce_grads(state: ShardedState, grads: Any) -> list[torch.Tensor]:
    """Returns this rank's slices of the mean of every rank's ``grads`` (a reduce-scatter).

    ``grads`` are this rank's *local* gradients of the scaled loss, structured like
    ``state.params``; the grads of :func:`grad_buffers` are used without a copy (and divided
    by d in place), others are copied into those buffers first.

    Raises:
      ValueError: a trained param has no gradient (a sharded bucket keeps one step count for
        its slice) -- before any collective, so where every rank lacks it, none waits; where
        one rank alone does, the others wait in the reduce-scatter until the timeout.
    """
    leaves = tree.flatten(grads)[0]
    own = state.flat.grad_views
    picked = [leaves[i] for i in state.trained] if len(leaves) == state.treedef.num_leaves else []
    if not (len(picked) == len(own) and all(map(operator.is_, picked, own))):
        leaves = tree.check_grads(state.params, grads)
        missing = [i for i in state.trained if leaves[i] is None]
        if missing:
            names = tree.leaf_names(state.params)
            raise ValueError(
                f"a sharded step needs a gradient for every param; {names[missing[0]]} has "
                "none (give it zeros: a sharded state keeps one step count per bucket slice)"
            )
        with torch.no_grad():
            flat.copy_all(own, [leaves[i] for i in state.trained])
    return state.sharding.reduce_scatter(state.buckets, state.flat.grad_buffers)


def step_shards(
    state: ShardedState, shard_grads: list[torch.Tensor], step: StepFn | None = None
) -> StepInfo:
    """Returns the info of stepping this rank's slices with ``shard_grads`` (from
    :func:`reduce_grads`), after all-gathering the new params into every rank's buffers."""
    step = step or StepFunction(inplace=True, compile_options=None)
    state.shard, info = step(state.shard, shard_grads)
    state.sharding.all_gather(state.buckets, state.flat.param_buffers)
    return info


def sharded_step(
    state: ShardedState, grads: Any, *, step: StepFn | None = None
) -> tuple[ShardedState, StepInfo]:
    """Returns ``(state, info)`` after one step on every rank, written into ``state`` in place.

    ``grads`` are this rank's *local* gradients of the scaled loss (not averaged: do not wrap
    the model in DDP), structured like ``state.params`` (see :func:`reduce_grads`).
    Collectives: one reduce-scatter of the grads, the consensus all-reduce, one all-gather of
    the params. ``step`` steps the shard in place: eagerly by default, or
    ``fp16fx.compile_step(inplace=True)``. ``info``'s ``finite`` and ``grad_norm`` are global.
    """
    check_sharded(state, "fdist.sharded_step", "fp16fx.step")
    return state, step_shards(state, reduce_grads(state, grads), step)


def persistent_bytes(state: ShardedState | MixedPrecisionState, grads: Any = None) -> int:
    """Returns the bytes of every distinct tensor storage the state (and ``grads``) hold."""
    if not isinstance(state, (ShardedState, MixedPrecisionState)):
        raise TypeError(
            "persistent_bytes takes a MixedPrecisionState (fp16fx.init) or a ShardedState "
            f"(fdist.init), got {type(state).__name__}"
        )
    extra = [g for g in optree.tree_leaves(grads) if g is not None]
    for g in extra:
        if not isinstance(g, torch.Tensor):
            raise TypeError(f"persistent_bytes: grads must be a tree of tensors, got a leaf {g!r}")
    if isinstance(state, ShardedState):
        found = [
            *state.flat.param_buffers,
            *state.flat.grad_buffers,
            *optree.tree_leaves(state.shard),
        ]
    else:
        found = optree.tree_leaves(state)
    return tree.storage_bytes([*found, *extra])
