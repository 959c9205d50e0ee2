"""Choosing and building ``FP16_Optimizer``'s engine, and the masters its param groups hold.

Layer: ``facade`` (DESIGN.md). The engines: :class:`~fp16fx.facade.fast.FastEngine` (the
compiled core over flat buffers), :class:`~fp16fx.facade.sharded.ShardedEngine` (the same over
this rank's slices) and :class:`~fp16fx.facade.generic.GenericEngine` (the wrapped optimizer on
FP32 masters, apex's algorithm).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

import torch

from fp16fx.facade.fast import FastEngine
from fp16fx.facade.generic import GenericEngine
from fp16fx.facade.groups import Unsupported
from fp16fx.facade.params import replace_params
from fp16fx.facade.policy import Scaler
from fp16fx.facade.sharded import ShardedEngine

logger = logging.getLogger("fp16fx")

Engine = FastEngine | GenericEngine


def build_engine(
    optimizer: torch.optim.Optimizer,
    trainable: list[list[torch.Tensor]],
    scaler: Scaler,
    *,
    path: str,
    compiled: bool,
    sharded: bool,
    group: Any,
    names: Mapping[int, str],
) -> tuple[Engine, list[list[torch.Tensor]]]:
    """Returns ``(engine, masters)`` for ``optimizer``, after putting ``masters`` (per group,
    what it holds for each trainable param) into its param groups.

    ``sharded``: shard over the process ``group`` (None: the world). ``path``:
    ``"auto"`` takes the fast engine when it can run the optimizer, ``"fast"`` insists on it
    (ValueError otherwise), ``"generic"`` never takes it. State the optimizer already holds
    moves into the engine (the fast one's buffers, or cast to the masters' dtype).
    """
    engine: Engine | None = None
    if sharded:
        engine = ShardedEngine(optimizer, trainable, scaler, group, compiled=compiled, names=names)
    elif path != "generic":
        try:
            engine = FastEngine(optimizer, trainable, scaler, compiled=compiled)
        except Unsupported as err:
            if path == "fast":
                raise ValueError(f"path='fast' is not possible: {err}") from None
            logger.info("fp16fx: FP16_Optimizer takes the generic path: %s", err)
    if engine is not None:
        masters = [[engine.entry(p) for p in params] for params in trainable]
    else:
        masters = [GenericEngine.make_masters(params) for params in trainable]
    for group, params, group_masters in zip(optimizer.param_groups, trainable, masters):
        replace_params(optimizer, group, params, group_masters)
    if engine is not None:
        existing = {m: optimizer.state.pop(m, None) for ms in masters for m in ms}
        engine.rebuild({m: s for m, s in existing.items() if s})
        return engine, masters
    if optimizer.state:  # cast existing state to the masters' dtype, as apex did
        optimizer.load_state_dict(optimizer.state_dict())
    return GenericEngine(optimizer, trainable, masters, scaler), masters


__all__ = ["Engine", "build_engine"]
