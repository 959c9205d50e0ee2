"""Loss-scale configuration: apex's arguments and checkpoint dicts <-> fp16fx policies.

Layer: ``facade`` (docs/design.md). The only loss-scale implementation is
:mod:`fp16fx.scaling`; this module only translates apex's spelling of a scaler (constructor
arguments, pickled scalers turned into plain dicts by
:func:`fp16fx.apex_checkpoint.load_apex_checkpoint`) into a
:class:`~fp16fx.scaling.DynamicLossScale` or :class:`~fp16fx.scaling.StaticLossScale` plus the
values of its :class:`~fp16fx.scaling.LossScaleState`, and back.

apex's "no floor" (``min_loss_scale=None``, its default) becomes ``min_scale = 2**-126``
(:data:`NO_FLOOR`): the smallest scale whose reciprocal is still a normal FP32 number, so
unscaling never divides by zero or relies on subnormals. apex itself had no floor at all; its
scale would keep halving until it reached 0 and every later step produced NaN. A scale that far
down only happens when the model produces inf/NaN on its own; fp16fx reports it (see
``FP16_Optimizer``'s docstring) instead of letting it underflow.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
import warnings
from collections.abc import Mapping
from typing import Any, NamedTuple

import torch

from fp16fx.consensus import Consensus
from fp16fx.saved_format import as_number
from fp16fx.scaling import (
    DynamicLossScale,
    LossScaleState,
    StaticLossScale,
    check_scale,
    is_power_of_two,
)

#: The floor used for apex's ``min_loss_scale=None``: 2**-126, reciprocal 2**126 (normal FP32).
NO_FLOOR = 2.0**-126
#: The ceiling used for the legacy apex ``DynamicLossScaler``, which had none, and for
#: ``max_loss_scale=inf`` (mirror of NO_FLOOR).
NO_CEILING = 2.0**126

FacadePolicy = DynamicLossScale | StaticLossScale


class ScaleValues(NamedTuple):
    """A policy's :class:`~fp16fx.scaling.LossScaleState` as Python numbers (a checkpoint's)."""

    scale: float
    good_steps: int
    overflows: int


@dataclasses.dataclass
class Scaler:
    """The loss-scale policy, its state tensors and the device-side overflow counters.

    Shared by ``FP16_Optimizer`` and its engine (stateful). ``state``'s tensors never change
    identity (values are written in place); ``stats`` holds (skipped steps, overflows
    that found the scale at its floor) since the reporter last read it, added to on the
    device by each step.
    ``consensus`` (None for one process) agrees each step's "finite" across processes
    (:class:`fp16fx.consensus.Consensus`).
    """

    policy: FacadePolicy
    state: LossScaleState
    stats: torch.Tensor
    consensus: Consensus | None = None

    def write(self, values: LossScaleState) -> None:
        """Writes ``values`` (tensors) into the state's tensors, in place."""
        with torch.no_grad():
            for dst, src in zip(self.state, values):
                dst.copy_(src)

    def count(self, finite: torch.Tensor, floored: torch.Tensor) -> None:
        """Adds a step's skip (not ``finite``) and overflow at the floor to ``stats``."""
        self.stats.add_(torch.stack([~finite, floored]).to(self.stats.dtype))

    def adjust(self, finite: torch.Tensor) -> torch.Tensor:
        """Moves the state by the policy's rule for a step whose grads were ``finite`` (in
        place), and counts the step; returns whether an overflow found the scale at its floor
        (a 0-d tensor: no sync)."""
        with torch.no_grad():
            moved, floored = self.policy.adjust(self.state, finite)
            self.write(moved)
            self.count(finite, floored)
        return floored


_APEX_KEYS = ("init_scale", "scale_factor", "scale_window", "min_loss_scale", "max_loss_scale")
_FP16FX_KEYS = tuple(f.name for f in dataclasses.fields(DynamicLossScale))
_APEX_TO_FIELD = {
    "scale_window": "growth_interval",
    "min_loss_scale": "min_scale",
    "max_loss_scale": "max_scale",
}


