"""torch.optim param groups -> the core's transforms (which groups the fast path can run).

Layer: ``facade`` (docs/design.md). The param groups of ``torch.optim.SGD``, ``Adam`` or
``AdamW`` become ``chain(clip_by_global_norm(max_norm), multi_transform([sgd | adam | adamw per
group], labels))`` from :mod:`fp16fx.transforms`, the one definition of each optimizer's math.
A group's *structure* (:class:`GroupSpec`: momentum on/off, nesterov, amsgrad, decoupled decay)
is fixed when the transform is built; its *numbers* (lr, betas, eps, weight decay, momentum,
dampening) and the clipping threshold are tensors in the state, rewritten from
``param_groups`` each step, where they changed (:class:`Written` remembers what it wrote). A
sharded or FSDP2 engine keeps the structures it was built with
(:func:`check_structure_unchanged`). A saved param group is checked here for the keys its
class steps with (:func:`check_saved_numbers`, :func:`check_loaded_group_keys`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from fp16fx.transforms import (
    GradientTransformation,
    adam,
    adamw,
    chain,
    check_hyperparam,
    clip_by_global_norm,
    multi_transform,
    replace_hyperparams,
    sgd,
)
from fp16fx.transforms.primitives import NO_CLIP

_KINDS = {torch.optim.SGD: "sgd", torch.optim.Adam: "adam", torch.optim.AdamW: "adamw"}
#: Per kind, the numbers a saved param group must hold: those torch.optim does not fill in
#: when it loads a group saved by an older version (it does amsgrad, nesterov, maximize...).
_ADAM_NUMBERS = frozenset({"lr", "betas", "eps", "weight_decay"})
SAVED_NUMBERS = {
    "sgd": frozenset({"lr", "momentum", "dampening", "weight_decay"}),
    "adam": _ADAM_NUMBERS,
    "adamw": _ADAM_NUMBERS,
}


class Unsupported(Exception):
    """The fast path cannot run this configuration; raised before anything is changed."""


@dataclasses.dataclass(frozen=True)
class GroupSpec:
    """The structure of a param group's transform (changing it means rebuilding)."""

    optimizer: str  # the fp16fx optimizer that steps it: "sgd", "adam" or "adamw"
    has_momentum: bool = False
    nesterov: bool = False
    amsgrad: bool = False


def describe(spec: GroupSpec) -> str:
    """Names a group's structure, e.g. ``Adam with amsgrad``, ``SGD with nesterov momentum``."""
    name = {"sgd": "SGD", "adam": "Adam", "adamw": "AdamW"}[spec.optimizer]
    if spec.nesterov:
        return f"{name} with nesterov momentum"
    if spec.has_momentum:
        return f"{name} with momentum"
    return f"{name} with amsgrad" if spec.amsgrad else name


def fast_kind(optimizer: torch.optim.Optimizer) -> str | None:
    """Returns ``"sgd"``, ``"adam"`` or ``"adamw"`` when ``optimizer`` is exactly SGD, Adam or
    AdamW.

    Subclasses are excluded: they may change the math. ``foreach``, ``fused`` and
    ``capturable`` do not change it and are ignored.
    """
    return _KINDS.get(type(optimizer))


def group_spec(kind: str, group: dict[str, Any], index: int) -> GroupSpec:
    """Returns the structure of param group ``index``; raises Unsupported if the core lacks it."""
    for flag in ("maximize", "differentiable"):
        if group.get(flag):
            raise Unsupported(f"param group {index} has {flag}=True")
    if kind == "sgd":
        momentum = group["momentum"] != 0
        nesterov = momentum and bool(group["nesterov"])
        dampening = group["dampening"]
        if nesterov and _nonzero_number(dampening):
            # torch.optim.SGD refuses this only when built; set later, or in a group added
            # later, it steps it. The fast path builds its transforms from the group, and
            # fp16fx.sgd refuses it as torch's constructor does: torch's path takes it.
            raise Unsupported(f"param group {index} has nesterov=True with dampening={dampening}")
        return GroupSpec("sgd", has_momentum=momentum, nesterov=nesterov)
    # torch >= 2.7 marks the decay in every Adam/AdamW group; older AdamW groups lack the key.
    optimizer = "adamw" if group.get("decoupled_weight_decay", kind == "adamw") else "adam"
    return GroupSpec(optimizer, amsgrad=bool(group["amsgrad"]))


