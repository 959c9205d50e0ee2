"""fp16fx on ``torch.distributed``: found-inf consensus, DDP, sharded (ZeRO-1 style) state.

Layer: ``distributed`` (DESIGN.md). The transport is ``torch.distributed`` alone (gloo, NCCL).

    import fp16fx.distributed as fdist
    state = fdist.init(params, fp16fx.adam(1e-3))               # replicated, with consensus
    state = fdist.init(params, fp16fx.adam(1e-3), shard=True)   # 1/d of masters and moments

See ``docs/distributed.md`` for torchrun commands, DDP interplay and memory.
"""

from fp16fx.distributed.api import init
from fp16fx.distributed.consensus import Consensus, default_consensus

__all__ = ["Consensus", "default_consensus", "init"]
