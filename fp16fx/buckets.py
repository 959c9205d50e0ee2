"""Flat buckets: many leaves as views into a few contiguous buffers, and the views back.

Layer: ``tree`` (DESIGN.md). Knows nothing about optimizers.

A compiled step over 2,000 separate tensors compiles 2,000 kernels and checks 2,000 guards per
call; over one contiguous buffer per dtype it compiles one and checks one. A :class:`Layout`
records, statically, which flat leaves share a bucket and where each sits; the tensors
themselves are the buckets, and every leaf a user sees is a view into one.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Hashable, Sequence
from typing import Any

import optree
import torch


@dataclasses.dataclass(frozen=True)
class Bucket:
    """Where the leaves of one bucket sit: flat leaf indices, element offsets, shapes."""

    indices: tuple[int, ...]
    offsets: tuple[int, ...]
    shapes: tuple[tuple[int, ...], ...]
    numel: int


@dataclasses.dataclass(frozen=True)
class Layout:
    """A static plan of flat buckets for the leaves of a tree (``None`` leaves excluded)."""

    treedef: optree.PyTreeSpec
    buckets: tuple[Bucket, ...]

    @property
    def first_indices(self) -> tuple[int, ...]:
        """The flat index of each bucket's first leaf (stands for the bucket's leaves)."""
        return tuple(b.indices[0] for b in self.buckets)


def plan(
    leaves: Sequence[torch.Tensor | None],
    treedef: optree.PyTreeSpec,
    keys: Sequence[Hashable] | None = None,
) -> Layout:
    """Returns a layout putting leaves of equal dtype (and equal ``keys[i]``) in one bucket."""
    groups: dict[tuple[Any, ...], list[int]] = {}
    for i, leaf in enumerate(leaves):
        if leaf is not None:
            key = (leaf.dtype, None if keys is None else keys[i])
            groups.setdefault(key, []).append(i)
    buckets = []
    for indices in groups.values():
        shapes = tuple(tuple(leaves[i].shape) for i in indices)
        sizes = [math.prod(s) for s in shapes]
        offsets = tuple(sum(sizes[:k]) for k in range(len(sizes)))
        buckets.append(Bucket(tuple(indices), offsets, shapes, sum(sizes)))
    return Layout(treedef, tuple(buckets))


def views(bucket: Bucket, flat: torch.Tensor) -> list[torch.Tensor]:
    """Returns the leaves of ``bucket`` as views into ``flat``."""
    return [
        flat[offset : offset + math.prod(shape)].view(shape)
        for offset, shape in zip(bucket.offsets, bucket.shapes)
    ]


def pack(
    bucket: Bucket, leaves: Sequence[torch.Tensor], dtype: torch.dtype, multiple: int = 1
) -> torch.Tensor:
    """Returns a new flat ``dtype`` buffer holding the bucket's leaves (picked from ``leaves``).

    Its length is ``bucket.numel`` rounded up to a multiple of ``multiple`` (d ranks' equal
    slices of a sharded buffer); the padding is zeros.
    """
    first = leaves[bucket.indices[0]]
    numel = math.ceil(bucket.numel / multiple) * multiple
    flat = torch.empty(numel, dtype=dtype, device=first.device)
    flat[bucket.numel :].zero_()
    for view, i in zip(views(bucket, flat), bucket.indices):
        view.copy_(leaves[i])
    return flat


def flat_view(bucket: Bucket, leaves: Sequence[torch.Tensor | None]) -> torch.Tensor | None:
    """Returns the flat buffer the bucket's leaves are views of, or None if they are not.

    True when every leaf is contiguous and sits, in order, back to back in one storage; the
    check reads addresses only (no data) and costs about a microsecond per leaf.
    """
    first = leaves[bucket.indices[0]]
    if not isinstance(first, torch.Tensor) or not first.is_contiguous():
        return None
    start = first.data_ptr()
    size = first.element_size()
    for i, offset, shape in zip(bucket.indices, bucket.offsets, bucket.shapes):
        leaf = leaves[i]
        if (
            not isinstance(leaf, torch.Tensor)
            or leaf.dtype != first.dtype
            or leaf.data_ptr() != start + offset * size
            or tuple(leaf.shape) != shape
            or not leaf.is_contiguous()
        ):
            return None
    offset = first.storage_offset()
    if offset + bucket.numel > first.untyped_storage().nbytes() // size:
        return None
    return first.detach().as_strided((bucket.numel,), (1,), offset)
