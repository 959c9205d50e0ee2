"""Checkpoints of sharded runs: one dict per rank, joined into the unsharded format.

Layer: ``distributed`` (docs/design.md). A rank's dict (:func:`state_dict`) is its shard's
``fp16fx.state_dict`` (this rank's slice of each bucket's params, masters and optimizer
moments; the shared counts, hyperparameters and loss-scale state) plus the metadata that puts
slices back together: world size, rank, each bucket's length, and where each param sits.
Only tensors and Python primitives (``weights_only=True``); tensors are copies. Every slice
of a state with int8 moments is whole blocks, so the ranks' block scales join into the
bucket's.

:func:`consolidate` joins every rank's dict into the dict ``fp16fx.state_dict`` makes for an
unsharded state, keyed by param path -- the one format every loader reads:
``fp16fx.load_state_dict`` (one process), :func:`load_state_dict` (sharded, any world size),
and ``FP16_Optimizer``'s loaders after the facade's own conversion.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import optree
import torch

from fp16fx import checkpoint, flat, tree
from fp16fx.distributed.sharded import ShardedState
from fp16fx.precision import ZERO_BLOCK_SCALE, Precision

FORMAT = "fp16fx.sharded/2"
ShardDict = dict[str, Any]


def state_dict(state: ShardedState) -> ShardDict:
    """Returns this rank's checkpoint dict (a snapshot: tensors are copies)."""
    leaf_paths = _leaf_paths(state)
    layout = state.flat.layout
    leaves = {}
    for b, bucket in enumerate(layout.buckets):
        for k, i in enumerate(bucket.indices):
            leaves[leaf_paths[state.trained[i]]] = {
                "bucket": b,
                "offset": bucket.offsets[k],
                "shape": list(bucket.shapes[k]),
            }
    shard = optree.tree_map(
        lambda t: t.detach().clone() if isinstance(t, torch.Tensor) else t,
        checkpoint.state_dict(state.shard),
    )
    return {
        "format": FORMAT,
        "world_size": state.sharding.world_size,
        "rank": state.sharding.rank,
        "buckets": [{"numel": b.numel, "padded": b.padded} for b in layout.buckets],
        "leaves": leaves,
        "shard": shard,
    }


def _leaf_paths(state: ShardedState) -> list[str]:
    return tree.leaf_paths(state.treedef)


def check_complete(shards: Sequence[Mapping[str, Any]]) -> list[Mapping[str, Any]]:
    """Returns ``shards`` in rank order after checking they are one whole checkpoint.

    Raises:
      ValueError: not all of this format, a rank missing or twice, or dicts of different
        layouts (from another run).
    """
    if not isinstance(shards, Sequence) or not all(isinstance(d, Mapping) for d in shards):
        raise ValueError(f"expected the list of every rank's {FORMAT!r} dict")
    shards = sorted(shards, key=lambda d: d.get("rank", -1))
    if not shards or any(d.get("format") != FORMAT for d in shards):
        raise ValueError(f"expected the per-rank dicts of a {FORMAT!r} checkpoint")
    world = shards[0]["world_size"]
    if [d["rank"] for d in shards] != list(range(world)):
        raise ValueError(
            f"a checkpoint saved by {world} ranks needs all their dicts; got ranks "
            f"{[d['rank'] for d in shards]}"
        )
    first = shards[0]
    for d in shards:
        if d["buckets"] != first["buckets"] or d["leaves"] != first["leaves"]:
            raise ValueError(f"rank {d['rank']}'s dict has another layout than rank 0's")
    return shards


