"""Loss scaling: policies, their state, and the one definition of "unscale and check".

Layer: ``scaling`` (docs/design.md). Pure functions on tensors; never touches params.

A policy is a frozen (hashable) dataclass holding configuration only. Its mutable part is a
:class:`LossScaleState` of 0-d tensors that travels inside the training state, so changing the
scale never changes a compiled graph. ``policy.adjust(state, finite)`` returns a *new* state.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from collections.abc import Iterable, Sequence
from typing import Any, NamedTuple, Protocol

import torch

from fp16fx.tree import is_finite


class LossScaleState(NamedTuple):
    """The mutable part of every loss-scale policy, as 0-d tensors.

    Attributes:
      scale: the current loss scale (float32).
      good_steps: finite steps since the scale last changed or overflowed (int32).
      overflows: overflows since the scale last grew or backed off (int32; for hysteresis).
    """

    scale: torch.Tensor
    good_steps: torch.Tensor
    overflows: torch.Tensor


def _state(scale: float, device: torch.device | str | None) -> LossScaleState:
    return LossScaleState(
        scale=torch.tensor(scale, dtype=torch.float32, device=device),
        good_steps=torch.zeros((), dtype=torch.int32, device=device),
        overflows=torch.zeros((), dtype=torch.int32, device=device),
    )


class LossScalePolicy(Protocol):
    """What the step needs of a policy: an initial state and a pure ``adjust``."""

    def init(self, device: torch.device | str | None = None) -> LossScaleState: ...

    def adjust(
        self, state: LossScaleState, finite: torch.Tensor
    ) -> tuple[LossScaleState, torch.Tensor]:
        """Returns ``(new_state, floored)``; ``floored`` is True when an overflow found the
        scale already at its minimum (it can go no lower)."""
        ...


def is_power_of_two(x: float) -> bool:
    """Returns whether ``x`` is a positive (possibly fractional) power of two: 2**k, k an int."""
    return x > 0 and math.isfinite(x) and math.frexp(x)[0] == 0.5


#: The scales a state can hold: it keeps them in an FP32 tensor, where a larger value would
#: be inf and a smaller one a subnormal or 0 (every step then skipped, or nothing learnt).
_FP32_NORMAL = (torch.finfo(torch.float32).tiny, torch.finfo(torch.float32).max)


def check_scale(name: str, value: float) -> None:
    """Raises ValueError, naming ``name``, unless ``value`` is a number that FP32 holds as a
    positive normal value (a loss scale, or a factor or bound of one)."""
    low, high = _FP32_NORMAL
    number = isinstance(value, numbers.Real) and not isinstance(value, bool)  # numpy's too
    if not (number and is_finite(value) and low <= value <= high):
        raise ValueError(
            f"{name} must be a finite number > 0 that FP32 holds as a normal value "
            f"({low:g} to {high:g}), got {value!r}"
        )


def scale_fault(
    policy: NoLossScale | StaticLossScale | DynamicLossScale, scale: float
) -> str | None:
    """Returns why no run under the built-in loss-scale ``policy`` holds the loss scale
    ``scale`` (a loaded state's, a scale set by hand) -- it lies outside the range the
    policy's ``scale_range()`` gives -- or None.

    Outside the range, a fixed scale is not the policy's at all (NoLossScale at 2**24 skips
    every step for ever), and a dynamic one below its ``min_scale`` is raised to it by the
    next overflow, which reports the scale floored."""
    low, high = policy.scale_range()
    if low <= scale <= high:
        return None
    # 9 digits tell FP32 values apart (a static scale of 1000.1 is held as 1000.09998)
    holds = f"only {low:.9g}" if low == high else f"scales from {low:.9g} to {high:.9g} only"
    return f"it is {scale:.9g}, but a run under {type(policy).__name__} holds {holds}"


def _check_finite(finite: Any) -> None:
    """Raises TypeError unless ``finite`` is what ``adjust`` takes: a 0-d bool tensor (a
    longer one would broadcast the scale state to its shape)."""
    if not (isinstance(finite, torch.Tensor) and finite.dtype == torch.bool and finite.ndim == 0):
        raise TypeError(f"adjust expects finite as a 0-d bool tensor, got {finite!r}")


class _FixedLossScale:
    """A scale that never moves: ``adjust`` returns the state as it is, never floored."""

    def adjust(
        self, state: LossScaleState, finite: torch.Tensor
    ) -> tuple[LossScaleState, torch.Tensor]:
        _check_finite(finite)
        return state, torch.zeros_like(finite)


@dataclasses.dataclass(frozen=True)
class NoLossScale(_FixedLossScale):
    """No loss scaling: the scale is 1 for ever (the usual choice for BF16)."""

    def init(self, device: torch.device | str | None = None) -> LossScaleState:
        return _state(1.0, device)

    def scale_range(self) -> tuple[float, float]:
        """Returns the lowest and highest loss scale a run under this policy holds: 1."""
        return 1.0, 1.0


@dataclasses.dataclass(frozen=True)
class StaticLossScale(_FixedLossScale):
    """A fixed loss scale. Non-finite steps are still skipped; the scale never moves.

    A power of two keeps scaling and unscaling exact; other values are accepted (apex scripts
    use e.g. 128 or 1000) and cost two roundings when the gradients are unscaled (of
    ``1 / scale``, then of the product: apex's way, too).
    """

    scale: float

    def __post_init__(self) -> None:
        check_scale("scale", self.scale)
        object.__setattr__(self, "scale", float(self.scale))  # a numpy number saves as one

    def init(self, device: torch.device | str | None = None) -> LossScaleState:
        return _state(float(self.scale), device)

    def scale_range(self) -> tuple[float, float]:
        """Returns the lowest and highest loss scale a run under this policy holds: its
        ``scale``, as the state's FP32 tensor holds it."""
        held = float(torch.tensor(self.scale, dtype=torch.float32))
        return held, held


#: The largest count ``LossScaleState``'s int32 counters hold.
_COUNTER_MAX = 2**31 - 1


@dataclasses.dataclass(frozen=True)
class DynamicLossScale:
    """A loss scale that backs off on overflow and grows after a run of finite steps.

    The rule, applied once per step after the gradients were checked::

        if finite:
            good_steps += 1
            if good_steps == growth_interval:
                scale = min(scale * growth_factor, max_scale)
                good_steps = overflows = 0
        else:                                   # the step itself is skipped
            floored = scale <= min_scale            # it can go no lower
            good_steps = 0
            overflows += 1
            if overflows == hysteresis:
                scale = max(scale * backoff_factor, min_scale)
                overflows = 0

    Hysteresis N tolerates N-1 overflows (each still skips its step) before backing off.
    At the floor the scale is clamped, never lowered further, and ``adjust`` reports an
    overflow that found it there (``info.loss_scale_floored`` in a step), whether or not
    hysteresis lets it back off: raising on a collapsed scale is left to the caller, which can
    check that flag whenever it is willing to sync with the device. (A back-off clamped on its
    way down is not one: the gradients of the next try are made at a lower scale.)
    ``backoff_factor`` is below 1: a scale that never backs off would skip every overflowing
    step for ever.

    All factors and bounds must be powers of two, so that scaling and unscaling stay exact.
    The first scale is ``init_scale`` clamped into ``[min_scale, max_scale]``, as in apex.
    """

    init_scale: float = 2.0**16
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    growth_interval: int = 2000
    hysteresis: int = 1
    min_scale: float = 1.0
    max_scale: float = 2.0**24

    def __post_init__(self) -> None:
        for name in ("init_scale", "growth_factor", "backoff_factor", "min_scale", "max_scale"):
            value = getattr(self, name)
            check_scale(name, value)
            object.__setattr__(self, name, float(value))  # a numpy number saves as one
            if not is_power_of_two(value):
                raise ValueError(
                    f"{name} must be a power of two (so that scaling is exact), got {value!r}"
                )
        if self.growth_factor < 1:
            raise ValueError(f"growth_factor must be >= 1, got {self.growth_factor!r}")
        if self.backoff_factor >= 1:
            raise ValueError(
                f"backoff_factor must be < 1 (a scale that does not back off skips every "
                f"overflowing step for ever; a fixed one is StaticLossScale), got "
                f"{self.backoff_factor!r}"
            )
        for name in ("growth_interval", "hysteresis"):
            value = getattr(self, name)
            if isinstance(value, bool) or not (isinstance(value, numbers.Integral) and value >= 1):
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")
            if value > _COUNTER_MAX:  # a larger one would wrap in the comparison: always met
                hint = "; to never grow, set max_scale to init_scale" * (name == "growth_interval")
                raise ValueError(
                    f"{name} must be at most 2**31 - 1, what its int32 counter holds{hint}; "
                    f"got {value!r}"
                )
            object.__setattr__(self, name, int(value))
        if not self.min_scale <= self.max_scale:
            raise ValueError(
                f"min_scale ({self.min_scale}) must not exceed max_scale ({self.max_scale})"
            )

    def init(self, device: torch.device | str | None = None) -> LossScaleState:
        start = min(max(self.init_scale, self.min_scale), self.max_scale)
        return _state(start, device)

    def scale_range(self) -> tuple[float, float]:
        """Returns the lowest and highest loss scale a run under this policy holds:
        ``min_scale`` and ``max_scale``, each included (``init`` clamps ``init_scale`` into
        them, and ``adjust`` clamps every move)."""
        return self.min_scale, self.max_scale

    def counter_fault(self, good_steps: int, overflows: int) -> str | None:
        """Returns why no run under this policy holds these counters (a loaded state's), or
        None: the rule resets each when it reaches its bound. (Loaded at 2**31 - 1, the next
        count wrapped the int32 counter below the bound: no growth, or no back-off, for 2**31
        steps.)"""
        for name, count, bound in (
            ("good_steps", good_steps, "growth_interval"),
            ("overflows", overflows, "hysteresis"),
        ):
            if count >= getattr(self, bound):
                return (
                    f"{name} is {count}, but the policy resets it when it reaches its "
                    f"{bound}, {getattr(self, bound)}"
                )
        return None

    def adjust(
        self, state: LossScaleState, finite: torch.Tensor
    ) -> tuple[LossScaleState, torch.Tensor]:
        _check_finite(finite)
        zero = torch.zeros_like(state.good_steps)
        good_steps = torch.where(finite, state.good_steps + 1, zero)
        overflows = torch.where(finite, state.overflows, state.overflows + 1)
        grow = finite & (good_steps >= self.growth_interval)
        back_off = ~finite & (overflows >= self.hysteresis)

        grown = torch.clamp(state.scale * self.growth_factor, max=self.max_scale)
        backed_off = torch.clamp(state.scale * self.backoff_factor, min=self.min_scale)
        scale = torch.where(grow, grown, torch.where(back_off, backed_off, state.scale))

        changed = grow | back_off
        new_state = LossScaleState(
            scale=scale,
            good_steps=torch.where(changed, zero, good_steps),
            overflows=torch.where(changed, zero, overflows),
        )
        return new_state, ~finite & (state.scale <= self.min_scale)


class GradCheck(NamedTuple):
    """What a step on the current grads would decide by, asked without stepping.

    Attributes:
      finite: 0-d bool, False when any element of any grad is inf or NaN.
      norm: 0-d float32, the global L2 norm of the unscaled grads (inf when not finite).
    """

    finite: torch.Tensor
    norm: torch.Tensor


class CheckedGrads(NamedTuple):
    """What :func:`unscale_and_check` finds.

    Attributes:
      unscaled: the grads divided by the scale, in FP32.
      finite: 0-d bool, False when any element of any grad is inf or NaN.
      norm: 0-d float32, the global L2 norm of ``unscaled`` (inf or NaN when not finite; inf
        too when finite values square past FP32's range, as in torch's own clipping).
    """

    unscaled: list[torch.Tensor]
    finite: torch.Tensor
    norm: torch.Tensor


def global_norm(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """Returns the L2 norm of all ``tensors`` (at least one) together, as a 0-d tensor.

    ``vector_norm`` per tensor, not ``square().sum()``: Inductor's CPU code for it is ~10x
    faster. In FP32 it overflows to inf past ~1.8e19, as ``torch.nn.utils.clip_grad_norm_``.
    """
    return torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(t) for t in tensors]))


