"""``fp16fx.distributed.init``: the functional state, replicated (with consensus) or sharded.

Layer: ``distributed`` (DESIGN.md).
"""

from __future__ import annotations

from typing import Any

from fp16fx.distributed.consensus import default_consensus
from fp16fx.distributed.sharded import init_sharded
from fp16fx.scaling import LossScalePolicy
from fp16fx.step import init as _init_state
from fp16fx.transforms import GradientTransformation


def init(
    params: Any,
    optimizer: GradientTransformation,
    loss_scale: LossScalePolicy | None = None,
    *,
    buckets: bool = False,
    process_group: Any = "auto",
    shard: bool = False,
) -> Any:
    """Returns the training state for ``params`` on one of several processes.

    Args:
      params, optimizer, loss_scale, buckets: as for :func:`fp16fx.init`.
      process_group: ``"auto"`` (the world group when torch.distributed is initialized with
        more than one process), ``None`` (no consensus: a single-process state), or a group.
      shard: keep only this rank's 1/d of the FP32 masters and optimizer moments
        (:class:`fp16fx.distributed.ShardedState`; step it with
        :func:`fp16fx.distributed.sharded_step`). Needs a process group.

    Without ``shard`` this is :func:`fp16fx.init` with a :class:`Consensus`: the usual
    ``fp16fx.step`` / ``compile_step`` then skip or apply on every process together. Give it
    the grads DDP averaged (or any grads the ranks already agree on).
    """
    consensus = default_consensus(process_group)
    if shard:
        if consensus is None:
            raise ValueError(
                "shard=True needs torch.distributed initialized with more than one process "
                "(or a process_group): there is nothing to shard across"
            )
        group = consensus.group
        return init_sharded(params, optimizer, loss_scale, group=group)
    return _init_state(params, optimizer, loss_scale, buckets=buckets, consensus=consensus)
