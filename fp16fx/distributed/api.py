"""``init``: the functional state, replicated (with consensus) or sharded; ``average_grads``:
data parallelism without DDP, one all-reduce per flat grad buffer.

Layer: ``distributed`` (docs/design.md).
"""

from __future__ import annotations

from typing import Any

import optree
import torch
import torch.distributed as dist

from fp16fx import flat
from fp16fx.consensus import default_consensus, refuse_non_member
from fp16fx.distributed.init_checks import check_on_every_rank
from fp16fx.distributed.sharded import all_reduce_mean, first_rank, init_sharded
from fp16fx.init_arguments import check_switch
from fp16fx.precision import Precision
from fp16fx.scaling import LossScalePolicy
from fp16fx.state import init as _init_state
from fp16fx.transforms import GradientTransformation


def init(
    params: Any,
    optimizer: GradientTransformation,
    loss_scale: LossScalePolicy | None = None,
    *,
    buckets: bool = False,
    process_group: Any = "auto",
    shard: bool = False,
    master: str = "fp32",
    moments: str = "fp32",
) -> Any:
    """Returns the training state for ``params`` on one of several processes.

    Args:
      params, optimizer, loss_scale, buckets, master, moments: as for :func:`fp16fx.init`
        (compact precision: docs/precision.md; sharded, each rank keeps its slice of the
        corrections and moments).
      process_group: ``"auto"`` (the world group when torch.distributed is initialized with
        more than one process), ``None`` (no consensus: a single-process state), or a group.
      shard: keep only this rank's 1/d (always bucketed) of the masters and optimizer moments
        (:class:`fp16fx.distributed.ShardedState`; step it with
        :func:`fp16fx.distributed.sharded_step`). Needs a process group. ``shard`` and
        ``buckets`` must be bools (TypeError: a string such as "no" is truthy).

    Without ``shard`` this is :func:`fp16fx.init` with a :class:`Consensus`, after
    broadcasting the params from the group's first rank (as DDP does): the usual
    ``fp16fx.step`` / ``compile_step`` then skip or apply on every process together. Give it
    the grads DDP averaged, or average them with :func:`average_grads`.
    """
    check_switch("shard", shard)
    check_switch("buckets", buckets)  # sharded, always bucketed: a mistake all the same
    consensus = default_consensus(process_group)
    if shard:
        if consensus is None:
            Precision(master, moments)  # a wrong name first
            raise ValueError(
                "shard=True needs torch.distributed initialized with more than one process "
                "(or a process_group): there is nothing to shard across"
            )
        group = consensus.group
        return init_sharded(
            params, optimizer, loss_scale, group=group, master=master, moments=moments
        )
    if consensus is not None:  # checked first on every rank: the broadcast changes the params
        group = consensus.group
        check_on_every_rank(
            params, optimizer, loss_scale, group, master=master, moments=moments, buckets=buckets
        )
        with torch.no_grad():
            for p in optree.tree_leaves(params):
                dist.broadcast(p, src=first_rank(group), group=group)
    return _init_state(
        params,
        optimizer,
        loss_scale,
        buckets=buckets,
        consensus=consensus,
        master=master,
        moments=moments,
    )


#: The most bytes of loose grads coalesced into one all-reduce (DDP's default bucket_cap_mb).
_COALESCE_BYTES = 25 << 20


def average_grads(grads: Any, group: Any = None) -> None:
    """Replaces ``grads`` (any pytree of tensors) by their mean over the processes of ``group``.

    What DDP does after backward, without DDP's own gradient buffers: grads that together fill
    one storage exactly (the flat buffers of ``fp16fx.grad_buffers`` or of ``FP16_Optimizer``'s
    fast path) are divided by d and all-reduced as *one* tensor, in place -- no copy; other
    grads (e.g. ``torch.func.grad``'s) are copied into flat buffers of up to 25 MB per dtype,
    as DDP's buckets, so that a model's many small grads cost a few collectives, not one each.
    Unlike DDP it does not overlap communication with backward. A ``group`` this process is
    not in (torch's value from ``new_group`` for the processes it leaves out) raises
    ValueError, the grads untouched.
    """
    refuse_non_member(group)  # its world size, -1, would flip the grads' sign
    by_storage: dict[int, list[torch.Tensor]] = {}
    for g in optree.tree_leaves(grads):
        if not isinstance(g, torch.Tensor):
            raise TypeError(f"average_grads expects a pytree of tensors, got a leaf {g!r}")
        by_storage.setdefault(g.untyped_storage().data_ptr(), []).append(g)
    loose: list[torch.Tensor] = []
    with torch.no_grad():
        for tensors in by_storage.values():
            whole = flat.whole_storage(tensors)
            if whole is None:
                loose += tensors
            else:
                all_reduce_mean(whole, group)
        for run in _coalesced_runs(loose):
            joined = torch.cat([t.reshape(-1) for t in run])
            all_reduce_mean(joined, group)
            for t, part in zip(run, joined.split([t.numel() for t in run])):
                t.copy_(part.view_as(t))


def _coalesced_runs(tensors: list[torch.Tensor]) -> list[list[torch.Tensor]]:
    """Returns ``tensors`` in runs of one dtype and device, each at most _COALESCE_BYTES (or
    a single larger tensor)."""
    runs: list[list[torch.Tensor]] = []
    filling: dict[tuple[torch.dtype, torch.device], tuple[list[torch.Tensor], int]] = {}
    for t in tensors:
        key, nbytes = (t.dtype, t.device), t.numel() * t.element_size()
        run, size = filling.get(key, (None, 0))
        if run is None or size + nbytes > _COALESCE_BYTES:
            run, size = [], 0
            runs.append(run)
        run.append(t)
        filling[key] = (run, size + nbytes)
    return runs
