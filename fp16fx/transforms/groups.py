"""Param groups: ``multi_transform``, and reading or changing hyperparameters by name.

Layer: ``transforms`` (docs/design.md).

``multi_transform(transforms, labels)`` updates each segment with the transform its label
names, as optax's ``multi_transform`` does with ``masked``: transform ``k``'s state covers every
segment, holding :data:`~fp16fx.segments.MASKED` where the segment is another's, so the
step can cut, pick and read segments of the whole state without knowing the routing.
"""

from __future__ import annotations

import dataclasses
import numbers
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, NamedTuple

import optree
import torch

from fp16fx import tree
from fp16fx.segments import expand, merge, select
from fp16fx.transforms.base import (
    GradientTransformation,
    Hyperparams,
    Params,
    State,
    Updates,
    check_hyperparam,
    labels_of,
)


class MultiTransformState(NamedTuple):
    """The states of ``multi_transform``'s transforms, each over every segment (MASKED where
    the segment is not its own)."""

    inner: tuple[State, ...]


def multi_transform(
    transforms: Sequence[GradientTransformation], labels: Any
) -> GradientTransformation:
    """Returns the transform applying ``transforms[label]`` to each param, by its label.

    This is how param groups with different hyperparameters share one step (and one global
    gradient norm). ``labels`` gives each param of the tree given to ``fp16fx.init`` the index
    of its transform: as a tree shaped like the params (``{"fc.weight": 0, "fc.bias": 1}``),
    as a function of the params returning one (optax's spelling), or as one label per flat
    leaf in optree's order -- for params in a dict that is sorted by key, so a flat sequence
    of different labels is refused for a dict whose keys are not given sorted (it would route
    by another order). The labels are copied when it is built.
    A ``None`` param keeps its place among the labels; its label is not read (any value
    that is not itself a container, None too).
    ``get_hyperparams`` then returns one dict per group, and
    ``set_hyperparams(state, group=k, ...)`` changes group ``k`` alone.

    Raises:
      TypeError, ValueError: not a sequence of transforms, or one holding another
        ``multi_transform``; ``labels`` of another structure than the params, or naming no
        transform -- when ``fp16fx.init`` resolves them against the params.
    """
    one = isinstance(transforms, GradientTransformation)  # itself a tuple: of functions
    if one or not isinstance(transforms, Sequence):
        raise TypeError(
            "multi_transform() takes a list of fp16fx transforms, one per label, e.g. "
            f"[fp16fx.adam(1e-3), fp16fx.sgd(0.1)]; got {'one transform' if one else transforms}"
        )
    transforms = tuple(transforms)
    if not transforms:
        raise ValueError("multi_transform() needs at least one transform")
    strays = [t for t in transforms if not isinstance(t, GradientTransformation)]
    if strays:
        raise TypeError(f"multi_transform() takes fp16fx transforms, got {strays[0]!r}")
    if any(t.param_labels is not None for t in transforms):
        raise ValueError("multi_transform() cannot hold another multi_transform")
    if labels is None or isinstance(labels, (str, bytes)):
        raise TypeError(f"multi_transform() needs labels, one per param; got {labels!r}")
    if not callable(labels):  # a copy: changing the caller's list later changes nothing
        flat = isinstance(labels, Iterator) or not isinstance(labels, (Sequence, Mapping))
        labels = tuple(labels) if flat else optree.tree_map(lambda x: x, labels)
    resolve = ParamLabels(labels, len(transforms))

    def owned(params: Params, k: int) -> list[bool]:
        return [label == k for label in labels_of(params)]

    def init(params: Params) -> MultiTransformState:
        inner = []
        for k, t in enumerate(transforms):
            mine = owned(params, k)
            inner.append(expand(t.init(select(params, mine)), mine, params.labels))
        return _on_device_of(params, MultiTransformState(tuple(inner)))

    def update(updates: Updates, state: MultiTransformState, params: Params) -> Any:
        new_inner = []
        for k, (t, inner) in enumerate(zip(transforms, state.inner)):
            mine = owned(params, k)
            if any(mine):
                some, new = t.update(
                    select(updates, mine), select(inner, mine), select(params, mine)
                )
                updates, inner = merge(updates, some, mine), merge(inner, new, mine)
            new_inner.append(inner)
        return updates, MultiTransformState(tuple(new_inner))

    return GradientTransformation(init, update, resolve)