def consolidate(shards: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """Returns the unsharded ``fp16fx.state_dict`` of a sharded run from every rank's dict.

    Per-element tensors (params, masters, moments) are joined across ranks and cut per param
    (views of one joined tensor per bucket and key); per-param scalars (step counts),
    hyperparameters and the loss-scale state are equal on every rank and taken from rank 0.
    No process group is needed.

    Raises:
      ValueError: the dicts are not one complete sharded checkpoint.
    """
    shards = check_complete(shards)
    first = shards[0]
    block = _block(first["shard"])
    try:
        whole = []  # per bucket: key -> the joined tensor (or the shared scalar)
        for b, bucket in enumerate(first["buckets"]):
            parts = [d["shard"]["params"][str(b)] for d in shards]
            whole.append(
                {
                    key: value if value.ndim == 0 else torch.cat([p[key] for p in parts])
                    for key, value in parts[0].items()
                }
            )
            for key, value in whole[-1].items():
                length = bucket["padded"] // (block if key.endswith(".scales") else 1)
                if value.ndim and value.numel() != length:
                    raise ValueError(f"bucket {b}'s {key!r} joins to {value.numel()} values")
        params = {}
        for path, where in first["leaves"].items():
            start, shape = where["offset"], tuple(where["shape"])
            params[path] = {
                key: _leaf_part(key, value, start, shape, block)
                for key, value in whole[where["bucket"]].items()
            }
    except (KeyError, IndexError, TypeError, RuntimeError) as err:
        raise ValueError(f"a damaged sharded checkpoint: {err!r}") from None
    shard = first["shard"]
    return {
        "format": checkpoint.FORMAT,
        "policy": shard["policy"],
        "loss_scale": shard["loss_scale"],
        "count": shard["count"],
        "hyperparams": shard["hyperparams"],
        "params": params,
        **({"precision": shard["precision"]} if "precision" in shard else {}),
    }


def _block(shard: Mapping[str, Any]) -> int:
    """Returns the int8 block size of a rank's shard dict (dicts saved before compact
    precision have no ``precision``: their block is never read)."""
    return shard.get("precision", checkpoint.precision_dict(Precision()))["block"]


def _leaf_part(key: str, value: torch.Tensor, start: int, shape: tuple, block: int) -> Any:
    """Returns the part of a bucket's joined ``value`` that a leaf of ``shape`` at ``start``
    saves under ``key``, as ``fp16fx.state_dict`` saves it: its values; for an int8 moment
    the ``.scales`` of the blocks it overlaps and its ``.offset`` in the first."""
    end = start + math.prod(shape)
    if key.endswith(".scales"):
        return value[checkpoint.blocks_of(start, end, block)]
    if key.endswith(".offset"):
        return torch.tensor(start % block, device=value.device)
    return value if value.ndim == 0 else value[start:end].view(shape)


def template(state: ShardedState) -> dict[str, Any]:
    """Returns the unsharded state dict ``state`` would have, with meta tensors as values."""
    mine = checkpoint.state_dict(state.shard)
    block = state.shard.precision.block
    paths = _leaf_paths(state)
    params = {}
    for b, bucket in enumerate(state.buckets):
        slice_entry = mine["params"][str(b)]
        for k, i in enumerate(bucket.indices):
            start, end = bucket.offsets[k], bucket.offsets[k + 1]
            params[paths[state.trained[i]]] = {
                key: torch.empty(
                    _leaf_shape(key, value, bucket.shapes[k], start, end, block),
                    dtype=value.dtype,
                    device="meta",
                )
                for key, value in slice_entry.items()
            }
    return {**mine, "params": params}


def _leaf_shape(
    key: str, value: torch.Tensor, shape: tuple, start: int, end: int, block: int
) -> tuple[int, ...]:
    """Returns the shape of what a leaf of ``shape`` in ``[start, end)`` saves under ``key``."""
    if key.endswith(".scales"):
        blocks = checkpoint.blocks_of(start, end, block)
        return (blocks.stop - blocks.start,)
    return () if value.ndim == 0 else tuple(shape)


def load_state_dict(
    state: ShardedState, sd: Mapping[str, Any] | Sequence[Mapping[str, Any]]
) -> None:
    """Loads a checkpoint into ``state``: an unsharded state dict (``fp16fx.state_dict``, or
    :func:`consolidate` of a sharded run at any world size), or the list of every rank's
    dicts. Each rank writes the whole params and cuts its own slices of the rest.

    Raises:
      ValueError (StateDictError): the checkpoint does not fit -- another optimizer, policy or
        params, a rank missing, or params of one bucket saved with different step counts (a
        sharded bucket keeps one). Nothing is changed.
    """
    if not isinstance(sd, Mapping):
        sd = consolidate(sd)
    mine = checkpoint.precision_dict(state.shard.precision)
    saved = sd.get("precision", mine)  # dicts saved before compact precision hold FP32
    if saved != mine:
        raise checkpoint.StateDictError(
            f"the state dict does not fit this state: it was saved in precision {saved}, a "
            f"sharded state loads {mine} only; load it into an unsharded state "
            "(fp16fx.load_state_dict), which converts between precisions"
        )
    sd = {**sd, "precision": mine}
    checkpoint.check_fits(template(state), sd)
    block = state.shard.precision.block
    paths = _leaf_paths(state)
    per_bucket = []
    for bucket in state.buckets:
        saved = [sd["params"][paths[state.trained[i]]] for i in bucket.indices]
        counts = {checkpoint.leaf_scalars(entry) for entry in saved}
        if len(counts) > 1:
            raise checkpoint.StateDictError(
                f"the params of one flat bucket ({bucket.dtype}) were saved with different "
                f"step counts {sorted(counts)}; a sharded state keeps one per bucket"
            )
        for start, entry in zip(bucket.offsets, saved):
            offsets = [int(v) for key, v in entry.items() if key.endswith(".offset")]
            if any(offset != start % block for offset in offsets):
                raise checkpoint.StateDictError(
                    "its int8 moments' blocks restart inside a flat bucket (the state was cut "
                    "where params missed gradients); a sharded state keeps one run of blocks "
                    "per bucket: load it into an unsharded state (fp16fx.load_state_dict)"
                )
        per_bucket.append(saved)
    mine = checkpoint.per_leaf(state.shard)
    with torch.no_grad():
        for b, (bucket, saved) in enumerate(zip(state.buckets, per_bucket)):
            mine_slice = state.sharding.slice(bucket)
            for key, dst in mine[b].items():
                if key.endswith(".offset"):  # 0: every slice starts a block
                    continue
                if dst.ndim == 0:
                    dst.copy_(saved[0][key])
                elif key.endswith(".scales"):
                    # Blocks of padding alone are in no leaf's entry.
                    full = dst.new_full((bucket.padded // block,), ZERO_BLOCK_SCALE)
                    for start, end, entry in zip(bucket.offsets, bucket.offsets[1:], saved):
                        full[checkpoint.blocks_of(start, end, block)] = entry[key]
                    dst.copy_(full[checkpoint.blocks_of(mine_slice.start, mine_slice.stop, block)])
                else:
                    full = torch.zeros(bucket.padded, dtype=dst.dtype, device=dst.device)
                    for view, entry in zip(flat.views(bucket, full), saved):
                        view.copy_(entry[key])
                    if key == "param":
                        state.flat.param_buffers[b].copy_(full)
                    else:
                        dst.copy_(full[mine_slice])
        checkpoint.load_shared(state.shard, sd)
