"""Choosing, building and switching ``FP16_Optimizer``'s engine; the masters its groups hold.

Layer: ``facade`` (docs/design.md). The engines: :class:`~fp16fx.facade.fast.FastEngine` (the
core over flat buffers, whole or sharded) and :class:`~fp16fx.facade.generic.GenericEngine`
(the wrapped optimizer on FP32 masters, apex's algorithm).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist

from fp16fx import dtensors
from fp16fx.consensus import Consensus, refuse_non_member
from fp16fx.facade import torch_state
from fp16fx.facade.fast import FastEngine
from fp16fx.facade.generic import GenericEngine
from fp16fx.facade.groups import Unsupported
from fp16fx.facade.params import ParamSet, replace_params
from fp16fx.facade.policy import Scaler
from fp16fx.facade.takeover import NOT_SHARDED
from fp16fx.precision import Precision
from fp16fx.state import FP32

logger = logging.getLogger("fp16fx")

Engine = FastEngine | GenericEngine


def shard_group(shard: Any) -> Any:
    """Returns the process group to shard over (None: the world), or NOT_SHARDED.

    Raises:
      TypeError: ``shard`` is none of True, False, None or a process group.
      ValueError: ``shard`` is a group this process is not in, or sharding cannot be done
        at all (torch.distributed not initialized, or one process), before anything changed.
        What one rank might refuse alone is :func:`check_path`'s, run where the others learn
        of it.
    """
    if shard is False or shard is None:
        return NOT_SHARDED
    refuse_non_member(shard)  # (torch's value for it is no group either: say what it is)
    if shard is not True and not (dist.is_available() and isinstance(shard, dist.ProcessGroup)):
        raise TypeError(
            f"shard must be True (the world group), False, None or a torch.distributed process "
            f"group, got {shard!r}"
        )
    if not (dist.is_available() and dist.is_initialized()):
        raise ValueError(
            "shard=... needs torch.distributed initialized (dist.init_process_group) with more "
            "than one process: the masters and moments are split across the processes"
        )
    group = None if shard is True else shard
    if dist.get_world_size(group) == 1:
        raise ValueError("shard=... needs more than one process: there is nothing to shard across")
    return group


def check_path(path: str, process_group: Any, group: Any) -> None:
    """Raises ValueError unless ``path`` is one FP16_Optimizer knows and, sharded (``group``
    from :func:`shard_group`), it and ``process_group`` leave the sharding to ``group``."""
    if path not in ("auto", "fast", "generic"):
        raise ValueError(f"path must be 'auto', 'fast' or 'generic', got {path!r}")
    if group is NOT_SHARDED:
        return
    if path == "generic":
        raise ValueError("shard=... runs on the fast path only; path='generic' cannot shard")
    if not (isinstance(process_group, str) and process_group == "auto"):
        raise ValueError(
            "with shard=..., the found-inf consensus runs over the shard's group; pass a group "
            "as shard=group and leave process_group='auto'"
        )


def build_engine(
    optimizer: torch.optim.Optimizer,
    trainable: list[list[torch.Tensor]],
    scaler: Scaler,
    *,
    path: str,
    compiled: bool,
    shard: Any,
    names: Mapping[int, str],
    precision: Precision = FP32,
) -> tuple[Engine, list[list[torch.Tensor]]]:
    """Returns ``(engine, masters)`` for ``optimizer``, after putting ``masters`` (per group,
    what it holds for each trainable param) into its param groups.

    ``shard``: a process group to shard over (None: the world), or NOT_SHARDED. DTensor
    params (FSDP2) are stepped on their local shards, the skip and norm agreed over their
    mesh (the scaler's consensus becomes that one). ``path``:
    ``"auto"`` takes the fast engine when it can run the optimizer, ``"fast"`` insists on it
    (ValueError otherwise), ``"generic"`` never takes it. State the optimizer already holds
    moves into the engine (the fast one's buffers, or cast to the masters' dtype; on FSDP2
    shards the fast engine refuses it).
    ``precision`` other than FP32 masters and moments needs the fast engine (sharded, on FSDP2
    params, or neither).
    """
    engine: Engine | None = None
    compact = f"master={precision.master!r}, moments={precision.moments!r}"
    if precision != FP32 and path == "generic":
        raise ValueError(f"{compact} runs on the fast path only; path='generic' cannot take it")
    flat = [p for params in trainable for p in params]
    _, mesh, group = dtensors.local_shards(flat, name_of=lambda i: names[id(flat[i])])
    if mesh is not None:  # FSDP2: every rank holds other elements, agreed over the mesh
        if shard is not NOT_SHARDED:
            raise ValueError("shard=... with an FSDP2 model: FSDP2 shards the state already")
        given = scaler.consensus  # process_group=group scopes it to that group
        if given is not None and given.group is not None:
            if dist.get_world_size(given.group) != mesh.size():
                raise ValueError(
                    f"process_group spans {dist.get_world_size(given.group)} processes, the "
                    f"FSDP2 params' mesh {mesh.size()}: give a group of the mesh's processes"
                )
            group = given.group
        scaler.consensus = Consensus(group=group, sharded=True)
    if shard is not NOT_SHARDED:
        try:
            engine = FastEngine(
                optimizer,
                trainable,
                scaler,
                compiled=compiled,
                names=names,
                shard=shard,
                precision=precision,
            )
        except Unsupported as err:  # raised before anything changed
            raise ValueError(f"shard=... needs the fast path, which cannot run: {err}") from None
        scaler.consensus = engine.state.consensus
    elif path != "generic":
        try:
            engine = FastEngine(
                optimizer,
                trainable,
                scaler,
                compiled=compiled,
                names=names,
                consensus=scaler.consensus,
                precision=precision,
            )
        except Unsupported as err:
            if path == "fast":
                raise ValueError(f"path='fast' is not possible: {err}") from None
            if precision != FP32:
                raise ValueError(f"{compact} needs the fast path: {err}") from None
            logger.info("fp16fx: FP16_Optimizer takes the generic path: %s", err)
    if engine is not None:
        masters = [[engine.entry(p) for p in params] for params in trainable]
    else:
        masters = [GenericEngine.make_masters(params) for params in trainable]
    # What torch's own load may replace (the list, its dicts, the state object) and what
    # replace_params edits in place (each group's params list, the state's keys).
    groups, state = optimizer.param_groups, optimizer.state
    held_groups = [(group, list(group["params"])) for group in groups]
    held_state = dict(state)
    try:
        for group, params, group_masters in zip(groups, trainable, masters):
            replace_params(optimizer, group, params, group_masters)
        if engine is not None:
            existing = {m: optimizer.state.pop(m, None) for ms in masters for m in ms}
            existing = {m: s for m, s in existing.items() if s}
            if existing:
                engine.load(existing, {}, scaler.policy)
            return engine, masters
        if optimizer.state:  # cast existing state to the masters' dtype, as apex did
            try:
                optimizer.load_state_dict(optimizer.state_dict())
            except (KeyError, ValueError, TypeError, RuntimeError) as err:
                raise ValueError(
                    f"the state the optimizer given holds does not fit its params: "
                    f"{type(optimizer).__name__}.load_state_dict, onto their FP32 masters, "
                    f"refused it ({type(err).__name__}: {err}); give it its own state, or a "
                    "fresh optimizer"
                ) from err
    except BaseException:  # e.g. torch's own load refusing a state: the optimizer as given
        optimizer.param_groups, optimizer.state = groups, state
        groups[:] = [group for group, _ in held_groups]
        for group, params in held_groups:
            group["params"][:] = params
        state.clear()
        state.update(held_state)
        raise
    return GenericEngine(optimizer, trainable, masters, scaler), masters


def _check_sparse_grads_taken(fast: FastEngine, reason: Exception | str) -> None:
    """Raises ValueError, naming the param, where a grad is sparse and the wrapped optimizer
    refuses one (torch's Adam and AdamW always, its SGD with weight decay): it would refuse
    only after the switch to the generic path, which is for good."""
    groups = fast.optimizer.param_groups
    for label, p in zip(fast.labels, fast.flat.params, strict=True):
        if p.grad is None or p.grad.layout == torch.strided:
            continue
        if fast.kind == "sgd" and not groups[label]["weight_decay"]:
            continue
        name = type(fast.optimizer).__name__ + (" with weight_decay" if fast.kind == "sgd" else "")
        raise ValueError(
            f"{reason}: {fast.names.get(id(p), 'a param')} has a sparse gradient, which "
            f"torch.optim.{name} does not take (torch.optim.SparseAdam does; or make the "
            "layer's gradient dense, e.g. nn.Embedding(..., sparse=False))"
        )


def handover(
    fast: FastEngine, params: ParamSet, reason: Exception | str, *, keep_state: bool
) -> GenericEngine:
    """Returns the generic engine that takes over from ``fast`` (``reason``: what the fast one
    cannot run), the optimizer state moved over with ``keep_state`` (without, the caller is
    about to load one). The masters' grads are not made yet.

    Raises ValueError, before anything changed, if ``fast`` is sharded (or an FSDP2
    model's: the generic path keeps no sharded state), if, with ``keep_state``, a grad is
    sparse where the wrapped optimizer refuses one, or if ``fast`` keeps compact precision
    (the generic path steps FP32 masters).
    """
    if fast.sharded is not None or fast.fsdp:
        raise ValueError(
            f"{reason}: this needs the generic path, which {fast.whose} cannot take: the "
            "generic path keeps whole FP32 masters and torch.optim's state on every rank"
        )
    if keep_state:  # a step's switch (a load's replaces the state, and its step refuses)
        _check_sparse_grads_taken(fast, reason)
    if fast.compact:
        precision = fast.state.precision
        raise ValueError(
            f"{reason}: this needs the generic path, which master={precision.master!r}, "
            f"moments={precision.moments!r} cannot take (it steps FP32 masters)"
        )
    optimizer = fast.optimizer
    logger.warning(
        "fp16fx: FP16_Optimizer switches to the generic path (%s): from now on the wrapped "
        "%s steps FP32 masters, with one host sync per step",
        reason, type(optimizer).__name__,
    )  # fmt: skip
    if keep_state:
        exported = fast.export()
        groups = [(bool(group.get("amsgrad")), group["params"]) for group in optimizer.param_groups]
        for param in torch_state.lacking_amsgrad_maximum(groups, exported):
            exported[param]["max_exp_avg_sq"] = torch.zeros_like(exported[param]["exp_avg_sq"])
        optimizer.state.update(exported)
    stepped_finite = None if fast.last_info is None else fast.last_info.finite
    return GenericEngine(optimizer, params.trainable, params.masters, fast.scaler, stepped_finite)


__all__ = [
    "Engine",
    "build_engine",
    "check_path",
    "handover",
    "shard_group",
]
