"""fp16fx on ``torch.distributed``: found-inf consensus, DDP, sharded (ZeRO-1 style) state.

Layer: ``distributed`` (docs/design.md). The transport is ``torch.distributed`` alone (gloo, NCCL).

    import fp16fx.distributed as fdist
    state = fdist.init(params, fp16fx.adam(1e-3))               # replicated, with consensus
    state = fdist.init(params, fp16fx.adam(1e-3), shard=True)   # 1/d of masters and moments
    grads = fdist.grad_buffers(state)                           # make them the params' .grad
    state, info = fdist.sharded_step(state, grads)              # local grads in, in place
    fdist.average_grads(grads)                                  # DDP's average, without DDP
    torch.save(fdist.state_dict(state), f"shard{rank}.pt")      # one file per rank
    fp16fx.load_state_dict(one, fdist.consolidate(shards))      # any of them: one format

FSDP2 models need nothing from here to train (``fp16fx.init`` and ``FP16_Optimizer`` take
their DTensor params); :mod:`fp16fx.distributed.fsdp` holds their DCP checkpoint conversions.

See ``docs/distributed.md`` for torchrun commands, DDP interplay, sharding and memory.
"""

from fp16fx.consensus import Consensus, default_consensus
from fp16fx.distributed.api import average_grads, init
from fp16fx.distributed.checkpoint import consolidate, load_state_dict, state_dict
from fp16fx.distributed.sharded import (
    ShardedState,
    grad_buffers,
    init_sharded,
    persistent_bytes,
    reduce_grads,
    sharded_step,
    step_shards,
)

__all__ = [
    "Consensus",
    "ShardedState",
    "average_grads",
    "consolidate",
    "default_consensus",
    "grad_buffers",
    "init",
    "init_sharded",
    "load_state_dict",
    "persistent_bytes",
    "reduce_grads",
    "sharded_step",
    "state_dict",
    "step_shards",
]
