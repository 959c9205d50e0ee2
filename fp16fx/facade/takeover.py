"""What the fast path takes over from a torch optimizer, checked before anything changes.

Layer: ``facade`` (docs/design.md). :func:`read_optimizer` reads an SGD/Adam/AdamW's param
groups and the per-param state it holds into what :class:`~fp16fx.facade.fast.FastEngine`
builds its core state from, and refuses -- before a param moves, and sharded, in the
agreement every rank makes before the init -- what the core cannot run (Unsupported: the
generic path takes it) or what does not fit (ValueError).
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

import torch

from fp16fx import dtensors
from fp16fx.consensus import Consensus
from fp16fx.distributed.agreement import initializing_together
from fp16fx.facade import torch_state
from fp16fx.facade.groups import GroupSpec, Unsupported, build_transform, fast_kind, group_spec
from fp16fx.flat import first_sparse_grad
from fp16fx.transforms import GradientTransformation

#: ``shard`` for an engine that keeps the whole state on every rank.
NOT_SHARDED = object()


def initializing_together_if_sharded(shard: Any) -> contextlib.AbstractContextManager[None]:
    """Sharded (``shard`` a process group; None: the world), :func:`initializing_together`:
    where the block raises on one rank, every rank raises (the sharded init's
    ``check_on_every_rank`` within it agrees for it). Unsharded, the block alone."""
    return contextlib.nullcontext() if shard is NOT_SHARDED else initializing_together(shard)


class Takeover(NamedTuple):
    """An optimizer's param groups as the core runs them."""

    kind: str  #: "sgd", "adam" or "adamw"
    specs: list[GroupSpec]  #: each group's structure
    labels: list[int]  #: each trained param's group, in ``params`` order
    transform: GradientTransformation  #: the groups' math, over ``params``
    params: list[torch.Tensor]  #: the trained params, group by group
    fsdp: bool  #: whether they are FSDP2's DTensor shards (stepped where they are)
    #: Sharded: the state the optimizer holds, summarized per param, which every rank must
    #: hold alike (``fdist.init_sharded``'s ``agreed``); unsharded, empty.
    agreed: list[tuple[str, Any]]


def read_optimizer(
    optimizer: torch.optim.Optimizer,
    trainable: Sequence[Sequence[torch.Tensor]],
    names: Mapping[int, str],
    *,
    shard: Any,
    consensus: Consensus | None,
) -> Takeover:
    """Returns ``optimizer``'s groups over ``trainable[k]`` (group ``k``'s params that require
    grad) as the core runs them. ``names``: ``{id(param): readable name}``, for errors;
    ``shard``: a process group, or NOT_SHARDED; ``consensus``: the engine's, if processes
    agree on the steps (unsharded).

    Raises Unsupported where the core cannot run the optimizer (not exactly SGD/Adam/AdamW,
    nothing trainable, a sparse grad, a model in shared memory that no process group agrees
    on); ValueError where a group's numbers or the state the optimizer holds do not fit (on
    FSDP2 shards, any state it holds: torch's per-param state cannot be taken over there).
    Sharded, a rank that raises makes every rank raise (:func:`initializing_together`).
    """
    # Inside FP16_Optimizer's own block this is part of its agreement; alone, one of its own.
    with initializing_together_if_sharded(shard):
        kind = fast_kind(optimizer)
        if kind is None:
            raise Unsupported(f"{type(optimizer).__name__} is not exactly SGD, Adam or AdamW")
        if not any(trainable):
            raise Unsupported("no param requires grad, so there is nothing to put in buffers")
        groups = optimizer.param_groups
        specs = [group_spec(kind, g, k) for k, g in enumerate(groups)]
        labels = [k for k, params in enumerate(trainable) for _ in params]
        transform = build_transform(specs, groups, labels)  # validates the numbers
        params = [p for group_params in trainable for p in group_params]
        sparse = first_sparse_grad(params)  # the generic path takes these
        if sparse is not None:
            p = params[sparse]
            raise Unsupported(f"{names[id(p)]} has a {p.grad.layout} gradient")
        fsdp = dtensors.has_dtensors(params)  # FSDP2's shards: stepped where they are
        if not fsdp and shard is NOT_SHARDED and consensus is None:  # one shared model
            refuse_shared(params, names)
        for p in params:
            held = optimizer.state.get(p, {})
            if held and fsdp:
                raise ValueError(
                    f"{names[id(p)]} has state in the optimizer given: an FSDP2 model's "
                    "FP16_Optimizer cannot take over torch.optim's state (its state is "
                    "FSDP2's shards). Wrap a fresh optimizer, then load fp16fx's checkpoint "
                    "(FP16_Optimizer.state_dict(), through DCP: docs/distributed.md)"
                )
            try:
                torch_state.check(kind, p, held, "state")
                torch_state.check_values(kind, held, "state")
            except ValueError as err:
                raise ValueError(
                    f"the state the optimizer given holds for {names[id(p)]}: {err}"
                ) from None
        # Read in this block: a rank that cannot read it tells the others.
        agreed: list[tuple[str, Any]] = []
        if shard is not NOT_SHARDED:
            summaries = [torch_state.summary(optimizer.state.get(p)) for p in params]
            torch_state.check_one_count_per_bucket(specs, labels, params, summaries, names)
            agreed = [
                (f"the state its optimizer holds for {names[id(p)]}", summary)
                for p, summary in zip(params, summaries, strict=True)
            ]
    return Takeover(
        kind=kind,
        specs=specs,
        labels=labels,
        transform=transform,
        params=params,
        fsdp=fsdp,
        agreed=agreed,
    )


def refuse_shared(params: Sequence[torch.Tensor], names: Mapping[int, str]) -> None:
    """Raises Unsupported naming the first of ``params`` in shared memory, where processes
    that do not agree as one job (no consensus: ``process_group=None``, or the default
    outside a torch.distributed job of two or more processes) share a model: Hogwild
    training. (CPU tensors only: ``is_shared`` is always True on CUDA. No DTensor comes here:
    an FSDP2 engine keeps its shards where they are, and adds no group.)"""
    for p in params:
        if p.device.type == "cpu" and p.is_shared():
            raise Unsupported(
                f"{names.get(id(p), 'a param')} is in shared memory (model.share_memory(), as "
                "Hogwild training does) and no process_group agrees on the steps (None, or one "
                "process): the fast path would move it into a buffer of its own, which the "
                "other processes would not see "
                "(for a copy of the model in each process, build it there, or clone its params)"
            )


__all__ = [
    "NOT_SHARDED",
    "Takeover",
    "initializing_together_if_sharded",
    "read_optimizer",
    "refuse_shared",
]