def all_finite(grads: Iterable[torch.Tensor]) -> bool:
    """Returns whether every value of ``grads`` (scaled or not) is finite, reading them only
    (one sync; empty tensors, such as an FSDP2 rank's empty shard, and no tensors at all
    count as finite): what :func:`unscale_and_check` decides on the device, asked between
    steps."""
    largest = [torch.linalg.vector_norm(g, ord=float("inf")) for g in grads if g.numel()]
    return not largest or bool(torch.isfinite(torch.stack(largest)).all())


def unscale(grads: Sequence[torch.Tensor], scale: torch.Tensor) -> list[torch.Tensor]:
    """Returns ``grads`` divided by the loss scale ``scale`` in FP32: multiplied by
    ``1 / scale``, exact when the scale is a power of two."""
    inv_scale = torch.reciprocal(scale)
    return [g.float() * inv_scale for g in grads]


def unscale_and_check(grads: Iterable[torch.Tensor], scale: torch.Tensor) -> CheckedGrads:
    """Returns the grads divided by ``scale`` in FP32, whether all are finite, and their norm.

    One reduction pass computes both: ``finite`` from the largest magnitude (exactly "every
    element is finite": grads of 1e19, whose squares overflow, are finite), ``norm`` from the
    squares. Unscaling multiplies by ``1 / scale``, exact when the scale is a power of two.
    Nothing is synced to the host. ``grads``: any iterable of tensors (read once).
    """
    if not isinstance(scale, torch.Tensor):
        raise TypeError(
            f"scale must be the loss scale tensor (state.loss_scale.scale), got {scale!r}"
        )
    grads = list(grads)  # a generator would be spent by the check below
    strays = [i for i, g in enumerate(grads) if not isinstance(g, torch.Tensor)]
    if strays:
        raise TypeError(f"grads[{strays[0]}] is {grads[strays[0]]!r}, not a tensor")
    unscaled = unscale(grads, scale)
    if not unscaled:
        zero = scale.new_zeros(())
        return CheckedGrads(unscaled, torch.isfinite(zero), zero)
    # A sparse grad's entries, summed where an index repeats (an embedding's repeated token)
    values = [u.coalesce()._values() if u.is_sparse else u for u in unscaled]
    values = [v for v in values if v.numel()] or [scale.new_zeros(1)]  # an empty FSDP2 shard
    largest = torch.stack([v.abs().amax() for v in values]).amax()
    return CheckedGrads(unscaled, torch.isfinite(largest), global_norm(values))
