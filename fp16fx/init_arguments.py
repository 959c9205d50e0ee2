"""The arguments of ``fp16fx.init``, checked, and the layout planned for them.

Layer: ``step`` (docs/design.md). Everything here runs before anything changes: a refusal
leaves the params as they were. It is also what every rank of a sharded or replicated init
checks before the params are broadcast
(:func:`fp16fx.distributed.init_checks.check_on_every_rank`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

import torch
import torch.distributed as dist

from fp16fx import dtensors, flat, tree
from fp16fx.consensus import Consensus
from fp16fx.flat import Layout
from fp16fx.precision import Precision
from fp16fx.scaling import DynamicLossScale, LossScalePolicy, NoLossScale
from fp16fx.transforms import GradientTransformation


def default_policy(params: Sequence[torch.Tensor | None]) -> LossScalePolicy:
    """Returns ``DynamicLossScale()`` when any param is FP16, else ``NoLossScale()``."""
    if any(p is not None and p.dtype == torch.float16 for p in params):
        return DynamicLossScale()
    return NoLossScale()


class Arguments(NamedTuple):
    """:func:`~fp16fx.state.init`'s arguments, checked, and the layout it plans for them."""

    params: Any  #: as given; DTensors' local shards
    mesh: Any  #: DTensor params' mesh, else None
    group: Any  #: that mesh's process group
    leaves: list[Any]
    treedef: Any
    labels: Any  #: the optimizer's label per leaf, or None
    policy: LossScalePolicy
    precision: Precision
    layout: Layout


def checked_arguments(
    params: Any,
    optimizer: GradientTransformation,
    loss_scale: LossScalePolicy | None,
    *,
    buckets: bool,
    master: str,
    moments: str,
) -> Arguments:
    """Returns :func:`~fp16fx.state.init`'s arguments checked and its layout planned, before
    anything changes. Raises as :func:`~fp16fx.state.init` does."""
    check_optimizer(optimizer)
    check_switch("buckets", buckets)
    precision = Precision(master, moments)
    params, mesh, group = dtensors.local_shards(params)
    leaves, treedef = tree.check_params(params)
    policy = checked_policy(loss_scale, leaves)
    labels = None if optimizer.param_labels is None else optimizer.param_labels(params)
    # Buckets of whole int8 blocks (each scale a broadcast): moved into padded buffers, or
    # already in them (FlatParams(..., multiple)); else the params as given.
    layout = flat.plan(leaves, treedef, labels, precision.multiple)
    if not buckets and any(flat.flat_view(b, leaves) is None for b in _padded(layout)):
        layout = flat.plan(leaves, treedef, labels)
    if mesh is not None:
        layout = layout.recut(range(len(leaves)))  # each shard steps where FSDP keeps it
    if precision.compensated:
        check_compensable_layout(layout, leaves, buckets)
    return Arguments(
        params=params,
        mesh=mesh,
        group=group,
        leaves=leaves,
        treedef=treedef,
        labels=labels,
        policy=policy,
        precision=precision,
        layout=layout,
    )


def _padded(layout: Layout) -> list[flat.Bucket]:
    return [b for b in layout.buckets if b.padded != b.numel]


def check_switch(name: str, value: Any) -> None:
    """Raises TypeError naming argument ``name`` unless ``value`` is True or False: a string
    such as "no" would switch it on by its truthiness."""
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be True or False, got {value!r}")


def check_optimizer(optimizer: Any) -> None:
    """Raises TypeError unless ``optimizer`` is an fp16fx transform."""
    if not isinstance(optimizer, GradientTransformation):
        raise TypeError(
            f"optimizer must be an fp16fx transform such as fp16fx.adam(), got {optimizer!r}"
        )


def checked_policy(loss_scale: Any, leaves: list[Any]) -> LossScalePolicy:
    """Returns the loss-scale policy of :func:`~fp16fx.state.init`'s ``loss_scale`` (its
    default for ``leaves`` if None); raises TypeError unless it is one."""
    policy = default_policy(leaves) if loss_scale is None else loss_scale
    if isinstance(policy, type) or not callable(getattr(policy, "adjust", None)):
        raise TypeError(
            f"loss_scale must be a loss-scale policy such as fp16fx.DynamicLossScale() (an "
            f"instance), got {policy!r}"
        )
    return policy


def check_compensable_layout(layout: Layout, leaves: list[Any], buckets: bool) -> None:
    """Raises ValueError unless a compensated state can hold ``leaves``: FP16/BF16 params (an
    FP32 param is its own master), one flat tensor per segment (the fused pass writes it; an
    FP32 one is then its own master too, the state keeps no FP32 copy of any param)."""
    low = [s for s in layout.segments if layout.buckets[s.bucket].dtype != torch.float32]
    if not low:
        raise ValueError(
            "master='compensated' carries FP16/BF16 params' masters in a short correction; "
            "these params are all FP32, their own masters: use master='fp32'"
        )
    if not buckets and any(
        flat.flat_view(layout.buckets[s.bucket], leaves, s.lo, s.hi) is None
        for s in layout.segments
    ):
        raise ValueError(
            "master='compensated' keeps no FP32 copy, so the step must write the params in "
            "its fused pass: pass buckets=True (or params that are views of one flat buffer "
            "per dtype, FP32 ones included)"
        )


def mesh_consensus(consensus: Consensus | None, mesh: Any, group: Any, buckets: bool) -> Consensus:
    """Returns the sharded consensus for DTensor params on ``mesh``: over its ``group``, or
    the given one's group (e.g. one with a shorter timeout) if it spans as many processes."""
    if buckets:
        raise ValueError(
            "buckets=True would move DTensor params out of FSDP's storage; pass buckets=False"
        )
    if consensus is None:
        return Consensus(group=group, sharded=True)
    if not consensus.sharded or dist.get_world_size(consensus.group) != mesh.size():
        raise ValueError(
            f"the params are DTensor shards on {mesh}: the step agrees over a group of its "
            f"{mesh.size()} processes with Consensus(sharded=True); got {consensus}"
        )
    return consensus
