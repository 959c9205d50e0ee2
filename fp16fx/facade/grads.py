"""What the fast path remembers about the gradients: facts that hold while the grads do.

Layer: ``facade`` (docs/design.md). apex kept the unscaled grads in FP32 copies, the masters'
grads: a clip it applied to them held until a backward or ``zero_grad`` replaced them, and a
second ``step()`` without a new backward stepped them again. fp16fx's fast path keeps no copy
-- every step reads the model's scaled grads from their flat buffers -- so it remembers instead
what apex would have done to them, each fact with a :class:`GradStamp` of the grads it is
about (:class:`GradMemo`), and the fact lapses once they change. The fast engine keeps these
facts in a :class:`FastGrads`, beside what across processes no rank learns alone: the last
check every rank made of its grads, and (sharded) the mean grads a reduce-scatter left.
"""

from __future__ import annotations

import contextlib
import operator
import weakref
from collections.abc import Callable, Iterator, Sequence
from typing import Generic, TypeVar

import torch
from torch.distributed.tensor import DTensor

from fp16fx import dtensors
from fp16fx.facade.policy import Scaler
from fp16fx.scaling import GradCheck, LossScaleState
from fp16fx.step import StepInfo
from fp16fx.transforms.primitives import NO_CLIP, clip_coefficient, clip_limit

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


class GradFacts:
    """What an engine knows of the current gradients, each fact lapsing once they change (the
    fast engine keeps all three; the generic one, whose masters' grads hold the rest, the scale):

    - the clip ``clip_master_grads`` asked of them (:meth:`clip`), which every step applies
      while they are these grads, as apex's in-place clip of its masters' grads held;
    - the loss scale they were made with (:meth:`made_at`), where it may not be the current
      one: a step left them (a second step steps them again, unscaled by that scale), or a
      scale set by hand came after them;
    - their check (:meth:`checked`), cached in one process (across processes a check is a
      collective, which every rank runs anew).

    ``stamp()`` returns the grads now (a :class:`GradStamp`).
    """

    def __init__(self, stamp: Callable[[], GradStamp]) -> None:
        self._stamp = stamp
        self._clip = GradMemo[float]()
        self._made_at = GradMemo[torch.Tensor]()
        self._checked = GradMemo[GradCheck]()

    def clip_norm(self) -> float:
        """Returns the max_norm a step now clips to: :meth:`clip`'s while the grads are the
        ones it saw, else ``NO_CLIP``."""
        max_norm = self._clip.get()
        return NO_CLIP if max_norm is None else max_norm

    def clip(self, max_norm: float, norm: torch.Tensor) -> torch.Tensor:
        """Makes the steps clip the current grads (global norm ``norm``, unclipped) to
        ``max_norm`` for as long as they are these grads. Returns the norm of the grads this
        clip sees: ``norm``, or where they are clipped already, the clipped one, which this
        clip scales again as apex's second in-place clip did (the step then applies both
        factors at once)."""
        limit, clipped_to = max_norm, self.clip_norm()
        if clipped_to != NO_CLIP:
            first = clip_coefficient(clipped_to, norm)
            if first == 0:  # an inf norm: the first clip zeroed the grads (inf * 0 is no norm)
                return torch.zeros_like(norm)  # and this one keeps them so, its step too
            clipped = norm * first
            both = first * clip_coefficient(limit, clipped)
            limit = clip_limit(both, norm) if both < 1 else NO_CLIP
            norm = clipped
        self._clip.remember(limit, self._stamp())
        return norm

    def made_at(self) -> torch.Tensor | None:
        """Returns the loss scale the grads were made with, if they are ones a step left or
        :meth:`keep_scale` saw (nothing wrote them since), else None: the current one."""
        return self._made_at.get()

    def keep_scale(self, scale: torch.Tensor) -> None:
        """Makes the current grads keep the loss scale ``scale`` (the current one, about to
        be set by hand), unless they carry one already."""
        if self._made_at.get() is None:
            self._made_at.remember(scale.clone(), self._stamp())

    def still_these(self, clip: float, made_at: torch.Tensor | None) -> None:
        """Records the current grads, after the engine's own writes (a step; new buffers), as
        the ones ``clip`` still applies to (``NO_CLIP``: none) and that were made with the
        loss scale ``made_at`` (None: the current one)."""
        stamp = self._stamp()
        self._clip.remember(None if clip == NO_CLIP else clip, stamp)
        self._made_at.remember(made_at, stamp)

    def checked(self) -> GradCheck | None:
        """Returns the check :meth:`remember_check` kept, while the grads are the same."""
        return self._checked.get()

    def remember_check(self, checked: GradCheck) -> None:
        self._checked.remember(checked, self._stamp())

    def forget_check(self) -> None:
        self._checked.forget()


