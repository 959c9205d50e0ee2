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

import contextlib
import math
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist

from fp16fx import checkpoint, flat, saved_format, tree
from fp16fx.distributed.agreement import checks_passed, loading_together
from fp16fx.distributed.sharded import ShardedState, check_sharded
from fp16fx.precision import ZERO_BLOCK_SCALE, Precision, encode_master
from fp16fx.saved_format import StateDictError

FORMAT = "fp16fx.sharded/2"
ShardDict = dict[str, Any]


def state_dict(state: ShardedState) -> ShardDict:
    """Returns this rank's checkpoint dict (a snapshot: tensors are copies)."""
    check_sharded(state, "fdist.state_dict", "fp16fx.state_dict")
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
    shard = checkpoint.state_dict_copy(state.shard)
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
      StateDictError (a ValueError): not all of this format, a rank missing or twice, or
        dicts of different layouts, precisions or loss-scale policies (from another run) or
        of different counts, loss scales, hyperparameters or step counts (saved at different
        steps).
    """
    if not isinstance(shards, Sequence) or not all(isinstance(d, Mapping) for d in shards):
        raise StateDictError(f"expected the list of every rank's {FORMAT!r} dict")
    with _damage_named():
        return _in_rank_order(shards)


@contextlib.contextmanager
def _damage_named() -> Iterator[None]:
    """Turns what a damaged rank dict raises (a key missing, a value of another type) into a
    StateDictError that says so."""
    try:
        yield
    except (KeyError, IndexError, AttributeError, TypeError, RuntimeError) as err:
        raise StateDictError(f"a damaged sharded checkpoint: {err!r}") from None


def _in_rank_order(shards: Sequence[Mapping[str, Any]]) -> list[Mapping[str, Any]]:
    shards = sorted(shards, key=lambda d: d.get("rank", -1))
    if not shards or any(d.get("format") != FORMAT for d in shards):
        raise StateDictError(f"expected the per-rank dicts of a {FORMAT!r} checkpoint")
    world = shards[0]["world_size"]
    other = next((d for d in shards if d["world_size"] != world), None)
    if other is not None:
        raise StateDictError(
            f"rank {other['rank']}'s dict was saved by {other['world_size']} ranks, rank "
            f"{shards[0]['rank']}'s by {world}: the dicts of different runs"
        )
    if [d["rank"] for d in shards] != list(range(world)):
        raise StateDictError(
            f"a checkpoint saved by {world} ranks needs all their dicts; got ranks "
            f"{[d['rank'] for d in shards]}"
        )
    first = shards[0]
    for d in shards:
        if d["buckets"] != first["buckets"] or d["leaves"] != first["leaves"]:
            raise StateDictError(f"rank {d['rank']}'s dict has another layout than rank 0's")
        for key in ("precision", "policy"):  # .get: no "precision" before compact precision
            if d["shard"].get(key) != first["shard"].get(key):
                raise StateDictError(
                    f"rank {d['rank']}'s dict has {key} {d['shard'].get(key)}, rank 0's "
                    f"{first['shard'].get(key)}: the dicts of different runs"
                )
    ours = _shared_values(first["shard"])
    for d in shards[1:]:
        theirs = _shared_values(d["shard"])
        for where, value in ours.items():
            if not torch.equal(theirs[where], value):
                raise StateDictError(
                    f"rank {d['rank']}'s dict has {where} = {theirs[where].tolist()}, rank "
                    f"0's {value.tolist()}: the dicts were saved at different steps, or "
                    "by different runs"
                )
    return shards


def _run_values(sd: Mapping[str, Any]) -> dict[str, torch.Tensor]:
    """Returns a state dict's (or a rank's shard dict's) count, loss-scale state and
    hyperparameters, keyed by where they sit: what every rank's copy holds alike."""
    out = {"['count']": sd["count"]}
    for group in ("loss_scale", "hyperparams"):
        out.update({f"[{group!r}][{key!r}]": v for key, v in sd[group].items()})
    return out


def _shared_values(shard: Mapping[str, Any]) -> dict[str, torch.Tensor]:
    """Returns what every rank's shard dict holds alike: :func:`_run_values` and each
    bucket's step counts."""
    out = _run_values(shard)
    for b, entry in shard["params"].items():
        counts = {k: v for k, v in entry.items() if saved_format.is_step_count(k, v)}
        out.update({f"['params'][{b!r}][{key!r}]": v for key, v in counts.items()})
    return out