def policy_from_args(
    static_loss_scale: float,
    dynamic_loss_scale: bool,
    dynamic_loss_args: Mapping[str, Any] | None,
) -> FacadePolicy:
    """Returns the policy for apex's ``FP16_Optimizer`` scaling arguments.

    ``dynamic_loss_args`` takes apex's keys (``init_scale``, ``scale_factor``, ``scale_window``,
    ``min_loss_scale``, ``max_loss_scale``) and :class:`~fp16fx.scaling.DynamicLossScale`'s
    field names (``hysteresis``, ``growth_interval``, ...). Defaults are apex's: start 2**16,
    window 2000, ceiling 2**24 (``inf``, apex's "none": :data:`NO_CEILING`), no floor
    (:data:`NO_FLOOR`). ``scale_factor`` f is honoured as
    growth factor f and back-off factor 1/f (apex's amp-era scaler ignored it and always used 2).

    Raises:
      TypeError: ``dynamic_loss_args`` is not a mapping.
      ValueError: an unknown or duplicated key, or a value the policy rejects (named).
    """
    fields = None if dynamic_loss_args is None else dynamic_fields(dynamic_loss_args)
    if not dynamic_loss_scale:
        if dynamic_loss_args:
            warnings.warn(
                "dynamic_loss_args is ignored because dynamic_loss_scale=False (as in apex)",
                stacklevel=3,
            )
        try:
            return StaticLossScale(static_loss_scale)
        except ValueError as err:
            raise ValueError(f"static_loss_scale: {err}") from None
    try:
        return DynamicLossScale(**(fields or {"min_scale": NO_FLOOR}))
    except ValueError as err:
        raise ValueError(f"dynamic_loss_args {dict(dynamic_loss_args or {})}: {err}") from None


def dynamic_fields(args: Mapping[str, Any]) -> dict[str, Any]:
    """Returns ``DynamicLossScale`` keyword arguments for apex- or fp16fx-style ``args``."""
    if not isinstance(args, Mapping):
        raise TypeError(f"dynamic_loss_args must be a dict, got {type(args).__name__}")
    unknown = sorted(set(args) - set(_APEX_KEYS) - set(_FP16FX_KEYS))
    if unknown:
        raise ValueError(
            f"dynamic_loss_args has unknown key(s) {unknown}; apex's keys are "
            f"{list(_APEX_KEYS)} and fp16fx's {list(_FP16FX_KEYS)}"
        )
    fields: dict[str, Any] = {}
    given_by: dict[str, str] = {}

    def put(field: str, value: Any, key: str) -> None:
        if field in fields:
            raise ValueError(
                f"dynamic_loss_args sets {field} twice (by {given_by[field]!r} and {key!r})"
            )
        fields[field], given_by[field] = value, key

    for key, value in args.items():
        if key == "scale_factor":
            real = isinstance(value, numbers.Real) and not isinstance(value, bool)
            if not (real and value > 1):
                raise ValueError(
                    f"dynamic_loss_args['scale_factor'] must be a number > 1, got {value!r}"
                )
            put("growth_factor", float(value), key)
            put("backoff_factor", 1.0 / value, key)
        elif key == "min_loss_scale" and not value:
            put("min_scale", NO_FLOOR, key)  # apex: None (or 0) means "no floor"
        elif key == "max_loss_scale" and value == math.inf:
            put("max_scale", NO_CEILING, key)  # apex: no ceiling
        else:
            put(_APEX_TO_FIELD.get(key, key), value, key)
    fields.setdefault("min_scale", NO_FLOOR)
    return fields


def scaler_to_dict(policy: FacadePolicy, values: ScaleValues) -> dict[str, Any]:
    """Returns the checkpoint dict (Python primitives only) of ``policy`` in state ``values``."""
    out: dict[str, Any] = {
        "format": "fp16fx",
        "dynamic": isinstance(policy, DynamicLossScale),
        "loss_scale": float(values.scale),
        "good_steps": int(values.good_steps),
        "overflows": int(values.overflows),
    }
    if isinstance(policy, DynamicLossScale):
        out.update(dataclasses.asdict(policy))
    return out


def _get(d: Mapping[str, Any], key: str, kind: type) -> Any:
    if key not in d:
        raise ValueError(f"loss_scaler has no {key!r} entry")
    value = d[key]
    if kind is bool:
        if not isinstance(value, bool):
            raise ValueError(f"loss_scaler[{key!r}] must be a bool, got {value!r}")
        return value
    try:
        return as_number(value, kind)
    except TypeError:
        raise ValueError(f"loss_scaler[{key!r}] must be a number, got {value!r}") from None
    except ValueError:
        raise ValueError(f"loss_scaler[{key!r}] must be an integer, got {value!r}") from None


def _count(d: Mapping[str, Any], key: str) -> int:
    """A step counter of the scaler: the state keeps it in an int32 tensor."""
    value = _get(d, key, int)
    if not 0 <= value < 2**31:
        raise ValueError(f"loss_scaler[{key!r}] must be a count in [0, 2**31), got {value!r}")
    return value


def _amp_bound(d: Mapping[str, Any], key: str, up: bool) -> float:
    """Returns apex amp's scale bound ``key`` as the power of two inside it (``up``: the next
    one above, else below), at most :data:`NO_CEILING`, which an infinite ceiling (amp's
    ``min(inf, 2 * s)`` never caps) also is."""
    value = _get(d, key, float)
    if value == math.inf and not up:
        return NO_CEILING
    check_scale(f"loss_scaler[{key!r}]", value)
    if not is_power_of_two(value):
        # frexp's exponent is exact (log2 rounds values an ulp off a power of two onto it):
        # value = m * 2**e, m in (0.5, 1), between 2**(e-1) and 2**e
        exponent = math.frexp(value)[1]
        value = 2.0 ** (exponent if up else exponent - 1)
    return min(value, NO_CEILING)


