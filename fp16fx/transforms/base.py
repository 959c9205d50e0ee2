"""The transform protocol, ``chain``, and hyperparameters as tensors.

Layer: ``transforms`` (DESIGN.md). Optimizer math on FP32 values; knows nothing of FP16 or
loss scales.

A :class:`GradientTransformation` maps incoming updates (at first: unscaled FP32 gradients) to
outgoing updates, optax-style, over *flat lists* aligned with the trained leaves. It keeps two
kinds of state:

* hyperparameters, a dict of 0-d float64 tensors shared by all leaves. Being tensors, they can
  change between steps (``set_hyperparams``) without recompiling a compiled step; float64 keeps
  scalar arithmetic such as Adam's bias corrections as precise as torch.optim's host-side math.
* one leaf state per trained leaf (moments, step count), so that a leaf whose gradient is
  missing in a step keeps its state untouched, as in torch.optim.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Hashable, Mapping, Sequence
from typing import Any, NamedTuple

import torch

Hyperparams = dict[str, torch.Tensor]
LeafState = Any
Updates = list[torch.Tensor]


class TransformState(NamedTuple):
    """Optimizer state: shared hyperparameters and one state per param leaf.

    Attributes:
      hyperparams: name -> 0-d float64 tensor (a tuple of such dicts for ``chain``).
      leaves: a tree with the structure of the params, holding each leaf's state
        (``None`` at untrained leaves).
    """

    hyperparams: Any
    leaves: Any


class GradientTransformation(NamedTuple):
    """A pure optimizer piece: ``init_hyperparams``, ``init_leaf`` and ``update``.

    ``init_leaf(param, index)`` returns the state of the flat leaf ``index``.
    ``update(updates, leaf_states, params, hyperparams, grad_norm, indices)`` takes lists
    aligned leaf by leaf (``params`` are the FP32 masters, ``indices`` the flat leaf indices
    they stand for) and returns ``(updates, leaf_states)`` without mutating its inputs.
    ``grad_norm`` is the global L2 norm of ``updates`` when the caller knows it (the first
    transform of a step), else ``None``.

    ``partition`` is ``None``, or a label per flat leaf: leaves with different labels are
    updated differently (``multi_transform``) and so never share a flat bucket.
    """

    init_hyperparams: Callable[[torch.device], Any]
    init_leaf: Callable[[torch.Tensor, int], LeafState]
    update: Callable[
        [
            Updates,
            Sequence[LeafState],
            Sequence[torch.Tensor],
            Any,
            torch.Tensor | None,
            Sequence[int],
        ],
        tuple[Updates, list[LeafState]],
    ]
    partition: tuple[Hashable, ...] | None = None


def _non_negative(x: float) -> bool:
    return x >= 0


def _unit_interval(x: float) -> bool:
    return 0 <= x < 1


_VALID: dict[str, tuple[Callable[[float], bool], str]] = {
    "lr": (_non_negative, ">= 0"),
    "eps": (_non_negative, ">= 0"),
    "weight_decay": (_non_negative, ">= 0"),
    "momentum": (_non_negative, ">= 0"),
    "dampening": (lambda x: True, "a number"),
    "beta1": (_unit_interval, "in [0, 1)"),
    "beta2": (_unit_interval, "in [0, 1)"),
    "max_norm": (lambda x: x > 0, "> 0"),
}


def check_hyperparam(name: str, value: float) -> float:
    """Returns ``value`` as a float after checking it is valid for hyperparameter ``name``."""
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            raise ValueError(f"hyperparameter {name!r} must be a scalar, got shape {value.shape}")
        value = value.item()
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        raise TypeError(f"hyperparameter {name!r} must be a number, got {value!r}")
    valid, rule = _VALID[name]
    if not (math.isfinite(value) and valid(value)):
        raise ValueError(f"hyperparameter {name!r} must be {rule}, got {value!r}")
    return float(value)


def hyperparams(device: torch.device, **values: float) -> Hyperparams:
    """Returns the dict of 0-d float64 tensors on ``device`` holding the checked ``values``."""
    return {
        name: torch.tensor(check_hyperparam(name, v), dtype=torch.float64, device=device)
        for name, v in values.items()
    }


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
    update: Callable[[Updates, Sequence[torch.Tensor], Hyperparams, torch.Tensor | None], Updates],
    **defaults: float,
) -> GradientTransformation:
    """Returns a transform with hyperparameters ``defaults`` and no per-leaf state."""
    for name, value in defaults.items():
        check_hyperparam(name, value)
    return GradientTransformation(
        init_hyperparams=lambda device: hyperparams(device, **defaults),
        init_leaf=lambda param, index: (),
        update=lambda updates, leaf_states, params, hp, grad_norm, indices: (
            update(updates, params, hp, grad_norm),
            list(leaf_states),
        ),
    )


def chain(*transforms: GradientTransformation) -> GradientTransformation:
    """Returns the transform applying ``transforms`` in order, each to the previous' output.

    Its hyperparameters are the tuple of theirs, its leaf state the tuple of theirs. Only the
    first transform is told the incoming gradient norm (later ones see changed updates).
    """
    if not transforms:
        raise ValueError("chain() needs at least one transform")

    def init_hyperparams(device: torch.device) -> tuple[Any, ...]:
        return tuple(t.init_hyperparams(device) for t in transforms)

    def init_leaf(param: torch.Tensor, index: int) -> tuple[LeafState, ...]:
        return tuple(t.init_leaf(param, index) for t in transforms)

    def update(updates, leaf_states, params, hp, grad_norm, indices):
        per_transform = list(zip(*leaf_states)) if leaf_states else [()] * len(transforms)
        new_per_transform = []
        for i, transform in enumerate(transforms):
            updates, new_states = transform.update(
                updates,
                list(per_transform[i]),
                params,
                hp[i],
                grad_norm if i == 0 else None,
                indices,
            )
            new_per_transform.append(new_states)
        return updates, [tuple(s) for s in zip(*new_per_transform)]

    partitions = [t.partition for t in transforms if t.partition is not None]
    partition = tuple(zip(*partitions)) if partitions else None
    return GradientTransformation(init_hyperparams, init_leaf, update, partition)


def multi_transform(
    transforms: Sequence[GradientTransformation], labels: Sequence[int]
) -> GradientTransformation:
    """Returns the transform applying ``transforms[labels[i]]`` to flat leaf ``i``.

    This is how param groups with different hyperparameters share one step (and one global
    gradient norm). Its hyperparameters are the tuple of the transforms'; ``set_hyperparams``
    changes a name in every group, ``replace_hyperparams(hp[k], ...)`` in group ``k`` alone.
    """
    transforms, labels = tuple(transforms), tuple(labels)
    if not transforms:
        raise ValueError("multi_transform() needs at least one transform")
    bad = [label for label in labels if not 0 <= label < len(transforms)]
    if bad:
        raise ValueError(f"labels {bad} name no transform (there are {len(transforms)})")

    def init_hyperparams(device: torch.device) -> tuple[Any, ...]:
        return tuple(t.init_hyperparams(device) for t in transforms)

    def init_leaf(param: torch.Tensor, index: int) -> LeafState:
        return transforms[labels[index]].init_leaf(param, index)

    def update(updates, leaf_states, params, hp, grad_norm, indices):
        new_updates, new_states = list(updates), list(leaf_states)
        for label, transform in enumerate(transforms):
            slots = [k for k, index in enumerate(indices) if labels[index] == label]
            if not slots:
                continue
            group_updates, group_states = transform.update(
                [updates[k] for k in slots],
                [leaf_states[k] for k in slots],
                [params[k] for k in slots],
                hp[label],
                grad_norm,
                [indices[k] for k in slots],
            )
            for k, u, s in zip(slots, group_updates, group_states):
                new_updates[k], new_states[k] = u, s
        return new_updates, new_states

    return GradientTransformation(init_hyperparams, init_leaf, update, labels)


def _hyperparam_dicts(hp: Any) -> list[Hyperparams]:
    if isinstance(hp, Mapping):
        return [hp]
    return [d for sub in hp for d in _hyperparam_dicts(sub)]


def replace_hyperparams(hp: Any, values: Mapping[str, float], *, inplace: bool = False) -> Any:
    """Returns ``hp`` with every hyperparameter named in ``values`` set to its value.

    A name applies to every transform of a chain that has it (e.g. ``lr``). With
    ``inplace=True`` the existing tensors are overwritten (``fill_``: no host sync, and tensor
    addresses stay put, as CUDA-graph replay needs) and ``hp`` itself is returned.

    Raises:
      KeyError: a name no transform has; ValueError/TypeError: a value out of range.
      Nothing is changed when any name or value is bad.
    """
    dicts = _hyperparam_dicts(hp)
    known = {name for d in dicts for name in d}
    unknown = sorted(set(values) - known)
    if unknown:
        raise KeyError(f"no hyperparameter named {unknown}; this optimizer has {sorted(known)}")
    checked = {name: check_hyperparam(name, value) for name, value in values.items()}
    if inplace:
        for d in dicts:
            for name, value in checked.items():
                if name in d:
                    d[name].fill_(value)
        return hp
    return _rebuild(hp, checked)


def _rebuild(hp: Any, checked: Mapping[str, float]) -> Any:
    if isinstance(hp, Mapping):
        return {
            name: torch.full_like(t, checked[name]) if name in checked else t
            for name, t in hp.items()
        }
    return tuple(_rebuild(sub, checked) for sub in hp)
