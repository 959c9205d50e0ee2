"""Checkpoints of ``FP16_Optimizer(shard=True)``: one dict per rank, joined into apex's format.

Layer: ``facade`` (DESIGN.md). A rank's dict (:func:`state_dict`) holds, per flat bucket, its
slice of the FP32 master and of each optimizer tensor under torch.optim's name (``exp_avg``,
``momentum_buffer``, ...), the bucket's step count, where the bucket's params sit in their
param group, and :func:`fp16fx.distributed.checkpoint.shard_meta`'s metadata (world size, rank,
bucket and slice lengths); beside them the param groups (hyperparameters) and the loss-scale
entries of the unsharded dict. Only tensors and Python primitives (``weights_only=True``).

:func:`consolidate_state_dict` joins every rank's dict (:mod:`fp16fx.distributed.checkpoint`
joins the slices) into the ordinary apex-format dict, which any ``FP16_Optimizer`` loads --
sharded at any world size, or not sharded. ``load_state_dict`` of a sharded optimizer takes
either; it checks everything first (as the unsharded loader does) and cuts its own slices.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch

from fp16fx.distributed.checkpoint import check_complete, join, shard_meta
from fp16fx.facade import checkpoint, torch_state

if TYPE_CHECKING:
    from fp16fx.facade.optimizer import FP16_Optimizer
    from fp16fx.facade.sharded import ShardedEngine

FORMAT = "fp16fx.FP16_Optimizer.sharded/1"
_SCALER_KEYS = ("loss_scaler", "dynamic_loss_scale", "overflow", "first_closure_call_this_step")


def state_dict(opt: FP16_Optimizer) -> dict[str, Any]:
    """Returns this rank's checkpoint dict (a snapshot: tensors are copies; one sync)."""
    engine: ShardedEngine = opt._engine  # type: ignore[assignment]
    inners = [torch_state.stateful(leaf) for leaf in engine.bucket_leaves]
    zero = engine.count.new_zeros(())
    counts = torch.stack([zero if inner is None else inner.count for inner in inners]).tolist()
    buckets = []
    for b, (bucket, inner) in enumerate(zip(engine.buckets, inners)):
        place = {id(p): i for i, p in enumerate(opt.param_groups[bucket.group]["params"])}
        named = {} if inner is None else torch_state.named_tensors(inner)
        low = bucket.dtype != torch.float32
        buckets.append(
            {
                "group": bucket.group,
                "params": [place[id(p)] for p in bucket.params],
                "shapes": [list(p.shape) for p in bucket.params],
                "count": counts[b],
                "master": engine.masters[b].detach().clone() if low else None,
                "state": {key: t.clone() for key, t in named.items() if t.numel()},
            }
        )
    return {
        "format": FORMAT,
        **shard_meta(engine.sharding, [bucket.offsets[-1] for bucket in engine.buckets]),
        "buckets": buckets,
        "param_groups": opt.optimizer.state_dict()["param_groups"],  # the state is ours
        **checkpoint.scaler_entries(opt),
    }


def consolidate_state_dict(shards: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """Returns the apex-format ``FP16_Optimizer`` dict of a sharded run from all its ranks'
    :func:`state_dict` dicts (any order); no process group needed.

    It loads into any ``FP16_Optimizer`` over the same params and optimizer: unsharded, or
    sharded at any world size. Tensors are views of one joined tensor per bucket.

    Raises:
      ValueError: the dicts are not one complete sharded ``FP16_Optimizer`` checkpoint.
    """
    shards = check_complete(shards, FORMAT)
    first = shards[0]
    try:
        groups = first["param_groups"]
        state: dict[int, dict[str, Any]] = {}
        masters: list[dict[int, torch.Tensor]] = [{} for _ in groups]
        for b, desc in enumerate(first["buckets"]):

            def joined(get: Any, b: int = b) -> torch.Tensor:
                parts = [get(d["buckets"][b]) for d in shards]
                return join(parts, first["numels"][b], first["shard_numel"][b])

            master = None if desc["master"] is None else joined(lambda d: d["master"])
            named = {key: joined(lambda d, key=key: d["state"][key]) for key in desc["state"]}
            start = 0
            for place, shape in zip(desc["params"], desc["shapes"]):
                part = slice(start, start + math.prod(shape))
                start = part.stop
                if master is not None:
                    masters[desc["group"]][place] = master[part].view(shape)
                if desc["count"] and named:
                    entry = {key: t[part].view(shape) for key, t in named.items()}
                    if "exp_avg" in named:  # Adam counts steps per param; SGD does not
                        entry = {"step": torch.tensor(float(desc["count"])), **entry}
                    state[groups[desc["group"]]["params"][place]] = entry
        return {
            **{key: first[key] for key in _SCALER_KEYS},
            "optimizer_state_dict": {"state": state, "param_groups": groups},
            "fp32_from_fp16": [[m[place] for place in sorted(m)] for m in masters],
        }
    except (KeyError, IndexError, TypeError, RuntimeError) as err:
        raise ValueError(f"a damaged sharded FP16_Optimizer checkpoint: {err!r}") from None


def load_state_dict(opt: FP16_Optimizer, sd: Any) -> None:
    """Loads an apex-format dict (e.g. :func:`consolidate_state_dict`'s) into the sharded
    ``opt``: each rank cuts its slices. Raises ValueError/TypeError naming what does not fit,
    having changed nothing. The FP16/BF16 params are set from the loaded masters."""
    plan = checkpoint.parse(opt, sd)
    engine: ShardedEngine = opt._engine  # type: ignore[assignment]
    if plan.specs is None:
        raise ValueError(
            "the state dict's param groups need the generic path (e.g. maximize=True), which "
            "a sharded FP16_Optimizer does not have"
        )
    engine.check_structure(plan.specs)
    params: dict[Any, torch.Tensor] = {}
    for saved, group in zip(plan.osd["param_groups"], opt.param_groups):
        params.update(zip(saved["params"], group["params"]))
    per_param = {params[key]: dict(value) for key, value in plan.osd["state"].items()}
    engine.load(per_param, {id(p): value for p, value in plan.masters})
    for group, loaded in zip(opt.param_groups, plan.groups):
        group.update(loaded)
    opt._scaler.policy = plan.policy
    with torch.no_grad():
        for dst, value in zip(opt._scaler.state, plan.values):
            dst.fill_(value)
    opt.first_closure_call_this_step = plan.first_closure_call