class FastGrads:
    """What the fast engine knows of its current gradients: their :class:`GradFacts`
    (:attr:`facts`), and across processes what a read one rank makes alone cannot learn
    without a collective -- the last check every rank made of them (:meth:`last_agreed`) --
    and, sharded, this step's mean grads, reduce-scattered once (:meth:`scattered`).

    ``stamp()`` returns the grads now (a :class:`GradStamp`); ``scaler``: the facade's loss
    scale, which :meth:`scale_of_the_grads` swaps; ``sharded``: whether the engine averages
    its grads by a reduce-scatter (in place, so that it steps each grad once). The engine
    reads the grads and runs their checks and collectives; it hands the results in here.
    """

    def __init__(self, stamp: Callable[[], GradStamp], scaler: Scaler, *, sharded: bool) -> None:
        self.facts = GradFacts(stamp)
        self._stamp, self._scaler, self._sharded = stamp, scaler, sharded
        self._scattered: list[torch.Tensor] | None = None  # sharded: this step's mean grads
        # Across processes, the last check every rank made of these grads (a clip's, or the
        # step's): what a read one rank makes alone returns, with no collective.
        self._agreed: GradCheck | None = None
        # And a clip's, while this rank's grads are still the ones it checked: what every
        # rank's overflow read returns alike (a rank's own grads may differ after DDP).
        self._agreed_of_these: GradMemo[GradCheck] = GradMemo()

    @property
    def reduced(self) -> bool:
        """Whether the current grads were reduce-scattered already (sharded, by a clip)."""
        return self._scattered is not None

    def scattered(self, reduce: Callable[[], list[torch.Tensor]]) -> list[torch.Tensor]:
        """Returns this rank's slices of the mean gradient: those ``reduce()`` (one
        reduce-scatter) returned, which runs once per step."""
        if self._scattered is None:
            self._scattered = reduce()
        return self._scattered

    @contextlib.contextmanager
    def scale_of_the_grads(self) -> Iterator[bool]:
        """Within it, the state's loss scale is the one the grads were made with, where they
        are the ones the last step left (nothing wrote them since), so that the core unscales
        them by it; after it, the policy's state is as it was. Yields whether it swapped the
        scale. The grads themselves are not touched.

        Sharded, such grads raise RuntimeError, before anything changed: the reduce-scatter
        averaged them in place.
        """
        made_at = self.facts.made_at()
        if made_at is None:
            yield False
            return
        if self._sharded:
            raise RuntimeError(
                "a sharded FP16_Optimizer steps each gradient once (its reduce-scatter averaged "
                "them in place): call backward() or zero_grad() before using them again"
            )
        kept = LossScaleState(*(t.clone() for t in self._scaler.state))
        self._scaler.state.scale.copy_(made_at)
        try:
            yield True
        finally:
            self._scaler.write(kept)

    def keep_scale(self, collect: Callable[[], object]) -> None:
        """Makes the current grads keep the loss scale they were made with (the current one,
        unless they carry one already), which is about to be set by hand. (Sharded: they take
        the new one, as a sharded engine unscales each grad once, by the current scale.)
        ``collect()`` moves the grads into the buffers a step reads (TypeError: it cannot)."""
        if self._sharded or self.facts.made_at() is not None:
            return
        # The grads a step reads: their flat buffer's views (a stamp before would lapse). A
        # sparse grad moves nothing (TypeError): the generic path takes them, by this scale.
        with contextlib.suppress(TypeError):
            collect()
        self.facts.keep_scale(self._scaler.state.scale)

    def cached(self, distributed: bool) -> GradCheck | None:
        """Returns the check :meth:`remember` kept while the grads are unchanged; None across
        processes (``distributed``), where a check is a collective every rank runs anew: a
        cache would hold on some ranks only, where one rank alone wrote its grads."""
        return None if distributed else self.facts.checked()

    def remember(self, checked: GradCheck, distributed: bool) -> None:
        """Keeps ``checked``, a check just made of the current grads: across processes
        (``distributed``) as the last one every rank made, else cached (:meth:`cached`)."""
        if distributed:
            self._agreed = checked
            self._agreed_of_these.remember(checked, self._stamp())
        else:
            self.facts.remember_check(checked)

    def agreed_of_these(self) -> GradCheck | None:
        """Returns the check every rank agreed on in the last clip while this rank's grads
        are still the ones it checked (no write since), else None."""
        return self._agreed_of_these.get()

    def last_agreed(self, distributed: bool) -> GradCheck | None:
        """Returns the last check every rank made of these grads (a clip's or the step's);
        None on one process (not ``distributed``), or where none was made since the last
        ``zero_grad``."""
        return self._agreed if distributed else None

    def forget_check(self) -> None:
        """Forgets the cached check (new grads arrived).

        Raises RuntimeError if a sharded engine's grads were already reduce-scattered (and so
        divided by d in place) without a step or ``zero_grad()`` since: new grads would add
        to them.
        """
        if self._scattered is not None:
            raise RuntimeError(
                "the gradients were already reduce-scattered (by clip_master_grads) and so "
                "divided by the world size; call step() or zero_grad() before another backward"
            )
        self.facts.forget_check()

    def stepped(self, info: StepInfo, clip: float) -> None:
        """Records a step of the current grads, which returned ``info``, clipped to ``clip``:
        its check is the one every rank agreed on, and the grads, which a second step steps
        again, still have that clip and were made with the step's loss scale."""
        self._scattered = None
        self._agreed = GradCheck(info.finite, info.grad_norm)
        self._agreed_of_these.forget()  # (the step's own info says it after a step)
        self.facts.forget_check()
        self.facts.still_these(clip, info.loss_scale)  # the scale the grads were made with

    def regrouped(self, clip: float, made_at: torch.Tensor | None) -> None:
        """Records that the grads moved into new buffers (a param group was added): the same
        grads, with their clip ``clip`` and scale ``made_at``, but a check must read them
        there, and an agreed norm left the new group out (every rank agrees anew)."""
        self.facts.forget_check()
        self.facts.still_these(clip, made_at)
        self._agreed = None
        self._agreed_of_these.forget()

    def zeroed(self) -> None:
        """Forgets the cached check, the agreed one and the mean grads (``zero_grad``: new
        grads come; the other facts lapse by their stamps)."""
        self.facts.forget_check()
        self._scattered = self._agreed = None
        self._agreed_of_these.forget()


_GRAD = operator.attrgetter("grad")


def _seen(grad: torch.Tensor | None) -> tuple[weakref.ref[torch.Tensor], int] | None:
    return None if grad is None else (weakref.ref(grad), _version(grad))


def _same(seen: tuple[weakref.ref[torch.Tensor], int] | None, grad: torch.Tensor | None) -> bool:
    if seen is None or grad is None:
        return seen is None and grad is None
    return seen[0]() is grad and seen[1] == _version(grad)


def _version(grad: torch.Tensor) -> int:
    return (dtensors.local(grad) if isinstance(grad, DTensor) else grad)._version


__all__ = ["FastGrads", "GradFacts", "GradMemo", "GradStamp"]
