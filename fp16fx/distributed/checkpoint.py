"""Checkpoints of sharded runs: one dict per rank, loadable at any world size or unsharded.

Layer: ``distributed`` (DESIGN.md). A rank's dict holds its slice of every bucket's FP32
master and per-element optimizer state, the shared scalars (hyperparameters, loss-scale
state, step counts) and the metadata to put slices back together: world size, rank, each
bucket's length and slice length. Only tensors and Python primitives (``weights_only=True``).

Loading at another world size reads *all* the ranks' dicts (every rank reads the whole saved
state once), joins each bucket's slices, drops the old padding and cuts the new slice. The
FP16/BF16 params are not saved: every step sets them to their masters cast down, so they are
rebuilt from the masters.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import optree
import torch

from fp16fx.distributed.sharded import ShardedState, Sharding
from fp16fx.state import MixedPrecisionState

FORMAT = "fp16fx.sharded/1"
ShardDict = dict[str, Any]


def shard_meta(sharding: Sharding, numels: Sequence[int]) -> ShardDict:
    """Returns the metadata that lets a rank's slices be joined with the other ranks': world
    size, rank, each buffer's unpadded length (``numels``) and slice length."""
    return {
        "world_size": sharding.world_size,
        "rank": sharding.rank,
        "numels": list(numels),
        "shard_numel": list(sharding.shard_numel),
    }


def state_dict(state: ShardedState) -> ShardDict:
    """Returns this rank's checkpoint dict (a snapshot: tensors are copies)."""
    shard = state.shard
    masters, opt_state = shard.children()[1], shard.children()[2]
    return {
        "format": FORMAT,
        **shard_meta(state, [b.numel for b in state.layout.buckets]),
        "master": [m.detach().clone() for m in masters],
        "opt_state": [[t.clone() for t in optree.tree_leaves(leaf)] for leaf in opt_state.leaves],
        "hyperparams": [t.clone() for t in optree.tree_leaves(opt_state.hyperparams)],
        "loss_scale": [t.clone() for t in shard.loss_scale],
        "count": shard.count.clone(),
    }


def check_complete(shards: Sequence[ShardDict], fmt: str) -> list[ShardDict]:
    """Returns ``shards`` in rank order after checking they are one whole checkpoint.

    Raises:
      ValueError: not all of format ``fmt``, a rank missing or twice, or dicts with different
        buffer layouts (from another run).
    """
    if not isinstance(shards, Sequence) or not all(isinstance(d, Mapping) for d in shards):
        raise ValueError(f"expected the list of every rank's {fmt!r} dict")
    shards = sorted(shards, key=lambda d: d.get("rank", -1))
    if not shards or any(d.get("format") != fmt for d in shards):
        raise ValueError(f"expected the per-rank dicts of an {fmt!r} checkpoint")
    world = shards[0]["world_size"]
    if [d["rank"] for d in shards] != list(range(world)):
        raise ValueError(
            f"a checkpoint saved by {world} ranks needs all their dicts; got ranks "
            f"{[d['rank'] for d in shards]}"
        )
    first = shards[0]
    for d in shards:
        if d["numels"] != first["numels"] or d["shard_numel"] != first["shard_numel"]:
            raise ValueError(f"rank {d['rank']}'s dict has another bucket layout than rank 0's")
    return shards


def join(parts: Sequence[torch.Tensor], numel: int, shard_numel: int) -> torch.Tensor:
    """Returns a buffer's ``numel`` values from its ranks' slices ``parts`` (padding dropped);
    a tensor that is not a slice (a 0-d count) is equal on every rank: rank 0's."""
    if all(p.ndim == 1 and p.shape[0] == shard_numel for p in parts):
        return torch.cat(list(parts))[:numel]
    return parts[0]