def consolidate(shards: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """Returns the unsharded ``fp16fx.state_dict`` of a sharded run from every rank's dict.

    Per-element tensors (params, masters, moments) are joined across ranks and cut per param
    (views of one joined tensor per bucket and key); per-param scalars (step counts),
    hyperparameters and the loss-scale state are equal on every rank and taken from rank 0.
    No process group is needed.

    Raises:
      StateDictError (a ValueError): the dicts are not one complete sharded checkpoint.
    """
    shards = check_complete(shards)
    with _damage_named():
        return _joined_shards(shards)


def _joined_shards(shards: list[Mapping[str, Any]]) -> dict[str, Any]:
    """:func:`consolidate`'s join of complete rank dicts, in rank order; raises what a
    damaged one gives (KeyError, AttributeError, ...) for it to name."""
    first = shards[0]
    block = _block(first["shard"])
    whole = []  # per bucket: key -> the joined tensor (or the shared scalar)
    for b, bucket in enumerate(first["buckets"]):
        parts = [d["shard"]["params"][str(b)] for d in shards]
        _check_slice_dtypes(b, shards, parts)
        whole.append(
            {
                key: value if value.ndim == 0 else torch.cat([p[key] for p in parts])
                for key, value in parts[0].items()
            }
        )
        for key, value in whole[-1].items():
            length = bucket["padded"] // (block if key.endswith(".scales") else 1)
            if value.ndim and value.numel() != length:
                raise StateDictError(f"bucket {b}'s {key!r} joins to {value.numel()} values")
    params = {}
    for path, where in first["leaves"].items():
        start, shape = where["offset"], tuple(where["shape"])
        params[path] = {
            key: _leaf_part(key, value, start, shape, block)
            for key, value in whole[where["bucket"]].items()
        }
    shard = first["shard"]
    return {
        "format": saved_format.FORMAT,
        "policy": shard["policy"],
        "loss_scale": shard["loss_scale"],
        "count": shard["count"],
        "hyperparams": shard["hyperparams"],
        "params": params,
        **({"precision": shard["precision"]} if "precision" in shard else {}),
    }


def _check_slice_dtypes(
    b: int, shards: list[Mapping[str, Any]], parts: list[Mapping[str, torch.Tensor]]
) -> None:
    """Raises StateDictError where a rank's slice of bucket ``b`` (its entry of ``parts``)
    holds a key in another dtype than rank 0's: torch.cat would promote it to values no rank
    saved."""
    for key, value in parts[0].items():
        for d, part in zip(shards, parts):
            if part[key].dtype != value.dtype:
                raise StateDictError(
                    f"rank {d['rank']}'s dict has bucket {b}'s {key!r} in {part[key].dtype}, "
                    f"rank 0's in {value.dtype}"
                )


def _block(shard: Mapping[str, Any]) -> int:
    """Returns the int8 block size of a rank's shard dict (dicts saved before compact
    precision have no ``precision``: their block is never read)."""
    return shard.get("precision", saved_format.precision_dict(Precision()))["block"]


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


def template(state: ShardedState, *, canonical: bool = False) -> dict[str, Any]:
    """Returns the unsharded state dict ``state`` would have, with meta tensors as values;
    ``canonical``: its entries in FP32 terms (``fp16fx.saved_format.canonical``), the form a
    checkpoint saved in another precision is checked and loaded in."""
    mine = checkpoint.state_dict(state.shard)
    block = state.shard.precision.block
    paths = _leaf_paths(state)
    params = {}
    for b, bucket in enumerate(state.buckets):
        slice_entry = mine["params"][str(b)]
        if canonical:  # decoded on the meta device: shapes and dtypes, no copies
            on_meta = {k: v if v.ndim == 0 else v.to("meta") for k, v in slice_entry.items()}
            slice_entry = saved_format.canonical(on_meta, block)
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
    # A sharded state keeps one segment per bucket: a saved dict's segments are not its own.
    return {**saved_format.without_segments(mine), "params": params}


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

    A dict saved in the state's precision whose int8 blocks start where the state's do (any
    sharded run's, or an unsharded one's whose blocks did not restart inside a bucket) loads
    bitwise. Any other -- saved in another precision, or with blocks restarting where params
    missed gradients -- is decoded to FP32 and encoded into the state's precision, rounded to
    nearest, as ``fp16fx.load_state_dict`` does; so is one saved over params of another
    float dtype (each FP32 master kept, the param that master rounded).

    Raises:
      ValueError (StateDictError): the checkpoint does not fit -- another optimizer, policy or
        params, a rank missing, or params of one bucket saved with different step counts (a
        sharded bucket keeps one). Nothing is changed. A collective: where one rank refuses,
        the others raise too, naming it, and none has loaded the checkpoint
        (:func:`~fp16fx.distributed.agreement.loading_together`).
    """
    check_sharded(state, "fdist.load_state_dict", "fp16fx.load_state_dict")
    with loading_together(state.sharding.process_group):
        _load(state, sd)


def _load(state: ShardedState, sd: Mapping[str, Any] | Sequence[Mapping[str, Any]]) -> None:
    """:func:`load_state_dict`'s checks, the ranks' agreement, then its writes."""
    if not isinstance(sd, Mapping):
        sd = consolidate(sd)
    elif sd.get("format") == FORMAT:
        raise StateDictError(
            f"this is rank {sd.get('rank')}'s dict of a checkpoint saved by "
            f"{sd.get('world_size')} ranks: pass the list of every rank's dicts"
        )
    saved_format.check_dense(sd)  # before anything is written: nothing changes
    saved, precision = saved_format.precision_of(sd), state.shard.precision
    # A dict saved before compact precision has no "precision": its own, said as the state's is.
    sd = {**sd, "precision": saved_format.precision_dict(saved)}
    signs = checkpoint.moment_signs(state.shard.opt_state)
    non_negative = checkpoint.non_negative_keys(signs)
    if not isinstance(sd.get("params"), Mapping):
        raise StateDictError("the state dict has no ['params'] dict")
    stored = template(state)
    as_stored = saved == precision and not _dtypes_changed(stored["params"], sd["params"])
    if as_stored:
        saved_format.check_fits(stored, sd, non_negative)
        entries = sd["params"]
    else:
        in_fp32_terms = template(state, canonical=True)
        entries = {
            path: checkpoint.in_dtype_of(
                path,
                entry,
                in_fp32_terms["params"].get(path),
                compensated=precision.compensated,
            )
            for path, entry in saved_format.canonical_params(sd["params"], saved.block).items()
        }
        converted = {**sd, "precision": saved_format.precision_dict(precision), "params": entries}
        saved_format.check_fits(in_fp32_terms, converted, non_negative)
    saved_format.check_codes(sd["params"], signs)
    if precision.compensated:
        saved_format.check_compensable(entries)
    per_bucket = _per_bucket(state, entries)
    step_counts = []
    for bucket, saved_entries in zip(state.buckets, per_bucket):
        counts = {saved_format.leaf_scalars(entry) for entry in saved_entries}
        if len(counts) > 1:
            raise StateDictError(
                f"the params of one flat bucket ({bucket.dtype}) were saved with different "
                f"step counts {sorted(counts)}; a sharded state keeps one per bucket"
            )
        step_counts.append(sorted(counts))
    copy = as_stored and _blocks_start_alike(state, per_bucket)
    if as_stored and not copy:  # decoded now: a malformed entry is refused before agreeing
        per_bucket = _per_bucket(state, saved_format.canonical_params(sd["params"], saved.block))
    everyone = checks_passed(_facts(sd, step_counts))  # every rank's checks, before any writes
    if everyone is not None:
        _check_alike(everyone, state.sharding.process_group)
    with torch.no_grad():
        if copy:
            _copy_as_stored(state, per_bucket)
        else:
            _store_converted(state, per_bucket, saved.compensated)
        checkpoint.load_shared(state.shard, sd)


def _facts(sd: Mapping[str, Any], step_counts: list[list[Any]]) -> dict[str, Any]:
    """Returns what every rank's copy of one checkpoint holds alike, as Python values: the
    count, the loss-scale state, the hyperparameters and each bucket's ``step_counts``."""
    facts: dict[str, Any] = {where: v.tolist() for where, v in _run_values(sd).items()}
    facts.update({f"bucket {b}'s step counts": c for b, c in enumerate(step_counts)})
    return facts


def _check_alike(everyone: list[dict[str, Any]], group: Any) -> None:
    """Raises StateDictError, on every rank alike, where a rank's :func:`_facts` differ from
    the first rank's of ``group``: it was handed another checkpoint (a stale copy, another
    run's), and the ranks would train on a mixture of two states."""
    first, first_rank = everyone[0], dist.get_global_rank(group, 0)
    for place, facts in enumerate(everyone):
        where = next((key for key in first if facts.get(key) != first[key]), None)
        if where is not None:
            raise StateDictError(
                f"rank {dist.get_global_rank(group, place)} was given another checkpoint than "
                f"rank {first_rank} ({where}: {facts.get(where)} there, {first[where]} on rank "
                f"{first_rank}; a copy saved at another step, or by another run): every rank "
                "must load the same one"
            )


def _per_bucket(state: ShardedState, entries: Mapping[str, Any]) -> list[list[Any]]:
    """Returns the saved ``entries`` (keyed by leaf path) of each bucket's leaves, in order."""
    paths = _leaf_paths(state)
    return [[entries[paths[state.trained[i]]] for i in b.indices] for b in state.buckets]


def _dtypes_changed(mine: Mapping[str, Any], saved: Mapping[str, Any]) -> bool:
    """Whether a saved leaf's param has another dtype than the state's param there (the
    model's dtype changed since: FP16, BF16, FP32)."""
    return any(
        isinstance(entry, Mapping)
        and isinstance(entry.get("param"), torch.Tensor)
        and path in mine
        and entry["param"].dtype != mine[path]["param"].dtype
        for path, entry in saved.items()
    )


def _blocks_start_alike(state: ShardedState, per_bucket: list[list[Any]]) -> bool:
    """Whether every saved int8 moment's ``.offset`` is where the state's blocks put its
    param (each bucket one run of blocks from its start), and the leaves that share a block
    saved its scale alike (:func:`fp16fx.checkpoint.scales_agree`)."""
    block = state.shard.precision.block
    return all(
        int(value) == start % block
        for bucket, saved in zip(state.buckets, per_bucket)
        for start, entry in zip(bucket.offsets, saved)
        for key, value in entry.items()
        if key.endswith(".offset")
    ) and checkpoint.scales_agree(_end_blocks(state, per_bucket))


def _end_blocks(state: ShardedState, per_bucket: list[list[Any]]) -> Iterator[tuple[Any, Any]]:
    """Yields each saved leaf's first and last int8 block, named by bucket, key and index,
    with the scale the leaf saved for it."""
    block = state.shard.precision.block
    for b, (bucket, saved) in enumerate(zip(state.buckets, per_bucket)):
        for start, end, entry in zip(bucket.offsets, bucket.offsets[1:], saved):
            blocks = checkpoint.blocks_of(start, end, block)
            for key in (k for k in entry if k.endswith(".scales") and entry[k].numel()):
                yield (b, key, blocks.start), entry[key][0]
                yield (b, key, blocks.stop - 1), entry[key][-1]


def _joined(bucket: flat.Bucket, saved: list[Mapping[str, Any]], key: str) -> torch.Tensor:
    """Returns the saved leaves' ``key`` packed into one padded buffer of the bucket
    (``flat.pack``: the padding zero), in the saved dtype."""
    picked: list[torch.Tensor | None] = [None] * (max(bucket.indices) + 1)
    for i, entry in zip(bucket.indices, saved):
        picked[i] = entry[key]
    return flat.pack(bucket, picked, saved[0][key].dtype)


def _copy_as_stored(state: ShardedState, per_bucket: list[list[Any]]) -> None:
    """Copies saved entries in the state's own format into this rank's slices (bitwise)."""
    block = state.shard.precision.block
    mine = checkpoint.per_leaf(state.shard)
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
            elif key == "param":
                state.flat.param_buffers[b].copy_(_joined(bucket, saved, key))
            else:
                dst.copy_(_joined(bucket, saved, key)[mine_slice])


def _whole_param(
    state: ShardedState, bucket: Any, saved: list[Any], from_compensated: bool
) -> torch.Tensor:
    """Returns a bucket's whole params as a load writes them on every rank, alike: the saved
    ones, or from saved FP32-terms masters (``"master"`` entries), those of the state's own
    precision: each rank encodes only its slice of the masters, from the whole params. A
    compensated state's are the params :func:`fp16fx.precision.encode_master` keeps or
    moves; a full state's, from a compensated dict, as
    :func:`fp16fx.saved_format.full_param` gives them."""
    params = _joined(bucket, saved, "param")
    compensated = state.shard.precision.compensated
    if "master" not in saved[0] or not (compensated or from_compensated):
        return params
    masters = _joined(bucket, saved, "master").to(params.device)
    if compensated:
        return encode_master(masters, params.dtype, None, param=params)[0]
    return saved_format.full_param(params, masters)


def _store_converted(
    state: ShardedState, per_bucket: list[list[Any]], from_compensated: bool
) -> None:
    """Writes saved entries in FP32 terms (of a compensated dict: ``from_compensated``) into
    the whole params and this rank's slices, encoded in the state's precision by
    ``fp16fx.checkpoint.store`` (the bucket's padding zero)."""
    slices = []
    for b, (bucket, saved) in enumerate(zip(state.buckets, per_bucket)):
        mine_slice = state.sharding.slice(bucket)
        entry = {}
        for key, value in saved[0].items():
            if saved_format.is_step_count(key, value):  # one per bucket (checked)
                entry[key] = value
                continue
            # Encoded where the state lives (the checkpoint may have been loaded elsewhere).
            device = state.flat.param_buffers[b].device
            if key == "param":  # whole, alike on every rank
                full = _whole_param(state, bucket, saved, from_compensated).to(device)
                state.flat.param_buffers[b].copy_(full)
            else:
                full = _joined(bucket, saved, key).to(device)
            entry[key] = full[mine_slice]
        slices.append(entry)
    checkpoint.store(state.shard, slices)
