"""The params an FP16_Optimizer trains: readable names, checks, masters put in their groups.

Layer: ``facade`` (docs/design.md).
"""

from __future__ import annotations

import dataclasses
import operator
import weakref
from collections.abc import Sequence
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from fp16fx import dtensors, tree


def param_names(optimizer: torch.optim.Optimizer) -> dict[int, str]:
    """Returns ``{id(param): readable name}`` for error messages, e.g.
    ``param 'fc.weight' (param_groups[0]['params'][3])`` when the groups carry names."""
    names = {}
    for k, group in enumerate(optimizer.param_groups):
        given = group.get("param_names")
        for i, p in enumerate(group["params"]):
            where = f"param_groups[{k}]['params'][{i}]"
            names[id(p)] = f"param {given[i]!r} ({where})" if given else where
    return names


def check_unique(groups: list[dict[str, Any]], names: dict[int, str], first: int = 0) -> None:
    """Raises ValueError, naming it, if a param is listed twice in one group (torch.optim
    warns and steps it twice; its two entries would share one master here). ``groups`` are
    param groups ``first``, ``first + 1``, ..."""
    for k, group in enumerate(groups, start=first):
        seen: dict[int, int] = {}
        for i, p in enumerate(group["params"]):
            if id(p) in seen:
                raise ValueError(
                    f"param_groups[{k}]['params'][{i}] is param_groups[{k}]['params']"
                    f"[{seen[id(p)]}] again: a param listed twice in a group would be stepped "
                    "twice; list it once"
                )
            seen[id(p)] = i


def check_trainable(
    params: list[torch.Tensor], names: dict[int, str], device: torch.device | None = None
) -> None:
    """Raises TypeError/ValueError, naming the param by its place in the param groups, unless
    ``params`` pass :func:`fp16fx.tree.check_trainable` (on ``device``, if given)."""
    tree.check_trainable(
        [names.get(id(p), f"param {i}") for i, p in enumerate(params)], params, device
    )


def replace_params(
    optimizer: torch.optim.Optimizer,
    group: dict[str, Any],
    params: list[torch.Tensor],
    masters: list[torch.Tensor],
) -> None:
    """Puts each param's master in its place in ``group`` and moves its existing state over."""
    master_of = {id(p): m for p, m in zip(params, masters)}
    for i, p in enumerate(group["params"]):
        master = master_of.get(id(p))
        if master is None or master is p:
            continue
        group["params"][i] = master
        if p in optimizer.state:
            optimizer.state[master] = optimizer.state.pop(p)


@dataclasses.dataclass
class ParamSet:
    """What an ``FP16_Optimizer`` trains, group by group.

    Attributes:
      trainable: per param group, its params that require grad (the model's tensors).
      masters: per param group, what the group holds for each of them (an FP32 master for an
        FP16/BF16 param, the param itself for an FP32 one).
      frozen: the params that had ``requires_grad=False`` when it was built (never trained).
      names: ``{id(param): readable name}``, for errors.
    """

    trainable: list[list[torch.Tensor]]
    masters: list[list[torch.Tensor]]
    frozen: list[torch.Tensor]
    names: dict[int, str]

    def known(self) -> set[int]:
        """Returns the ids of every param it holds, trained or frozen."""
        return {id(p) for p in self.frozen} | {id(p) for ps in self.trainable for p in ps}

    def add(
        self,
        params: list[torch.Tensor],
        masters: list[torch.Tensor],
        group: dict[str, Any],
        names: dict[int, str],
    ) -> None:
        """Records a new param group: ``params`` (requiring grad) with their ``masters``."""
        self.trainable.append(params)
        self.masters.append(masters)
        self.frozen.extend(p for p in group["params"] if not p.requires_grad)
        self.names.update(names)

    def master_of(self) -> dict[int, torch.Tensor]:
        """Returns ``{id(param): its master}`` over every group."""
        return {id(p): m for ps, ms in zip(self.trainable, self.masters) for p, m in zip(ps, ms)}


class GradStamp:
    """The gradients of some params at one moment, to tell later whether any has changed.

    Each grad is held weakly and compared by identity -- a new tensor is never taken for a
    freed one whose ``id`` it reuses -- with its version counter, which a write in place
    moves (a DTensor's: its local shard's, which FSDP2 writes). ``views`` and ``buffers``
    (a :class:`~fp16fx.flat.FlatParams`' grad views and their flat buffers): while every grad
    is its view, the buffers' counters, which their views share, say it all, read once per
    buffer rather than per param (a many-param model's step would pay a Python loop).
    """

    def __init__(
        self,
        params: Sequence[torch.Tensor],
        views: Sequence[torch.Tensor] = (),
        buffers: Sequence[torch.Tensor] = (),
    ) -> None:
        self._params, self._views, self._buffers = list(params), views, buffers
        grads = list(map(_GRAD, self._params))
        self._seen: list[tuple[weakref.ref[torch.Tensor], int] | None] | None = None
        self._versions: list[int] = []
        if views and all(map(operator.is_, grads, views)):
            self._versions = [b._version for b in buffers]
        else:
            self._seen = [_seen(g) for g in grads]

    def unchanged(self) -> bool:
        """Whether every param has the gradient it had then, unwritten since."""
        grads = map(_GRAD, self._params)
        if self._seen is None:  # the few buffers first: any backward moved their counters
            versions_still = [b._version for b in self._buffers] == self._versions
            return versions_still and all(map(operator.is_, grads, self._views))
        return all(map(_same, self._seen, grads))


_GRAD = operator.attrgetter("grad")


def _seen(grad: torch.Tensor | None) -> tuple[weakref.ref[torch.Tensor], int] | None:
    return None if grad is None else (weakref.ref(grad), _version(grad))


def _same(seen: tuple[weakref.ref[torch.Tensor], int] | None, grad: torch.Tensor | None) -> bool:
    if seen is None or grad is None:
        return seen is None and grad is None
    return seen[0]() is grad and seen[1] == _version(grad)


def _version(grad: torch.Tensor) -> int:
    return (dtensors.local(grad) if isinstance(grad, DTensor) else grad)._version
