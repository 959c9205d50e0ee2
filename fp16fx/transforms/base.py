"""The transform protocol, hyperparameters as named tensors, and ``chain``.

Layer: ``transforms`` (docs/design.md). Optimizer math on FP32 values; knows nothing of FP16,
loss scales or flat buffers.

A :class:`GradientTransformation` is optax's pair of pure functions::

    state            = transform.init(params)
    updates, state'  = transform.update(updates, state, params)

``params`` are the FP32 masters and ``updates`` start as the unscaled gradients; the step hands
both over as :class:`~fp16fx.segments.Segments` (one flat tensor per segment of its state), and
a transform treats them as any pytree: its per-param state is a tree like the params
(``tree_map(torch.zeros_like, params)``). The one thing a transform may need beyond its
arguments, the global norm of the step's gradients (for clipping), the step puts into the
transform's own state, in a :class:`GradNorm` slot. Hyperparameters live in the state as
:class:`Hyperparams`, 0-d float64 tensors under their names, so they can change between steps
(``fp16fx.set_hyperparams``) without recompiling a compiled step; float64 keeps scalar
arithmetic such as Adam's bias corrections as precise as torch.optim's host-side math.

A NamedTuple state may name the fields that are never negative (Adam's second moments) in a
class attribute ``non_negative``: a compact state then stores them in a form for non-negative
values (:mod:`fp16fx.precision`'s int8 moments: unsigned, with a fourth-root companding that
keeps small values).
"""

from __future__ import annotations

import numbers
from collections.abc import Callable, Hashable
from typing import Any, NamedTuple

import optree
import torch

from fp16fx.segments import MASKED, Segments
from fp16fx.tree import is_finite

Params = Any
Updates = Any
State = Any


class GradientTransformation(NamedTuple):
    """A pure optimizer piece: ``init(params) -> state``, ``update(updates, state, params) ->
    (updates, state)``; neither mutates its inputs.

    ``param_labels`` is None, or (a :class:`~fp16fx.transforms.groups.ParamLabels`) called
    with the params tree given to ``fp16fx.init`` it returns a label per flat leaf: leaves
    with different labels are updated by different transforms
    (:func:`~fp16fx.transforms.multi_transform`) and so never share a flat buffer.
    """

    init: Callable[[Params], State]
    update: Callable[[Updates, State, Params], tuple[Updates, State]]
    param_labels: Callable[[Any], tuple[Hashable, ...]] | None = None


class Hyperparams(dict):
    """A transform's hyperparameters: name -> float64 tensor (0-d; ``betas``: two values)."""


optree.register_pytree_node(
    Hyperparams,
    lambda h: (tuple(h.values()), tuple(h)),
    lambda names, values: Hyperparams(zip(names, values)),
    namespace=optree.registry.__GLOBAL_NAMESPACE,
)


class GradNorm(NamedTuple):
    """A slot in a transform's state that the step fills, before every update, with the global
    L2 norm of that step's unscaled gradients -- agreed by every process, so in a sharded
    state it is the norm of the whole gradient, not of this rank's slice."""

    value: torch.Tensor


def _is_grad_norm(x: Any) -> bool:
    return isinstance(x, GradNorm)


def with_grad_norm(state: State, norm: torch.Tensor) -> State:
    """Returns ``state`` with every :class:`GradNorm` slot holding ``norm``."""
    return optree.tree_map(
        lambda x: GradNorm(norm) if _is_grad_norm(x) else x,
        state,
        is_leaf=_is_grad_norm,
        none_is_leaf=True,
    )


def _kept(x: Any) -> bool:
    return isinstance(x, (Segments, Hyperparams, GradNorm))


