"""Sharded (ZeRO-1 style) state: each of d ranks keeps 1/d of the FP32 masters and moments.

Layer: ``distributed`` (DESIGN.md). No optimizer math and no loss-scale math here: the shard is
an ordinary :class:`~fp16fx.state.MixedPrecisionState` over slices of flat buffers, stepped by
the one core, :func:`fp16fx.step.apply_updates_`. One step, on every rank::

    flat grad (FP16, padded to d * s)  /= d                  # as DDP pre-divides its buckets
    shard grad (s values)  = reduce_scatter(flat grad)        # the averaged grads of my slice
                                                              # (gloo: all_reduce, then slice)
    shard step             = apply_updates_ on my slice       # finite + norm agreed by all ranks
    flat param (FP16)      = all_gather(my slice)             # every rank gets the new params

A bucket of n values is padded with zeros to d * ceil(n / d); the padding's params, grads,
masters and moments stay 0 (an Adam or SGD update of a zero grad on a zero param is 0), so an
uneven last shard needs no special case. The consensus is :class:`Consensus` with
``sharded=True``: the global gradient norm is the root of the ranks' summed squares.
:class:`Sharding` is the one place that slices, reduce-scatters and all-gathers; the functional
:func:`sharded_step` and ``FP16_Optimizer(shard=True)`` both step through it.

Persistent bytes per param and rank, Adam: FP16 param 2 + FP16 grad 2 + (master 4 + m 4 +
v 4) / d = 4 + 12/d.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import optree
import torch
import torch.distributed as dist

from fp16fx import buckets, tree
from fp16fx.buckets import Layout
from fp16fx.consensus import Consensus, collective_error
from fp16fx.scaling import LossScalePolicy
from fp16fx.state import MixedPrecisionState
from fp16fx.state import init as init_state
from fp16fx.step import Info, apply_updates_, run_step
from fp16fx.transforms import GradientTransformation

# torch >= 2.14 renamed the flat collectives (the old names warn); torch 2.6 has only the old.
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor

#: An in-place step over a state and its grads, e.g. ``fp16fx.compile_step(inplace=True)``.
InplaceStep = Callable[[MixedPrecisionState, Any], tuple[MixedPrecisionState, Info]]


def all_reduce_mean(flat: torch.Tensor, group: Any) -> None:
    """Replaces ``flat`` by its mean over ``group``'s ranks, in place.

    Divided by d first, as DDP does: exact for a power-of-two d, and the FP16 sum cannot
    overflow where the mean would not.
    """
    flat.div_(dist.get_world_size(group))
    dist.all_reduce(flat, group=group)


class Sharding:
    """Which slice of each padded flat buffer this rank owns, and the collectives over them.

    One definition of ZeRO-1's data movement, used by :class:`ShardedState` (the functional
    API) and by ``FP16_Optimizer(shard=True)``. Holds numbers and a group, no tensors.

    Attributes:
      shard_numel: per buffer, the length s of every rank's slice (the buffer holds d * s).
      group, world_size, rank: the process group and this rank's place in it.
      scatter_by_all_reduce: reduce the grads with an all-reduce and read this rank's slice,
        instead of a reduce-scatter. True on gloo, whose reduce-scatter of GPT-2's 249 MB of
        FP16 grads took 396 ms against 277 ms for an all-reduce of them (2 processes, CPU);
        NCCL's reduce-scatter moves 1/d of an all-reduce's bytes into the rank.
    """

    def __init__(self, shard_numel: Sequence[int], group: Any) -> None:
        self.shard_numel = tuple(shard_numel)
        self.group = group
        self.world_size = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self.scatter_by_all_reduce = dist.get_backend(group) == dist.Backend.GLOO

    @classmethod
    def of(cls, flat_params: Sequence[torch.Tensor], group: Any) -> Sharding:
        """Returns the sharding of ``flat_params`` (padded to a multiple of d by
        :func:`fp16fx.buckets.pack`) over ``group``, after broadcasting them from the group's
        first rank (as DDP does), so that every rank starts from the same values."""
        world = dist.get_world_size(group)
        with torch.no_grad():
            for flat in flat_params:
                if flat.numel() % world:
                    raise ValueError(f"a flat buffer of {flat.numel()} values is not padded")
                dist.broadcast(flat, src=_first_rank(group), group=group)
        return cls([flat.numel() // world for flat in flat_params], group)

    def slice(self, b: int) -> slice:
        """Returns this rank's range in buffer ``b``."""
        s = self.shard_numel[b]
        return slice(self.rank * s, (self.rank + 1) * s)

    def reduce_scatter(self, flat_grads: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """Returns, per buffer, this rank's slice of the mean of every rank's ``flat_grads``.

        The grads are divided by d in place first (they are spent): as DDP pre-divides, exact
        for a power-of-two d, and the FP16 sum cannot overflow where the mean would not. With
        :attr:`scatter_by_all_reduce` the buffers are all-reduced in place (then they hold
        the mean, as after DDP) and the slices returned are views of them.
        """
        shards = []
        with torch.no_grad():
            for b, flat in enumerate(flat_grads):
                try:
                    if self.scatter_by_all_reduce:
                        all_reduce_mean(flat, self.group)
                        shard = flat[self.slice(b)]
                    else:
                        flat.div_(self.world_size)
                        shard = flat.new_empty(self.shard_numel[b])
                        _reduce_scatter(shard, flat, group=self.group)
                except RuntimeError as err:
                    raise collective_error("the gradients' reduce-scatter", err) from err
                shards.append(shard)
        return shards

    def all_gather(self, flat_params: Sequence[torch.Tensor]) -> None:
        """Writes every rank's slice of each of ``flat_params`` into all ranks' buffers."""
        with torch.no_grad():
            for b, flat in enumerate(flat_params):
                mine = flat[self.slice(b)].clone()  # a collective's input must not alias its output
                try:
                    _all_gather(flat, mine, group=self.group)
                except RuntimeError as err:
                    raise collective_error("the params' all-gather", err) from err


class ShardedState(Sharding):
    """This rank's training state: full low-precision params, 1/d of the rest (stateful).

    A :class:`Sharding` of its flat buffers (``shard_numel``, ``group``, ``world_size``,
    ``rank``, ``slice``) with the state over its slices.

    Attributes:
      params: the params as given to :func:`fp16fx.distributed.init`, now views into
        ``flat_params`` (so a model built on them trains in place).
      flat_params: per bucket, the padded flat params (every rank holds all of them).
      shard: the :class:`~fp16fx.state.MixedPrecisionState` of this rank's slice of each
        bucket: its params are views into ``flat_params``, its FP32 masters and optimizer
        moments exist only for the slice. Hyperparameters and the loss scale live here
        (``fp16fx.set_hyperparams(state.shard, lr=..., inplace=True)``).
      layout: the buckets' :class:`~fp16fx.buckets.Layout` (unpadded offsets).
    """

    def __init__(
        self,
        params: Any,
        flat_params: list[torch.Tensor],
        shard: MixedPrecisionState,
        layout: Layout,
        sharding: Sharding,
    ) -> None:
        super().__init__(sharding.shard_numel, sharding.group)
        self.params = params
        self.flat_params = flat_params
        self.shard = shard
        self.layout = layout
        self.flat_grads: list[torch.Tensor] | None = None

    def __repr__(self) -> str:
        n = sum(b.numel for b in self.layout.buckets)
        mine = sum(self.shard_numel)
        return (
            f"ShardedState({n:,} trained values, {mine:,} of them mastered here, "
            f"rank {self.rank} of {self.world_size}, count={self.shard.count.tolist()})"
        )


def _reindexed(
    optimizer: GradientTransformation, indices: tuple[int, ...]
) -> GradientTransformation:
    """Returns ``optimizer`` seen through a list whose item ``k`` stands for leaf ``indices[k]``.

    The shard state is a list with one tensor per bucket; ``multi_transform`` picks a leaf's
    transform by its index in the original tree, so the indices are translated back.
    """
    if optimizer.partition is None:
        return optimizer

    def init_leaf(param: torch.Tensor, k: int) -> Any:
        return optimizer.init_leaf(param, indices[k])

    def update(updates, leaf_states, params, hp, grad_norm, ks):
        return optimizer.update(
            updates, leaf_states, params, hp, grad_norm, [indices[k] for k in ks]
        )

    partition = tuple(optimizer.partition[i] for i in indices)
    return GradientTransformation(optimizer.init_hyperparams, init_leaf, update, partition)


def init_sharded(
    params: Any,
    optimizer: GradientTransformation,
    loss_scale: LossScalePolicy | None = None,
    *,
    group: Any = None,
) -> ShardedState:
    """Returns this rank's :class:`ShardedState` for ``params`` (the same on every rank).

    The params are moved into one padded flat buffer per dtype (and optimizer label) and each
    given tensor is re-pointed at its view. The params are then broadcast from the group's
    first rank (as DDP does), so every rank starts from the same values.
    """
    leaves, treedef = tree.check_params(params)
    layout = buckets.plan(leaves, treedef, keys=optimizer.partition)
    world = dist.get_world_size(group)
    flat_params = []
    with torch.no_grad():
        for bucket in layout.buckets:
            first = leaves[bucket.indices[0]]
            flat = buckets.pack(bucket, leaves, first.dtype, multiple=world)
            for i, view in zip(bucket.indices, buckets.views(bucket, flat)):
                leaves[i].data = view
            flat_params.append(flat)
    sharding = Sharding.of(flat_params, group)
    slices = [flat[sharding.slice(b)] for b, flat in enumerate(flat_params)]
    shard = init_state(
        slices,
        _reindexed(optimizer, layout.first_indices),
        loss_scale,
        consensus=Consensus(group=group, sharded=True),
    )
    params = tree.unflatten(treedef, leaves)
    return ShardedState(params, flat_params, shard, layout, sharding)


def _first_rank(group: Any) -> int:
    """Returns the global rank of ``group``'s rank 0 (the world's when None)."""
    return 0 if group is None else dist.get_global_rank(group, 0)


def grad_buffers(state: ShardedState) -> Any:
    """Returns zeroed grads structured like ``state.params``: views into padded flat buffers.

    Make them the model params' ``.grad`` (autograd accumulates into them); a step then reads
    them without a copy. :func:`sharded_step` divides them by d in place (they are spent).
    """
    leaves, treedef = tree.flatten(state.params)
    grads: list[torch.Tensor | None] = [None] * len(leaves)
    state.flat_grads = [torch.zeros_like(flat) for flat in state.flat_params]
    for bucket, flat in zip(state.layout.buckets, state.flat_grads):
        for i, view in zip(bucket.indices, buckets.views(bucket, flat)):
            grads[i] = view
    return tree.unflatten(treedef, grads)


def _padded_flat_grad(
    state: ShardedState, b: int, grads: list[torch.Tensor | None]
) -> torch.Tensor:
    """Returns bucket ``b``'s grads as one padded flat tensor: the grad buffer itself when the
    grads are its views, else a new one (one copy)."""
    bucket, flat_params = state.layout.buckets[b], state.flat_params[b]
    view = buckets.flat_view(bucket, grads)
    if view is not None and state.flat_grads is not None:
        own = state.flat_grads[b]
        if view.data_ptr() == own.data_ptr():
            return own
    flat = torch.zeros_like(flat_params)
    for i, v in zip(bucket.indices, buckets.views(bucket, flat)):
        v.copy_(grads[i])
    return flat


def _default_step(state: MixedPrecisionState, grads: Any) -> tuple[MixedPrecisionState, Info]:
    return run_step(apply_updates_, state, grads, inplace=True)


def sharded_step(
    state: ShardedState, grads: Any, *, step: InplaceStep = _default_step
) -> tuple[ShardedState, Info]:
    """Returns ``(state, info)`` after one step on every rank, written into ``state`` in place.

    ``grads`` are this rank's *local* gradients of the scaled loss (not averaged: do not wrap
    the model in DDP), structured like ``state.params``; the grads of
    :func:`grad_buffers` are used without a copy (and divided by d in place). Collectives:
    one reduce-scatter of the grads, the consensus all-reduce, one all-gather of the params.
    ``step`` runs the shard's in-place step: eager by default, or
    ``fp16fx.compile_step(inplace=True)``. ``info`` is the shard step's (its ``finite`` and
    ``grad_norm`` are global).
    """
    grad_leaves = tree.check_grads(state.params, grads)
    missing = [i for b in state.layout.buckets for i in b.indices if grad_leaves[i] is None]
    if missing:  # before any collective: the other ranks must not be left waiting mid-step
        names = tree.leaf_names(state.params)
        raise ValueError(
            f"sharded_step needs a gradient for every param; {names[missing[0]]} has none "
            "(give it zeros: a sharded state keeps one step count per bucket slice)"
        )
    with torch.no_grad():
        flats = [_padded_flat_grad(state, b, grad_leaves) for b in range(len(state.flat_params))]
    shard_grads = state.reduce_scatter(flats)
    _, info = step(state.shard, shard_grads)
    state.all_gather(state.flat_params)
    return state, info


def persistent_bytes(state: ShardedState | MixedPrecisionState, grads: Any = None) -> int:
    """Returns the bytes of every distinct tensor storage the state (and ``grads``) hold."""
    if isinstance(state, ShardedState):
        found = [*state.flat_params, *optree.tree_leaves(state.shard.children())]
        found += state.flat_grads or []
    else:
        found = optree.tree_leaves(state.children())
    found += [g for g in optree.tree_leaves(grads) if g is not None]
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in found}
    return sum(storages.values())