def _on_device_of(params: Params, state: State) -> State:
    """Returns ``state`` with its tensors on the params' device. A group that owns no param
    makes its hyperparameters where no param tells it the device (the CPU), and a step that
    read them there would keep a GPU's step out of its CUDA graph."""
    device = next(x.device for x in optree.tree_leaves(params) if isinstance(x, torch.Tensor))
    return optree.tree_map(
        lambda x: x.to(device) if isinstance(x, torch.Tensor) else x, state, none_is_leaf=True
    )


@dataclasses.dataclass(frozen=True, eq=True)
class ParamLabels:
    """``multi_transform``'s labels as given -- a tree shaped like the params, a flat
    sequence, or a function of the params -- and called with the params, one label per flat
    leaf. Two are equal when given alike (a chain may hold several ``multi_transform``s that
    route alike)."""

    given: Any
    n_transforms: int

    __hash__ = None  # type: ignore[assignment]  # given may be a dict

    def __call__(self, params: Any) -> tuple[int, ...]:
        given = self.given(params) if callable(self.given) else self.given
        return _flat_labels(given, params, self.n_transforms)


def _flat_labels(given: Any, params: Any, n_transforms: int) -> tuple[int, ...]:
    """Returns one label per flat leaf of ``params`` (0 for a None param) from ``given``, a
    tree shaped like ``params`` or a flat sequence; raises naming what does not fit."""
    leaves, treedef = tree.flatten(params)
    containers = (list, tuple, Mapping)
    sequence = (
        isinstance(given, (list, tuple))
        and len(given) == len(leaves)
        and not any(isinstance(label, containers) for label in given)
    )
    if sequence:
        flat = list(given)
    else:
        try:
            flat = treedef.flatten_up_to(given)
        except (TypeError, ValueError):
            raise ValueError(
                f"multi_transform's labels have neither the structure of the params "
                f"({treedef}) nor one label per flat leaf ({len(leaves)}, None leaves "
                f"included); got {given!r}"
            ) from None
    names = tree.leaf_names(params)
    out = []
    for name, leaf, label in zip(names, leaves, flat):
        if leaf is None:
            out.append(0)
            continue
        if isinstance(label, bool) or not isinstance(label, numbers.Integral):
            raise TypeError(f"multi_transform's label of {name} is {label!r}, not an index")
        if not 0 <= label < n_transforms:
            raise ValueError(
                f"multi_transform's label of {name} is {label}: there are {n_transforms} transforms"
            )
        out.append(int(label))
    routed = {label for label, leaf in zip(out, leaves) if leaf is not None}
    if sequence and len(routed) > 1 and tree.dict_order_differs(params):
        raise ValueError(
            "multi_transform's labels are a flat sequence, but the params hold a dict whose "
            "keys are not in sorted order, the order optree flattens them in: give the "
            "labels as a dict with the params' keys, or a function of the params"
        )
    return tuple(out)


def _is_node(x: Any) -> bool:
    return isinstance(x, (Hyperparams, MultiTransformState))


def map_hyperparams(
    fn: Callable[[Hyperparams, int | None], Hyperparams], state: State, group: int | None = None
) -> State:
    """Returns ``state`` with each :class:`Hyperparams` ``h`` replaced by ``fn(h, group)``:
    ``group`` is ``k`` inside ``multi_transform``'s transform ``k``, None outside it."""

    def visit(node: Any) -> Any:
        if isinstance(node, Hyperparams):
            return fn(node, group)
        if isinstance(node, MultiTransformState):
            return MultiTransformState(
                tuple(map_hyperparams(fn, inner, k) for k, inner in enumerate(node.inner))
            )
        return node

    return optree.tree_map(visit, state, is_leaf=_is_node, none_is_leaf=True)