def _dynamic(**fields: Any) -> DynamicLossScale:
    try:
        return DynamicLossScale(**fields)
    except ValueError as err:
        raise ValueError(f"loss_scaler: {err}") from None


def scaler_from_dict(d: Any) -> tuple[FacadePolicy, ScaleValues]:
    """Returns ``(policy, its state's values)`` for a checkpoint's scaler dict.

    Formats: ``"fp16fx"`` (written by :func:`scaler_to_dict`) and the three that
    :func:`fp16fx.apex_checkpoint.apex_scaler_to_dict` produces (``"apex.amp"``,
    ``"apex.fp16_utils.dynamic"``, ``"apex.fp16_utils.static"``). apex bounds that are not
    powers of two are moved inwards to the nearest power of two (floor up, ceiling down).

    Raises:
      ValueError: an unknown format, or a missing or bad entry (named).
    """
    policy, values = _read_scaler(d)
    fault = policy.counter_fault(*values[1:]) if isinstance(policy, DynamicLossScale) else None
    if fault is not None:
        raise ValueError(f"loss_scaler: {fault}")
    return policy, values


def _read_scaler(d: Any) -> tuple[FacadePolicy, ScaleValues]:
    """:func:`scaler_from_dict`'s reading of each format."""
    if not isinstance(d, Mapping):
        raise ValueError(f"loss_scaler must be a dict, got {type(d).__name__}")
    fmt = d.get("format")
    scale = _get(d, "loss_scale", float)
    check_scale("loss_scaler['loss_scale']", scale)
    if fmt == "fp16fx":
        values = ScaleValues(scale, _count(d, "good_steps"), _count(d, "overflows"))
        if not _get(d, "dynamic", bool):
            return StaticLossScale(scale), values
        fields = {f: d[f] for f in _FP16FX_KEYS if f in d}
        missing = sorted(set(_FP16FX_KEYS) - set(fields))
        if missing:
            raise ValueError(f"loss_scaler has no {missing} entries")
        return _dynamic(**fields), values
    if fmt == "apex.amp":
        if not _get(d, "dynamic", bool):
            return StaticLossScale(scale), ScaleValues(scale, good_steps=0, overflows=0)
        floor = d.get("min_loss_scale")
        min_scale = NO_FLOOR if not floor else _amp_bound(d, "min_loss_scale", up=True)
        max_scale = _amp_bound(d, "max_loss_scale", up=False)
        policy = _dynamic(
            init_scale=min(max(2.0**16, min_scale), max_scale),
            growth_interval=_get(d, "scale_window", int),
            min_scale=min_scale,
            max_scale=max_scale,
        )
        return policy, ScaleValues(scale, good_steps=_count(d, "unskipped"), overflows=0)
    if fmt == "apex.fp16_utils.dynamic":
        # Legacy rule: grow when (cur_iter - last_overflow_iter) % window == 0, i.e. after
        # `window` clean iterations counted from the last overflow; floor 1, no ceiling.
        window = _get(d, "scale_window", int)
        factor = _get(d, "scale_factor", float)
        if factor == 1:  # its scale never moves: a fixed one (a dynamic one must back off)
            if scale < 1:
                raise ValueError(
                    f"loss_scaler: a legacy DynamicLossScaler with scale_factor 1 at scale "
                    f"{scale:g}, below 1, has no fp16fx policy (apex lifts such a scale to 1 "
                    "at its next overflow, then never moves it)"
                )
            return StaticLossScale(scale), ScaleValues(scale, good_steps=0, overflows=0)
        policy = _dynamic(
            init_scale=2.0**32,
            growth_factor=factor,
            backoff_factor=1.0 / factor if factor > 0 else factor,
            growth_interval=window,
            min_scale=1.0,
            max_scale=NO_CEILING,
        )
        clean = _get(d, "cur_iter", int) - _get(d, "last_overflow_iter", int) - 1
        return policy, ScaleValues(scale, good_steps=clean % window, overflows=0)
    if fmt == "apex.fp16_utils.static":
        return StaticLossScale(scale), ScaleValues(scale, good_steps=0, overflows=0)
    raise ValueError(
        f"loss_scaler has unknown format {fmt!r}; expected 'fp16fx' or an apex scaler as "
        "fp16fx.load_apex_checkpoint returns it ('apex.amp', 'apex.fp16_utils.dynamic', "
        "'apex.fp16_utils.static')"
    )