def consolidate(shards: Sequence[ShardDict]) -> ShardDict:
    """Returns the whole state from every rank's dict: per bucket, unpadded full tensors.

    Per-element tensors (masters, moments) are joined across ranks; scalars (step counts,
    hyperparameters, loss scale) are equal on every rank and taken from rank 0.

    Raises:
      ValueError: the dicts are not one complete sharded checkpoint (a rank missing, twice,
        or from another run's layout).
    """
    shards = check_complete(shards, FORMAT)
    first = shards[0]

    def joined(b: int, parts: Sequence[torch.Tensor]) -> torch.Tensor:
        return join(parts, first["numels"][b], first["shard_numel"][b])

    n_buckets = len(first["numels"])
    return {
        "numels": first["numels"],
        "master": [joined(b, [d["master"][b] for d in shards]) for b in range(n_buckets)],
        "opt_state": [
            [joined(b, parts) for parts in zip(*(d["opt_state"][b] for d in shards))]
            for b in range(n_buckets)
        ],
        "hyperparams": first["hyperparams"],
        "loss_scale": first["loss_scale"],
        "count": first["count"],
    }


def _check_layout(numels: list[int], full: ShardDict) -> None:
    if numels != full["numels"]:
        raise ValueError(
            f"the checkpoint's buckets hold {full['numels']} values, this state's {numels}: "
            "it was saved for other params or another optimizer"
        )


def _load_common(target: MixedPrecisionState, full: ShardDict) -> None:
    opt_state = target.children()[2]
    hp = optree.tree_leaves(opt_state.hyperparams)
    if len(hp) != len(full["hyperparams"]):
        raise ValueError("the checkpoint's optimizer has other hyperparameters than this one")
    for dst, src in zip(
        [*hp, *target.loss_scale, target.count],
        [*full["hyperparams"], *full["loss_scale"], full["count"]],
    ):
        dst.copy_(src)


def load_state_dict(state: ShardedState, shards: Sequence[ShardDict]) -> None:
    """Loads a sharded checkpoint (all its ranks' dicts, any world size) into ``state``.

    Raises ValueError (before changing anything) when the checkpoint does not fit.
    """
    full = consolidate(shards)
    _check_layout([b.numel for b in state.layout.buckets], full)
    shard = state.shard
    masters, opt_state = shard.children()[1], shard.children()[2]
    _check_leaves(opt_state.leaves, full)
    with torch.no_grad():
        for b, flat in enumerate(state.flat_params):
            n, mine = full["numels"][b], state.slice(b)
            flat.zero_()
            flat[:n].copy_(full["master"][b])  # params are their masters cast down
            if not _same_storage(masters[b], flat):  # an FP32 bucket's master is its param
                masters[b].copy_(cut(full["master"][b], mine))
            for dst, src in zip(optree.tree_leaves(opt_state.leaves[b]), full["opt_state"][b]):
                dst.copy_(cut(src, mine) if dst.ndim == 1 and src.ndim == 1 else src)
        _load_common(shard, full)


def _same_storage(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()


def cut(full: torch.Tensor, mine: slice) -> torch.Tensor:
    """Returns ``full[mine]``, zero-padded where ``mine`` runs past its end."""
    if full.shape[0] == 0:
        return full
    out = full.new_zeros(mine.stop - mine.start)
    got = full[mine.start : mine.stop]
    out[: got.shape[0]] = got
    return out


def _check_leaves(leaves: Sequence[Any], full: ShardDict) -> None:
    for b, leaf in enumerate(leaves):
        if len(optree.tree_leaves(leaf)) != len(full["opt_state"][b]):
            raise ValueError("the checkpoint's optimizer keeps other state than this one")


def load_unsharded(state: MixedPrecisionState, shards: Sequence[ShardDict]) -> None:
    """Loads a sharded checkpoint into an unsharded state made by
    ``fp16fx.init(params, optimizer, buckets=True)`` with the same params and optimizer
    (e.g. to go on in one process). Its tensors are written in place."""
    if state.layout is None:
        raise ValueError("load_unsharded needs a bucketed state: fp16fx.init(..., buckets=True)")
    full = consolidate(shards)
    _check_layout([b.numel for b in state.layout.buckets], full)
    params, masters, opt_state = state.children()[:3]
    _check_leaves(opt_state.leaves, full)
    with torch.no_grad():
        for b in range(len(params)):
            masters[b].copy_(full["master"][b])
            if params[b] is not masters[b]:
                params[b].copy_(full["master"][b])
            for dst, src in zip(optree.tree_leaves(opt_state.leaves[b]), full["opt_state"][b]):
                dst.copy_(src)
        _load_common(state, full)