def hyperparam_groups(state: State) -> list[dict[str, torch.Tensor]]:
    """Returns one dict per param group (one in all without ``multi_transform``) of the
    hyperparameter tensors that apply to it, shared ones (outside ``multi_transform``)
    included. A name two transforms share (``weight_decay`` in ``adam`` and a chained
    ``add_decayed_weights``) maps to the first one's tensor, a group's own (inside
    ``multi_transform``) before a shared one."""
    shared: dict[str, torch.Tensor] = {}
    groups: dict[int, dict[str, torch.Tensor]] = {}

    def collect(h: Hyperparams, group: int | None) -> Hyperparams:
        into = shared if group is None else groups.setdefault(group, {})
        for name, tensor in h.items():
            into.setdefault(name, tensor)
        return h

    map_hyperparams(collect, state)
    for node in optree.tree_leaves(state, is_leaf=_is_node, none_is_leaf=True):
        if isinstance(node, MultiTransformState):  # a group with none of its own counts too
            for k in range(len(node.inner)):
                groups.setdefault(k, {})
    if not groups:
        return [shared]
    return [{**shared, **groups[k]} for k in sorted(groups)]


def replace_hyperparams(
    state: State,
    values: Mapping[str, Any],
    *,
    group: int | None = None,
    inplace: bool = False,
) -> State:
    """Returns ``state`` with every hyperparameter named in ``values`` set to its value.

    A name applies to every transform that has it (in param group ``group`` only, if given,
    and in the transforms shared by all groups). With ``inplace=True`` the existing tensors
    are overwritten (``fill_``/``copy_``: no host sync, and addresses stay put, as CUDA-graph
    replay needs) and ``state`` itself is returned.

    Raises:
      KeyError: a name no transform (of that group) has; ``group`` out of range.
      ValueError, TypeError: a value out of range. Nothing changes when anything is bad.
    """
    groups = hyperparam_groups(state)
    index = isinstance(group, numbers.Integral) and not isinstance(group, bool)
    if group is not None and not (index and 0 <= group < len(groups)):
        raise KeyError(f"no param group {group!r}; this optimizer has {len(groups)}")
    group = None if group is None else int(group)
    known = set(groups[group] if group is not None else (n for g in groups for n in g))
    unknown = sorted(set(values) - known)
    if unknown:
        where = "" if group is None else f" in group {group}"
        raise KeyError(
            f"no hyperparameter named {unknown}{where}; this optimizer has {sorted(known)}"
        )
    checked = {name: check_hyperparam(name, value) for name, value in values.items()}

    def change(h: Hyperparams, owner: int | None) -> Hyperparams:
        if group is not None and owner not in (None, group):
            return h
        names = [n for n in checked if n in h]
        if not names:
            return h
        if inplace:
            for name in names:
                _fill(h[name], checked[name])
            return h
        return Hyperparams(
            (n, _fill(torch.empty_like(t), checked[n]) if n in names else t) for n, t in h.items()
        )

    return map_hyperparams(change, state)


def _fill(t: torch.Tensor, value: float | tuple[float, ...]) -> torch.Tensor:
    """Writes ``value`` into ``t`` with ``fill_`` (a kernel launch, never a host sync)."""
    if isinstance(value, tuple):
        for part, v in zip(t, value):
            part.fill_(v)
    else:
        t.fill_(value)
    return t


def read_hyperparams(state: State) -> list[dict[str, Any]]:
    """Returns :func:`hyperparam_groups` as Python numbers (``betas`` a pair); one sync."""
    groups = hyperparam_groups(state)
    names = [(k, n) for k, g in enumerate(groups) for n in g]
    if not names:
        return [{} for _ in groups]
    # Joined on the first one's device (a transform of one's own may keep one elsewhere),
    # then one copy to the host: one copy each was one sync each.
    device = groups[names[0][0]][names[0][1]].device
    flat = torch.cat([groups[k][n].reshape(-1).to(device) for k, n in names]).cpu().tolist()
    out: list[dict[str, Any]] = [{} for _ in groups]
    at = 0
    for k, n in names:
        size = groups[k][n].numel()
        value = flat[at : at + size]
        out[k][n] = tuple(value) if groups[k][n].ndim else value[0]
        at += size
    return out


__all__ = [
    "MultiTransformState",
    "ParamLabels",
    "hyperparam_groups",
    "map_hyperparams",
    "multi_transform",
    "read_hyperparams",
    "replace_hyperparams",
]