def _nonzero_number(value: Any) -> bool:
    """Whether ``value`` is a valid ``dampening`` other than 0: a finite Python or NumPy
    number, or a one-value tensor holding one (read: one sync, as :func:`group_values` reads
    it too). Anything else (NaN, a meta tensor...) is :func:`group_values`' to name."""
    try:
        return check_hyperparam("dampening", value) != 0
    except (TypeError, ValueError):
        return False


def group_values(spec: GroupSpec, group: dict[str, Any], index: int) -> dict[str, Any]:
    """Returns the core's hyperparameters for param group ``index`` (tensors, e.g. a tensor
    lr, as floats); raises TypeError/ValueError naming the group and the value that is not a
    number in its range (None, a string, a tensor of several values, a NaN...)."""
    values = {"lr": group["lr"], "weight_decay": group["weight_decay"]}
    if spec.optimizer == "sgd":
        if spec.has_momentum:
            values.update(momentum=group["momentum"], dampening=group["dampening"])
    else:
        values.update(betas=group["betas"], eps=group["eps"])
    try:
        return {name: check_hyperparam(name, value) for name, value in values.items()}
    except (TypeError, ValueError) as err:
        raise type(err)(f"param group {index}: {err}") from None


def group_transform(spec: GroupSpec, values: dict[str, Any]) -> GradientTransformation:
    """Returns the group's optimizer: ``sgd``, ``adam`` or ``adamw`` with ``values``.

    Raises ValueError/TypeError (from the transforms) when a value is out of range.
    """
    if spec.optimizer == "sgd":
        return sgd(**values, nesterov=spec.nesterov)
    make = adamw if spec.optimizer == "adamw" else adam
    return make(**values, amsgrad=spec.amsgrad)


def build_transform(
    specs: Sequence[GroupSpec], groups: Sequence[dict[str, Any]], labels: Sequence[int]
) -> GradientTransformation:
    """Returns ``chain(clip_by_global_norm(NO_CLIP), multi_transform(groups' optimizers))``
    for params labelled with their group's index.

    Raises ValueError/TypeError naming the group whose value is out of range.
    """
    named = []
    for k, (spec, group) in enumerate(zip(specs, groups)):
        values = group_values(spec, group, k)
        try:
            named.append(group_transform(spec, values))
        except (ValueError, TypeError) as err:
            raise type(err)(f"param group {k}: {err}") from None
    return chain(clip_by_global_norm(NO_CLIP), multi_transform(named, labels))


class Written:
    """The numbers last written into the core's hyperparameter tensors, so that a step
    rewrites only those that changed: each param group's (:func:`group_values`) and the
    clipping threshold (None: not known, the next :meth:`write` writes it).

    A new transform holds what :meth:`built` records; a load writes a checkpoint's numbers,
    after which :meth:`forgotten` makes the next write write them all (a number set back to
    the value last written before the load would otherwise be taken as written already).
    """

    def __init__(self, per_group: list[dict[str, Any]], max_norm: float | None) -> None:
        self._per_group, self._max_norm = per_group, max_norm

    @classmethod
    def built(cls, specs: Sequence[GroupSpec], groups: Sequence[dict[str, Any]]) -> Written:
        """Returns what a transform just built for structures ``specs`` over param groups
        ``groups`` (:func:`build_transform`) holds: their numbers, and no clip."""
        per_group = [group_values(s, g, k) for k, (s, g) in enumerate(zip(specs, groups))]
        return cls(per_group, NO_CLIP)

    def forgotten(self) -> Written:
        """Returns a record of nothing written, for as many groups."""
        return Written([{} for _ in self._per_group], None)

    def write(
        self,
        opt_state: Any,
        specs: Sequence[GroupSpec],
        groups: Sequence[dict[str, Any]],
        max_norm: float,
    ) -> None:
        """Writes the numbers of param groups ``groups`` (structures ``specs``) and the
        clipping threshold ``max_norm`` that changed since the last write into the core's
        optimizer state ``opt_state``, in place, and records them (no sync, unless a group
        holds a number as a tensor: reading it syncs)."""
        for k, (spec, group) in enumerate(zip(specs, groups)):
            values, written = group_values(spec, group, k), self._per_group[k]
            changed = {n: v for n, v in values.items() if n not in written or written[n] != v}
            if changed:
                replace_hyperparams(opt_state, changed, group=k, inplace=True)
                written.update(changed)
        if max_norm != self._max_norm:
            replace_hyperparams(opt_state, {"max_norm": max_norm}, inplace=True)
            self._max_norm = max_norm