def check_kept(state: State) -> None:
    """Raises TypeError naming the first tensor of a transform's ``init`` state that a step
    would not keep, or per-param state that a state dict cannot hold (integers per value,
    which it would take for a step count; one floating value per segment; Segments of
    anything but tensors). A step
    keeps the per-param state (the parts inside the
    :class:`~fp16fx.segments.Segments` the transform was given, cut and saved with them),
    :class:`Hyperparams` and :class:`GradNorm` slots; a tensor elsewhere would be dropped by
    the pure step and the state dict. A count of steps lives per param, as in
    :func:`~fp16fx.transforms.primitives.scale_by_adam`."""
    accessors, leaves, _ = optree.tree_flatten_with_accessor(state, is_leaf=_kept)
    for accessor, leaf in zip(accessors, leaves):
        for x in leaf if isinstance(leaf, Segments) else ():
            _check_per_param(accessor.codify("state"), x)
        if isinstance(leaf, torch.Tensor):
            raise TypeError(
                f"the optimizer's init returned a tensor at {accessor.codify('state')} that is "
                "not per param: a transform's state holds tensors only in a tree like the "
                "params its init is given (e.g. tree_map(torch.zeros_like, params)), in "
                "Hyperparams and in GradNorm slots; keep a step count per param, as "
                "fp16fx.adam does"
            )


def _check_per_param(where: str, x: Any) -> None:
    """Raises TypeError unless ``x``, a segment's part of a transform's per-param state at
    ``where``, is a floating tensor of the segment's values (1-D) or an integer step count
    (0-d), or no part (None, or :data:`~fp16fx.segments.MASKED`): a state dict tells a step
    count by its dtype, and saves per-value state per param."""
    if x is None or x is MASKED:
        return
    if not isinstance(x, torch.Tensor):
        raise TypeError(
            f"the optimizer's init returned Segments holding a {type(x).__name__} at {where}: "
            "a transform's per-param state is a tree like the params it is given, one tensor "
            "per segment (tree_map(torch.zeros_like, params))"
        )
    if x.ndim and not x.is_floating_point():
        raise TypeError(
            f"the optimizer's init returned {x.dtype} values per param at {where}: per-value "
            "state is floating (FP32 counts exactly to 2**24), as a state dict tells a step "
            "count (an integer, 0-d per param) by its dtype"
        )
    if not x.ndim and x.is_floating_point():
        raise TypeError(
            f"the optimizer's init returned one {x.dtype} value per param at {where}: "
            "per-param state is per value (tree_map(torch.zeros_like, params)) or an integer "
            "step count (0-d); a state dict could not save one floating value per param "
            "and load it back"
        )


def _non_negative(x: float) -> bool:
    return x >= 0


def _unit_interval(x: float) -> bool:
    return 0 <= x < 1


#: The least magnitude that rounds to inf in FP32 (half an ulp past its largest value, where
#: round-to-nearest-even goes up): the step turns its hyperparameters into FP32 numbers.
_FP32_OVERFLOW = 2.0**128 - 2.0**103

#: The rule for a number of any value FP32 holds: dampening, or a transform of your own's.
_ANY_NUMBER: tuple[Callable[[float], bool], str] = (lambda x: True, "a finite number")

#: Each hyperparameter's valid range, and the rule as the error states it.
_VALID: dict[str, tuple[Callable[[float], bool], str]] = {
    "lr": (_non_negative, ">= 0"),
    "eps": (_non_negative, ">= 0"),
    "weight_decay": (_non_negative, ">= 0"),
    "momentum": (_non_negative, ">= 0"),
    "dampening": _ANY_NUMBER,
    "betas": (_unit_interval, "a pair of numbers in [0, 1)"),
    "max_norm": (lambda x: x > 0, "> 0"),
}


def _number(name: str, value: Any) -> float:
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            raise ValueError(f"hyperparameter {name!r} must be a scalar, got shape {value.shape}")
        if value.is_meta:
            raise TypeError(f"hyperparameter {name!r} is a meta tensor, which holds no value")
        value = value.item()
    if not isinstance(value, numbers.Real) or isinstance(value, bool):  # numpy's numbers too
        raise TypeError(f"hyperparameter {name!r} must be a number, got {value!r}")
    valid, rule = _VALID.get(name, _ANY_NUMBER)
    if not (is_finite(value) and valid(value)):
        shown = repr(value) if len(repr(value)) <= 40 else "a number too large for a float"
        raise ValueError(f"hyperparameter {name!r} must be {rule}, got {shown}")
    value = float(value)  # (a NumPy float32 would cast the bound below to its own dtype)
    if abs(value) >= _FP32_OVERFLOW and name != "max_norm":  # (a max_norm past it clips nothing)
        raise ValueError(
            f"hyperparameter {name!r} is {value!r}, which rounds to inf in FP32 (as every "
            f"value from {_FP32_OVERFLOW!r} does): the step computes in FP32"
        )
    return value


