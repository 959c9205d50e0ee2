"""What the fast path remembers about the gradients: facts that hold while the grads do.

Layer: ``facade`` (docs/design.md). apex kept the unscaled grads in FP32 copies, the masters'
grads: a clip it applied to them held until a backward or ``zero_grad`` replaced them, and a
second ``step()`` without a new backward stepped them again. fp16fx's fast path keeps no copy
-- every step reads the model's scaled grads from their flat buffers -- so it remembers instead
what apex would have done to them, each fact with a :class:`GradStamp` of the grads it is
about (:class:`GradMemo`), and the fact lapses once they change.
"""

from __future__ import annotations

import operator
import weakref
from collections.abc import Sequence
from typing import Generic, TypeVar

import torch
from torch.distributed.tensor import DTensor

from fp16fx import dtensors

T = TypeVar("T")


class GradStamp:
    """The gradients of some params at one moment, to tell later whether any has changed.

    Each grad is held weakly and compared by identity -- a new tensor is never taken for a
    freed one whose ``id`` it reuses -- with its version counter, which a write in place
    moves (a DTensor's: its local shard's, which FSDP2 writes). ``views`` and ``buffers``
    (a :class:`~fp16fx.flat.FlatParams`' grad views and their flat buffers): while every grad
    is its view, the buffers' counters, which their views share, say it all, read once per
    buffer rather than per param (a many-param model's step would pay a Python loop).

    ``empty``: no param had a gradient then. Such a stamp tells whether grads arrived, but
    not which ones came and went since (a backward, then ``zero_grad(set_to_none=True)``).
    """

    def __init__(
        self,
        params: Sequence[torch.Tensor],
        views: Sequence[torch.Tensor] = (),
        buffers: Sequence[torch.Tensor] = (),
    ) -> None:
        self._params, self._views, self._buffers = list(params), views, buffers
        grads = list(map(_GRAD, self._params))
        self.empty = all(g is None for g in grads)
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


class GradMemo(Generic[T]):
    """A value that holds for some gradients: :meth:`get` returns it while they are unchanged."""

    def __init__(self) -> None:
        self._value: T | None = None
        self._stamp: GradStamp | None = None

    def remember(self, value: T | None, stamp: GradStamp) -> None:
        """Keeps ``value`` (None: nothing) for the grads ``stamp`` saw."""
        self._value, self._stamp = value, None if value is None else stamp

    def get(self) -> T | None:
        """Returns the value if the grads are still the ones it was remembered for, else None
        (always None over no grads at all: others may have come and gone since)."""
        if self._stamp is not None and not self._stamp.empty and self._stamp.unchanged():
            return self._value
        return None

    def forget(self) -> None:
        self._value = self._stamp = None


_GRAD = operator.attrgetter("grad")


def _seen(grad: torch.Tensor | None) -> tuple[weakref.ref[torch.Tensor], int] | None:
    return None if grad is None else (weakref.ref(grad), _version(grad))


def _same(seen: tuple[weakref.ref[torch.Tensor], int] | None, grad: torch.Tensor | None) -> bool:
    if seen is None or grad is None:
        return seen is None and grad is None
    return seen[0]() is grad and seen[1] == _version(grad)


def _version(grad: torch.Tensor) -> int:
    return (dtensors.local(grad) if isinstance(grad, DTensor) else grad)._version


__all__ = ["GradMemo", "GradStamp"]