def check_structure_unchanged(
    specs: Sequence[GroupSpec], built: Sequence[GroupSpec], whose: str, loading: bool = False
) -> None:
    """Raises ValueError, naming the group and its structures, if group structures ``specs``
    differ from those a sharded or FSDP2 engine was ``built`` with, which it keeps (``whose``:
    the optimizer, as its errors name it; ``loading``: ``specs`` are a state dict's groups)."""
    if specs == built:
        return
    k, (new, old) = next((k, p) for k, p in enumerate(zip(specs, built)) if p[0] != p[1])
    if loading:
        raise ValueError(
            f"the state dict does not fit this FP16_Optimizer: the state dict's "
            f"param_groups[{k}] runs {describe(new)}; this optimizer's runs "
            f"{describe(old)} ({whose} keeps the structure it was built with: build "
            "one over such groups to load it)"
        )
    raise ValueError(
        f"{whose} cannot change the structure of param_groups[{k}] after it was "
        f"built (now {describe(new)}, built as {describe(old)}); build a new one"
    )


def check_saved_numbers(optimizer: torch.optim.Optimizer, k: int, saved: Mapping[str, Any]) -> None:
    """Raises ValueError unless saved param group ``k`` has the hyperparameters ``optimizer``'s
    class (SGD, Adam, AdamW) steps with: a group saved from another optimizer would load
    (torch keeps the saved group whole) and the next step fail on the missing key."""
    kind = fast_kind(optimizer)
    missing = sorted(SAVED_NUMBERS[kind] - set(saved)) if kind else []
    if missing:
        raise ValueError(
            f"optimizer_state_dict['param_groups'][{k}] lacks {missing}: it was saved from "
            f"another optimizer than torch.optim.{type(optimizer).__name__}"
        )


#: The keys torch.optim's LR schedulers add to a param group (``lr_scheduler``, ``swa_utils``).
_SCHEDULER_KEYS = frozenset(
    {"initial_lr", "max_lr", "min_lr", "max_momentum", "base_momentum", "swa_lr"}
)


def check_loaded_group_keys(
    optimizer: torch.optim.Optimizer,
    before: Sequence[Mapping[str, Any]],
    saved: Sequence[Mapping[str, Any]],
) -> None:
    """Raises ValueError where a param group torch loaded was saved from another optimizer
    class: it lacks hyperparameters (keys of the class's defaults) the group had ``before``
    the load, even once torch filled in the keys the class gained since (``__setstate__``),
    and has keys neither the group nor the class's defaults have. The check for any class (the
    fast path's are checked by name, before loading): torch keeps a saved group whole, so a
    dict of another class loaded and the next step failed on the key it lacks (``KeyError:
    'alpha'``). Either alone is allowed: a dict of an older or newer version of the class
    (LBFGS reads a ``maximize`` it lacks as False), or keys of a scheduler (``initial_lr``,
    ``max_lr``) or the user's on one side only. torch's schedulers' keys are never foreign:
    an older dict of the class, saved under a scheduler, has both otherwise."""
    hyperparams = set(optimizer.defaults)
    known = {"params", "param_names", *hyperparams, *_SCHEDULER_KEYS}
    for k, (mine, loaded, theirs) in enumerate(zip(before, optimizer.param_groups, saved)):
        missing = sorted((hyperparams & set(mine)) - set(loaded))
        foreign = sorted(set(theirs) - set(mine) - known)
        if missing and foreign:
            cls = type(optimizer)
            name = (f"torch.optim.{cls.__name__}" if getattr(torch.optim, cls.__name__, None) is cls
                    else f"{cls.__module__}.{cls.__qualname__}")  # fmt: skip
            raise ValueError(
                f"optimizer_state_dict['param_groups'][{k}] lacks {missing} and has {foreign}: "
                f"it was saved from another optimizer than {name}"
            )