def check_hyperparam(name: str, value: Any) -> float | tuple[float, ...]:
    """Returns ``value`` as a float (``betas``: a pair) after checking it is valid for ``name``:
    in the range of a hyperparameter fp16fx knows (``lr >= 0``...), and any other one (a
    transform of your own's) a number FP32 holds.

    Raises:
      TypeError, ValueError: the value is not a number, or out of range (named).
    """
    if name == "betas":
        if isinstance(value, torch.Tensor):
            value = value.tolist()
        if not (isinstance(value, (tuple, list)) and len(value) == 2):
            raise ValueError(f"hyperparameter 'betas' must be a pair of numbers, got {value!r}")
        return tuple(_number(name, v) for v in value)
    return _number(name, value)


def hyperparams(params: Params, **values: Any) -> Hyperparams:
    """Returns the checked ``values`` as float64 tensors on the device of ``params``."""
    leaves = [x for x in optree.tree_leaves(params) if isinstance(x, torch.Tensor)]
    device = leaves[0].device if leaves else None
    return Hyperparams(
        (name, torch.tensor(check_hyperparam(name, v), dtype=torch.float64, device=device))
        for name, v in values.items()
    )


def scalars(*values: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Returns ``values`` as 0-d float32 tensors, each computed once per step.

    Stacking them makes the compiler materialise the scalars in a tiny buffer; left alone,
    Inductor inlines scalar math such as ``beta2 ** count`` (a float64 ``pow``) into every
    iteration of the fused elementwise loop, which made Adam 6x slower on CPU. A stack of one
    tensor is a view the compiler sees through, so a single value is stacked twice.
    """
    floats = [v.float() for v in values]
    stacked = torch.stack(floats if len(floats) > 1 else floats * 2)
    return tuple(stacked.unbind())[: len(floats)]


def stateless(
    update: Callable[[Updates, Hyperparams, Params], Updates], **defaults: Any
) -> GradientTransformation:
    """Returns a transform whose state is just its hyperparameters ``defaults``."""
    for name, value in defaults.items():
        check_hyperparam(name, value)
    return GradientTransformation(
        init=lambda params: hyperparams(params, **defaults),
        update=lambda updates, state, params: (update(updates, state, params), state),
    )


def chain(*transforms: GradientTransformation) -> GradientTransformation:
    """Returns the transform applying ``transforms`` in order, each to the previous' output.

    Its state is the tuple of theirs.
    """
    if not transforms:
        raise ValueError("chain() needs at least one transform")
    for t in transforms:
        if not isinstance(t, GradientTransformation):
            raise TypeError(f"chain() takes fp16fx transforms, got {t!r}")
    labelled = [t.param_labels for t in transforms if t.param_labels is not None]
    if any(labels != labelled[0] for labels in labelled[1:]):
        raise ValueError("the multi_transforms of a chain must label the params alike")

    def init(params: Params) -> tuple[State, ...]:
        return tuple(t.init(params) for t in transforms)

    def update(updates: Updates, state: tuple[State, ...], params: Params) -> Any:
        new_state = []
        for t, s in zip(transforms, state):
            updates, s = t.update(updates, s, params)
            new_state.append(s)
        return updates, tuple(new_state)

    return GradientTransformation(init, update, labelled[0] if labelled else None)


def labels_of(params: Params) -> tuple[Hashable, ...]:
    """Returns the segment labels of ``params`` (a :class:`Segments`), for routing."""
    if not isinstance(params, Segments):
        raise TypeError(
            "multi_transform routes by segment labels: its params must be fp16fx Segments, "
            f"as fp16fx.step passes them; got {type(params).__name__}"
        )
    return params.labels


__all__ = [
    "GradNorm",
    "GradientTransformation",
    "Hyperparams",
    "chain",
    "check_hyperparam",
    "check_kept",
    "hyperparams",
    "labels_of",
    "scalars",
    "stateless",
    "with_grad_norm",
]
