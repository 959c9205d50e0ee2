"""``Segments``: one value per segment of a training state, and the operations on such trees.

Layer: ``tree`` (docs/design.md). Knows nothing about optimizers.

The step hands an optimizer its params as :class:`Segments` -- one flat FP32 tensor per
segment of the state's :class:`~fp16fx.flat.Layout` -- and an optimizer's state holds "trees
like the params" (``mu = tree_map(zeros_like, params)``), so every per-param part of any
optimizer's state is a ``Segments`` too. That lets the step cut a segment in two, pick the
segments that have a gradient, or read one leaf's part of every state, without knowing the
optimizer: it finds the ``Segments`` nodes in the state. Each entry of a ``Segments`` is a
tensor (1-D: one value per element of the segment; 0-d: an integer for the segment, a step
count), a :data:`MASKED` placeholder (a segment an inner transform of ``multi_transform`` does
not own), or None.

Each ``Segments`` also carries its segments' ``labels`` (e.g. param groups): static metadata,
preserved by ``optree.tree_map``, read by ``multi_transform`` to route segments.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterator, Sequence
from typing import Any

import optree
import torch

PyTree = Any


class Segments:
    """An immutable sequence of one value per segment, with each segment's label."""

    __slots__ = ("items", "labels")

    def __init__(self, items: Sequence[Any], labels: Sequence[Hashable]) -> None:
        self.items = tuple(items)
        self.labels = tuple(labels)
        if len(self.items) != len(self.labels):
            raise ValueError(f"{len(self.items)} segments but {len(self.labels)} labels")

    def __len__(self) -> int:
        return len(self.items)

    def __iter__(self) -> Iterator[Any]:
        return iter(self.items)

    def __getitem__(self, k: int) -> Any:
        return self.items[k]

    def __repr__(self) -> str:
        return f"Segments({list(self.items)!r}, labels={self.labels})"


class _Masked:
    """The placeholder for a segment that a transform does not own (``multi_transform``)."""

    __slots__ = ()

    def __repr__(self) -> str:
        return "MASKED"


MASKED = _Masked()

_NAMESPACE = optree.registry.__GLOBAL_NAMESPACE  # plain optree calls see the tensors inside
optree.register_pytree_node(
    Segments,
    lambda s: (s.items, s.labels),
    lambda labels, items: Segments(items, labels),
    namespace=_NAMESPACE,
)
optree.register_pytree_node(
    _Masked, lambda m: ((), None), lambda _, __: MASKED, namespace=_NAMESPACE
)


def _is_segments(x: Any) -> bool:
    return isinstance(x, Segments)


def map_segments(fn: Callable[..., Segments], tree: PyTree, *rest: PyTree) -> PyTree:
    """Returns ``tree`` with every ``Segments`` node ``s`` replaced by ``fn(s, *same in rest)``;
    everything else (e.g. hyperparameters) is kept from ``tree``."""
    return optree.tree_map(
        lambda s, *others: fn(s, *others) if _is_segments(s) else s,
        tree,
        *rest,
        is_leaf=_is_segments,
        none_is_leaf=True,
    )


def select(tree: PyTree, keep: Sequence[bool]) -> PyTree:
    """Returns ``tree`` with each ``Segments`` cut down to the segments where ``keep``."""
    picked = [k for k, yes in enumerate(keep) if yes]
    return map_segments(
        lambda s: Segments([s.items[k] for k in picked], [s.labels[k] for k in picked]), tree
    )


def merge(full: PyTree, part: PyTree, keep: Sequence[bool]) -> PyTree:
    """Returns ``full`` with its segments where ``keep`` replaced, in order, by ``part``'s
    (the inverse of :func:`select`)."""

    def put(whole: Segments, some: Segments) -> Segments:
        items, taken = list(whole.items), iter(some.items)
        for k, yes in enumerate(keep):
            if yes:
                items[k] = next(taken)
        return Segments(items, whole.labels)

    return map_segments(put, full, part)


def expand(part: PyTree, keep: Sequence[bool], labels: Sequence[Hashable]) -> PyTree:
    """Returns ``part`` (a tree over the segments where ``keep``) as a tree over all of them,
    :data:`MASKED` at the others."""

    def widen(some: Segments) -> Segments:
        taken = iter(some.items)
        return Segments([next(taken) if yes else MASKED for yes in keep], labels)

    return map_segments(widen, part)


def split(tree: PyTree, k: int, sizes: Sequence[int]) -> PyTree:
    """Returns ``tree`` with segment ``k`` cut into consecutive parts of ``sizes`` elements:
    1-D entries become views, 0-d ones (counts) copies, placeholders placeholders."""

    def cut(value: Any) -> list[Any]:
        if not isinstance(value, torch.Tensor):
            return [value] * len(sizes)
        if value.ndim == 0:
            return [value.clone() for _ in sizes]
        if value.numel() == 0:
            return [value] * len(sizes)
        return list(value.split(list(sizes)))

    def cut_segments(s: Segments) -> Segments:
        parts = cut(s.items[k])
        items = [*s.items[:k], *parts, *s.items[k + 1 :]]
        labels = [*s.labels[:k], *[s.labels[k]] * len(sizes), *s.labels[k + 1 :]]
        return Segments(items, labels)

    return map_segments(cut_segments, tree)


def named_segments(tree: PyTree) -> list[tuple[str, Segments]]:
    """Returns every ``Segments`` node of ``tree`` with its path, e.g. ``("[1].mu", ...)``."""
    accessors, nodes, _ = optree.tree_flatten_with_accessor(
        tree, is_leaf=_is_segments, none_is_leaf=True
    )
    return [(a.codify(""), node) for a, node in zip(accessors, nodes) if _is_segments(node)]
